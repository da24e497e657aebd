"""The wire enums as Python reads them: which graphs a ``GraphMode`` records.

``FULL`` records a whole uniform-decode step; ``PIECEWISE`` records the pieces between attention
calls, so it serves mixed and prefill steps too. The worker's capture plan and dispatcher and the
operator's size selection (``traffic_sizes``) all ask these, so a new mode is taught here once.
"""

from __future__ import annotations

from graphkeeper.proto import worker_pb2 as pb

_HAS_FULL = frozenset({pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_FULL_DECODE_ONLY, pb.GRAPH_MODE_FULL_AND_PIECEWISE})
_HAS_PIECEWISE = frozenset({pb.GRAPH_MODE_PIECEWISE, pb.GRAPH_MODE_FULL_AND_PIECEWISE})


def mode_has_full(mode: int) -> bool:
    """Whether ``mode`` records FULL graphs (uniform decode steps)."""
    return mode in _HAS_FULL


def mode_has_piecewise(mode: int) -> bool:
    """Whether ``mode`` records PIECEWISE graphs (any step, attention eager between the pieces)."""
    return mode in _HAS_PIECEWISE


def mode_has_graphs(mode: int) -> bool:
    """Whether ``mode`` records any graph at all (every mode but NONE and UNSPECIFIED)."""
    return mode_has_full(mode) or mode_has_piecewise(mode)
