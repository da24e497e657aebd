"""Graph modes as data: what this backend can record instead of the mode asked for, and the capture
plan (which (mode, size) keys, in which order) that the capture controller and the benchmarks share.

``FULL`` records a whole uniform-decode step; ``PIECEWISE`` records the pieces between attention
calls (attention runs eagerly between them), so it serves mixed and prefill steps too. Which of
them a policy's mode records is ``graphkeeper.proto.enums`` (the operator asks it too).
"""

from __future__ import annotations

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_has_full, mode_has_piecewise
from graphkeeper.proto.policy import padding_table

NONE, PIECEWISE, FULL = pb.GRAPH_MODE_NONE, pb.GRAPH_MODE_PIECEWISE, pb.GRAPH_MODE_FULL
Key = tuple[int, int]  # (runtime mode, padded size)


def full_sizes(ladder: list[int], max_num_seqs: int) -> list[int]:
    """The sizes uniform decode steps pad to: FULL graphs beyond them would never be replayed."""
    table = padding_table(ladder)
    top = min(max_num_seqs, ladder[-1]) if ladder else 0
    return sorted({table[n] for n in range(1, top + 1)})


def capture_plan(effective_mode: int, ladder: list[int], max_num_seqs: int,
                 coarse: list[int] | tuple[int, ...] = ()) -> list[Key]:
    """The keys to capture for a mode and ladder, largest size first within each runtime mode (the
    first capture sizes the shared memory pool; smaller ones reuse its blocks). ``coarse`` sizes
    (above the ladder, ``large_steps.py``) are PIECEWISE only: no decode batch is that large."""
    plan: list[Key] = []
    if mode_has_full(effective_mode):
        plan += [(FULL, n) for n in reversed(full_sizes(ladder, max_num_seqs))]
    if mode_has_piecewise(effective_mode):
        plan += [(PIECEWISE, n) for n in reversed([*ladder, *coarse])]
    return plan


def downgrade_mode(requested: int, support: int, cuda: bool) -> tuple[int, str]:
    """The nearest mode this backend can record, and why it differs from ``requested``.

    ``support`` is a GraphSupport value: 0 never, 1 uniform decode only, 2 always.
    """
    if requested == pb.GRAPH_MODE_NONE:
        return pb.GRAPH_MODE_NONE, ""
    if not cuda:
        return pb.GRAPH_MODE_NONE, "no CUDA device: graphs cannot be recorded"
    if support == 0:
        if requested == pb.GRAPH_MODE_PIECEWISE:
            return requested, ""  # PIECEWISE never records attention: nothing to downgrade
        if mode_has_piecewise(requested) or requested == pb.GRAPH_MODE_FULL:
            return pb.GRAPH_MODE_PIECEWISE, "attention backend cannot be recorded: PIECEWISE only"
        return pb.GRAPH_MODE_NONE, "attention backend cannot be recorded and the mode has no PIECEWISE"
    if support == 1 and requested == pb.GRAPH_MODE_FULL:
        return (
            pb.GRAPH_MODE_FULL_AND_PIECEWISE,
            "attention backend records only uniform decode steps: mixed steps use PIECEWISE",
        )
    return requested, ""
