"""The engine core: one thread that owns the device and runs the step loop.

A step is ``schedule -> run -> postprocess``: the scheduler picks rows, the runner executes them
as the dispatcher decided and samples on the device, and postprocessing appends the tokens,
stops and frees sequences, and publishes the step's outputs in one call. The loop launches step
N+1 before it waits for step N's tokens, so the host prepares the next step while the device
runs the current one, and the one host synchronisation per step overlaps device work.

Other threads never write the loop's state: a submit is a ``Mailbox`` entry, a cancel a flag, a
policy or a reload is offered to ``Control`` (the GraphControl state, under its one lock), a Sleep
or a Wake to ``SleepControl``, and each is taken by the engine between steps (``_between_steps``).

Beside this module, each in its own: the mailbox, step isolation (``isolation``), a model reload
(``reload``), sleep and wake (``sleep_control``), track B's KV sizing (``kv_sizing``); the capture
plan, capture phases and idle release are the capture controller's (``executor/graphs/controller.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.worker.engine.blocks import BlockManager, blocks_for
from graphkeeper.worker.engine.control import Control, Reload, starting_policy
from graphkeeper.worker.engine.drain import refuse_unstarted
from graphkeeper.worker.engine.errors import (
    CannotFit,
    InvalidTokens,
    NotServing,
    QueueFull,
    ReloadBusy,
    ReloadUnsupported,
    injected_failure,
)
from graphkeeper.worker.engine.gc_pauses import GcPauses, freeze_heap
from graphkeeper.worker.engine.isolation import fail_step, isolate
from graphkeeper.worker.engine.kv_sizing import UtilizationSizing
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.logits_state import (
    build_logits_batch,
    logits_state_for,
    mark_counted,
    use_mask_buffer,
)
from graphkeeper.worker.engine.mailbox import Mailbox
from graphkeeper.worker.engine.model_roots import check_model_root
from graphkeeper.worker.engine.model_slot import ModelSlot
from graphkeeper.worker.engine.outputs import InFlight, OutputProcessor, direct_publish
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.engine.reload import reload_model
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler
from graphkeeper.worker.engine.sequence import Limits, Sequence, sequence_for
from graphkeeper.worker.engine.sizing import settle, utilization_error
from graphkeeper.worker.engine.sleep_control import SleepControl
from graphkeeper.worker.engine.startup import StartupClock, capture_parts, step_parts
from graphkeeper.worker.engine.status import graph_status, kv_cache_status, model_info
from graphkeeper.worker.engine.step_budget import install_step_budget
from graphkeeper.worker.engine.step_overruns import StepOverruns, allocator_note
from graphkeeper.worker.engine.structured import Grammars
from graphkeeper.worker.engine.tp_ranks import capture_controller, reload_refusal
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Dispatcher
from graphkeeper.worker.executor.transfer import pinned_masks
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.source import ModelSourceError, check_source
from graphkeeper.worker.model.step import forbid_recompiles
from graphkeeper.worker.model.tokenizer import Tokenizer
from graphkeeper.worker.settings import EngineSettings, check_block_size

log = logging.getLogger(__name__)
S = pb.LifecycleState
L = pb.LedgerStage
STEADY_AFTER_STEPS = 16


class Engine:
    def __init__(self, settings: EngineSettings, metrics: WorkerMetrics | None = None) -> None:
        """Raises SizingError (or ModelSourceError) when the KV cache asked for cannot fit: checked
        here, from the model's config and the memory there is, before anything is allocated."""
        self.clock = StartupClock(settings.process_started_at, settings.engine_spawned_at)
        #: The start's stages until READY (empty before); the API process adds the last one.
        self.startup = pb.StartupStatus()
        self.device = torch.device(settings.device)
        check_block_size(settings.kv_block_size)
        if error := utilization_error(settings.gpu_memory_utilization or None, self.device.type,
                                      settings.kv_cache_memory):
            raise ValueError(error)
        settings, self.sizes = settle(settings, self.device)
        log.info("sizes: %s", self.sizes.explanation)
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.gc_pauses = GcPauses(self.metrics.gc_pause, "engine")
        self.lifecycle = Lifecycle()
        self.lifecycle.subscribe(self.metrics.set_lifecycle)
        self.ledger = Ledger()
        #: Whether this worker records graphs at all (a recapture starts only where they exist).
        self.captures_graphs = self.device.type == "cuda"
        #: Track B: the KV cache sized after measured graph memory (does nothing under track A).
        self.kv_sizing = UtilizationSizing(settings.gpu_memory_utilization)
        kv_blocks = self.kv_sizing.provisional_blocks(settings, self.sizes.kv_blocks)
        self.slot = ModelSlot(settings, self.device, self.ledger, self.metrics, kv_blocks=kv_blocks)
        self.blocks = BlockManager(kv_blocks, settings.kv_block_size, prefix_caching=settings.prefix_caching)
        self.control = Control(starting_policy(settings.policy), self.lifecycle,
                               (settings.max_num_seqs, settings.max_num_batched_tokens))
        self.scheduler = Scheduler(settings.max_num_seqs, settings.max_num_batched_tokens, settings.prefill_chunk,
                                   self.blocks)
        self.dispatcher = Dispatcher()
        self.recorder = StepRecorder(self.metrics)
        self.overruns = StepOverruns(self.metrics, note=allocator_note(self.device))
        self.recorder.listed_tenants = frozenset(t.tenant for t in self.control.policy.tenants)
        policy = self.control.policy
        adopted_at = time.time()  # one stamp: the histogram and the counters describe one window
        self.recorder.traffic.reset(policy.policy_uid, policy.generation, adopted_at)
        self.recorder.serving.reset(adopted_at)
        self.outputs = OutputProcessor(self.scheduler, self.metrics)
        self.capture = capture_controller(self.slot.ranks, self.dispatcher, self.metrics, settings.max_num_seqs,
                                          settings.max_num_batched_tokens, settings.inject_capture_failures)
        self.capture.verdicts_dir = lambda: self.slot.compile_report.cache_dir  # coarse verdicts kept there
        self.publish: Callable[[list[tuple[Any, list[int], Any]]], None] = direct_publish
        self.failed: BaseException | None = None
        self.steps_since_ready = 0
        self.mailbox = Mailbox()
        self.sleep_control = SleepControl(self.device.type, settings.sleep_mode, self.control, self.metrics,
                                          self.mailbox.wake)
        self.grammars = Grammars()
        self._stop = threading.Event()
        self._draining = False
        self._last_finish = 0.0
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
        """Queues an admitted request (the API layer validated it); raises QueueFull, NotServing,
        CannotFit or InvalidTokens."""
        loaded = self.slot.loaded
        if self._draining or self.failed is not None or not self.lifecycle.serving or loaded is None:
            raise NotServing(f"worker is {lifecycle_name(self.lifecycle.state)}")
        if self.scheduler.queued(len(self.mailbox)) >= self.settings.max_queue:
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")
        seq = sequence_for(req, stream, self.slot.eos_ids)
        vocab = loaded.config.vocab_size
        if seq.prompt and (min(seq.prompt) < 0 or max(seq.prompt) >= vocab):
            raise InvalidTokens(f"prompt_token_ids: a token id is outside the vocabulary [0, {vocab})")
        seq.logits = logits_state_for(req, self.grammars, self.tokenizer, vocab,
                                      next(iter(loaded.config.eos_token_ids), 0))
        need = blocks_for(len(seq.prompt) + seq.max_new_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise CannotFit(f"prompt ({len(seq.prompt)} tokens) plus max_new_tokens ({seq.max_new_tokens}) needs "
                            f"{need} KV blocks of {self.blocks.block_size} tokens; the cache has "
                            f"{self.blocks.num_blocks} in all")
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self.mailbox.submit(seq)
        return seq

    def cancel(self, seq: Sequence, reason: int = pb.FINISH_REASON_CANCELLED, outcome: str | None = None) -> None:
        """Ends ``seq`` at the next step; ``reason`` is its finish (FINISH_REASON_STOP when the API
        layer matched a stop string, so the request is counted as stopped, not cancelled) and
        ``outcome`` what ``requests_total`` counts it as when not the reason's own name
        (``write_timeout``: the API layer cut off a client that stopped reading)."""
        seq.cancel_reason, seq.cancel_outcome = reason, outcome
        seq.cancelled.set()
        self.mailbox.wake()

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        """Idempotent by (uid, generation); raises PolicyError or StalePolicy.

        The policy becomes pending here and adopted on the engine thread.
        """
        self.kv_sizing.check_graphs_fit(self.capture, policy, self.recorder.traffic)
        unchanged, recapture = self.control.offer(policy)
        if not unchanged:
            self.mailbox.post(lambda: self._adopt_policy(policy))
        return pb.ApplyGraphPolicyResponse(applied_generation=policy.generation, unchanged=unchanged,
                                           recapture_started=recapture and self.captures_graphs)

    def load_revision(self, source: str, revision: str) -> Future:
        """Schedules a model reload; the future resolves to the new revision once it serves.

        Everything that can be judged without loading is judged here, before admission pauses:
        raises ReloadUnsupported with several tensor parallel ranks, ReloadRefused for a source
        outside the model roots and ReloadBusy (a NotServing) while another reload is pending; a
        source that cannot load (no config.json, no weights, an unknown preset) returns an already
        failed future. The engine loads the source's resolved
        real path, the one the root check judged.
        """
        if refusal := reload_refusal(self.settings.tensor_parallel_size):
            raise ReloadUnsupported(refusal)
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
        self.mailbox.wake()
        return future

    def alive(self) -> bool:
        return self.thread.is_alive() and self.failed is None

    def drain_and_stop(self, timeout: float) -> None:
        """Graceful shutdown within ``timeout`` seconds: refuse new requests and, at once, those that
        never started (``drain``); let running ones finish, then end whatever is left (its streams
        get UNAVAILABLE) and stop the loop."""
        self._draining = True
        self.control.move(S.LIFECYCLE_STATE_DRAINING)
        self.mailbox.post(lambda: refuse_unstarted(self))  # their clients retry elsewhere now
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.scheduler.running or self.scheduler.waiting or self.mailbox):
            time.sleep(0.05)
        self._stop.set()
        self.mailbox.wake()
        self.thread.join(timeout=10)

    def model_info(self) -> pb.GetModelInfoResponse | None:
        return model_info(self.slot.loaded, self.settings.max_seq_len, self.settings.max_num_seqs,
                          self.slot.eos_ids, self.tokenizer, self.scheduler.step_budget.to_proto())

    def status(self) -> pb.GraphStatus:
        """What the engine has adopted, read under the lock its changes are made under."""
        snap = self.control.snapshot()
        loaded = self.slot.loaded
        return graph_status(
            snap, capture=self.capture, recorder=self.recorder, ledger=self.ledger,
            model_revision=loaded.revision if loaded else "", running=len(self.scheduler.running),
            queued=len(self.scheduler.waiting) + len(self.mailbox), compile=self.slot.compile_status(),
            kv_cache=self.kv_status(), step_budget=self.scheduler.step_budget.to_proto(),
            startup=self.startup, sleep=self.sleep_control.status(),
            tensor_parallel_size=self.settings.tensor_parallel_size)

    def kv_status(self) -> pb.KVCacheStatus:
        """The KV cache's blocks, prefix cache and preemptions (counts read without a lock: each is
        one integer the engine thread writes)."""
        runner = self.slot.runner
        return self.kv_sizing.report(kv_cache_status(
            self.blocks.block_size, self.blocks.status(), prefix_caching=self.blocks.prefix_caching,
            preemptions=self.scheduler.preemptions,
            nbytes=runner.cache.nbytes() if runner else self.sizes.kv_cache_bytes, sizing=self.kv_sizing.label))

    # --- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        self.gc_pauses.install()
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
            leftover = [*self.scheduler.running, *self.scheduler.waiting, *self.mailbox.take()]
            failed = self.failed
            why = "the worker is shutting down" if failed is None else f"engine stopped: {type(failed).__name__}"
            self.publish(self.outputs.end(leftover, NotServing(why)))
            self.gc_pauses.uninstall()

    def _startup(self) -> None:
        s, clock = self.settings, self.clock
        clock.lap("engine_setup")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            torch.cuda.init()
            torch.zeros(1, device=self.device)  # creates the context before the first ledger entry
            use_mask_buffer(pinned_masks)
        self.ledger.record(L.LEDGER_STAGE_CONTEXT, self.device)
        clock.lap("device_context")
        fresh = self.slot.load(s.model, s.model_revision)
        clock.split("kv_cache", {"weights": self.slot.weights_seconds})
        self.slot.install(fresh)
        self.recorder.set_attention(self.slot.runner.attention.name)
        self.blocks.reset_prefix_cache(self.slot.loaded.revision)
        self.control.move(S.LIFECYCLE_STATE_MODEL_LOADED)
        clock.lap("tokenizer")
        self.slot.prepare_step()
        self.ledger.record(L.LEDGER_STAGE_WARMUP, self.device)
        self.control.move(S.LIFECYCLE_STATE_WARMED)
        clock.split("warm_up", step_parts(self.slot.compile_report))
        freeze_heap()  # the capture phase's collections then walk only what it allocates
        self.capture.begin(self.control.policy, self.slot.runner)
        self.capture.run_all()
        clock.split("capture_other", capture_parts(self.capture.parts))
        self.kv_sizing.size(self.slot, self.blocks, self.capture, self.control.policy, s.max_num_batched_tokens)
        if self.slot.compile_report.enabled:
            forbid_recompiles()
        self._captured()
        self._export_gauges()
        self.startup = clock.finish(self.slot.compile_report)
        self.control.move(S.LIFECYCLE_STATE_CAPTURED)
        self.control.move(S.LIFECYCLE_STATE_READY)
        log.info("READY: %s", self.capture.summary())
        self.ready.set()

    def _loop(self) -> None:
        """schedule -> launch -> finish: step N+1 is launched before step N's tokens are read."""
        inflight: InFlight | None = None
        while not self._stop.is_set():
            inflight = self._between_steps(inflight)
            step = self.scheduler.schedule()
            launched, failure = self._launch(step, inflight) if step is not None else (None, None)
            self._finish(inflight)
            inflight = launched
            if failure is not None:  # after the previous step's tokens: streams stay in order
                culprits = isolate(step, failure, self.scheduler, lambda part: self._read(self._start(part)))
                self.publish(fail_step(self.outputs, culprits, failure))
            self._export_gauges()
            if inflight is None and step is None:
                self.mailbox.sleep(0.05 if not self.capture.active else 0)
        self._finish(inflight)

    def _between_steps(self, inflight: InFlight | None) -> InFlight | None:
        """What the engine thread does between two steps, in this order: a sleep or a wake that is
        due (a sleeping engine with nothing to wake it for does nothing else), commands (policies to
        adopt), a pending reload (admission paused; it runs once nothing runs), new requests,
        cancels, then one key of a capture phase or the release of idle graphs, either of which
        first finishes the step in flight. Returns the step still in flight."""
        if self.sleep_control.between_steps(self, inflight):
            return inflight
        self.mailbox.run_commands()
        if self.control.reload is not None:
            self.scheduler.admitting = False  # running sequences finish on the weights they started with
            if inflight is None and self.scheduler.drained:
                reload_model(self, self.control.reload)
        for seq in self.mailbox.take():
            self.scheduler.add(seq)
        for seq in self.scheduler.reap_cancelled():
            self.publish([(seq.stream, [], self.outputs.completion(seq, seq.cancel_reason, seq.cancel_outcome))])
        if self.capture.active:
            self._finish(inflight)
            inflight = None
            if self.capture.step():
                self._captured()
        elif self.capture.idle_graphs(self.recorder.last_used):
            self._finish(inflight)  # no step still replaying the graphs being released
            inflight = None
            self.capture.release_idle(self.capture.idle_graphs(self.recorder.last_used))
            self.scheduler.step_budget = install_step_budget(self.settings, self.capture.graph_set, self.device.type,
                                                             kept=self.scheduler.step_budget)
        return inflight

    def _export_gauges(self) -> None:
        b = self.blocks
        self.metrics.queue_depth.set(len(self.scheduler.waiting) + len(self.mailbox))
        self.metrics.running_sequences.set(len(self.scheduler.running))
        self.metrics.set_kv(b.block_size, *b.status(), self.scheduler.preemptions)
        self.metrics.set_stretched(self.scheduler.steps_stretched)

    # --- one step: run, then postprocess ---------------------------------------------------

    def _launch(self, step: ScheduledStep, before: InFlight | None) -> tuple[InFlight | None, Exception | None]:
        """Dispatches and launches a step; its tokens are read by ``_finish`` after the next launch.

        A step that raises is returned as its failure, for ``isolate`` once the step before it
        has been postprocessed.
        """
        try:
            return self._start(step, before), None
        except Exception as err:  # noqa: BLE001 - isolated: the culprit fails, the others run again
            return None, err

    def _start(self, step: ScheduledStep, before: InFlight | None = None) -> InFlight:
        """Launches ``step`` (the one place a step runs); raises what the step raised.

        A step with rows that need every earlier token (penalties, grammars) reads the step
        ``before`` it once its own forward pass is queued, so the device computes while the host
        waits, feeds its tokens to the logits states and builds its logits processing from them;
        the step before is published after this step's sampling is queued (by the loop).
        """
        plan = step.plan
        desc = BatchDescriptor(plan.num_tokens, plan.uniform_decode,
                               all(self.control.tenant_allows(s.tenant) for s in step.sequences))
        decision = self.dispatcher.dispatch(desc)
        started = time.perf_counter()
        if failure := injected_failure(self.settings.inject_step_failure, plan.prompt_tokens):
            raise failure
        runner = self.slot.runner
        hidden = runner.execute(plan, decision, self.capture.graph_set)
        if step.needs_history:
            self.outputs.accept_ahead(before)
            plan.logits = build_logits_batch(step.samplers)
        try:
            launched = runner.sample_and_send(hidden, plan)
        finally:  # the matchers are the publication's again (the masks' thread may still hold them on a failure)
            if plan.logits is not None:
                plan.logits.finished_masks()
        if plan.logits is not None and len(plan.logits.reset_slots):
            mark_counted(step.samplers)
        return InFlight(step, decision, desc, launched, started, time.perf_counter() - started)

    def _finish(self, inflight: InFlight | None) -> None:
        """Reads a launched step's tokens, counts it once, and publishes its outputs in one call."""
        if inflight is None:
            return
        try:
            self._read(inflight)
        except Exception as err:  # noqa: BLE001 - the step after it is already launched: no re-run
            self.publish(fail_step(self.outputs, inflight.step.sequences, err))

    def _read(self, inflight: InFlight) -> None:
        """Waits for a launched step's tokens, records the step and publishes them; raises what
        the step raised."""
        step = inflight.step
        reading = time.perf_counter()
        tokens = inflight.launched.tokens().tolist()
        now = time.perf_counter()
        overlapped = inflight.started < self._last_finish  # launched before the previous read
        elapsed = now - max(inflight.started, self._last_finish)
        self._last_finish = now
        self.recorder.record(inflight.decision, inflight.desc, step.sequences,
                             {s.tenant for s in step.sequences}, elapsed, generated=len(step.samplers))
        self.overruns.check(step.plan, self.scheduler.step_budget, elapsed, inflight.launch_seconds, now,
                            now - reading, overlapped)
        self.outputs.prompt_logprobs(step.sequences, step.plan.num_decode, inflight.launched.prompt_logprobs())
        self.publish(self.outputs.step_outputs(step.samplers, tokens, now, inflight.launched.token_logprobs()))
        self.steps_since_ready += 1
        if self.steps_since_ready == STEADY_AFTER_STEPS:
            self.ledger.record(L.LEDGER_STAGE_STEADY, self.device)
            self.ledger.export(self.metrics)

    # --- policies, graphs and model revisions ----------------------------------------------

    def _adopt_policy(self, policy: pb.GraphPolicy) -> None:
        """Tenant toggles take effect at the next step; a change of the captured set recaptures."""
        recapture = self.control.recaptures(self.control.policy, policy)
        self.control.adopt(policy, recapture and self.captures_graphs)
        self.recorder.listed_tenants = frozenset(t.tenant for t in policy.tenants)
        traffic = self.recorder.traffic.tokens()  # what the old policy served: a max_graphs limit keeps its keys
        adopted_at = time.time()  # one stamp: the histogram and the counters describe one window
        self.recorder.traffic.reset(policy.policy_uid, policy.generation, adopted_at)
        self.recorder.serving.reset(adopted_at)
        self.capture.adopt(policy)
        self.metrics.policy_generation.set(policy.generation)
        log.info("policy %s generation %d adopted (recapture: %s)", (policy.policy_name or policy.policy_uid)[:64],
                 policy.generation, recapture)
        if recapture:
            self.metrics.recaptures.labels("policy").inc()
            self.capture.release()
            self.begin_capture(traffic)

    def begin_capture(self, traffic: dict[tuple[int, bool], int] | None = None) -> None:
        """Plans the adopted policy's graphs; they are captured one per loop pass from here
        (engine thread only: after a policy is adopted, or a new model installed)."""
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
        self.scheduler.step_budget = install_step_budget(self.settings, graphs, self.device.type)
        freeze_heap()  # a full collection under load walks only what serving allocated
        if self.control.captured(self.capture.last_failure):
            log.info("READY: %s", self.capture.summary())
