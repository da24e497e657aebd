"""Graph memory by pool, from the allocator's snapshot: a pool's own segments, nothing else."""

from graphkeeper.worker.executor.graphs.pool_memory import REGULAR_POOL, bytes_by_pool


def test_segments_add_up_by_pool_and_unpooled_segments_are_the_regular_pool():
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 2 << 20},
        {"segment_pool_id": (1, 3), "total_size": 20 << 20},
        {"segment_pool_id": (1, 3), "total_size": 2 << 20},
        {"segment_pool_id": [1, 4], "total_size": 4 << 20},  # lists as well as tuples
        {"total_size": 1 << 20},  # an older snapshot without the key
    ]
    assert bytes_by_pool(segments) == {REGULAR_POOL: 3 << 20, (1, 3): 22 << 20, (1, 4): 4 << 20}


def test_an_empty_snapshot_holds_nothing():
    assert bytes_by_pool([]) == {}
