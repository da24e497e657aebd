"""Graph memory accounting on a simulated device: the figure is the graph pool's own segments (and
the piece buffers), so a second model in memory, a model revision change or a release cannot make
it zero or wrong, and a release is shown only once its memory was measured.

The device here is a small model of the caching allocator (segments by pool, a pool freed once its
last graph is reset, ``empty_cache`` returning free segments): the part of CUDA the accounting reads.
``GraphSet`` itself is the real class; the GPU tests check the same figures on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from graphkeeper.worker.executor.graphs import graph_set as graph_set_module
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, GraphSet
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE

MIB = 2**20
TOTAL = 80 * 1024 * MIB


@dataclass
class SimulatedDevice:
    """Segments by pool id; a graph pool's segments go back at ``empty_cache`` once no graph uses it."""

    segments: list[dict] = field(default_factory=list)
    users: dict[tuple[int, int], int] = field(default_factory=dict)
    outside: int = 0  # device memory outside the allocator (context, libraries, other processes)
    next_pool: int = 0

    def allocate(self, pool: tuple[int, int], nbytes: int) -> None:
        self.segments.append({"segment_pool_id": pool, "total_size": nbytes})

    def capture(self, pool: tuple[int, int], nbytes: int) -> SimpleNamespace:
        """A graph recorded into ``pool`` that needed ``nbytes`` more pool memory."""
        self.users[pool] = self.users.get(pool, 0) + 1
        if nbytes:
            self.allocate(pool, nbytes)

        def reset() -> None:
            self.users[pool] -= 1

        return SimpleNamespace(reset=reset)

    def empty_cache(self) -> None:
        self.segments = [s for s in self.segments
                         if s["segment_pool_id"] == (0, 0) or self.users.get(s["segment_pool_id"], 0) > 0]

    def pool_handle(self) -> tuple[int, int]:
        self.next_pool += 1
        return (0, self.next_pool)

    def used(self) -> int:
        return self.outside + sum(s["total_size"] for s in self.segments)


@pytest.fixture
def device(monkeypatch) -> SimulatedDevice:
    dev = SimulatedDevice(outside=500 * MIB)
    dev.allocate((0, 0), 2048 * MIB)  # weights and KV cache: the regular pool
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: [dict(s) for s in dev.segments])
    monkeypatch.setattr(cuda, "empty_cache", dev.empty_cache)
    monkeypatch.setattr(cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "graph_pool_handle", dev.pool_handle)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a, **k: (TOTAL - dev.used(), TOTAL))
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a, **k: sum(s["total_size"] for s in dev.segments))
    monkeypatch.setattr(cuda, "Stream", lambda *a, **k: object())
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    monkeypatch.setattr(graph_set_module.GraphSet, "_eager_row", lambda self: None)
    return dev


def runner() -> SimpleNamespace:
    return SimpleNamespace(addresses=lambda: (1, 2, 3), device=torch.device("cpu"),
                           attention=SimpleNamespace(records_mixed=False))


def capture(dev: SimulatedDevice, graphs: GraphSet, key: tuple[int, int], pool_bytes: int) -> None:
    """What CaptureJob does for one key, as far as memory goes: record, then measure."""
    before = graphs.measure()
    graph = dev.capture(graphs.pool, pool_bytes)
    graphs.captured[key] = CapturedGraph(key[0], key[1], [graph], 0.01, 0, 0)
    graphs.captured[key].device_bytes = graphs.measure() - before
    graphs.memory_bytes = graphs.measure()


def capture_ladder(dev: SimulatedDevice) -> GraphSet:
    """Largest first: the first key sizes the shared pool, the smaller ones reuse its blocks."""
    graphs = GraphSet(runner())
    capture(dev, graphs, (FULL, 64), 20 * MIB)
    capture(dev, graphs, (FULL, 8), 0)
    capture(dev, graphs, (PIECEWISE, 64), 2 * MIB)
    capture(dev, graphs, (PIECEWISE, 8), 0)
    return graphs


def test_graph_memory_is_the_pool_s_and_nothing_else_on_the_device_moves_it(device):
    graphs = capture_ladder(device)
    assert graphs.memory_bytes == 22 * MIB
    assert [e.device_bytes for e in graphs.captured.values()] == [20 * MIB, 0, 2 * MIB, 0]
    device.allocate((0, 0), 2048 * MIB)  # a second model loads beside the first
    device.outside += 300 * MIB  # and a library grows
    assert graphs.measure() == 22 * MIB


def test_after_a_revision_change_the_new_set_reads_what_a_fresh_one_reads(device):
    fresh = capture_ladder(device)
    device.allocate((0, 0), 2048 * MIB)  # the new weights load beside the old ones
    fresh.release()  # stale graphs go before the new weights serve
    device.segments = device.segments[:1] + device.segments[2:]  # the old weights are freed
    device.empty_cache()
    again = capture_ladder(device)
    assert again.memory_bytes == fresh.memory_bytes == 22 * MIB
    assert again.pool != fresh.pool


def test_a_partial_release_keeps_the_shared_pool_and_the_last_one_gives_it_back(device):
    graphs = capture_ladder(device)
    used_before_graphs = device.used() - 22 * MIB
    graphs.release_idle({(FULL, 8), (PIECEWISE, 8)})
    assert graphs.memory_bytes == 22 * MIB  # the pool keeps the blocks the other graphs use
    assert set(graphs.released) == {(FULL, 8), (PIECEWISE, 8)} and set(graphs.captured) == {(FULL, 64), (PIECEWISE, 64)}
    graphs.release_idle({(FULL, 64), (PIECEWISE, 64)})
    assert graphs.memory_bytes == 0 and not graphs.captured and len(graphs.released) == 4
    assert device.used() == used_before_graphs  # the device has it back, not only the figure


def test_a_release_is_shown_only_once_its_memory_was_measured(device, monkeypatch):
    """A reader on another thread (status) must never see every graph released beside the memory
    they held, nor see a graph vanish from both lists while it is being released."""
    graphs = capture_ladder(device)
    seen = []
    measure = GraphSet.measure

    def measuring(self: GraphSet) -> int:
        seen.append((set(self.captured), set(self.released), self.memory_bytes))
        return measure(self)

    monkeypatch.setattr(GraphSet, "measure", measuring)
    graphs.release_idle(set(graphs.captured))
    keys, released, memory = seen[-1]
    assert len(keys) == 4 and not released and memory == 22 * MIB  # still shown captured while measured
    assert graphs.memory_bytes == 0 and len(graphs.released) == 4 and not graphs.captured
