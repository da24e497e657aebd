"""Counts every step once: the metrics, the totals ``GraphStatus`` reports, and each request's
execution summary all come from ``StepRecorder.record``, so they cannot disagree."""

from __future__ import annotations

from collections import Counter
from contextlib import suppress

from graphkeeper.proto.policy import mode_name, reason_name
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Decision
from graphkeeper.worker.metrics import TENANT_EXECUTIONS, WorkerMetrics


class StepRecorder:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.graph_steps: Counter[tuple[int, int]] = Counter()  # (mode, padded size) -> steps
        self.eager_steps: Counter[int] = Counter()  # reason -> steps
        self.real_tokens = 0
        self.padded_tokens = 0
        self._listed: frozenset[str] = frozenset()

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
               elapsed: float) -> None:
        """One step: how it ran, for how many rows, for which sequences and listed tenants."""
        m = self.metrics
        rows = desc.num_tokens if decision.eager else decision.size
        self.real_tokens += desc.num_tokens
        self.padded_tokens += rows
        m.real_tokens.inc(desc.num_tokens)
        m.padded_tokens.inc(rows)
        if decision.eager:
            self.eager_steps[decision.reason] += 1
            m.eager_steps.labels(reason_name(decision.reason)).inc()
            m.step_duration.labels("eager").observe(elapsed)
            key, per_sequence = decision.reason, "eager_steps"
        else:
            self.graph_steps[(decision.mode, decision.size)] += 1
            name = mode_name(decision.mode)
            m.graph_replays.labels(name, str(decision.size)).inc()
            m.step_duration.labels(name).observe(elapsed)
            key, per_sequence = (decision.mode, decision.size), "graph_steps"
        execution = "eager" if decision.eager else "graph"
        for tenant in tenants & self.listed_tenants:
            m.tenant_steps.labels(tenant, execution).inc()  # bounded: only tenants the policy lists
        for seq in sequences:
            getattr(seq, per_sequence)[key] += 1
