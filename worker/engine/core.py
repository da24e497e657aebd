"""The engine core: one thread that owns the device and runs the step loop.

A step is ``schedule -> run -> postprocess``: the scheduler picks rows, the runner executes them
as the dispatcher decided and samples on the device, and postprocessing appends the tokens,
stops and frees sequences, and publishes the step's outputs in one call. The loop launches step
N+1 before it waits for step N's tokens, so the host prepares the next step while the device
runs the current one, and the one host synchronisation per step overlaps device work.

Other threads never write the loop's state: a submit or a cancel is an inbox entry or a flag, a
policy or a reload is offered to ``Control`` (the GraphControl state, under its one lock) and
taken by the engine at the top of its loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.proto.policy import PolicyError, effective_requested_mode, resolve_capture_sizes
from graphkeeper.worker.engine.blocks import BlockManager, blocks_for
from graphkeeper.worker.engine.control import Control, Reload, starting_policy
from graphkeeper.worker.engine.errors import (
    CannotFit,
    NotServing,
    QueueFull,
    ReloadBusy,
    StepFailed,
    device_broken,
    injected_failure,
)
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.model_roots import ReloadRefused, check_model_root
from graphkeeper.worker.engine.model_slot import ModelSlot
from graphkeeper.worker.engine.outputs import InFlight, OutputProcessor, direct_publish
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler, sub_step
from graphkeeper.worker.engine.sequence import Limits, Sequence, sequence_for
from graphkeeper.worker.engine.sizing import (
    UtilizationPlan,
    aligned,
    check_utilization,
    estimate_graph_bytes,
    plan_kv_by_utilization,
    settle,
)
from graphkeeper.worker.engine.startup import Laps, step_phases
from graphkeeper.worker.engine.status import graph_status, kv_cache_status, model_info
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Dispatcher
from graphkeeper.worker.executor.graphs.economics import idle_keys
from graphkeeper.worker.executor.graphs.modes import capture_plan, downgrade_mode
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.attention import SlotAttention
from graphkeeper.worker.model.kv_cache import check_block_size
from graphkeeper.worker.model.loader import ModelSourceError, check_source
from graphkeeper.worker.model.step import forbid_recompiles
from graphkeeper.worker.model.tokenizer import Tokenizer
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)
S = pb.LifecycleState
L = pb.LedgerStage
STEADY_AFTER_STEPS = 16
#: Seconds between two looks for idle graphs (a look is a dict scan; releasing is rare).
IDLE_CHECK_SECONDS = 1.0


class Engine:
    def __init__(self, settings: EngineSettings, metrics: WorkerMetrics | None = None) -> None:
        """Raises SizingError (or ModelSourceError) when the KV cache asked for cannot fit: checked
        here, from the model's config and the memory there is, before anything is allocated."""
        self.device = torch.device(settings.device)
        check_block_size(settings.kv_block_size)
        if settings.gpu_memory_utilization:
            check_utilization(settings.gpu_memory_utilization)
            if self.device.type != "cuda":
                raise ValueError("--gpu-memory-utilization sizes the KV cache from device memory: it needs a CUDA "
                                 "device (use --kv-cache-memory elsewhere)")
            if settings.kv_cache_memory:
                raise ValueError("--gpu-memory-utilization and --kv-cache-memory both size the KV cache: give one")
        settings, self.sizes = settle(settings, self.device)
        log.info("sizes: %s", self.sizes.explanation)
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.lifecycle = Lifecycle()
        self.lifecycle.subscribe(self.metrics.set_lifecycle)
        self.ledger = Ledger()
        #: Whether this worker records graphs at all (a recapture starts only where they exist).
        self.captures_graphs = self.device.type == "cuda"
        kv_blocks = self.sizes.kv_blocks
        if settings.gpu_memory_utilization:  # provisional: one whole context, until the graphs are measured
            kv_blocks = blocks_for(aligned(settings.max_seq_len), settings.kv_block_size)
        #: Track B's plan and what was free once the final graphs were captured (0 under track A).
        self.kv_plan: UtilizationPlan | None = None
        self.kv_free_after_capture = 0
        self.graph_room = 0  # track B: device memory graphs may take beside the cache
        self.slot = ModelSlot(settings, self.device, self.ledger, self.metrics, kv_blocks=kv_blocks)
        self.blocks = BlockManager(kv_blocks, settings.kv_block_size, prefix_caching=settings.prefix_caching)
        self.control = Control(starting_policy(settings.policy), self.lifecycle,
                               (settings.max_num_seqs, settings.max_num_batched_tokens))
        self.scheduler = Scheduler(settings.max_num_seqs, settings.max_num_batched_tokens, settings.prefill_chunk,
                                   self.blocks)
        self.dispatcher = Dispatcher()
        self.recorder = StepRecorder(self.metrics)
        self.recorder.listed_tenants = frozenset(t.tenant for t in self.control.policy.tenants)
        policy = self.control.policy
        self.recorder.traffic.reset(policy.policy_uid, policy.generation)
        self.outputs = OutputProcessor(self.scheduler, self.metrics)
        self.capture = CaptureController(self.dispatcher, self.metrics, settings.max_num_seqs,
                                         settings.max_num_batched_tokens, settings.inject_capture_failures)
        self.publish: Callable[[list[tuple[Any, list[int], Any]]], None] = direct_publish
        self.failed: BaseException | None = None
        self.steps_since_ready = 0
        self._inbox: deque[Sequence] = deque()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self._last_finish = 0.0
        self._idle_checked = 0.0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # --- public API (any thread) ----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.slot.tokenizer

    def limits(self) -> Limits | None:
        """What requests may ask of the served model; None until it is loaded."""
        loaded = self.slot.loaded
        if loaded is None:
            return None
        tok = self.tokenizer
        return Limits(loaded.config.vocab_size, self.settings.max_seq_len, text_prompts=tok is not None,
                      chat=tok is not None and tok.has_chat_template, max_token_bytes=self.slot.max_token_bytes)

    def submit(self, req: pb.GenerateRequest, stream: Any) -> Sequence:
        """Queues an admitted request (the API layer validated it); raises QueueFull or NotServing."""
        loaded = self.slot.loaded
        if self._draining or self.failed is not None or not self.lifecycle.serving or loaded is None:
            raise NotServing(f"worker is {lifecycle_name(self.lifecycle.state)}")
        if self._queued() >= self.settings.max_queue:
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")
        seq = sequence_for(req, stream, self.slot.eos_ids)
        need = blocks_for(len(seq.prompt) + seq.max_new_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise CannotFit(f"prompt ({len(seq.prompt)} tokens) plus max_new_tokens ({seq.max_new_tokens}) needs "
                            f"{need} KV blocks of {self.blocks.block_size} tokens; the cache has "
                            f"{self.blocks.num_blocks} in all")
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self._inbox.append(seq)
        self._wake.set()
        return seq

    def _queued(self) -> int:
        """Requests that will wait for a slot: those submitted and not running, less the slots free
        now (one still in the inbox while a slot is free runs at the next step; it is not queued)."""
        free = max(self.settings.max_num_seqs - len(self.scheduler.running), 0)
        return max(len(self._inbox) + len(self.scheduler.waiting) - free, 0)

    def cancel(self, seq: Sequence, reason: int = pb.FINISH_REASON_CANCELLED) -> None:
        """Ends ``seq`` at the next step; ``reason`` is its finish (FINISH_REASON_STOP when the API
        layer matched a stop string, so the request is counted as stopped, not cancelled)."""
        seq.cancel_reason = reason
        seq.cancelled.set()
        self._wake.set()

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        """Idempotent by (uid, generation); raises PolicyError or StalePolicy.

        The policy becomes pending here and adopted on the engine thread.
        """
        self._check_graphs_fit(policy)
        unchanged, recapture = self.control.offer(policy)
        if not unchanged:
            self._commands.put(lambda: self._adopt_policy(policy))
            self._wake.set()
        return pb.ApplyGraphPolicyResponse(applied_generation=policy.generation, unchanged=unchanged,
                                           recapture_started=recapture and self.captures_graphs)

    def load_revision(self, source: str, revision: str) -> Future:
        """Schedules a model reload; the future resolves to the new revision once it serves.

        Everything that can be judged without loading is judged here, before admission pauses:
        raises ReloadRefused for a source outside the model roots and ReloadBusy (a NotServing)
        while another reload is pending; a source that cannot load (no config.json, no weights, an
        unknown preset) returns an already failed future. The engine loads the source's resolved
        real path, the one the root check judged.
        """
        resolved = check_model_root(source, self.settings.model, self.settings.model_roots)
        future: Future = Future()
        if self.control.reload is not None:
            raise ReloadBusy("a model reload is already in progress: retry when it has finished")
        try:
            check_source(resolved)
        except (ModelSourceError, OSError, ValueError) as err:
            self.control.reload_failed(f"model reload failed: {str(err)[:256]}")
            future.set_exception(err)
            return future
        if not self.control.request_reload(Reload(resolved, revision, future)):
            raise ReloadBusy("a model reload is already in progress: retry when it has finished")
        self._wake.set()
        return future

    def alive(self) -> bool:
        return self.thread.is_alive() and self.failed is None

    def drain_and_stop(self, timeout: float) -> None:
        """Graceful shutdown within ``timeout`` seconds: refuse new requests, let running ones
        finish, then end whatever is left (its streams get UNAVAILABLE) and stop the loop."""
        self._draining = True
        self.control.move(S.LIFECYCLE_STATE_DRAINING)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.scheduler.running or self.scheduler.waiting or self._inbox):
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=10)

    def model_info(self) -> pb.GetModelInfoResponse | None:
        return model_info(self.slot.loaded, self.settings.max_seq_len, self.settings.max_num_seqs,
                          self.slot.eos_ids, self.tokenizer)

    def status(self) -> pb.GraphStatus:
        """What the engine has adopted, read under the lock its changes are made under."""
        snap = self.control.snapshot()
        loaded = self.slot.loaded
        return graph_status(
            snap, capture=self.capture, recorder=self.recorder, ledger=self.ledger,
            model_revision=loaded.revision if loaded else "", running=len(self.scheduler.running),
            queued=len(self.scheduler.waiting) + len(self._inbox), compile=self.slot.compile_status(),
            kv_cache=self.kv_status())

    def kv_status(self) -> pb.KVCacheStatus:
        """The KV cache's blocks, prefix cache and preemptions (counts read without a lock: each is
        one integer the engine thread writes)."""
        runner, plan = self.slot.runner, self.kv_plan
        status = kv_cache_status(
            self.blocks.block_size, self.blocks.status(), prefix_caching=self.blocks.prefix_caching,
            preemptions=self.scheduler.preemptions,
            nbytes=runner.cache.nbytes() if runner else self.sizes.kv_cache_bytes,
            sizing="utilization" if self.settings.gpu_memory_utilization else "explicit")
        if plan is not None:
            status.planned_bytes, status.free_after_capture_bytes = plan.kv_bytes, self.kv_free_after_capture
        return status

    def _export_kv(self) -> None:
        b = self.blocks
        self.metrics.set_kv(b.block_size, *b.status(), self.scheduler.preemptions)

    # --- track B: the KV cache sized after measured graph memory ----------------------------

    def _check_graphs_fit(self, policy: pb.GraphPolicy) -> None:
        """Under track B the cache took what the graphs left: a policy whose graphs would need
        more than the graphs hold now plus what is still free is refused (PolicyError), not
        captured into an out-of-memory."""
        graphs = self.capture.graph_set
        if self.kv_plan is None or graphs is None or not graphs.captured:
            return
        mode, _ = downgrade_mode(effective_requested_mode(policy), int(SlotAttention.graph_support), True)
        if mode == pb.GRAPH_MODE_NONE:
            return
        ladder = resolve_capture_sizes(policy.capture_sizes, self.settings.max_num_seqs,
                                       self.settings.max_num_batched_tokens)
        keys = capture_plan(mode, ladder, self.settings.max_num_seqs)
        measured = {k: max(0, e.device_bytes) for k, e in graphs.captured.items()}
        need = estimate_graph_bytes(keys, measured)
        if need > self.graph_room:
            raise PolicyError("capture_sizes", f"its graphs would take about {need} B of device memory; beside the KV "
                              f"cache sized by --gpu-memory-utilization there is room for {self.graph_room} B "
                              "(fewer or smaller sizes, or restart the worker to size the cache for them)")

    def _size_kv_by_utilization(self, utilization: float) -> None:
        """Measures what the step and the graphs take beside the provisional KV cache, gives the
        cache what is left of ``utilization`` x device memory, and captures the graphs again
        against it (a new KV allocation invalidates every graph: they are released first).

        The activation peak is measured on an eager step of the whole token budget, the largest
        a fallback step can be: serving must keep that much free outside the graphs' pools.
        """
        device, runner = self.device, self.slot.runner
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.compiler.set_stance("default"):
            runner.warm_up(self.settings.max_num_batched_tokens)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        cache = runner.cache
        plan = plan_kv_by_utilization(
            total_bytes=total, utilization=utilization, used_bytes=total - free,
            provisional_kv_bytes=cache.num_blocks * cache.block_bytes, activation_peak_bytes=peak,
            block_bytes=cache.block_bytes, min_blocks=cache.max_blocks_per_seq)
        log.info("--gpu-memory-utilization: %s", plan.explanation)
        self.capture.release()
        runner = cache = None
        self.slot.resize_kv(plan.kv_blocks)
        self.blocks.resize(plan.kv_blocks)
        self.capture.begin(self.control.policy, self.slot.runner)
        self.capture.run_all()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # What the cache could have taken, knowing the final capture: the prediction's truth.
        self.kv_free_after_capture = plan.kv_bytes + int(total * utilization) - (total - free) - peak
        graphs = self.capture.graph_set
        self.graph_room = (graphs.memory_bytes if graphs else 0) + max(0, self.kv_free_after_capture - plan.kv_bytes)
        self.kv_plan = plan
        log.info("KV cache planned %d B; %d B was free for it after the final capture (%.2f%% apart)",
                 plan.kv_bytes, self.kv_free_after_capture,
                 100 * abs(plan.kv_bytes - self.kv_free_after_capture) / max(1, self.kv_free_after_capture))

    # --- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self._startup()
                self._loop()
        except BaseException as err:  # noqa: BLE001 - reported through self.failed and the log
            log.exception("engine stopped: %s", err)
            self.failed = err
            self.control.move(S.LIFECYCLE_STATE_DRAINING)  # health NOT_SERVING at once
            self.ready.set()
        finally:  # every request still held ends (shutdown past the drain deadline, or a dead engine)
            leftover = [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]
            self._inbox.clear()
            failed = self.failed
            why = "the worker is shutting down" if failed is None else f"engine stopped: {type(failed).__name__}"
            self.publish(self.outputs.end(leftover, NotServing(why)))

    def _startup(self) -> None:
        s, laps = self.settings, Laps()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            torch.cuda.init()
            torch.zeros(1, device=self.device)  # creates the context before the first ledger entry
        self.ledger.record(L.LEDGER_STAGE_CONTEXT, self.device)
        laps.lap("device context")
        self.slot.install(self.slot.load(s.model, s.model_revision))
        self.recorder.set_attention(self.slot.runner.attention.name)
        self.blocks.reset_prefix_cache(self.slot.loaded.revision)
        self.control.move(S.LIFECYCLE_STATE_MODEL_LOADED)
        laps.lap("weights and KV cache")
        self.slot.prepare_step()
        self.ledger.record(L.LEDGER_STAGE_WARMUP, self.device)
        self.control.move(S.LIFECYCLE_STATE_WARMED)
        laps.lap(f"step ({step_phases(self.slot.compile_report)})")
        self.capture.begin(self.control.policy, self.slot.runner)
        self.capture.run_all()
        if s.gpu_memory_utilization:
            self._size_kv_by_utilization(s.gpu_memory_utilization)
        if self.slot.compile_report.enabled:
            forbid_recompiles()
        self._captured()
        self._export_kv()
        self.control.move(S.LIFECYCLE_STATE_CAPTURED)
        self.control.move(S.LIFECYCLE_STATE_READY)
        laps.lap("capture")
        log.info("READY: %s", self.capture.summary())
        log.info(laps.line())
        self.ready.set()

    def _loop(self) -> None:
        inflight: InFlight | None = None
        while not self._stop.is_set():
            while not self._commands.empty():
                self._commands.get_nowait()()
            if self.control.reload is not None:
                self.scheduler.admitting = False  # running sequences finish on the weights they started with
                if inflight is None and self.scheduler.drained:
                    self._reload(self.control.reload)
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            for seq in self.scheduler.reap_cancelled():
                self.publish([(seq.stream, [], self.outputs.completion(seq, seq.cancel_reason))])
            if self.capture.active:
                self._finish(inflight)
                inflight = None
                if self.capture.step():
                    self._captured()
            elif self._idle_graphs():
                self._finish(inflight)  # no step still replaying the graphs being released
                inflight = None
                self.capture.release_idle(self._idle_graphs())
            step = self.scheduler.schedule()
            launched, failure = self._launch(step) if step is not None else (None, None)
            self._finish(inflight)
            inflight = launched
            if failure is not None:
                self._isolate(step, failure)  # after the previous step's tokens: streams stay in order
            self.metrics.queue_depth.set(len(self.scheduler.waiting) + len(self._inbox))
            self.metrics.running_sequences.set(len(self.scheduler.running))
            self._export_kv()
            if inflight is None and step is None:
                self._wake.wait(0.05 if not self.capture.active else 0)
                self._wake.clear()
        self._finish(inflight)

    def _idle_graphs(self) -> set[tuple[int, int]]:
        """Captured graphs no step replayed for the policy's idle-release time (looked for at most
        once every ``IDLE_CHECK_SECONDS``; the look that finds some is repeated by the caller)."""
        seconds = self.capture.idle_release_seconds
        graphs = self.capture.graph_set
        if not seconds or graphs is None or not graphs.captured:
            return set()
        now = time.monotonic()
        if now - self._idle_checked < IDLE_CHECK_SECONDS:
            return set()
        found = idle_keys({k: t for k, t in self.recorder.last_used().items() if k in graphs.captured},
                          now, seconds)
        if not found:
            self._idle_checked = now
        return found

    # --- one step: run, then postprocess ---------------------------------------------------

    def _launch(self, step: ScheduledStep) -> tuple[InFlight | None, Exception | None]:
        """Dispatches and launches a step; its tokens are read by ``_finish`` after the next launch.

        A step that raises is returned as its failure, for ``_isolate`` once the step before it
        has been postprocessed.
        """
        try:
            return self._start(step), None
        except Exception as err:  # noqa: BLE001 - isolated: the culprit fails, the others run again
            return None, err

    def _start(self, step: ScheduledStep) -> InFlight:
        """Launches ``step`` (the one place a step runs); raises what the step raised."""
        plan = step.plan
        desc = BatchDescriptor(plan.num_tokens, plan.uniform_decode,
                               all(self.control.tenant_allows(s.tenant) for s in step.sequences))
        decision = self.dispatcher.dispatch(desc)
        started = time.perf_counter()
        if failure := injected_failure(self.settings.inject_step_failure, plan.prompt_tokens):
            raise failure
        runner = self.slot.runner
        launched = runner.sample_and_send(runner.execute(plan, decision, self.capture.graph_set), plan)
        return InFlight(step, decision, desc, launched, started)

    def _finish(self, inflight: InFlight | None) -> None:
        """Reads a launched step's tokens, counts it once, and publishes its outputs in one call."""
        if inflight is None:
            return
        try:
            self._read(inflight)
        except Exception as err:  # noqa: BLE001 - the step after it is already launched: no re-run
            self._fail_step(inflight.step.sequences, err)

    def _read(self, inflight: InFlight) -> None:
        """Waits for a launched step's tokens, records the step and publishes them; raises what
        the step raised."""
        step = inflight.step
        tokens = inflight.launched.tokens().tolist()
        now = time.perf_counter()
        elapsed = now - max(inflight.started, self._last_finish)
        self._last_finish = now
        self.recorder.record(inflight.decision, inflight.desc, step.sequences,
                             {s.tenant for s in step.sequences}, elapsed)
        self.publish(self.outputs.step_outputs(step.samplers, tokens, now))
        self.steps_since_ready += 1
        if self.steps_since_ready == STEADY_AFTER_STEPS:
            self.ledger.record(L.LEDGER_STAGE_STEADY, self.device)
            self.ledger.export(self.metrics)

    def _isolate(self, step: ScheduledStep, err: Exception) -> None:
        """A step raised at launch: re-runs its sequences in halves, bisecting down to the ones
        that fail on their own, so a poison request fails alone and its batch-mates go on.

        Each sub-step is the failed step's own rows for its sequences (``sub_step``), run and read
        at once; a sequence in no failing half is unaffected. At most ``2 x sequences`` sub-steps
        run; whatever is still suspect after that fails with the step. A broken device stops the
        engine as before.
        """
        if device_broken(err):
            raise err
        self.scheduler.launch_failed(step)
        log.error("step of %d tokens (%d sequences) failed: %s: %s; isolating it", step.plan.num_tokens,
                  len(step.sequences), type(err).__name__, err)
        suspects, culprits = [list(step.sequences)], []
        budget = 2 * len(step.sequences)
        while suspects:
            group = suspects.pop()
            if len(group) == 1 or budget <= 0:
                culprits += group
                continue
            half = len(group) // 2
            for part in (group[:half], group[half:]):
                budget -= 1
                try:
                    self._read(self._start(sub_step(step, set(part))))
                except Exception as sub_err:  # noqa: BLE001 - this half holds a culprit
                    if device_broken(sub_err):
                        raise sub_err from err
                    suspects.append(part)
        self._fail_step(culprits, err)

    def _fail_step(self, sequences: list[Sequence], err: Exception) -> None:
        """A step that raised fails these requests; a broken device stops the engine."""
        if device_broken(err):
            raise err
        if sequences:
            log.error("failing %d request(s) of a step that raised %s: %s", len(sequences), type(err).__name__, err)
        failure = StepFailed(f"the step running this request failed: {type(err).__name__}")
        self.publish(self.outputs.end(sequences, failure, outcome="error"))

    # --- policies, graphs and model revisions ----------------------------------------------

    def _adopt_policy(self, policy: pb.GraphPolicy) -> None:
        """Tenant toggles take effect at the next step; a change of the captured set recaptures."""
        recapture = self.control.recaptures(self.control.policy, policy)
        self.control.adopt(policy, recapture and self.captures_graphs)
        self.recorder.listed_tenants = frozenset(t.tenant for t in policy.tenants)
        traffic = self.recorder.traffic.tokens()  # what the old policy served: a max_graphs limit keeps its keys
        self.recorder.traffic.reset(policy.policy_uid, policy.generation)
        self.capture.idle_release_seconds = policy.idle_release_seconds
        self.metrics.policy_generation.set(policy.generation)
        log.info("policy %s generation %d adopted (recapture: %s)", (policy.policy_name or policy.policy_uid)[:64],
                 policy.generation, recapture)
        if recapture:
            self.metrics.recaptures.labels("policy").inc()
            self.capture.release()
            self._begin_capture(traffic)

    def _begin_capture(self, traffic: dict[tuple[int, bool], int] | None = None) -> None:
        """Plans the adopted policy's graphs; they are captured one per loop pass from here."""
        self.capture.begin(self.control.policy, self.slot.runner, traffic)
        if not self.capture.active:
            self._captured()

    def _captured(self) -> None:
        """A capture phase ended: ledger, errors, and READY again after a recapture."""
        self.ledger.record(L.LEDGER_STAGE_CAPTURE, self.device)
        self.ledger.export(self.metrics)
        graphs = self.capture.graph_set
        self.recorder.graphs_captured(list(graphs.captured) if graphs else [])
        self.metrics.policy_generation.set(self.control.policy.generation)
        if self.control.captured(self.capture.last_failure):
            log.info("READY: %s", self.capture.summary())

    def _reload(self, reload: Reload) -> None:
        """Loads the new weights beside the old ones; only a complete load replaces anything.

        The resolved source is judged again here, just before loading: a directory whose
        entries were relinked outside the roots since the request is refused.
        """
        try:
            again = check_model_root(reload.source, self.settings.model, self.settings.model_roots)
            if again != reload.source:
                raise ReloadRefused("source", "changed since it was checked (a link was replaced)")
            fresh = self.slot.load(reload.source, reload.revision)
        except Exception as err:  # noqa: BLE001 - the old model keeps serving, graphs and all
            message = f"model reload failed: {str(err)[:256]}"
            self.control.reload_failed(message)
            log.error(message)
            self.scheduler.admitting = True
            reload.future.set_exception(err)
            return

        def install() -> bool:
            self.capture.release()  # before the new weights serve: stale graphs can never replay
            self.capture.hold_eager()
            return self.slot.install(fresh)

        kept = self.control.swap_model(self.captures_graphs, install)
        # One coherent ledger of the new model: the old one's stages go, and the weights and KV
        # cache are measured again now that the old weights and graphs are freed.
        self.ledger.restart(self.device, self.slot.runner.cache.nbytes())
        if not kept:
            self.slot.prepare_step()
        self.ledger.record(L.LEDGER_STAGE_WARMUP, self.device)
        self.steps_since_ready = 0  # STEADY is measured again, on the new model
        self.recorder.set_attention(self.slot.runner.attention.name)
        self.blocks.reset_prefix_cache(self.slot.loaded.revision)  # nothing runs now: every block is free
        self.metrics.recaptures.labels("model_revision").inc()
        self._begin_capture()
        self.scheduler.admitting = True
        reload.future.set_result(self.slot.loaded.revision)
