"""The capture plan is derived once: ``plan_capture`` (pure) gives the modes, ladder and keys a policy
asks for, ``max_graphs`` included; ``CaptureController.begin`` and track B's memory check both take
it from ``CaptureController.plan``. The controller alone holds the idle-release time and decides
when graphs are idle. The ``--gpu-memory-utilization`` rules are one function for the CLI and the
engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.engine.kv_sizing import UtilizationSizing
from graphkeeper.worker.engine.scheduler import Scheduler
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.engine.sizing import UtilizationPlan, utilization_error
from graphkeeper.worker.engine.traffic import TrafficHistogram
from graphkeeper.worker.executor.graphs.controller import CaptureController, plan_capture
from graphkeeper.worker.executor.graphs.dispatcher import Dispatcher
from graphkeeper.worker.executor.graphs.economics import IdleRelease
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE, capture_plan
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.plan import SamplingSpec

M = pb.GraphMode
SIZES = [1, 2, 4, 8, 16]
ALWAYS, NEVER = 2, 0  # GraphSupport values


def policy(mode: int = M.GRAPH_MODE_FULL_AND_PIECEWISE, **fields) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="u", generation=1, mode=mode,
                          capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=SIZES)), **fields)


def plan(p: pb.GraphPolicy, traffic=None, *, cuda: bool = True, support: int = ALWAYS):
    return plan_capture(p, traffic, cuda=cuda, graph_support=support, max_num_seqs=4, max_num_batched_tokens=64)


def controller() -> CaptureController:
    return CaptureController(Dispatcher(), WorkerMetrics(), max_num_seqs=4, max_num_batched_tokens=64,
                             inject_failures=frozenset())


def graphs(reserved: int = 0, **device_bytes) -> SimpleNamespace:
    """A graph set holding captured keys (``f1=`` FULL 1, ``p16=`` PIECEWISE 16) of these bytes of
    graph memory, each having reserved ``reserved`` bytes while it was captured."""
    mode = {"f": FULL, "p": PIECEWISE}
    keys = {k: (mode[k[0]], int(k[1:])) for k in device_bytes}
    return SimpleNamespace(captured={keys[k]: CapturedGraph(*keys[k], [], 0.0, b, reserved)
                                     for k, b in device_bytes.items()}, skipped={})


# --- the plan ------------------------------------------------------------------------------------


def test_the_plan_is_every_key_of_the_mode_and_ladder_without_a_limit():
    got = plan(policy())
    assert (got.requested_mode, got.effective_mode, got.downgrade_reason) == (
        M.GRAPH_MODE_FULL_AND_PIECEWISE, M.GRAPH_MODE_FULL_AND_PIECEWISE, "")
    assert got.ladder == SIZES
    assert got.keys == capture_plan(M.GRAPH_MODE_FULL_AND_PIECEWISE, SIZES, 4) and got.left_out == []


def test_max_graphs_keeps_the_smallest_keys_without_traffic_and_the_busiest_with_it():
    full = capture_plan(M.GRAPH_MODE_FULL_AND_PIECEWISE, SIZES, 4)
    quiet = plan(policy(max_graphs=3))
    assert quiet.keys == [(FULL, 2), (FULL, 1), (PIECEWISE, 1)]
    assert quiet.left_out == [k for k in full if k not in quiet.keys]
    busy = plan(policy(max_graphs=3), {(15, False): 100})
    assert (PIECEWISE, 16) in busy.keys and len(busy.keys) == 3
    assert sorted(busy.keys + busy.left_out) == sorted(full)


def test_without_cuda_nothing_is_planned_and_the_reason_is_given():
    got = plan(policy(max_graphs=3), cuda=False)
    assert got.effective_mode == M.GRAPH_MODE_NONE and "CUDA" in got.downgrade_reason
    assert got.keys == got.left_out == [] and got.ladder == SIZES


def test_a_backend_that_cannot_record_attention_plans_piecewise_only():
    got = plan(policy(M.GRAPH_MODE_FULL), support=NEVER)
    assert got.effective_mode == M.GRAPH_MODE_PIECEWISE and got.downgrade_reason
    assert got.keys == [(PIECEWISE, n) for n in reversed(SIZES)]


def test_begin_takes_its_modes_and_ladder_from_the_plan(runner):
    c = controller()
    p = policy(M.GRAPH_MODE_UNSPECIFIED, max_graphs=2, idle_release_seconds=30)
    c.begin(p, runner)  # a CPU runner: the plan without CUDA
    expected = c.plan(p, cuda=False)
    assert (c.requested_mode, c.effective_mode, c.downgrade_reason) == (
        expected.requested_mode, expected.effective_mode, expected.downgrade_reason)
    assert c.ladder == expected.ladder and c.idle_release_seconds == 30


# --- idle release: the controller's alone ---------------------------------------------------------


def test_adopting_a_policy_sets_the_idle_release_time_without_a_capture():
    c = controller()
    assert c.idle_release_seconds == 0
    c.adopt(policy(idle_release_seconds=5))
    assert c.idle_release_seconds == 5 and not c.active


def test_idle_graphs_are_the_captured_ones_unused_for_the_policy_time():
    c = controller()
    c.adopt(policy(idle_release_seconds=5))
    c.graph_set = graphs(f1=1, p16=1)
    used = {(FULL, 1): 100.0, (PIECEWISE, 16): 96.0, (PIECEWISE, 8): 0.0}  # PIECEWISE 8: not captured
    assert c.idle_graphs(lambda: used, now=101.0) == {(PIECEWISE, 16)}
    assert c.idle_graphs(lambda: used, now=101.0) == {(PIECEWISE, 16)}  # found: the caller looks again


def test_a_look_that_finds_nothing_waits_before_the_next_and_reads_nothing_meanwhile():
    idle = IdleRelease(check_seconds=1.0)
    idle.seconds = 5
    reads = []

    def last_used():
        reads.append(1)
        return {(FULL, 1): 100.0}

    assert idle.due({(FULL, 1)}, last_used, now=101.0) == set()
    assert idle.due({(FULL, 1)}, last_used, now=101.5) == set() and len(reads) == 1
    assert idle.due({(FULL, 1)}, last_used, now=105.0) == {(FULL, 1)} and len(reads) == 2


def test_no_idle_release_time_or_no_graphs_finds_nothing():
    c = controller()
    assert c.idle_graphs(lambda: pytest.fail("read without graphs"), now=1e9) == set()
    c.graph_set = graphs(f1=1)
    assert c.idle_graphs(lambda: pytest.fail("read with idle release off"), now=1e9) == set()


# --- track B's memory check uses the same plan --------------------------------------------------


def sized(room: int) -> UtilizationSizing:
    sizing = UtilizationSizing(0.9)
    sizing.plan, sizing.graph_room = UtilizationPlan(1 << 20, 64, "test"), room
    return sizing


def test_the_memory_check_counts_only_the_graphs_max_graphs_keeps():
    c = controller()
    c.graph_set = graphs(f1=1000, p1=1000)  # 1000 B a row in each mode
    sizing = sized(room=10_000)
    sizing.check_graphs_fit(c, policy(max_graphs=3), TrafficHistogram())  # FULL 2, FULL 1, PIECEWISE 1: 4000 B
    with pytest.raises(PolicyError, match="room for 10000 B"):
        sizing.check_graphs_fit(c, policy(), TrafficHistogram())  # all eight keys: 38000 B


def test_the_memory_check_prices_a_key_by_what_its_capture_reserved_when_that_is_more():
    """Graph memory counts the pool alone; a capture also reserves its stream's workspaces beside
    it, which the room (device memory) must hold too."""
    c = controller()
    c.graph_set = graphs(reserved=3000, f1=1000, p1=1000)  # 3000 B a row in each mode
    sized(room=12_000).check_graphs_fit(c, policy(max_graphs=3), TrafficHistogram())  # 4 rows: 12000 B
    with pytest.raises(PolicyError, match="room for 11999 B"):
        sized(room=11_999).check_graphs_fit(c, policy(max_graphs=3), TrafficHistogram())


def test_the_memory_check_keeps_the_keys_the_traffic_would_keep():
    c = controller()
    c.graph_set = graphs(f1=1000, p1=1000)
    traffic = TrafficHistogram()
    for _ in range(100):
        traffic.count(15, 3, False)  # mixed steps that pad to PIECEWISE 16
    with pytest.raises(PolicyError, match="about 18000 B"):
        sized(room=10_000).check_graphs_fit(c, policy(max_graphs=3), traffic)


def test_without_track_b_or_graphs_the_memory_check_passes():
    c = controller()
    UtilizationSizing(0.9).check_graphs_fit(c, policy(), TrafficHistogram())  # no plan yet
    sized(room=0).check_graphs_fit(c, policy(), TrafficHistogram())  # no graphs captured
    c.graph_set = graphs(f1=1000)
    sized(room=0).check_graphs_fit(c, policy(M.GRAPH_MODE_NONE), TrafficHistogram())


def test_track_a_starts_with_the_sized_cache_and_reports_explicit():
    sizing = UtilizationSizing(0)
    settings = EngineSettings(max_seq_len=100, kv_block_size=16)
    assert sizing.provisional_blocks(settings, 40) == 40 and sizing.label == "explicit"
    assert UtilizationSizing(0.5).provisional_blocks(settings, 40) == 7  # one context of 112 rows
    status = pb.KVCacheStatus()
    assert sizing.report(status) is status and status.planned_bytes == 0


# --- the --gpu-memory-utilization rules, once ----------------------------------------------------


@pytest.mark.parametrize(("utilization", "device", "kv_memory", "needle"), [
    (None, "cpu", "", None),
    (0.9, "cuda:0", "", None),
    (0.9, "cpu", "", "it needs --device cuda"),
    (0.9, "cuda", "2Gi", "give one"),
    (1.5, "cuda", "", "must be a fraction in (0, 1]"),
    (0, "cuda", "", "must be a fraction in (0, 1]"),
])
def test_the_utilization_rules(utilization, device, kv_memory, needle):
    error = utilization_error(utilization, device, kv_memory)
    assert error is None if needle is None else needle in error


def test_the_engine_applies_the_same_rules_before_loading_anything():
    with pytest.raises(ValueError, match="it needs --device cuda"):
        Engine(EngineSettings(model="random:tiny", gpu_memory_utilization=0.5))
    with pytest.raises(ValueError, match="give one"):
        Engine(EngineSettings(model="random:tiny", device="cuda", gpu_memory_utilization=0.5,
                              kv_cache_memory=1 << 30))


# --- admission's queue count -------------------------------------------------------------------


def test_queued_counts_what_waits_beyond_the_free_slots():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=0)
    assert s.queued(3) == 0 and s.queued(5) == 1
    s.waiting.extend(Sequence(request_id=str(i), tenant="", prompt=[1, 2], max_new_tokens=4,
                              sampling=SamplingSpec()) for i in range(2))
    assert s.queued(3) == 1 and s.queued() == 0
