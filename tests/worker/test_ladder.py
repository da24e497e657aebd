"""Capture-size ladders and the padding table (pure): which sizes a policy asks for, that every ladder
ends at its maximum, and that every token count pads to the smallest captured size that fits."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    default_ladder,
    default_max_capture_size,
    interactivity_ladder,
    padding_table,
    resolve_capture_sizes,
)


def test_default_ladder_at_512_has_51_sizes():
    ladder = default_ladder(512)
    assert len(ladder) == 51
    assert ladder == [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    assert ladder == sorted(set(ladder))


@pytest.mark.parametrize("max_size", [1, 2, 3, 5, 7, 8, 100, 250, 257, 300, 500, 511, 512, 1000])
def test_ladders_always_include_their_maximum(max_size):
    for ladder in (default_ladder(max_size), interactivity_ladder(max_size)):
        assert ladder[-1] == max_size
        assert all(s <= max_size for s in ladder)
        assert ladder == sorted(set(ladder))


def test_off_stride_maximum_is_appended_not_truncated():
    assert default_ladder(500)[-3:] == [480, 496, 500]
    assert default_ladder(3) == [1, 2, 3]
    assert default_ladder(8) == [1, 2, 4, 8]


def test_interactivity_ladder_is_every_size_to_32_then_default_steps():
    ladder = interactivity_ladder(512)
    assert ladder[:32] == list(range(1, 33))
    assert ladder[32:] == [s for s in default_ladder(512) if s > 32]
    assert len(ladder) == 76
    assert interactivity_ladder(20) == list(range(1, 21))


def test_default_max_capture_size_is_the_token_budget_capped_at_512():
    assert default_max_capture_size(8) == 8
    assert default_max_capture_size(256) == 256
    assert default_max_capture_size(512) == 512
    assert default_max_capture_size(2048) == 512


def test_resolve_capture_sizes():
    default = pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT)
    assert resolve_capture_sizes(default, 4, 64) == default_ladder(64)  # every step size has a graph
    assert resolve_capture_sizes(default, 256, 512) == default_ladder(512)
    # The token budget per step caps the ladder: bigger steps can never happen.
    assert resolve_capture_sizes(default, 256, 100) == default_ladder(100)
    assert resolve_capture_sizes(pb.CaptureSizes(), 256, 512) == default_ladder(512)
    inter = pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_INTERACTIVITY, max_capture_size=40)
    assert resolve_capture_sizes(inter, 4, 64) == interactivity_ladder(40)
    explicit = pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[16, 1, 4]))
    assert resolve_capture_sizes(explicit, 4, 64) == [1, 4, 16]
    explicit.max_capture_size = 24
    assert resolve_capture_sizes(explicit, 4, 64) == [1, 4, 16, 24]


@pytest.mark.parametrize("ladder", [
    default_ladder(512), interactivity_ladder(512), default_ladder(500), [1], [3, 17, 64], [7],
])
def test_padding_table_maps_every_count_to_the_smallest_size_that_fits(ladder):
    table = padding_table(ladder)
    assert len(table) == max(ladder) + 1
    assert table[0] == 0
    for n in range(1, max(ladder) + 1):
        expected = min(s for s in ladder if s >= n)
        assert table[n] == expected, n
    for size in ladder:
        assert table[size] == size


def test_padding_table_of_nothing():
    assert padding_table([]) == [0]
