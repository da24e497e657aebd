"""The wire enums as Python reads them: their label names, and which graphs a ``GraphMode`` records.

``FULL`` records a whole uniform-decode step; ``PIECEWISE`` records the pieces between attention
calls, so it serves mixed and prefill steps too. The worker's capture plan and dispatcher and the
operator's size selection (``traffic_sizes``) all ask these, so a new mode is taught here once.
The names are the forms metrics, logs, status and the CLI print (the proto's prefix stripped).
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


# --- names ------------------------------------------------------------------------------------


def mode_name(mode: int) -> str:
    """``GRAPH_MODE_FULL_AND_PIECEWISE`` -> ``full_and_piecewise`` (the metric label form)."""
    return pb.GraphMode.Name(mode).removeprefix("GRAPH_MODE_").lower()


def reason_name(reason: int) -> str:
    """``FALLBACK_REASON_TENANT_DISABLED`` -> ``tenant_disabled`` (the metric label form)."""
    return pb.FallbackReason.Name(reason).removeprefix("FALLBACK_REASON_").lower()


#: States in which a worker holds its adopted policy's graphs and serves them: a sleeping worker
#: keeps its graphs (its memory comes back at the same addresses) and a request wakes it.
SERVING_GRAPH_STATES = frozenset({pb.LIFECYCLE_STATE_READY, pb.LIFECYCLE_STATE_SLEEPING})


def serves_graphs(state: int) -> bool:
    """Whether a worker in ``state`` holds its graphs ready to serve (READY, or SLEEPING)."""
    return state in SERVING_GRAPH_STATES


def lifecycle_name(state: int) -> str:
    """``LIFECYCLE_STATE_READY`` -> ``READY`` (logs, status and health; ``.lower()`` for labels)."""
    return pb.LifecycleState.Name(state).removeprefix("LIFECYCLE_STATE_")
