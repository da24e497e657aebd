"""Every metric the worker exports, in one place.

Names carry the ``graphkeeper_`` prefix and base units; counters end in ``_total``; labels are
bounded: graph modes and fallback reasons come from the proto enums (lower case, prefix
stripped), sizes from the captured ladder, outcomes from a closed list here. The dashboard, the
alert rules and the docs use the names in ``METRIC_NAMES``; a test keeps them in step.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name, mode_name, reason_name

#: Label values of graphkeeper_requests_total{outcome}.
OUTCOMES = ("length", "stop", "eos", "cancelled", "write_timeout", "invalid", "oversize", "undecodable", "queue_full",
            "unavailable", "error")
#: Label values of graphkeeper_step_duration_seconds{execution_mode}.
EXECUTION_MODES = ("full", "piecewise", "eager")
#: Label values of graphkeeper_step_duration_seconds{attention_backend}: which attention ran.
ATTENTION_BACKENDS = ("triton", "sdpa")
#: Label values of graphkeeper_step_tokens{kind} and graphkeeper_step_sequences{kind}: a uniform
#: decode step (every sequence one token) or a mixed one (prefill chunks, with or without decodes).
STEP_KINDS = ("decode", "mixed")
FALLBACK_REASONS = tuple(
    reason_name(v) for v in pb.FallbackReason.values() if v != pb.FALLBACK_REASON_UNSPECIFIED
)
GRAPH_MODES = tuple(mode_name(v) for v in pb.GraphMode.values() if v != pb.GRAPH_MODE_UNSPECIFIED)
LIFECYCLE_STATES = tuple(
    lifecycle_name(v).lower()
    for v in pb.LifecycleState.values() if v != pb.LIFECYCLE_STATE_UNSPECIFIED
)
LEDGER_KINDS = ("device_used", "torch_allocated", "torch_reserved", "residual")

#: Label names of graphkeeper_model_info (an Info series; its labels are set when a model loads).
MODEL_INFO_LABELS = ("revision", "source", "dtype", "device")
#: Label values of graphkeeper_graph_mode{kind}.
MODE_KINDS = ("requested", "effective")
#: Label values of graphkeeper_recaptures_total{cause}.
RECAPTURE_CAUSES = ("policy", "model_revision")
#: Label values of graphkeeper_startup_stage_seconds{stage} (engine/startup.py's stages, in order).
STARTUP_STAGES = ("before_engine", "engine_process", "engine_setup", "device_context", "weights", "kv_cache",
                  "tokenizer", "kernel_tuning", "compile", "warm_up", "capture_setup", "capture_prime",
                  "capture_warm_up", "capture_record", "capture_validate", "capture_measure", "capture_finish",
                  "capture_other", "after_capture", "ready")
#: Label values of graphkeeper_startup_cache{outcome}; {cache} is "compile" or "tuning" ("shipped": the
#: tuning the worker ships for this GPU, model/shipped_tuning.py).
CACHE_OUTCOMES = ("off", "hit", "miss", "partial", "shipped")
#: Label values of graphkeeper_sleeps_total{level}.
SLEEP_LEVELS = ("1", "2")
#: Label values of graphkeeper_wakes_total{cause}: a Wake call, a request sent to the sleeping
#: worker, or other work that needs the device (a policy to adopt, a model reload).
WAKE_CAUSES = ("wake", "request", "control")
#: Label values of graphkeeper_tenant_steps_total{execution}.
TENANT_EXECUTIONS = ("graph", "eager")

# The *_created series double every counter for no dashboard's benefit.
disable_created_metrics()

#: Powers of two up to the largest step any policy allows (8192 tokens).
_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(14))
_SEQUENCE_BUCKETS = tuple(float(1 << i) for i in range(11))

#: Seconds, fine from 2 to 20 ms: a decode step, a stretched step and an inter-token gap fall there,
#: and so do the targets they are read against (an ITL p99 of 12 ms with 3.4 ms steps stretched to
#: 8.5 ms, on the H200): with only 5, 10 and 20 ms a p99 of 9 and one of 14 ms read alike.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.012, 0.016, 0.02, 0.03, 0.05,
                    0.1, 0.2, 0.5, 1, 2, 5, 10, 30)

#: Seconds: a young generation's collection takes tens of microseconds, a full one over the startup
#: heap tens of milliseconds.
_GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


class WorkerMetrics:
    """The worker's metrics, in a registry of its own (several workers may share a process in tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Serving.
        self.requests = Counter("graphkeeper_requests", "Generate requests by outcome.",
                                ["outcome"], registry=r)
        self.time_to_first_token = Histogram(
            "graphkeeper_time_to_first_token_seconds", "Admission to first token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "graphkeeper_inter_token_latency_seconds", "Time between a request's tokens.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.step_duration = Histogram(
            "graphkeeper_step_duration_seconds", "Engine step wall time by execution mode and attention backend.",
            ["execution_mode", "attention_backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram(
            "graphkeeper_step_tokens", "Real (unpadded) tokens per step, by kind (decode or mixed).",
            ["kind"], buckets=_TOKEN_BUCKETS, registry=r)
        self.step_sequences = Histogram(
            "graphkeeper_step_sequences", "Sequences per step, by kind (decode or mixed).",
            ["kind"], buckets=_SEQUENCE_BUCKETS, registry=r)
        self.queue_depth = Gauge("graphkeeper_queue_depth", "Requests waiting to start (for a slot or for KV blocks).",
                                 registry=r)
        self.running_sequences = Gauge("graphkeeper_running_sequences", "Sequences holding a KV slot.",
                                       registry=r)
        self.step_overruns = Counter(
            "graphkeeper_step_overruns", "Steps with decode rows that took longer than the step budget's bound "
            "(the stretch ceiling; the inter-token target without a TTFT guard) (engine/step_overruns.py).",
            registry=r)
        self.gc_pause = Histogram(
            "graphkeeper_gc_pause_seconds", "Pauses of the garbage collector, by process (engine, api) and the "
            "oldest generation collected (engine/gc_pauses.py).", ["process", "generation"], buckets=_GC_BUCKETS,
            registry=r)
        self.steps_stretched = Counter(
            "graphkeeper_steps_stretched", "Steps with decode rows stretched past the inter-token target for a "
            "prompt waiting past the TTFT target.", registry=r)
        self._stretched_seen = 0
        self.prompt_tokens = Counter("graphkeeper_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generated_tokens = Counter("graphkeeper_generated_tokens", "Tokens generated.", registry=r)
        # Graphs.
        self.graph_replays = Counter("graphkeeper_graph_replays", "Steps that replayed a graph.",
                                     ["mode", "size"], registry=r)
        self.eager_steps = Counter("graphkeeper_eager_steps", "Steps that ran eagerly, by reason.",
                                   ["fallback_reason"], registry=r)
        self.padded_tokens = Counter("graphkeeper_padded_tokens",
                                     "Token rows executed, padding included.", registry=r)
        self.real_tokens = Counter("graphkeeper_real_tokens", "Token rows executed for real sequences.",
                                   registry=r)
        self.capture_duration = Gauge("graphkeeper_graph_capture_duration_seconds",
                                      "Capture time of each captured graph.", ["mode", "size"], registry=r)
        self.capture_phase = Gauge("graphkeeper_graph_capture_phase_seconds",
                                   "The whole last capture phase (every part, the recording being one).", registry=r)
        self.capture_part = Gauge("graphkeeper_graph_capture_part_seconds",
                                  "Seconds the last capture phase spent in each part (setup, prime, warm_up, record, "
                                  "validate, measure, finish); they add up to the phase.", ["part"], registry=r)
        self.graph_memory = Gauge("graphkeeper_graph_memory_bytes",
                                  "Graph memory: the graph pool's segments and the piece buffers, as the allocator "
                                  "holds them (measured).", registry=r)
        self.graph_memory_budget = Gauge("graphkeeper_graph_memory_budget_bytes",
                                         "The policy's graph memory budget; 0 is unlimited.", registry=r)
        self.captured = Gauge("graphkeeper_graph_captured", "1 for each captured (mode, size).",
                              ["mode", "size"], registry=r)
        self.skipped = Gauge("graphkeeper_graph_skipped", "1 for each size left out, by reason.",
                             ["mode", "size", "fallback_reason"], registry=r)
        self.replay_step_time = Gauge(
            "graphkeeper_graph_replay_step_seconds",
            "GPU time of one step replaying each captured graph, measured at validation.", ["mode", "size"], registry=r)
        self.eager_step_time = Gauge(
            "graphkeeper_graph_eager_step_seconds",
            "GPU time of the same step run eagerly, measured at validation.", ["mode", "size"], registry=r)
        self.graph_padding = Counter(
            "graphkeeper_graph_padding_tokens", "Padding rows computed by each graph's replays (padded minus real).",
            ["mode", "size"], registry=r)
        self.released = Gauge("graphkeeper_graph_released", "1 for each (mode, size) released after sitting idle.",
                              ["mode", "size"], registry=r)
        self.idle_releases = Counter("graphkeeper_graph_idle_releases", "Graphs released after sitting idle.",
                                     registry=r)
        self.lifecycle = Gauge("graphkeeper_lifecycle_state", "1 for the current lifecycle state.",
                               ["state"], registry=r)
        self.policy_generation = Gauge("graphkeeper_policy_generation",
                                       "Generation of the graph policy the worker holds.", registry=r)
        self.graph_mode = Gauge("graphkeeper_graph_mode", "1 for the requested and the effective mode.",
                                ["kind", "mode"], registry=r)
        self.ledger = Gauge("graphkeeper_memory_ledger_bytes", "Memory at each lifecycle stage.",
                            ["stage", "kind"], registry=r)
        self.model = Info("graphkeeper_model", "The model being served.", registry=r)
        self.recaptures = Counter("graphkeeper_recaptures", "Recaptures started, by cause.", ["cause"],
                                  registry=r)
        self.compile_info = Info(
            "graphkeeper_compile", "How the step was built: -O level, compiled or not, compile cache outcome, "
            "kernels, weight quantization.", registry=r)
        self.compile_duration = Gauge("graphkeeper_compile_duration_seconds",
                                      "Time to compile (or load from the cache) and warm up the step.", registry=r)
        # Sleep and wake (engine/sleep_control.py).
        self.sleeping = Gauge("graphkeeper_sleeping", "The level the worker sleeps at (1 or 2); 0 while it is awake.",
                              registry=r)
        self.sleeps = Counter("graphkeeper_sleeps", "Sleeps carried out, by level.", ["level"], registry=r)
        self.wakes = Counter("graphkeeper_wakes", "Wakes, by what woke the worker.", ["cause"], registry=r)
        self.wake_duration = Gauge("graphkeeper_wake_duration_seconds", "How long the last wake took.", registry=r)
        # The start (set once, at the first READY the API process sees).
        self.startup_stage = Gauge("graphkeeper_startup_stage_seconds",
                                   "Seconds of each startup stage, from the worker process's start to READY.",
                                   ["stage"], registry=r)
        self.startup_cache = Gauge("graphkeeper_startup_cache",
                                   "1 for each on-disk cache's outcome at startup (off, hit, miss, partial).",
                                   ["cache", "outcome"], registry=r)
        self.tenant_steps = Counter(
            "graphkeeper_tenant_steps", "Steps holding a tenant's sequences (policy-listed tenants only).",
            ["tenant", "execution"], registry=r)
        # The paged KV cache (what routers read: utilisation and prefix locality).
        self.kv_blocks = Gauge("graphkeeper_kv_cache_blocks", "KV cache blocks in all.", registry=r)
        self.kv_used_blocks = Gauge("graphkeeper_kv_cache_used_blocks", "KV cache blocks held by running sequences.",
                                    registry=r)
        self.kv_cached_blocks = Gauge("graphkeeper_kv_cache_cached_blocks",
                                      "Free KV cache blocks that still hold a cached prefix.", registry=r)
        self.kv_usage = Gauge("graphkeeper_kv_cache_usage_ratio", "Used KV cache blocks over all (0 to 1).",
                              registry=r)
        self.kv_block_size = Gauge("graphkeeper_kv_cache_block_size_tokens", "Tokens per KV cache block.",
                                   registry=r)
        self.prefix_queries = Counter("graphkeeper_prefix_cache_queries_tokens",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("graphkeeper_prefix_cache_hits_tokens",
                                   "Prompt tokens found in the prefix cache (not computed again).", registry=r)
        self.preemptions = Counter("graphkeeper_preemptions", "Sequences preempted for lack of KV blocks.",
                                   registry=r)
        self._kv_seen = (0, 0, 0, 0, 0, 0)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for cause in RECAPTURE_CAUSES:
            self.recaptures.labels(cause)
        for level in SLEEP_LEVELS:
            self.sleeps.labels(level)
        for cause in WAKE_CAUSES:
            self.wakes.labels(cause)
        for reason in FALLBACK_REASONS:
            self.eager_steps.labels(reason)

    def set_lifecycle(self, state: int) -> None:
        current = lifecycle_name(state).lower()
        for name in LIFECYCLE_STATES:
            self.lifecycle.labels(name).set(1 if name == current else 0)

    def set_modes(self, requested: int, effective: int) -> None:
        for kind, value in zip(MODE_KINDS, (requested, effective), strict=True):
            for mode in GRAPH_MODES:
                self.graph_mode.labels(kind, mode).set(1 if mode == mode_name(value) else 0)

    def set_compile(self, level: int, compiled: bool, cache: str, kernels: str, quantization: str,
                    seconds: float) -> None:
        self.compile_info.info({"level": str(level), "compiled": "true" if compiled else "false", "cache": cache,
                                "kernels": bounded_label(kernels), "quantization": bounded_label(quantization)})
        self.compile_duration.set(seconds)

    def set_startup(self, startup: pb.StartupStatus) -> None:
        """The start's stages (a stage this worker had not: 0) and its caches' outcomes."""
        seconds = {s.stage: s.seconds for s in startup.stages}
        for stage in STARTUP_STAGES:
            self.startup_stage.labels(stage).set(seconds.get(stage, 0.0))
        for cache, outcome in (("compile", startup.compile_cache), ("tuning", startup.tuning_cache)):
            for value in CACHE_OUTCOMES:
                self.startup_cache.labels(cache, value).set(1 if value == outcome else 0)

    def set_kv(self, block_size: int, total: int, used: int, cached: int, queries: int, hits: int,
               preemptions: int) -> None:
        """The KV cache's gauges, and its counters moved on to the engine's running totals."""
        seen = (total, used, cached, queries, hits, preemptions)
        if seen == self._kv_seen:
            return
        _, _, _, q0, h0, p0 = self._kv_seen
        self._kv_seen = seen
        self.kv_block_size.set(block_size)
        self.kv_blocks.set(total)
        self.kv_used_blocks.set(used)
        self.kv_cached_blocks.set(cached)
        self.kv_usage.set(used / total if total else 0.0)
        self.prefix_queries.inc(max(0, queries - q0))
        self.prefix_hits.inc(max(0, hits - h0))
        self.preemptions.inc(max(0, preemptions - p0))

    def set_stretched(self, total: int) -> None:
        """The stretched-steps counter moved on to the scheduler's running total."""
        if total > self._stretched_seen:
            self.steps_stretched.inc(total - self._stretched_seen)
            self._stretched_seen = total

    def set_model(self, revision: str, source: str, dtype: str, device: str) -> None:
        """The model-info series: the source's kind and name, never a filesystem path; bounded values."""
        values = (bounded_label(revision), source_label(source), bounded_label(dtype), bounded_label(device))
        self.model.info(dict(zip(MODEL_INFO_LABELS, values, strict=True)))


#: The longest label value the worker exports; a longer one is cut with a marker.
MAX_LABEL_CHARS = 64


def bounded_label(value: str, limit: int = MAX_LABEL_CHARS) -> str:
    """``value`` cut to ``limit`` characters (the last one an ellipsis when cut).

    Label values come from requests and files (a revision is whatever LoadModelRevision was
    sent); an unbounded one bloats every scrape and the time-series database.
    """
    return value if len(value) <= limit else value[: limit - 1] + "…"


def source_label(source: str) -> str:
    """``random:<preset>[@seed]`` as it is; a directory as ``dir:<basename>``.

    A mount path says how a pod is laid out, not which model it serves, and it tells whoever
    reads the metrics about the node's filesystem; the basename is what names the model, and
    it is the same on every pod that serves it, wherever the volume is mounted.
    """
    if source.startswith("random:"):
        return bounded_label(source)
    name = PurePosixPath(source.rstrip("/")).name or "/"
    return bounded_label("dir:" + name)


def attention_backend_label(name: str) -> str:
    """The attention backend's label value (bounded: ``ATTENTION_BACKENDS``) from its name
    (``SlotAttention.name``: Triton decode and varlen kernels on CUDA, else PyTorch SDPA)."""
    return "triton" if name.startswith("triton") else "sdpa"


def metric_names(metrics: WorkerMetrics) -> set[str]:
    """Every series name the worker exports (counters with their ``_total`` suffix)."""
    names = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
    return names


#: The exported series names, for the dashboard, the alert rules and the docs.
METRIC_NAMES = frozenset({
    "graphkeeper_requests_total",
    "graphkeeper_time_to_first_token_seconds_bucket",
    "graphkeeper_time_to_first_token_seconds_count",
    "graphkeeper_time_to_first_token_seconds_sum",
    "graphkeeper_inter_token_latency_seconds_bucket",
    "graphkeeper_inter_token_latency_seconds_count",
    "graphkeeper_inter_token_latency_seconds_sum",
    "graphkeeper_step_duration_seconds_bucket",
    "graphkeeper_step_duration_seconds_count",
    "graphkeeper_step_duration_seconds_sum",
    "graphkeeper_gc_pause_seconds_bucket",
    "graphkeeper_gc_pause_seconds_count",
    "graphkeeper_gc_pause_seconds_sum",
    "graphkeeper_step_tokens_bucket",
    "graphkeeper_step_tokens_count",
    "graphkeeper_step_tokens_sum",
    "graphkeeper_step_sequences_bucket",
    "graphkeeper_step_sequences_count",
    "graphkeeper_step_sequences_sum",
    "graphkeeper_graph_replay_step_seconds",
    "graphkeeper_graph_eager_step_seconds",
    "graphkeeper_graph_padding_tokens_total",
    "graphkeeper_graph_released",
    "graphkeeper_graph_idle_releases_total",
    "graphkeeper_queue_depth",
    "graphkeeper_running_sequences",
    "graphkeeper_prompt_tokens_total",
    "graphkeeper_generated_tokens_total",
    "graphkeeper_graph_replays_total",
    "graphkeeper_eager_steps_total",
    "graphkeeper_padded_tokens_total",
    "graphkeeper_real_tokens_total",
    "graphkeeper_graph_capture_duration_seconds",
    "graphkeeper_graph_capture_phase_seconds",
    "graphkeeper_graph_capture_part_seconds",
    "graphkeeper_graph_memory_bytes",
    "graphkeeper_graph_memory_budget_bytes",
    "graphkeeper_graph_captured",
    "graphkeeper_graph_skipped",
    "graphkeeper_lifecycle_state",
    "graphkeeper_policy_generation",
    "graphkeeper_graph_mode",
    "graphkeeper_memory_ledger_bytes",
    "graphkeeper_model_info",
    "graphkeeper_recaptures_total",
    "graphkeeper_sleeping",
    "graphkeeper_sleeps_total",
    "graphkeeper_wakes_total",
    "graphkeeper_wake_duration_seconds",
    "graphkeeper_tenant_steps_total",
    "graphkeeper_compile_info",
    "graphkeeper_compile_duration_seconds",
    "graphkeeper_startup_stage_seconds",
    "graphkeeper_startup_cache",
    "graphkeeper_kv_cache_blocks",
    "graphkeeper_kv_cache_used_blocks",
    "graphkeeper_kv_cache_cached_blocks",
    "graphkeeper_kv_cache_usage_ratio",
    "graphkeeper_kv_cache_block_size_tokens",
    "graphkeeper_prefix_cache_queries_tokens_total",
    "graphkeeper_prefix_cache_hits_tokens_total",
    "graphkeeper_preemptions_total",
    "graphkeeper_steps_stretched_total",
    "graphkeeper_step_overruns_total",
})


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """Observes a whole step's values at once: one pass over the buckets instead of one call per
    value (a 64-row step observes 64 inter-token latencies)."""
    if not values:
        return
    bounds = histogram._upper_bounds
    counts = np.bincount(np.searchsorted(bounds, np.asarray(values), side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts):
        histogram._buckets[i].inc(int(counts[i]))
    histogram._sum.inc(float(sum(values)))
