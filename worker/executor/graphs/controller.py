"""The capture controller: which graphs a policy asks for, recording them (all at once at startup,
one key between steps during a recapture), swapping the finished set into the dispatcher, and
releasing graphs before anything can move their addresses, or once no step has replayed them for
the policy's idle-release time.

It owns the graph set, the ladder, the requested and effective modes, the idle-release time and
the capture metrics; the engine decides when to capture and moves the lifecycle. What a policy
asks for is ``plan_capture``, a pure function: the engine's memory check (track B) and ``begin``
both take it from ``CaptureController.plan``, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name, reason_name
from graphkeeper.proto.policy import effective_requested_mode, resolve_capture_sizes
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.coarse_memory import CoarseMemory, memory_facts
from graphkeeper.worker.executor.graphs.dispatcher import Dispatcher, GraphState
from graphkeeper.worker.executor.graphs.economics import IdleRelease, compute_bound_above, limit_plan
from graphkeeper.worker.executor.graphs.graph_set import GraphSet, Skipped
from graphkeeper.worker.executor.graphs.large_steps import planned_coarse_sizes
from graphkeeper.worker.executor.graphs.modes import Key, capture_plan, downgrade_mode
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.attention import SlotAttention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturePlan:
    """What one policy asks this worker to capture."""

    requested_mode: int
    effective_mode: int
    #: Why the effective mode differs from the requested one ("" when it does not).
    downgrade_reason: str
    #: The padding ladder: the policy's sizes, then any coarse ones (``large_steps.py``).
    ladder: list[int]
    #: The keys to capture, largest size first within each runtime mode (at most ``max_graphs``).
    keys: list[Key]
    #: The keys a ``max_graphs`` limit leaves out (skipped with SIZE_OVER_MAX_GRAPHS).
    left_out: list[Key]
    #: PIECEWISE sizes above the default ceiling, kept at the end of the phase only where they pay.
    coarse: list[int] = dataclasses.field(default_factory=list)


def plan_capture(policy: pb.GraphPolicy, traffic: Mapping[tuple[int, bool], int] | None, *, cuda: bool,
                 graph_support: int, max_num_seqs: int, max_num_batched_tokens: int) -> CapturePlan:
    """The modes, ladder and keys ``policy`` asks for on this backend (pure).

    ``traffic`` (steps per (real tokens, uniform decode), observed under the previous policy)
    chooses which keys a ``max_graphs`` limit keeps; without it, the smallest sizes. Without CUDA,
    or with an effective mode of NONE, nothing is captured. A budget above the default ceiling
    adds coarse PIECEWISE sizes (``large_steps.planned_coarse_sizes``) to the ladder and the keys.
    """
    requested = effective_requested_mode(policy)
    effective, why = downgrade_mode(requested, graph_support, cuda)
    ladder = resolve_capture_sizes(policy.capture_sizes, max_num_seqs, max_num_batched_tokens)
    coarse = planned_coarse_sizes(policy.capture_sizes, effective, max_num_batched_tokens)
    plan = capture_plan(effective, ladder, max_num_seqs, coarse)
    ladder = [*ladder, *coarse]
    keys, left_out = limit_plan(plan, policy.max_graphs, ladder, traffic)
    return CapturePlan(requested, effective, why, ladder, keys, left_out, coarse)


class CaptureController:
    def __init__(self, dispatcher: Dispatcher, metrics: WorkerMetrics, max_num_seqs: int,
                 max_num_batched_tokens: int, inject_failures: frozenset[int]) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.inject_failures = inject_failures
        self.graph_set: GraphSet | None = None
        self.job: CaptureJob | None = None
        self.requested_mode = pb.GRAPH_MODE_NONE
        self.effective_mode = pb.GRAPH_MODE_NONE
        self.downgrade_reason = ""
        self.ladder: list[int] = []
        #: The last capture phase's seconds by part (CAPTURE_PARTS); they add up to total_seconds.
        self.parts: dict[str, float] = {}
        self.last_failure = ""
        self.idle = IdleRelease()
        #: The compile cache directory of the step being captured ("" for none), where coarse
        #: verdicts are remembered between starts (``coarse_memory.py``): the engine's slot says.
        self.verdicts_dir: Callable[[], str] = lambda: ""

    @property
    def total_seconds(self) -> float:
        """The whole last capture phase: the sum of its parts (0 before any)."""
        return sum(self.parts.values())

    @property
    def active(self) -> bool:
        return self.job is not None

    @property
    def idle_release_seconds(self) -> int:
        """The adopted policy's idle-release time (0: graphs are never released while idle)."""
        return self.idle.seconds

    def plan(self, policy: pb.GraphPolicy, traffic: Mapping[tuple[int, bool], int] | None = None, *,
             cuda: bool = True) -> CapturePlan:
        """What ``policy`` asks this worker to capture (``plan_capture`` with this worker's limits)."""
        return plan_capture(policy, traffic, cuda=cuda, graph_support=int(SlotAttention.graph_support),
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)

    def adopt(self, policy: pb.GraphPolicy) -> None:
        """The engine adopted ``policy``: what changes without a capture (the idle-release time)."""
        self.idle.seconds = policy.idle_release_seconds

    def begin(self, policy: pb.GraphPolicy, runner: ModelRunner,
              traffic: Mapping[tuple[int, bool], int] | None = None) -> None:
        """Resolves modes and sizes for ``policy`` and plans the capture, largest size first.

        ``traffic`` chooses which keys a ``max_graphs`` limit keeps (``plan_capture``).
        """
        cuda = runner.device.type == "cuda"
        plan = self.plan(policy, traffic, cuda=cuda)
        self.adopt(policy)
        self.requested_mode, self.effective_mode = plan.requested_mode, plan.effective_mode
        self.downgrade_reason = plan.downgrade_reason
        self.metrics.set_modes(self.requested_mode, self.effective_mode)
        self.metrics.graph_memory_budget.set(policy.memory_budget_bytes)
        self.ladder = plan.ladder
        self.last_failure = ""
        if not cuda or self.effective_mode == pb.GRAPH_MODE_NONE:
            self.job = None
            self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                              backend_unsupported=not cuda))
            return
        self.graph_set = GraphSet(runner)
        for mode, size in plan.left_out:
            self.graph_set.skipped[(mode, size)] = Skipped(
                pb.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS,
                f"the policy keeps at most {policy.max_graphs} graphs; this one served the fewest observed steps")
        tolerance = 1e-4 if runner.loaded.dtype == torch.float32 else 2e-2
        memory = CoarseMemory.beside(self.verdicts_dir(), memory_facts(
            self.graph_set.whole_mixed, runner.model.tp.size, runner.cache.block_size)) if plan.coarse else None
        self.job = CaptureJob(self.graph_set, plan.keys, policy.memory_budget_bytes, self.inject_failures, tolerance,
                              coarse=tuple(plan.coarse), ladder=tuple(plan.ladder), memory=memory)
        self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                          recapturing=True))
        log.info("capturing %d graphs (%s, sizes %s..%s, budget %s B; PIECEWISE keys %s)", len(plan.keys),
                 mode_name(self.effective_mode), self.ladder[0], self.ladder[-1],
                 policy.memory_budget_bytes or "unlimited",
                 "whole steps, the attention recorded" if self.graph_set.whole_mixed
                 else "pieces around eager attention")

    def step(self) -> bool:
        """Captures the next key; True once the whole set is in and swapped into the dispatcher.

        Called only while ``active`` (a job is planned); without one there is nothing to finish.
        """
        if self.job is None:
            return False
        if not self.job.done:
            self.job.step()
        if self.job.done:
            self.finish()
            return True
        return False

    def run_all(self) -> None:
        if self.job is not None:
            self.job.run_all()
        self.finish()

    def finish(self) -> None:
        """Swaps the completed graph set in, at once, and records what it cost."""
        job, graphs = self.job, self.graph_set
        self.job = None
        if job is None:
            return
        job.finish()
        self.parts = dict(job.parts)
        self._publish_state()
        failures = [v.message for v in graphs.skipped.values() if v.reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED]
        self.last_failure = failures[-1] if failures else ""
        self._export()

    def _publish_state(self) -> None:
        graphs = self.graph_set
        self.dispatcher.update(GraphState(
            effective_mode=self.effective_mode, ladder=tuple(self.ladder),
            captured=frozenset(graphs.captured), skipped={k: v.reason for k, v in graphs.skipped.items()},
            released=frozenset(graphs.released),
            compute_bound_above=compute_bound_above(
                (g.mode, g.size, g.replay_seconds, g.eager_seconds) for g in graphs.captured.values()),
        ))

    def idle_graphs(self, last_used: Callable[[], Mapping[Key, float]], now: float | None = None) -> set[Key]:
        """Captured graphs no step replayed for the policy's idle-release time (looked for at most
        once every ``IDLE_CHECK_SECONDS``; the look that finds some is repeated by the caller once
        no step that may replay them is in flight). ``last_used`` is the step recorder's."""
        graphs = self.graph_set
        return set() if graphs is None else self.idle.due(graphs.captured, last_used, now)

    def release_idle(self, keys: set[tuple[int, int]]) -> None:
        """Releases these graphs (idle past the policy's time): their memory is given back, the
        dispatcher runs their steps eager with GRAPH_RELEASED_IDLE until the next capture phase.
        Between steps only: never while a step that may replay them is in flight."""
        graphs = self.graph_set
        keys = {k for k in keys if graphs is not None and k in graphs.captured}
        if not keys or self.job is not None:
            return
        graphs.release_idle(keys)
        self._publish_state()
        self.metrics.idle_releases.inc(len(keys))
        log.info("released %d idle graph(s) (no replay for %d s): %s; graph memory now %d B", len(keys),
                 self.idle_release_seconds, ", ".join(f"{mode_name(m)} {n}" for m, n in sorted(keys)),
                 graphs.memory_bytes)
        self._export()

    def release(self) -> None:
        """Graphs are dropped before anything that could move their addresses."""
        if self.graph_set is not None:
            self.graph_set.release()
            self.graph_set = None
        self.job = None
        for gauge in (self.metrics.captured, self.metrics.released, self.metrics.replay_step_time,
                      self.metrics.eager_step_time):
            gauge.clear()
        self.metrics.graph_memory.set(0)

    def hold_eager(self) -> None:
        """Every step runs eager (reason recapturing) until the next ``begin``."""
        self.dispatcher.update(GraphState(effective_mode=self.effective_mode, ladder=tuple(self.ladder),
                                          recapturing=True))

    def captured_count(self) -> int:
        return len(self.graph_set.captured) if self.graph_set else 0

    def summary(self) -> str:
        """The modes and what the last capture phase held, for the READY log line."""
        why = f" ({self.downgrade_reason})" if self.downgrade_reason else ""
        return (f"requested {mode_name(self.requested_mode)}, effective {mode_name(self.effective_mode)}{why}; "
                f"{self.captured_count()} graphs captured in {self.total_seconds:.2f} s")

    def _export(self) -> None:
        m, graphs = self.metrics, self.graph_set
        for gauge in (m.captured, m.skipped, m.capture_duration, m.released, m.replay_step_time, m.eager_step_time):
            gauge.clear()
        for (mode, size), entry in [*graphs.captured.items(), *graphs.released.items()]:
            labels = mode_name(mode), str(size)
            m.capture_duration.labels(*labels).set(entry.seconds)
            m.replay_step_time.labels(*labels).set(entry.replay_seconds)
            m.eager_step_time.labels(*labels).set(entry.eager_seconds)
        for mode, size in graphs.captured:
            m.captured.labels(mode_name(mode), str(size)).set(1)
        for mode, size in graphs.released:
            m.released.labels(mode_name(mode), str(size)).set(1)
        for (mode, size), skipped in graphs.skipped.items():
            m.skipped.labels(mode_name(mode), str(size), reason_name(skipped.reason)).set(1)
        m.capture_phase.set(self.total_seconds)
        for part, seconds in self.parts.items():
            m.capture_part.labels(part).set(seconds)
        m.graph_memory.set(graphs.memory_bytes)
