"""Graph modes as data (pure): the FULL sizes a ladder yields, and the nearest mode a backend can
record, with a reason exactly when the mode changed."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name
from graphkeeper.proto.policy import default_ladder
from graphkeeper.worker.executor.graphs.modes import downgrade_mode, full_sizes

ALL_MODES = [m for m in pb.GraphMode.values() if m != pb.GRAPH_MODE_UNSPECIFIED]


def test_full_sizes_are_the_decode_buckets():
    assert full_sizes(default_ladder(8), 4) == [1, 2, 4]
    assert full_sizes(default_ladder(512), 3) == [1, 2, 4]
    assert full_sizes([5, 10], 7) == [5, 10]
    assert full_sizes([], 4) == []


M = pb.GraphMode
DOWNGRADES = {
    # (requested, support, cuda): effective
    **{(m, s, False): (M.GRAPH_MODE_NONE if m != M.GRAPH_MODE_NONE else m)
       for m in ALL_MODES for s in (0, 1, 2)},
    **{(m, 2, True): m for m in ALL_MODES},
    (M.GRAPH_MODE_NONE, 0, True): M.GRAPH_MODE_NONE,
    (M.GRAPH_MODE_PIECEWISE, 0, True): M.GRAPH_MODE_PIECEWISE,
    (M.GRAPH_MODE_FULL, 0, True): M.GRAPH_MODE_PIECEWISE,
    (M.GRAPH_MODE_FULL_DECODE_ONLY, 0, True): M.GRAPH_MODE_NONE,
    (M.GRAPH_MODE_FULL_AND_PIECEWISE, 0, True): M.GRAPH_MODE_PIECEWISE,
    (M.GRAPH_MODE_NONE, 1, True): M.GRAPH_MODE_NONE,
    (M.GRAPH_MODE_PIECEWISE, 1, True): M.GRAPH_MODE_PIECEWISE,
    (M.GRAPH_MODE_FULL, 1, True): M.GRAPH_MODE_FULL_AND_PIECEWISE,
    (M.GRAPH_MODE_FULL_DECODE_ONLY, 1, True): M.GRAPH_MODE_FULL_DECODE_ONLY,
    (M.GRAPH_MODE_FULL_AND_PIECEWISE, 1, True): M.GRAPH_MODE_FULL_AND_PIECEWISE,
}


@pytest.mark.parametrize("key", sorted(DOWNGRADES), ids=lambda k: f"{mode_name(k[0])}-{k[1]}-{k[2]}")
def test_mode_downgrade(key):
    requested, support, cuda = key
    effective, why = downgrade_mode(requested, support, cuda)
    assert effective == DOWNGRADES[key]
    # A reason is given exactly when the mode changed.
    assert bool(why) == (effective != requested)


def test_downgrade_without_cuda_names_the_cause():
    effective, why = downgrade_mode(M.GRAPH_MODE_FULL_AND_PIECEWISE, 2, cuda=False)
    assert effective == M.GRAPH_MODE_NONE
    assert "CUDA" in why
