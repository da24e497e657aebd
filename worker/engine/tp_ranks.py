"""Tensor parallel ranks: rank 0 (the engine core) drives N-1 follower processes in lockstep.

Rank 0 is the engine: it schedules, dispatches, samples and answers. Each follower (rank r, on
``cuda:r`` or the CPU) holds its own shard of the weights (``load_model(..., tp=...)``) and a KV
cache of the shard's shapes with the same blocks, and does on its device exactly what rank 0
does on its own, in the same order, so every all-reduce in the model pairs across the ranks:
load, warm up, capture and release graphs, and run every step's ``StepPlan`` (forward and
sampling: a follower's sampled tokens stay on its device, where the next decode step reads them,
as each of vLLM's workers samples for itself; only rank 0's are read back and published).

The channel. One pipe per follower carries rank 0's commands, pickled, in order. A step sends two:
``Step`` (plan and the dispatcher's decision) before rank 0 runs its forward pass, and ``Sample``
before it samples (the plan's logits processing may be built in between, once the step before has
been read). A pipe rather than ``broadcast_object_list`` on a side group: the object broadcast is
itself two collectives that rank 0 waits on, while a pipe write returns once the bytes are in the
kernel's buffer, and a pipe's end tells rank 0 that a follower is gone. What travels is host data
(a step's two commands cost rank 0 about 80 us, ``bench/tp_channel_bench.py``); tensors travel
only through the model's collectives.

Failure is never a hang. Rank 0 watches its followers (their process sentinels and pipes) from a
thread: a follower that exits, or reports that it failed (to load, or in any command: a rank that
fell out of step cannot be put back), ends the engine core at once with exit code 1, so the API
process reports the worker failed (health NOT_SERVING) and exits non-zero. Every collective has a
timeout (``COLLECTIVE_TIMEOUT_SECONDS``), so a follower that hangs rather than dies fails rank 0's
next forward pass, which ends the engine core the same way. A follower dies with rank 0: the
kernel kills it when its parent goes (``PR_SET_PDEATHSIG``), and its pipe's end makes it exit.

With one rank (the default), none of this exists: the slot holds a plain ``ModelRunner`` and a
plain ``CaptureController``, and a step does nothing it did not do before.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.cpu_quota import size_torch_threads
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.dispatcher import Decision, Dispatcher
from graphkeeper.worker.log_limits import limit_logging
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.tensor_parallel import TensorParallel, init_tensor_parallel
from graphkeeper.worker.plan import LogitsBatch, StepPlan
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)
#: How long a collective (and the group's rendezvous) may wait for the other ranks, unless
#: ``TIMEOUT_ENV`` says otherwise (seconds).
COLLECTIVE_TIMEOUT_SECONDS = 60.0
TIMEOUT_ENV = "GRAPHKEEPER_TP_TIMEOUT_SECONDS"
#: How long rank 0 waits for a failing follower's own report before it exits without it.
REPORT_GRACE_SECONDS = 1.0
#: Fault injection for tests: the follower of this rank fails to load its shard.
INJECT_LOAD_ENV = "GRAPHKEEPER_INJECT_RANK_LOAD_FAILURE"


# --- the commands rank 0 sends, in the order its followers carry them out -------------------


@dataclass(frozen=True)
class Load:
    source: str
    revision: str


@dataclass(frozen=True)
class PrepareStep:
    """Build the step (and warm it up) as rank 0 does."""


@dataclass(frozen=True)
class WarmUp:
    rows: int
    every_row_count: bool | None


@dataclass(frozen=True)
class ResizeKV:
    num_blocks: int


@dataclass(frozen=True)
class Step:
    plan: StepPlan
    decision: Decision


@dataclass(frozen=True)
class Sample:
    """Sample the step just run; ``logits`` replaces the plan's when ``changed``."""

    logits: LogitsBatch | None
    changed: bool


@dataclass(frozen=True)
class CaptureCall:
    """A capture controller call rank 0 made: ``begin`` (policy bytes, traffic, the coarse verdicts
    rank 0 remembered), ``key`` (the next key, with rank 0's over-budget decision), ``finish`` (the
    keys rank 0 kept), ``release_idle`` (keys) or ``release``."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Failed:
    """A follower's last word before it exits non-zero."""

    rank: int
    reason: str


# --- rank 0 -------------------------------------------------------------------------------


