"""The engine core: one thread that owns the device and runs the step loop.

A step is ``schedule -> run -> postprocess``: the scheduler picks rows, the runner executes them
as the dispatcher decided and samples on the device, and postprocessing appends the tokens,
stops and frees sequences, and publishes the step's outputs in one call. The loop launches step
N+1 before it waits for step N's tokens, so the host prepares the next step while the device
runs the current one, and the one host synchronisation per step overlaps device work.

Other threads never write engine state: a policy, a reload, a submit or a cancel is a command or
an inbox entry that the engine takes at the top of its loop. What ``status()`` reports is what the
engine has adopted, read under one lock together with the lifecycle state; a pushed policy the
engine has not taken yet is reported as pending.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import mode_name, tenant_allows_graphs, validate_policy
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.model_roots import check_model_root
from graphkeeper.worker.engine.outputs import OutputProcessor
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler, Sequence
from graphkeeper.worker.engine.status import graph_status, model_info
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Decision, Dispatcher
from graphkeeper.worker.executor.runner import Launched, ModelRunner
from graphkeeper.worker.executor.sampling import SamplingSpec
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import LoadedModel, load_model
from graphkeeper.worker.model.step import (
    DEFAULT_CACHE_DIR,
    CompileReport,
    Optimization,
    forbid_recompiles,
    prepare_step,
)
from graphkeeper.worker.model.step import resolve as resolve_optimization
from graphkeeper.worker.model.tokenizer import Tokenizer, load_tokenizer
from graphkeeper.worker.serving.admission import Limits, validate_request

log = logging.getLogger(__name__)
S = pb.LifecycleState
L = pb.LedgerStage
STEADY_AFTER_STEPS = 16
#: Tenants whose graph permission is remembered; beyond this the memo starts over.
TENANT_MEMO_LIMIT = 4096
#: Policy uids whose highest generation is remembered, so generations never go backwards.
GENERATION_MEMORY = 1024


class QueueFull(RuntimeError):
    pass


class NotServing(RuntimeError):
    pass


class StalePolicy(RuntimeError):
    pass


class InjectedFailure(RuntimeError):
    """Raised only by the fault injection that tests ask for."""


class StepFailed(RuntimeError):
    """A step raised; the requests in it fail with this, the engine keeps serving."""


@dataclass
class EngineSettings:
    model: str = "random:tiny"
    model_revision: str = ""
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_seq_len: int = 512
    max_num_batched_tokens: int = 256
    max_queue: int = 256
    prefill_chunk: int = 0
    policy: pb.GraphPolicy | None = None
    inject_capture_failures: frozenset[int] = frozenset()
    model_roots: tuple[str, ...] = ()
    #: Fault injection for tests: a step holding this prompt token raises (fatally: as a broken device).
    inject_step_failure: tuple[int, bool] | None = None
    #: The -O preset with explicit flags applied (None: -O2 resolved for ``device``).
    optimization: Optimization | None = None
    compile_cache_dir: str = DEFAULT_CACHE_DIR
    quantization: str = "none"


def default_policy(mode: int = pb.GRAPH_MODE_FULL_AND_PIECEWISE) -> pb.GraphPolicy:
    """The policy a worker holds before any is applied: generation 0, default ladder."""
    return pb.GraphPolicy(
        policy_name="(worker default)", mode=mode,
        capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT),
    )


def direct_publish(updates: list[tuple[Any, list[int], Any]]) -> None:
    """Without an API layer (tests, benchmarks): each stream is a callable ``(tokens, end)``."""
    for stream, tokens, end in updates:
        if stream is not None:
            stream(tokens, end)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    step: ScheduledStep
    decision: Decision
    desc: BatchDescriptor
    launched: Launched
    started: float


class Engine:
    def __init__(self, settings: EngineSettings, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.lifecycle = Lifecycle()
        self.lifecycle.subscribe(self.metrics.set_lifecycle)
        self.ledger = Ledger()
        self.device = torch.device(settings.device)
        self.scheduler = Scheduler(settings.max_num_seqs, settings.max_num_batched_tokens, settings.prefill_chunk)
        self.dispatcher = Dispatcher()
        self.recorder = StepRecorder(self.metrics)
        self.outputs = OutputProcessor(self.scheduler, self.metrics)
        self.capture = CaptureController(self.dispatcher, self.metrics, settings.max_num_seqs,
                                         settings.max_num_batched_tokens, settings.inject_capture_failures)
        self.publish: Callable[[list[tuple[Any, list[int], Any]]], None] = direct_publish
        self.loaded: LoadedModel | None = None
        self.tokenizer: Tokenizer | None = None
        self.runner: ModelRunner | None = None
        self.optimization = settings.optimization or resolve_optimization(2, None, self.device.type)
        self.compile_report = CompileReport(level=self.optimization.level, reason=self.optimization.reason)
        self.policy = settings.policy if settings.policy and settings.policy.policy_uid else default_policy(
            (settings.policy.mode if settings.policy else 0) or pb.GRAPH_MODE_FULL_AND_PIECEWISE)
        self.pending_policy: pb.GraphPolicy | None = None
        self._generations: dict[str, int] = {self.policy.policy_uid: self.policy.generation}
        self._adopt_tenants(self.policy)
        self.last_error = ""
        self.failed: BaseException | None = None
        self.steps_since_ready = 0
        self._status_lock = threading.Lock()  # lifecycle moves and adopted state change together
        self._policy_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self._pending_reload: tuple[str, str, Future] | None = None
        self._last_finish = 0.0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # --- public API (any thread) ----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def limits(self) -> Limits:
        assert self.loaded is not None
        return Limits(self.loaded.config.vocab_size, self.settings.max_seq_len, text_prompts=self.tokenizer is not None)

    def submit(self, req: pb.GenerateRequest, stream: Any, prompt: list[int] | None = None) -> Sequence:
        """Validates and queues a request; raises AdmissionError, QueueFull or NotServing.

        ``prompt`` is the tokenized ``prompt_text`` when the request had one.
        """
        if self._draining or self.failed is not None or not self.lifecycle.serving or self.loaded is None:
            raise NotServing(f"worker is {pb.LifecycleState.Name(self.lifecycle.state)}")
        if prompt is not None and req.prompt_text:
            req = _with_prompt(req, prompt)  # the text's rules were checked before it was tokenized
        validate_request(req, self.limits())
        if len(self._inbox) + len(self.scheduler.waiting) >= self.settings.max_queue:
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")
        seq = self._new_sequence(req, stream)
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self._inbox.append(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled.set()
        self._wake.set()

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        """Idempotent by (uid, generation); raises PolicyError or StalePolicy.

        The policy becomes pending here and adopted on the engine thread; a generation older than
        any this worker has seen for the same uid is refused, held or pending.
        """
        with self._policy_lock:
            held = self._generations.get(policy.policy_uid)
            if held is not None and policy.generation < held:
                raise StalePolicy(f"generation {policy.generation} is older than generation {held} of policy "
                                  f"{policy.policy_uid[:64]!r}, which this worker already holds or was sent")
            if held is not None and policy.generation == held:
                return pb.ApplyGraphPolicyResponse(applied_generation=held, unchanged=True)
            validate_policy(policy, self.settings.max_num_batched_tokens)
            recapture = self.capture.config(policy) != self.capture.config(self.pending_policy or self.policy)
            self._remember_generation(policy)
            self.pending_policy = policy
            self._commands.put(lambda: self._adopt_policy(policy))
            self._wake.set()
            return pb.ApplyGraphPolicyResponse(
                applied_generation=policy.generation, recapture_started=recapture and self.device.type == "cuda")

    def load_revision(self, source: str, revision: str) -> Future:
        """Schedules a model reload; the future resolves to the new revision once it serves.

        Raises ReloadRefused for a source outside the model roots.
        """
        check_model_root(source, self.settings.model, self.settings.model_roots)
        future: Future = Future()
        self._commands.put(lambda: self._request_reload(source, revision, future))
        self._wake.set()
        return future

    def drain_and_stop(self, timeout: float) -> None:
        """Graceful shutdown within ``timeout`` seconds: refuse new requests, let running ones
        finish, then end whatever is left (its streams get UNAVAILABLE) and stop the loop."""
        self._draining = True
        with self._status_lock:
            if self.lifecycle.state != S.LIFECYCLE_STATE_DRAINING:
                self.lifecycle.move(S.LIFECYCLE_STATE_DRAINING)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.busy():
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=10)

    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._inbox)

    # --- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self._startup()
                self._loop()
        except BaseException as err:  # noqa: BLE001 - reported through self.failed and the log
            log.exception("engine stopped: %s", err)
            self.failed = err
            with self._status_lock:
                if self.lifecycle.state != S.LIFECYCLE_STATE_DRAINING:
                    self.lifecycle.move(S.LIFECYCLE_STATE_DRAINING)  # health NOT_SERVING at once
            self.ready.set()
        finally:
            self._end_all(NotServing("the worker is shutting down" if self.failed is None
                                     else f"engine stopped: {type(self.failed).__name__}"))

    def _startup(self) -> None:
        s = self.settings
        laps = [("before the engine", process_age())]
        began = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal began
            now = time.perf_counter()
            laps.append((name, now - began))
            began = now

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            torch.cuda.init()
            torch.zeros(1, device=self.device)  # creates the context before the first ledger entry
        self.ledger.record(L.LEDGER_STAGE_CONTEXT, self.device)
        lap("device context")
        self._install(self._load(s.model, s.model_revision))
        self._move(S.LIFECYCLE_STATE_MODEL_LOADED)
        lap("weights and KV cache")
        self._prepare_step()
        self.ledger.record(L.LEDGER_STAGE_WARMUP, self.device)
        self._move(S.LIFECYCLE_STATE_WARMED)
        lap(f"step ({step_phases(self.compile_report)})")
        self.capture.begin(self.policy, self.runner)
        self.capture.run_all()
        if self.compile_report.enabled:
            forbid_recompiles()
        self._captured()
        self._move(S.LIFECYCLE_STATE_CAPTURED)
        self._move(S.LIFECYCLE_STATE_READY)
        lap("capture")
        self._log_ready()
        log.info("startup: %s; READY %.1f s after the process started",
                 ", ".join(f"{name} {seconds:.1f} s" for name, seconds in laps), process_age())
        self.ready.set()

    def _load(self, source: str, revision: str) -> tuple[LoadedModel, KVCache]:
        """New weights (and a KV cache for their shapes); nothing the engine serves is touched."""
        s = self.settings
        cache_len = 16 * math.ceil(s.max_seq_len / 16)  # aligned rows for the attention kernels
        loaded = load_model(source, device=self.device, dtype=s.dtype, max_positions=cache_len, revision=revision,
                            quantization=s.quantization)
        self.ledger.record(L.LEDGER_STAGE_WEIGHTS, self.device)
        old = self.runner
        if old is not None and old.loaded.config == loaded.config and old.loaded.dtype == loaded.dtype:
            cache = old.cache  # same shapes: keep the allocation, only the weights move
        else:
            scratch = math.ceil(s.max_num_batched_tokens / cache_len)
            cache = KVCache(loaded.config, s.max_num_seqs, cache_len, device=self.device, dtype=loaded.dtype,
                            scratch_slots=scratch)
        self.ledger.record(L.LEDGER_STAGE_KV_CACHE, self.device)
        return loaded, cache

    def _install(self, loaded_cache: tuple[LoadedModel, KVCache]) -> bool:
        """Makes the new model the one that runs; True when it kept the old step functions (same
        config and dtype: the compiled pieces are functions of tensors and serve new weights)."""
        loaded, cache = loaded_cache
        old = self.runner
        kept = old is not None and (old.loaded.config, old.loaded.dtype, old.loaded.quantization) == (
            loaded.config, loaded.dtype, loaded.quantization)
        if kept:
            loaded.model.use_pieces(old.model.pieces, old.model.kernels, old.model.row_pieces)
        self.runner = ModelRunner(loaded, cache, self.settings.max_num_batched_tokens)
        self.loaded = loaded
        self.tokenizer = load_tokenizer(loaded.source)
        self.metrics.set_model(loaded.revision, loaded.source, str(loaded.dtype).removeprefix("torch."),
                               str(self.device))
        log.info("model %s revision %s loaded: %d parameters, %s on %s%s", loaded.source, loaded.revision,
                 loaded.parameter_count, loaded.dtype, self.device, ", with tokenizer" if self.tokenizer else "")
        return kept

    def _prepare_step(self) -> None:
        """Builds the step (fused kernels, or compiled: traced at the largest warm-up size, or loaded
        from the on-disk cache) and runs it once, before anything is captured."""
        s, o = self.settings, self.optimization
        rows = min(max(2, min(s.max_num_seqs, s.max_num_batched_tokens)), s.max_num_batched_tokens)
        self.compile_report = prepare_step(
            self.runner.model, compile=o.compile, cache_root=s.compile_cache_dir, quantization=s.quantization,
            warm_up=lambda: self.runner.warm_up(rows), level=o.level, reason=o.reason)
        r = self.compile_report
        self.metrics.set_compile(o.level, r.enabled, r.cache, self.runner.model.kernels, s.quantization, r.seconds)

    def _loop(self) -> None:
        inflight: InFlight | None = None
        while not self._stop.is_set():
            self._run_commands()
            if self._pending_reload is not None and inflight is None:
                self._maybe_reload()
            self._admit_inbox()
            for seq in self.scheduler.reap_cancelled():
                self._complete(seq, pb.FINISH_REASON_CANCELLED)
            if self.capture.active:
                inflight = self._finish(inflight)
                if self.capture.step():
                    self._captured()
            step = self.scheduler.schedule()
            launched = self._launch(step) if step is not None else None
            inflight = self._finish(inflight)
            inflight = launched
            self._update_gauges()
            if inflight is None and step is None:
                self._wake.wait(0.05 if not self.capture.active else 0)
                self._wake.clear()
        self._finish(inflight)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _admit_inbox(self) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())

    # --- one step: run, then postprocess ---------------------------------------------------

    def _launch(self, step: ScheduledStep) -> InFlight | None:
        """Dispatches and launches a step; its tokens are read by ``_finish`` after the next launch."""
        plan = step.plan
        desc = BatchDescriptor(plan.num_tokens, len(step.sequences), plan.uniform_decode,
                               all(self._tenant_allows(s.tenant) for s in step.sequences))
        decision = self.dispatcher.dispatch(desc)
        started = time.perf_counter()
        try:
            self._maybe_inject_failure(plan)
            hidden = self.runner.execute(plan, decision, self.capture.graph_set)
            launched = self.runner.sample_and_send(hidden, plan)
        except Exception as err:  # noqa: BLE001 - the step's requests fail, the engine keeps serving
            self._fail_step(step, err)
            return None
        return InFlight(step, decision, desc, launched, started)

    def _finish(self, inflight: InFlight | None) -> None:
        """Reads a launched step's tokens, counts it once, and publishes its outputs in one call."""
        if inflight is None:
            return None
        step = inflight.step
        try:
            tokens = inflight.launched.tokens().tolist()
        except Exception as err:  # noqa: BLE001
            self._fail_step(step, err)
            return None
        now = time.perf_counter()
        elapsed = now - max(inflight.started, self._last_finish)
        self._last_finish = now
        self.recorder.record(inflight.decision, inflight.desc, step.sequences,
                             {s.tenant for s in step.sequences}, elapsed)
        self.publish(self.outputs.step_outputs(step.samplers, tokens, now))
        self.steps_since_ready += 1
        if self.steps_since_ready == STEADY_AFTER_STEPS:
            self.ledger.record(L.LEDGER_STAGE_STEADY, self.device)
            self._export_ledger()
        return None

    def _maybe_inject_failure(self, plan) -> None:
        inject = self.settings.inject_step_failure
        if inject is not None and inject[0] in plan.prompt_tokens:
            raise InjectedFailure(f"CUDA error: injected device failure (token {inject[0]})" if inject[1]
                                  else f"injected step failure (token {inject[0]})")

    def _fail_step(self, step: ScheduledStep, err: Exception) -> None:
        """A step that raised fails its own requests; a broken device stops the engine."""
        if _device_broken(err):
            raise err
        log.error("step of %d tokens failed: %s: %s", step.plan.num_tokens, type(err).__name__, err)
        failure = StepFailed(f"the step running this request failed: {type(err).__name__}")
        self.publish(self.outputs.end(step.sequences, failure, outcome="error"))

    def _complete(self, seq: Sequence, reason: int) -> None:
        """Ends a sequence outside a step (cancelled) and tells its stream."""
        self.publish([(seq.stream, [], self.outputs.completion(seq, reason))])

    def _end_all(self, err: Exception) -> None:
        """Every request still held gets ``err`` (shutdown past the drain deadline, or a dead engine)."""
        leftover = [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]
        self._inbox.clear()
        self.publish(self.outputs.end(leftover, err))

    def _new_sequence(self, req: pb.GenerateRequest, stream: Any) -> Sequence:
        sp = req.sampling
        spec = SamplingSpec(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p or 1.0)
        seed = sp.seed if sp.HasField("seed") else random.getrandbits(63)
        eos = None if req.stopping.ignore_eos else self.loaded.config.eos_token_id
        return Sequence(
            request_id=req.request_id or f"req-{random.getrandbits(48):012x}", tenant=req.tenant,
            prompt=list(req.prompt_token_ids), max_new_tokens=req.stopping.max_new_tokens,
            sampling=spec, stream=stream, stop_ids=frozenset(req.stopping.stop_token_ids), eos_id=eos,
            seed=seed & (2**63 - 1),
        )

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.scheduler.waiting) + len(self._inbox))
        self.metrics.running_sequences.set(len(self.scheduler.running))

    # --- tenants --------------------------------------------------------------------------

    def _tenant_allows(self, tenant: str) -> bool:
        """The shared policy rule, memoised per tenant until the next policy is adopted."""
        allowed = self._tenant_allowed.get(tenant)
        if allowed is None:
            if len(self._tenant_allowed) >= TENANT_MEMO_LIMIT:
                self._tenant_allowed.clear()  # bounded: any number of tenant names may arrive
            allowed = self._tenant_allowed[tenant] = tenant_allows_graphs(self._tenant_policy, tenant)
        return allowed

    def _adopt_tenants(self, policy: pb.GraphPolicy) -> None:
        """Tenant toggles take effect at the next step; only the adopted policy's rules apply."""
        self._tenant_policy = policy
        self._tenant_allowed: dict[str, bool] = {}
        self.recorder.listed_tenants = frozenset(t.tenant for t in policy.tenants)

    # --- policies and graphs --------------------------------------------------------------

    def _remember_generation(self, policy: pb.GraphPolicy) -> None:
        if len(self._generations) >= GENERATION_MEMORY and policy.policy_uid not in self._generations:
            self._generations.pop(next(iter(self._generations)))
        self._generations[policy.policy_uid] = policy.generation

    def _adopt_policy(self, policy: pb.GraphPolicy) -> None:
        """Engine thread: tenant toggles now; a capture config change recaptures."""
        recapture = self.capture.config(policy) != self.capture.config(self.policy)
        with self._status_lock:
            if recapture and self.device.type == "cuda" and self.lifecycle.state == S.LIFECYCLE_STATE_READY:
                self._move(S.LIFECYCLE_STATE_RECAPTURING)
            self.policy = policy
            if self.pending_policy is policy:
                self.pending_policy = None
            self._adopt_tenants(policy)
        self.metrics.policy_generation.set(policy.generation)
        log.info("policy %s generation %d adopted (recapture: %s)", (policy.policy_name or policy.policy_uid)[:64],
                 policy.generation, recapture)
        if recapture:
            self.metrics.recaptures.labels("policy").inc()
            self._recapture()

    def _recapture(self) -> None:
        self.capture.release()
        self.capture.begin(self.policy, self.runner)
        if not self.capture.active:
            self._captured()

    def _captured(self) -> None:
        """A capture phase ended: ledger, errors, and READY again after a recapture."""
        self.ledger.record(L.LEDGER_STAGE_CAPTURE, self.device)
        self._export_ledger()
        self.metrics.policy_generation.set(self.policy.generation)
        with self._status_lock:
            self.last_error = self.capture.last_failure
            if self.lifecycle.state == S.LIFECYCLE_STATE_RECAPTURING:
                self._move(S.LIFECYCLE_STATE_READY)
                self._log_ready()

    def _move(self, state: int) -> None:
        self.lifecycle.move(state)

    def _export_ledger(self) -> None:
        for entry in list(self.ledger.entries.values()):
            stage = pb.LedgerStage.Name(entry.stage).removeprefix("LEDGER_STAGE_").lower()
            for kind, value in (("device_used", entry.device_used), ("torch_allocated", entry.torch_allocated),
                                ("torch_reserved", entry.torch_reserved), ("residual", entry.residual)):
                self.metrics.ledger.labels(stage, kind).set(value)

    def _log_ready(self) -> None:
        c = self.capture
        log.info("READY: requested %s, effective %s%s; %d graphs captured in %.2f s",
                 mode_name(c.requested_mode), mode_name(c.effective_mode),
                 f" ({c.downgrade_reason})" if c.downgrade_reason else "", c.captured_count(), c.total_seconds)

    # --- model revisions ------------------------------------------------------------------

    def _request_reload(self, source: str, revision: str, future: Future) -> None:
        if self._pending_reload is not None:
            future.set_exception(RuntimeError("a model reload is already in progress"))
            return
        self.scheduler.admitting = False  # running sequences finish on the weights they started with
        self._pending_reload = (source, revision, future)

    def _maybe_reload(self) -> None:
        """Loads the new weights beside the old ones; only a complete load replaces anything."""
        if self.scheduler.running:
            return
        source, revision, future = self._pending_reload
        try:
            fresh = self._load(source, revision)
        except Exception as err:  # noqa: BLE001 - the old model keeps serving, graphs and all
            with self._status_lock:
                self.last_error = f"model reload failed: {str(err)[:256]}"
                self._pending_reload = None
            log.error(self.last_error)
            self.scheduler.admitting = True
            future.set_exception(err)
            return
        with self._status_lock:
            if self.device.type == "cuda" and self.lifecycle.state == S.LIFECYCLE_STATE_READY:
                self._move(S.LIFECYCLE_STATE_RECAPTURING)
            self.capture.release()  # before the new weights serve: stale graphs can never replay
            self.capture.hold_eager()
            kept = self._install(fresh)
            self.last_error = ""
            self._pending_reload = None
        if not kept:
            self._prepare_step()
        self.metrics.recaptures.labels("model_revision").inc()
        self.capture.begin(self.policy, self.runner)
        if not self.capture.active:
            self._captured()
        self.scheduler.admitting = True
        future.set_result(self.loaded.revision)

    # --- status (any thread) --------------------------------------------------------------

    def model_info(self) -> pb.GetModelInfoResponse | None:
        return model_info(self.loaded, self.settings.max_seq_len, self.settings.max_num_seqs)

    def status(self) -> pb.GraphStatus:
        """What the engine has adopted, read under the same lock its changes are made under."""
        with self._status_lock:
            policy, pending, state, last_error = self.policy, self.pending_policy, self.lifecycle.state, self.last_error
            reload = self._pending_reload
        return graph_status(
            state=state, capture=self.capture, recorder=self.recorder, ledger=self.ledger, policy=policy,
            pending=pending, pending_revision=(reload[1] or reload[0]) if reload else "",
            model_revision=self.loaded.revision if self.loaded else "", last_error=last_error,
            running=len(self.scheduler.running), queued=len(self.scheduler.waiting) + len(self._inbox),
            compile=self.compile_report.to_proto(self.runner.model.kernels if self.runner else "",
                                                 self.settings.quantization),
        )


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; 0 where it cannot be read)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def step_phases(report: CompileReport) -> str:
    """What building the step spent its time on, for the startup log line (pure)."""
    parts = []
    if report.tuning is not None:
        parts.append(f"tuning {report.tuning.seconds:.1f} s, cache {report.tuning.cache}")
    if report.enabled:
        parts.append(f"compile {report.seconds:.1f} s, cache {report.cache}")
    return "; ".join(parts) or "no tuning or compilation"


def _with_prompt(req: pb.GenerateRequest, prompt: list[int]) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(req)
    out.ClearField("prompt_text")
    out.prompt_token_ids.extend(prompt)
    return out


def _device_broken(err: BaseException) -> bool:
    """CUDA errors other than out-of-memory leave the context unusable: the engine must stop."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    text = str(err)
    return "CUDA error" in text or "cudaError" in text or "CUBLAS_STATUS" in text
