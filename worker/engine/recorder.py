"""Counts every step once: the metrics, the totals ``GraphStatus`` reports, each request's
execution summary, the traffic histogram (step shapes since the last policy adoption) and what
each captured graph earned (replays, padding, last use) and the serving counters a canary is
compared on (tokens, sequence-seconds, latency: ``serving_counters.py``) all come from ``StepRecorder.record``, so
they cannot disagree."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass

from graphkeeper.proto.enums import mode_name, reason_name
from graphkeeper.worker.engine.serving_counters import ServingCounters
from graphkeeper.worker.engine.traffic import TrafficHistogram
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Decision
from graphkeeper.worker.metrics import STEP_KINDS, TENANT_EXECUTIONS, WorkerMetrics, attention_backend_label


@dataclass
class GraphUse:
    """What one captured graph earned since it was captured."""

    replays: int = 0
    padded_tokens: int = 0  # padding rows its replays computed (padded size minus real tokens)
    last_used: float = 0.0  # time.monotonic() of its last replay (its capture, before any)


class StepRecorder:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.graph_steps: Counter[tuple[int, int]] = Counter()  # (mode, padded size) -> steps
        self.eager_steps: Counter[int] = Counter()  # reason -> steps
        self.real_tokens = 0
        self.padded_tokens = 0
        self._listed: frozenset[str] = frozenset()
        self.traffic = TrafficHistogram()
        self.serving = ServingCounters()
        #: (mode, padded size) -> what that graph earned; started over at every capture phase.
        self.graph_use: dict[tuple[int, int], GraphUse] = {}
        self.attention_backend = "sdpa"
        # The step-shape series' children, looked up once (labels() is a dict lookup under a lock,
        # and these are observed on every step).
        self._shape_series = {kind: (metrics.step_tokens.labels(kind), metrics.step_sequences.labels(kind))
                              for kind in STEP_KINDS}

    def set_attention(self, name: str) -> None:
        """The served model's attention implementation (``SlotAttention.name``), as a bounded label."""
        self.attention_backend = attention_backend_label(name)

    def graphs_captured(self, keys, now: float | None = None) -> None:
        """A capture phase ended: each captured graph starts with nothing earned, used ``now``."""
        now = time.monotonic() if now is None else now
        self.graph_use = {key: GraphUse(last_used=now) for key in keys}

    def slept(self, seconds: float) -> None:
        """The worker slept ``seconds``: every graph's last use moves on by as much, so time asleep
        never counts as idle time (a wake must not release the graphs it kept)."""
        for use in list(self.graph_use.values()):
            use.last_used += seconds

    def last_used(self) -> dict[tuple[int, int], float]:
        return {key: use.last_used for key, use in list(self.graph_use.items())}

    @property
    def listed_tenants(self) -> frozenset[str]:
        """The tenants the adopted policy lists: the only ones with series of their own."""
        return self._listed

    @listed_tenants.setter
    def listed_tenants(self, tenants: frozenset[str]) -> None:
        """A new policy's tenants; the series of tenants it no longer lists are removed, so the
        series (and /metrics) stay as many as one policy's tenants however many come and go."""
        for tenant in self._listed - tenants:
            for execution in TENANT_EXECUTIONS:
                with suppress(KeyError):  # never ran a step of this kind
                    self.metrics.tenant_steps.remove(tenant, execution)
        self._listed = frozenset(tenants)

    def record(self, decision: Decision, desc: BatchDescriptor, sequences: list, tenants: set[str],
               elapsed: float, now: float | None = None, generated: int = 0) -> None:
        """One step: how it ran, for how many rows, for which sequences and listed tenants, and its
        shape (``now``: time.monotonic() when it ended, for the graph's last use; ``generated``:
        the sequences that sampled a token)."""
        m = self.metrics
        rows = desc.num_tokens if decision.eager else decision.size
        self.real_tokens += desc.num_tokens
        self.padded_tokens += rows
        m.real_tokens.inc(desc.num_tokens)
        m.padded_tokens.inc(rows)
        self.traffic.count(desc.num_tokens, len(sequences), desc.uniform_decode)
        self.serving.count(sequences=len(sequences), generated=generated, seconds=elapsed, replayed_rows=rows,
                           real_tokens=desc.num_tokens, eager=decision.eager)
        tokens, seqs = self._shape_series["decode" if desc.uniform_decode else "mixed"]
        tokens.observe(desc.num_tokens)
        seqs.observe(len(sequences))
        if decision.eager:
            self.eager_steps[decision.reason] += 1
            m.eager_steps.labels(reason_name(decision.reason)).inc()
            m.step_duration.labels("eager", self.attention_backend).observe(elapsed)
            key, per_sequence = decision.reason, "eager_steps"
        else:
            self.graph_steps[(decision.mode, decision.size)] += 1
            name = mode_name(decision.mode)
            m.graph_replays.labels(name, str(decision.size)).inc()
            m.step_duration.labels(name, self.attention_backend).observe(elapsed)
            key, per_sequence = (decision.mode, decision.size), "graph_steps"
            use = self.graph_use.get(key)
            if use is None:
                use = self.graph_use[key] = GraphUse()
            use.replays += 1
            use.padded_tokens += rows - desc.num_tokens
            use.last_used = time.monotonic() if now is None else now
            if rows > desc.num_tokens:
                m.graph_padding.labels(name, str(decision.size)).inc(rows - desc.num_tokens)
        execution = "eager" if decision.eager else "graph"
        for tenant in tenants & self.listed_tenants:
            m.tenant_steps.labels(tenant, execution).inc()  # bounded: only tenants the policy lists
        for seq in sequences:
            getattr(seq, per_sequence)[key] += 1
