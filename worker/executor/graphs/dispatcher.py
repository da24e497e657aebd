"""The one place that decides how a step runs: a graph of some mode and padded size, or eager
with exactly one reason.

Graph wrappers trust the answer; nothing else re-decides. The decision is a pure function of the
step's descriptor and the captured state, so every reason is testable without a GPU; the
``Dispatcher`` wraps it with the precomputed padding table. It counts nothing: the engine's step
recorder counts each step once, after it ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_has_full, mode_has_piecewise
from graphkeeper.proto.policy import padding_table
from graphkeeper.worker.executor.graphs.modes import FULL, NONE, PIECEWISE


class BatchDescriptor(NamedTuple):
    """What the dispatcher needs to know about a step."""

    num_tokens: int
    uniform_decode: bool  # every sequence contributes exactly one (decode) token
    graphs_allowed: bool  # every sequence's tenant may use graphs


class Decision(NamedTuple):
    """``mode`` is FULL, PIECEWISE or NONE (eager); ``reason`` is set exactly when eager."""

    mode: int
    size: int
    reason: int = pb.FALLBACK_REASON_UNSPECIFIED

    @property
    def eager(self) -> bool:
        return self.mode == NONE


@dataclass(frozen=True)
class GraphState:
    """What is captured now, as the dispatcher sees it.

    ``backend_unsupported`` is set when graphs cannot be recorded at all (no CUDA);
    ``recapturing`` while a new set is being captured (every step runs eager meanwhile);
    ``skipped`` maps (mode, size) to SIZE_OVER_BUDGET, SIZE_OVER_MAX_GRAPHS or SIZE_CAPTURE_FAILED;
    ``released`` holds the keys whose graphs were released after sitting idle (not in ``captured``
    any more: they come back only at the next capture phase, never on the request path);
    ``compute_bound_above`` when the largest captured size measured no faster replayed than eager
    (``economics.compute_bound_above``): a step larger still is COMPUTE_BOUND, not a missing graph.
    """

    effective_mode: int = NONE
    ladder: tuple[int, ...] = ()
    captured: frozenset[tuple[int, int]] = frozenset()
    skipped: dict[tuple[int, int], int] = field(default_factory=dict)
    backend_unsupported: bool = False
    recapturing: bool = False
    released: frozenset[tuple[int, int]] = frozenset()
    compute_bound_above: bool = False


def decide(desc: BatchDescriptor, state: GraphState, table: list[int]) -> Decision:
    """The decision for one step. Reasons are checked in a fixed order, so each step gets one."""
    n = desc.num_tokens
    if state.backend_unsupported:
        return Decision(NONE, n, pb.FALLBACK_REASON_BACKEND_UNSUPPORTED)
    if state.recapturing:
        return Decision(NONE, n, pb.FALLBACK_REASON_RECAPTURING)
    if state.effective_mode == pb.GRAPH_MODE_NONE:
        return Decision(NONE, n, pb.FALLBACK_REASON_MODE_EXCLUDES_STEP)
    if not desc.graphs_allowed:
        return Decision(NONE, n, pb.FALLBACK_REASON_TENANT_DISABLED)
    modes = _candidate_modes(desc, state.effective_mode)
    if not modes:
        return Decision(NONE, n, pb.FALLBACK_REASON_MODE_EXCLUDES_STEP)
    if not state.ladder or n > state.ladder[-1]:
        if state.compute_bound_above:
            return Decision(NONE, n, pb.FALLBACK_REASON_COMPUTE_BOUND)
        return Decision(NONE, n, pb.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE)
    padded = table[n]
    for mode in modes:
        if (mode, padded) in state.captured:
            return Decision(mode, padded)
    if (modes[0], padded) in state.released:
        return Decision(NONE, n, pb.FALLBACK_REASON_GRAPH_RELEASED_IDLE)
    # The best mode's reason; a coarse size has no FULL key, so a decode batch padded to one reads
    # its PIECEWISE key's (the first mode that recorded a skip).
    skipped = [state.skipped[(mode, padded)] for mode in modes if (mode, padded) in state.skipped]
    return Decision(NONE, n, skipped[0] if skipped else pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED)


def _candidate_modes(desc: BatchDescriptor, mode: int) -> list[int]:
    """Runtime modes that may serve this step, best first."""
    modes = []
    if desc.uniform_decode and mode_has_full(mode):
        modes.append(FULL)
    if mode_has_piecewise(mode):
        modes.append(PIECEWISE)
    return modes


class Dispatcher:
    """Holds the graph state and its padding table (the step recorder counts what it decides)."""

    def __init__(self, state: GraphState | None = None) -> None:
        self.update(state or GraphState(backend_unsupported=True))

    def update(self, state: GraphState) -> None:
        """Swaps in a new graph state (after a capture, at a recapture); O(max size) once."""
        self.state = state
        self.table = padding_table(list(state.ladder))

    def dispatch(self, desc: BatchDescriptor) -> Decision:
        return decide(desc, self.state, self.table)