def collective_timeout() -> float:
    """``COLLECTIVE_TIMEOUT_SECONDS``, or a positive number of seconds from ``TIMEOUT_ENV``."""
    try:
        seconds = float(os.environ.get(TIMEOUT_ENV, "") or COLLECTIVE_TIMEOUT_SECONDS)
    except ValueError:
        return COLLECTIVE_TIMEOUT_SECONDS
    return seconds if seconds > 0 else COLLECTIVE_TIMEOUT_SECONDS


def exit_engine_core(reason: str) -> None:
    """What rank 0 does when a follower is lost: the ranks can no longer compute a step, and the
    API process turns the engine core's exit into a failed, not-ready worker that exits 1."""
    log.error("tensor parallel: %s; the engine core exits", reason)
    logging.shutdown()
    os._exit(1)


def free_port() -> int:
    """A loopback TCP port free now, for the group's rendezvous (rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FollowerRanks:
    """Rank 0's followers: their processes, pipes and the thread that watches them."""

    def __init__(self, settings: EngineSettings, device: torch.device, kv_blocks: int | None,
                 on_lost=exit_engine_core) -> None:
        self.size = settings.tensor_parallel_size
        self.device_type = device.type
        self.on_lost = on_lost
        self.init_method = f"tcp://127.0.0.1:{free_port()}"  # rank 0 serves the rendezvous store there
        self.tp: TensorParallel | None = None
        ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA is never initialised in a forked child
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe(duplex=True)
            # Not daemonic, as the engine core is not: a follower may start processes of its own
            # (compile workers); it ends with rank 0 all the same (PR_SET_PDEATHSIG, its pipe's end).
            proc = ctx.Process(target=follower_main, name=f"graphkeeper-tp-rank-{rank}",
                               args=(theirs, settings, rank, self.init_method, kv_blocks, os.getpid(), level))
            proc.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(proc)
        log.info("tensor parallel: started ranks 1..%d (pids %s)", self.size - 1, [p.pid for p in self.procs])
        self._send_lock = threading.Lock()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def connect(self) -> TensorParallel:
        """Joins the group as rank 0 (once; the followers are waiting for it)."""
        if self.tp is None:
            self.tp = init_tensor_parallel(0, self.size, self.init_method, self.device_type,
                                           timeout_s=collective_timeout())
            log.info("tensor parallel: %d ranks joined (%s)", self.size, self.device_type)
        return self.tp

    def send(self, command: Any) -> None:
        """Hands every follower ``command``; a follower that is gone raises (the watcher is ending
        the process meanwhile)."""
        data = ForkingPickler.dumps(command)  # pickled once, whatever the number of followers
        with self._send_lock:
            for rank, pipe in enumerate(self.pipes, start=1):
                try:
                    pipe.send_bytes(data)  # what Connection.send does, and recv() reads
                except (OSError, ValueError) as err:
                    raise RuntimeError(f"tensor parallel rank {rank} is gone: {err}") from err

    def gone(self) -> str:
        """Which follower has exited (waiting a moment for one whose peers saw it go first), or ''."""
        ended = set(wait([p.sentinel for p in self.procs], REPORT_GRACE_SECONDS))
        for rank, proc in enumerate(self.procs, start=1):
            if proc.sentinel in ended:  # its code may be unknown a moment longer: the watcher reaps it
                code = proc.exitcode
                return f"rank {rank} (pid {proc.pid}) exited" + ("" if code is None else f" with code {code}")
        return ""

    def _watch(self) -> None:
        """Watcher thread: returns only by ending the process, when a follower fails or exits."""
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        by_pipe = {pipe: rank for rank, pipe in enumerate(self.pipes, start=1)}
        while True:
            ready = wait([*by_sentinel, *by_pipe])
            for obj in ready:
                if obj in by_pipe:
                    self.on_lost(self._report(obj, by_pipe[obj]))
                    return
            for obj in ready:
                rank, proc = by_sentinel[obj]
                proc.join(REPORT_GRACE_SECONDS)
                pipe = self.pipes[rank - 1]
                reason = self._report(pipe, rank) if pipe.poll(REPORT_GRACE_SECONDS) else ""
                self.on_lost(reason or f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                return

    @staticmethod
    def _report(pipe: Connection, rank: int) -> str:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            return f"rank {rank} closed its pipe (it exited)"
        if isinstance(message, Failed):
            return f"rank {message.rank} failed: {message.reason}"
        return f"rank {rank} sent an unexpected {type(message).__name__}"


class RankedRunner:
    """Rank 0's runner facade: the steps and warm-ups it runs are sent to the followers first,
    then run on rank 0's own ``ModelRunner`` (``local``); everything else is the local runner's."""

    def __init__(self, local: Any, ranks: FollowerRanks) -> None:
        self.local = local
        self.ranks = ranks
        self._sent_logits: LogitsBatch | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def execute(self, plan: StepPlan, decision: Decision, graphs: Any) -> torch.Tensor:
        """The step on every rank. A forward pass that fails on rank 0 (a collective that timed
        out, a device error) leaves the ranks' collectives out of step, which no retry puts back:
        the engine core exits at once rather than re-running steps against a broken group."""
        self.ranks.send(Step(plan, decision))
        self._sent_logits = plan.logits
        try:
            return self.local.execute(plan, decision, graphs)
        except Exception as err:  # noqa: BLE001 - the process ends here, with the reason logged
            self.ranks.on_lost(self.ranks.gone() or f"rank 0's forward pass failed ({type(err).__name__}: "
                                                     f"{str(err)[:512]})")
            raise

    def sample_and_send(self, hidden: torch.Tensor, plan: StepPlan) -> Any:
        changed = plan.logits is not self._sent_logits
        if changed and plan.logits is not None:
            plan.logits.finished_masks()  # the batch travels as data, its masks computed
        self.ranks.send(Sample(plan.logits if changed else None, changed))
        return self.local.sample_and_send(hidden, plan)

    def warm_up(self, rows: int, every_row_count: bool | None = None) -> None:
        self.ranks.send(WarmUp(rows, every_row_count))
        self.local.warm_up(rows, every_row_count)


class MirroredCapture(CaptureController):
    """Rank 0's capture controller: each call that records, replays or frees graphs is sent to the
    followers (whose own controllers repeat it on their shard), then made here. The capture plan
    is a pure function of the policy and the traffic, so every rank plans the same keys; whether a
    key is skipped for the memory budget is rank 0's decision, sent with the key, so every rank
    records the same ones, and a phase ends on every rank with the graphs rank 0 kept (a
    follower's graphs are as large as rank 0's: the budget, judged on rank 0, is per rank)."""

    def __init__(self, ranks: FollowerRanks, *args: Any) -> None:
        super().__init__(*args)
        self.ranks = ranks

    def begin(self, policy: pb.GraphPolicy, runner: Any, traffic: Any = None) -> None:
        """Plans here first (recording nothing yet), so the followers leave out the coarse keys
        rank 0 remembered as not paying (``coarse_memory.py``) and plan the same keys."""
        super().begin(policy, runner, traffic)
        remembered = dict(self.job.remembered) if self.job is not None else {}
        self.ranks.send(CaptureCall("begin", (policy.SerializeToString(), dict(traffic) if traffic else None,
                                              remembered)))

    def _key(self) -> None:
        """Records (or skips) the next key on every rank."""
        over = self.job.over_budget()
        self.ranks.send(CaptureCall("key", (over,)))
        self.job.step(over)

    def step(self) -> bool:
        if self.job is None:
            return False
        if not self.job.done:
            self._key()
        if self.job.done:
            self.finish()
            return True
        return False

    def run_all(self) -> None:
        while self.job is not None and not self.job.done:
            self._key()
        super().run_all()  # nothing left to record: the phase finishes (``finish`` below)

    def finish(self) -> None:
        """Ends the phase here, then on the followers, which keep exactly the graphs rank 0 kept
        (those it dropped over the budget or for a failed validation go there too)."""
        job = self.job
        super().finish()
        if job is not None:
            self.ranks.send(CaptureCall("finish", (set(self.graph_set.captured),)))

    def release_idle(self, keys: set[tuple[int, int]]) -> None:
        self.ranks.send(CaptureCall("release_idle", (set(keys),)))
        super().release_idle(keys)

    def release(self) -> None:
        self.ranks.send(CaptureCall("release"))
        super().release()


def capture_controller(ranks: FollowerRanks | None, *args: Any) -> CaptureController:
    """The engine's capture controller: plain with one rank, mirrored to the followers with more."""
    return CaptureController(*args) if ranks is None else MirroredCapture(ranks, *args)


def reload_refusal(tensor_parallel_size: int) -> str | None:
    """Why this worker refuses LoadModelRevision (None: it does not). With several ranks a reload
    would have to load, swap and recapture on every rank in lockstep; that is not built, so the
    worker serves the model it started with (a new revision is a rollout)."""
    if tensor_parallel_size > 1:
        return (f"model reloads are not supported with --tensor-parallel-size {tensor_parallel_size}: "
                "roll the worker out with the new model instead")
    return None


# --- a follower ---------------------------------------------------------------------------


class Follower:
    """One follower rank: its model slot and capture controller, driven by rank 0's commands."""

    def __init__(self, settings: EngineSettings, device: torch.device, tp: TensorParallel,
                 kv_blocks: int | None) -> None:
        from graphkeeper.worker.engine.model_slot import ModelSlot

        self.settings = settings
        self.metrics = WorkerMetrics()
        self.slot = ModelSlot(settings, device, Ledger(), self.metrics, kv_blocks=kv_blocks, tp=tp)
        self.capture = CaptureController(Dispatcher(), self.metrics, settings.max_num_seqs,
                                         settings.max_num_batched_tokens, settings.inject_capture_failures)
        self._step: tuple[StepPlan, torch.Tensor] | None = None

    def serve(self, pipe: Connection) -> None:
        """Carries out rank 0's commands until rank 0 closes the pipe (or goes away)."""
        with torch.inference_mode():
            while True:
                try:
                    command = pipe.recv()
                except (EOFError, OSError):
                    return
                self.handle(command)

    def handle(self, command: Any) -> None:
        slot = self.slot
        if isinstance(command, Step):
            hidden = slot.runner.execute(command.plan, command.decision, self.capture.graph_set)
            self._step = (command.plan, hidden)
        elif isinstance(command, Sample):
            plan, hidden = self._step
            self._step = None
            if command.changed:
                plan.logits = command.logits
            slot.runner.sample_and_send(hidden, plan)  # the tokens stay in last_tokens for the next step
        elif isinstance(command, Load):
            if os.environ.get(INJECT_LOAD_ENV) == str(self.slot.tp.rank):
                raise RuntimeError(f"injected load failure on rank {self.slot.tp.rank}")
            slot.install_shard(slot.load(command.source, command.revision))
        elif isinstance(command, PrepareStep):
            slot.prepare_step()
        elif isinstance(command, WarmUp):
            slot.runner.warm_up(command.rows, command.every_row_count)
        elif isinstance(command, ResizeKV):
            slot.resize_kv(command.num_blocks)
        elif isinstance(command, CaptureCall):
            self._capture(command)
        else:
            raise TypeError(f"unknown command {type(command).__name__}")

    def _capture(self, call: CaptureCall) -> None:
        if call.method == "begin":
            policy_bytes, traffic, remembered = call.args
            policy = pb.GraphPolicy.FromString(policy_bytes)
            policy.memory_budget_bytes = 0  # rank 0 judges the budget; nothing is dropped here alone
            self.capture.begin(policy, self.slot.runner, traffic)
            if self.capture.job is not None:
                self.capture.job.coarse = ()  # rank 0 judges what coarse graphs buy, as the budget
                self.capture.job.skip_remembered(remembered)
        elif call.method == "key":
            self.capture.job.step(*call.args)
        elif call.method == "finish":
            (kept,) = call.args
            graphs = self.capture.graph_set
            for key in set(graphs.captured) - kept:
                graphs.drop(key)
            self.capture.finish()
        else:
            getattr(self.capture, call.method)(*call.args)


def follower_device(device_type: str, rank: int) -> torch.device:
    """Rank ``r`` runs on ``cuda:r`` (rank 0 is the engine's own device) or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def follower_main(pipe: Connection, settings: EngineSettings, rank: int, init_method: str,
                  kv_blocks: int | None, parent_pid: int, log_level: str) -> None:
    """A follower process's entry point (``multiprocessing`` spawn target)."""
    from graphkeeper.worker.engine.spawn import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns shutdown; the follower ends with it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    limit_logging()
    size_torch_threads()
    device = follower_device(torch.device(settings.device).type, rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = init_tensor_parallel(rank, settings.tensor_parallel_size, init_method, device.type,
                                  timeout_s=collective_timeout())
        Follower(settings, device, tp, kv_blocks).serve(pipe)
    except BaseException as err:  # noqa: BLE001 - reported to rank 0, which ends the worker
        log.exception("rank %d failed", rank)
        with contextlib.suppress(OSError, ValueError):
            pipe.send(Failed(rank, f"{type(err).__name__}: {err}"[:1024]))
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # rank 0 closed the pipe: the worker is stopping
