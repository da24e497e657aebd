"""The engine: one thread that owns the device and runs the step loop.

Everything that touches the model, the KV cache or the graphs happens on this thread: startup
(load, allocate, warm up, capture), every step (schedule, dispatch, run, sample, stream back),
policy changes and model reloads. Other threads (gRPC handlers) hand it work through a queue and
read its counters; they never touch the device.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    effective_requested_mode,
    mode_name,
    reason_name,
    resolve_capture_sizes,
    tenant_allows_graphs,
    validate_policy,
)
from graphkeeper.worker.admission import Limits, validate_request
from graphkeeper.worker.attention import SlotAttention
from graphkeeper.worker.dispatcher import (
    FULL,
    PIECEWISE,
    BatchDescriptor,
    Decision,
    Dispatcher,
    GraphState,
    downgrade_mode,
    full_sizes,
    mode_has_full,
    mode_has_piecewise,
)
from graphkeeper.worker.graphs import CaptureJob, GraphSet
from graphkeeper.worker.kv_cache import KVCache
from graphkeeper.worker.ledger import Ledger
from graphkeeper.worker.lifecycle import Lifecycle
from graphkeeper.worker.loader import LoadedModel, load_model
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.runner import ModelRunner
from graphkeeper.worker.sampling import SamplingSpec, sample
from graphkeeper.worker.scheduler import ScheduledStep, Scheduler, Sequence

log = logging.getLogger(__name__)
S = pb.LifecycleState
L = pb.LedgerStage
STEADY_AFTER_STEPS = 16
_EXECUTION = {pb.GRAPH_MODE_NONE: "eager", FULL: "full", PIECEWISE: "piecewise"}


class QueueFull(RuntimeError):
    pass


class NotServing(RuntimeError):
    pass


class StalePolicy(RuntimeError):
    pass


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
    policy: pb.GraphPolicy = field(default_factory=pb.GraphPolicy)
    inject_capture_failures: frozenset[int] = frozenset()


def default_policy(mode: int = pb.GRAPH_MODE_FULL_AND_PIECEWISE) -> pb.GraphPolicy:
    """The policy a worker holds before any is applied: generation 0, default ladder."""
    return pb.GraphPolicy(
        policy_name="(worker default)", mode=mode,
        capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT),
    )


class Engine:
    def __init__(self, settings: EngineSettings, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.lifecycle = Lifecycle()
        self.lifecycle.subscribe(self.metrics.set_lifecycle)
        self.ledger = Ledger()
        self.device = torch.device(settings.device)
        self.scheduler = Scheduler(settings.max_num_seqs, settings.max_num_batched_tokens,
                                   settings.prefill_chunk)
        self.dispatcher = Dispatcher()
        self.loaded: LoadedModel | None = None
        self.runner: ModelRunner | None = None
        self.graph_set: GraphSet | None = None
        self.capture_job: CaptureJob | None = None
        self.policy = settings.policy if settings.policy.policy_uid else default_policy(
            settings.policy.mode or pb.GRAPH_MODE_FULL_AND_PIECEWISE)
        self.requested_mode = effective_requested_mode(self.policy)
        self.effective_mode = pb.GRAPH_MODE_NONE
        self.downgrade_reason = ""
        self.ladder: list[int] = []
        self._adopt_tenants(self.policy)
        self.last_error = ""
        self.total_capture_seconds = 0.0
        self.failed: BaseException | None = None
        self.steps_since_ready = 0
        self._policy_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self._pending_reload: tuple[str, str, Future] | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # --- public API (any thread) ----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def limits(self) -> Limits:
        assert self.loaded is not None
        return Limits(self.loaded.config.vocab_size, self.settings.max_seq_len)

    def submit(self, req: pb.GenerateRequest, emit: Callable[[str, object], None]) -> Sequence:
        """Validates and queues a request; raises AdmissionError, QueueFull or NotServing."""
        if self._draining or not self.lifecycle.serving or self.loaded is None:
            raise NotServing(f"worker is {pb.LifecycleState.Name(self.lifecycle.state)}")
        validate_request(req, self.limits())
        if len(self._inbox) + len(self.scheduler.waiting) >= self.settings.max_queue:
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")
        seq = self._new_sequence(req, emit)
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self._inbox.append(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled.set()
        self._wake.set()

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        """Idempotent by (uid, generation); raises PolicyError or StalePolicy."""
        with self._policy_lock:
            current = self.policy
            if policy.policy_uid == current.policy_uid:
                if policy.generation < current.generation:
                    raise StalePolicy(f"generation {policy.generation} is older than the held "
                                      f"generation {current.generation} of policy {policy.policy_uid}")
                if policy.generation == current.generation:
                    return pb.ApplyGraphPolicyResponse(applied_generation=current.generation, unchanged=True)
            validate_policy(policy, self.settings.max_num_batched_tokens)
            recapture = self._capture_config(policy) != self._capture_config(current)
            self.policy = policy
            self._commands.put(lambda: self._adopt_policy(policy, recapture))
            self._wake.set()
            return pb.ApplyGraphPolicyResponse(
                applied_generation=policy.generation,
                recapture_started=recapture and self.device.type == "cuda",
            )

    def load_revision(self, source: str, revision: str) -> Future:
        """Schedules a model reload; the future resolves to the new revision once it serves."""
        future: Future = Future()
        self._commands.put(lambda: self._request_reload(source, revision, future))
        self._wake.set()
        return future

    def drain_and_stop(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests, finish running ones, then stop the loop."""
        self._draining = True
        if self.lifecycle.state != S.LIFECYCLE_STATE_DRAINING:
            self.lifecycle.move(S.LIFECYCLE_STATE_DRAINING)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.scheduler.running or self.scheduler.waiting or self._inbox):
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=10)

    # --- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self._startup()
                self._loop()
        except BaseException as err:  # noqa: BLE001 - reported through self.failed and the log
            log.exception("engine stopped: %s", err)
            self.failed = err
            self.ready.set()

    def _startup(self) -> None:
        s = self.settings
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            torch.cuda.init()
            torch.zeros(1, device=self.device)  # creates the context before the first ledger entry
        self.ledger.record(L.LEDGER_STAGE_CONTEXT, self.device)
        self._load(s.model, s.model_revision)
        self.lifecycle.move(S.LIFECYCLE_STATE_MODEL_LOADED)
        self.runner.warm_up(min(s.max_num_seqs, s.max_num_batched_tokens))
        self.ledger.record(L.LEDGER_STAGE_WARMUP, self.device)
        self.lifecycle.move(S.LIFECYCLE_STATE_WARMED)
        self._begin_capture()
        if self.capture_job is not None:
            self.capture_job.run_all()
        self._finish_capture()
        self.lifecycle.move(S.LIFECYCLE_STATE_CAPTURED)
        self.lifecycle.move(S.LIFECYCLE_STATE_READY)
        self._log_ready()
        self.ready.set()

    def _load(self, source: str, revision: str) -> None:
        s = self.settings
        cache_len = 16 * math.ceil(s.max_seq_len / 16)  # aligned rows for the attention kernels
        loaded = load_model(source, device=self.device, dtype=s.dtype, max_positions=cache_len,
                            revision=revision)
        self.ledger.record(L.LEDGER_STAGE_WEIGHTS, self.device)
        old = self.runner
        if old is not None and old.loaded.config == loaded.config and old.loaded.dtype == loaded.dtype:
            cache = old.cache  # same shapes: keep the allocation, only the weights move
        else:
            self.runner = None
            scratch = math.ceil(s.max_num_batched_tokens / cache_len)
            cache = KVCache(loaded.config, s.max_num_seqs, cache_len, device=self.device,
                            dtype=loaded.dtype, scratch_slots=scratch)
        self.ledger.record(L.LEDGER_STAGE_KV_CACHE, self.device)
        self.loaded = loaded
        self.runner = ModelRunner(loaded, cache, s.max_num_batched_tokens)
        self.metrics.set_model(loaded.revision, loaded.source, str(loaded.dtype).removeprefix("torch."),
                               str(self.device))
        log.info("model %s revision %s loaded: %d parameters, %s on %s", loaded.source, loaded.revision,
                 loaded.parameter_count, loaded.dtype, self.device)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            self._maybe_reload()
            self._admit_inbox()
            for seq in self.scheduler.reap_cancelled():
                self._complete(seq, pb.FINISH_REASON_CANCELLED)
            if self.capture_job is not None:
                self._capture_step()
            step = self.scheduler.schedule()
            self._update_gauges()
            if step is None:
                self._wake.wait(0.05 if self.capture_job is None else 0)
                self._wake.clear()
                continue
            self._execute(step)

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

    # --- one step -------------------------------------------------------------------------

    def _execute(self, step: ScheduledStep) -> None:
        plan, runner = step.plan, self.runner
        desc = BatchDescriptor(plan.num_tokens, len(step.sequences), plan.uniform_decode,
                               self._graphs_allowed(step.sequences))
        decision = self.dispatcher.dispatch(desc)
        started = time.perf_counter()
        if decision.eager:
            hidden = runner.forward_eager(runner.prepare(plan, plan.num_tokens), plan.num_tokens)
        else:
            self.graph_set.check_fresh()
            hidden = self.graph_set.replay(decision.mode, decision.size, runner.prepare(plan, decision.size))
        tokens = sample(runner.logits(hidden, plan), [s.sampling for s in step.samplers],
                        [s.generator for s in step.samplers])
        elapsed = time.perf_counter() - started
        self.scheduler.advance(step)
        self._record(decision, desc, step, elapsed)
        now = time.perf_counter()
        self.metrics.generated_tokens.inc(len(tokens))
        for seq, token in zip(step.samplers, tokens, strict=True):
            self._append(seq, token, now)
        self.steps_since_ready += 1
        if self.steps_since_ready == STEADY_AFTER_STEPS:
            self.ledger.record(L.LEDGER_STAGE_STEADY, self.device)
            self._export_ledger()

    def _graphs_allowed(self, sequences: list[Sequence]) -> bool:
        return all(self._tenant_allows(s.tenant) for s in sequences)

    def _tenant_allows(self, tenant: str) -> bool:
        """The shared policy rule, memoised per tenant until the next policy is adopted."""
        allowed = self._tenant_allowed.get(tenant)
        if allowed is None:
            allowed = self._tenant_allowed[tenant] = tenant_allows_graphs(self._tenant_policy, tenant)
        return allowed

    def _adopt_tenants(self, policy: pb.GraphPolicy) -> None:
        """Tenant toggles take effect at the next step; only the adopted policy's rules apply."""
        self._tenant_policy = policy
        self._tenant_allowed: dict[str, bool] = {}
        self.listed_tenants = frozenset(t.tenant for t in policy.tenants)

    def _record(self, decision: Decision, desc: BatchDescriptor, step: ScheduledStep, elapsed: float) -> None:
        m = self.metrics
        m.step_duration.labels(_EXECUTION[decision.mode]).observe(elapsed)
        m.real_tokens.inc(desc.num_tokens)
        if decision.eager:
            m.eager_steps.labels(reason_name(decision.reason)).inc()
            m.padded_tokens.inc(desc.num_tokens)
        else:
            m.graph_replays.labels(mode_name(decision.mode), str(decision.size)).inc()
            m.padded_tokens.inc(decision.size)
        execution = "eager" if decision.eager else "graph"
        for tenant in {s.tenant for s in step.sequences} & self.listed_tenants:
            m.tenant_steps.labels(tenant, execution).inc()  # bounded: only tenants the policy lists
        for seq in step.sequences:
            if decision.eager:
                seq.eager_steps[decision.reason] += 1
            else:
                seq.graph_steps[(decision.mode, decision.size)] += 1

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.output.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.time_to_first_token.observe(now - seq.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.emit("tokens", [token])
        reason = seq.stop_reason()
        if reason != pb.FINISH_REASON_UNSPECIFIED:
            self.scheduler.finish(seq)
            self._complete(seq, reason)

    def _complete(self, seq: Sequence, reason: int) -> None:
        outcome = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.requests.labels(outcome).inc()
        end = time.perf_counter()
        summary = pb.ExecutionSummary(
            graph_steps=[pb.GraphStepCount(mode=m, size=s, steps=n) for (m, s), n in sorted(seq.graph_steps.items())],
            eager_steps=[pb.FallbackCount(reason=r, steps=n) for r, n in sorted(seq.eager_steps.items())],
        )
        seq.emit("completion", pb.Completion(
            request_id=seq.request_id, finish_reason=reason, prompt_tokens=len(seq.prompt),
            generated_tokens=len(seq.output),
            time_to_first_token_seconds=(seq.first_token_at - seq.arrived) if seq.first_token_at else 0.0,
            total_seconds=end - seq.arrived, execution=summary,
        ))

    def _new_sequence(self, req: pb.GenerateRequest, emit: Callable[[str, object], None]) -> Sequence:
        sp = req.sampling
        spec = SamplingSpec(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p or 1.0)
        generator = None
        if not spec.greedy:
            seed = sp.seed if sp.HasField("seed") else random.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        eos = None if req.stopping.ignore_eos else self.loaded.config.eos_token_id
        return Sequence(
            request_id=req.request_id or f"req-{random.getrandbits(48):012x}", tenant=req.tenant,
            prompt=list(req.prompt_token_ids), max_new_tokens=req.stopping.max_new_tokens,
            sampling=spec, emit=emit, stop_ids=frozenset(req.stopping.stop_token_ids), eos_id=eos,
            generator=generator,
        )

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.scheduler.waiting) + len(self._inbox))
        self.metrics.running_sequences.set(len(self.scheduler.running))

    # --- graphs ---------------------------------------------------------------------------

    def _capture_config(self, policy: pb.GraphPolicy) -> tuple:
        s = self.settings
        sizes = resolve_capture_sizes(policy.capture_sizes, s.max_num_seqs, s.max_num_batched_tokens)
        return effective_requested_mode(policy), tuple(sizes), policy.memory_budget_bytes

    def _adopt_policy(self, policy: pb.GraphPolicy, recapture: bool) -> None:
        """Engine thread: tenant toggles now; a capture config change recaptures."""
        self._adopt_tenants(policy)
        self.metrics.policy_generation.set(policy.generation)
        log.info("policy %s generation %d adopted (recapture: %s)", policy.policy_name or policy.policy_uid,
                 policy.generation, recapture)
        if recapture:
            self.metrics.recaptures.labels("policy").inc()
            self._recapture()

    def _recapture(self) -> None:
        self._release_graphs()
        if self.lifecycle.state == S.LIFECYCLE_STATE_READY:
            self.lifecycle.move(S.LIFECYCLE_STATE_RECAPTURING)
        self._begin_capture()
        if self.capture_job is None:
            self._finish_capture()

    def _begin_capture(self) -> None:
        """Resolves modes and sizes for the held policy and plans the capture (largest first)."""
        s, policy = self.settings, self.policy
        cuda = self.device.type == "cuda"
        self.requested_mode = effective_requested_mode(policy)
        self.effective_mode, self.downgrade_reason = downgrade_mode(
            self.requested_mode, int(SlotAttention.graph_support), cuda)
        self.metrics.set_modes(self.requested_mode, self.effective_mode)
        self.metrics.policy_generation.set(policy.generation)
        self.metrics.graph_memory_budget.set(policy.memory_budget_bytes)
        self.ladder = resolve_capture_sizes(policy.capture_sizes, s.max_num_seqs, s.max_num_batched_tokens)
        if not cuda or self.effective_mode == pb.GRAPH_MODE_NONE:
            self.capture_job = None
            self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                              backend_unsupported=not cuda))
            return
        plan = []
        if mode_has_full(self.effective_mode):
            plan += [(FULL, n) for n in reversed(full_sizes(self.ladder, s.max_num_seqs))]
        if mode_has_piecewise(self.effective_mode):
            plan += [(PIECEWISE, n) for n in reversed(self.ladder)]
        self.graph_set = GraphSet(self.runner)
        tolerance = 1e-4 if self.loaded.dtype == torch.float32 else 2e-2
        self.capture_job = CaptureJob(self.graph_set, plan, policy.memory_budget_bytes,
                                      s.inject_capture_failures, tolerance)
        self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                          recapturing=True))
        log.info("capturing %d graphs (%s, sizes %s..%s, budget %s B)", len(plan), mode_name(self.effective_mode),
                 self.ladder[0], self.ladder[-1], policy.memory_budget_bytes or "unlimited")

    def _capture_step(self) -> None:
        job = self.capture_job
        if not job.done:
            job.step()
        if job.done:
            self._finish_capture()

    def _finish_capture(self) -> None:
        """Swaps the completed graph set in, at once, and records what it cost."""
        job, graphs = self.capture_job, self.graph_set
        self.capture_job = None
        if job is not None:
            job.finish()
            self.total_capture_seconds = job.total_seconds
            self.dispatcher.update(GraphState(
                effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                captured=frozenset(graphs.captured), skipped={k: v.reason for k, v in graphs.skipped.items()},
            ))
            failures = [v.message for v in graphs.skipped.values()
                        if v.reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED]
            if failures:
                self.last_error = failures[-1]
            self._export_graphs()
        self.ledger.record(L.LEDGER_STAGE_CAPTURE, self.device)
        self._export_ledger()
        if self.lifecycle.state == S.LIFECYCLE_STATE_RECAPTURING:
            self.lifecycle.move(S.LIFECYCLE_STATE_READY)
            self._log_ready()

    def _export_ledger(self) -> None:
        for entry in list(self.ledger.entries.values()):
            stage = pb.LedgerStage.Name(entry.stage).removeprefix("LEDGER_STAGE_").lower()
            for kind, value in (("device_used", entry.device_used), ("torch_allocated", entry.torch_allocated),
                                ("torch_reserved", entry.torch_reserved), ("residual", entry.residual)):
                self.metrics.ledger.labels(stage, kind).set(value)

    def _export_graphs(self) -> None:
        m, graphs = self.metrics, self.graph_set
        m.captured.clear()
        m.skipped.clear()
        m.capture_duration.clear()
        for (mode, size), entry in graphs.captured.items():
            m.captured.labels(mode_name(mode), str(size)).set(1)
            m.capture_duration.labels(mode_name(mode), str(size)).set(entry.seconds)
        for (mode, size), skipped in graphs.skipped.items():
            m.skipped.labels(mode_name(mode), str(size), reason_name(skipped.reason)).set(1)
        m.capture_phase.set(self.total_capture_seconds)
        m.graph_memory.set(graphs.memory_bytes)

    def _release_graphs(self) -> None:
        """Graphs are dropped before anything that could move their addresses."""
        if self.graph_set is not None:
            self.graph_set.release()
            self.graph_set = None
        self.capture_job = None
        self.metrics.captured.clear()
        self.metrics.graph_memory.set(0)

    def _log_ready(self) -> None:
        captured = len(self.graph_set.captured) if self.graph_set else 0
        log.info("READY: requested %s, effective %s%s; %d graphs captured in %.2f s",
                 mode_name(self.requested_mode), mode_name(self.effective_mode),
                 f" ({self.downgrade_reason})" if self.downgrade_reason else "", captured,
                 self.total_capture_seconds)

    # --- model revisions ------------------------------------------------------------------

    def _request_reload(self, source: str, revision: str, future: Future) -> None:
        if self._pending_reload is not None:
            future.set_exception(RuntimeError("a model reload is already in progress"))
            return
        self.scheduler.admitting = False  # running sequences finish on the weights they started with
        self._pending_reload = (source, revision, future)

    def _maybe_reload(self) -> None:
        if self._pending_reload is None or self.scheduler.running:
            return
        source, revision, future = self._pending_reload
        self._pending_reload = None
        try:
            self._release_graphs()  # before the new weights exist: stale graphs can never replay
            self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                              recapturing=True))
            if self.lifecycle.state == S.LIFECYCLE_STATE_READY:
                self.lifecycle.move(S.LIFECYCLE_STATE_RECAPTURING)
            self._load(source, revision)
            self.metrics.recaptures.labels("model_revision").inc()
            self._begin_capture()
            if self.capture_job is None:
                self._finish_capture()
            future.set_result(self.loaded.revision)
        except Exception as err:  # noqa: BLE001 - the old model keeps serving when it can
            self.last_error = f"model reload failed: {err}"
            log.error(self.last_error)
            if self.lifecycle.state == S.LIFECYCLE_STATE_RECAPTURING:
                self._begin_capture()
                if self.capture_job is None:
                    self._finish_capture()
            future.set_exception(err)
        finally:
            self.scheduler.admitting = True

    # --- status (any thread) --------------------------------------------------------------

    def status(self) -> pb.GraphStatus:
        graphs = self.graph_set
        captured = dict(graphs.captured) if graphs else {}
        skipped = dict(graphs.skipped) if graphs else {}
        eager = dict(self.dispatcher.eager_steps)
        return pb.GraphStatus(
            state=self.lifecycle.state,
            requested_mode=self.requested_mode,
            effective_mode=self.effective_mode,
            mode_downgrade_reason=self.downgrade_reason,
            policy_uid=self.policy.policy_uid,
            policy_generation=self.policy.generation,
            model_revision=self.loaded.revision if self.loaded else "",
            captured=[pb.CapturedSize(size=s, mode=m, capture_seconds=e.seconds, device_bytes=e.device_bytes,
                                      reserved_bytes=e.reserved_bytes) for (m, s), e in sorted(captured.items())],
            skipped=[pb.SkippedSize(size=s, mode=m, reason=v.reason, message=v.message)
                     for (m, s), v in sorted(skipped.items())],
            fallbacks=[pb.FallbackCount(reason=r, steps=n) for r, n in sorted(eager.items())],
            graph_steps=sum(dict(self.dispatcher.graph_steps).values()),
            eager_steps=sum(eager.values()),
            graph_memory_bytes=graphs.memory_bytes if graphs else 0,
            total_capture_seconds=self.total_capture_seconds,
            ledger=self.ledger.to_proto(),
            running_sequences=len(self.scheduler.running),
            queued_requests=len(self.scheduler.waiting) + len(self._inbox),
            last_error=self.last_error,
        )

