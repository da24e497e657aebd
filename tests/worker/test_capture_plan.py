"""The capture plan and the capture controller on the CPU: the plan lists FULL sizes, then PIECEWISE
ones, largest first, with FULL graphs only up to the size a full decode batch pads to; a controller
that begins on a CPU plans no capture and tells the dispatcher that the backend cannot record."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_has_full, mode_has_graphs, mode_has_piecewise
from graphkeeper.proto.policy import default_ladder
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.dispatcher import FULL, PIECEWISE, BatchDescriptor, Dispatcher, GraphState
from graphkeeper.worker.executor.graphs.modes import capture_plan
from graphkeeper.worker.metrics import WorkerMetrics

M = pb.GraphMode
R = pb.FallbackReason
LADDER = [1, 2, 4, 8, 16]
DECODE3 = BatchDescriptor(num_tokens=3, uniform_decode=True, graphs_allowed=True)

# --- the plan -----------------------------------------------------------------------------------


def test_full_and_piecewise_plans_full_sizes_then_piecewise_sizes_largest_first():
    assert capture_plan(M.GRAPH_MODE_FULL_AND_PIECEWISE, LADDER, 4) == [
        (FULL, 4), (FULL, 2), (FULL, 1), (PIECEWISE, 16), (PIECEWISE, 8), (PIECEWISE, 4), (PIECEWISE, 2),
        (PIECEWISE, 1)]


def test_full_graphs_stop_at_the_size_a_full_decode_batch_pads_to():
    assert capture_plan(M.GRAPH_MODE_FULL_DECODE_ONLY, LADDER, 5) == [(FULL, 8), (FULL, 4), (FULL, 2), (FULL, 1)]
    assert capture_plan(M.GRAPH_MODE_FULL, LADDER, 16) == [(FULL, n) for n in reversed(LADDER)]
    assert capture_plan(M.GRAPH_MODE_FULL, LADDER, 64) == [(FULL, n) for n in reversed(LADDER)]
    assert capture_plan(M.GRAPH_MODE_FULL, [3, 17], 1) == [(FULL, 3)]


def test_piecewise_plans_the_whole_ladder_and_none_plans_nothing():
    assert capture_plan(M.GRAPH_MODE_PIECEWISE, LADDER, 4) == [(PIECEWISE, n) for n in reversed(LADDER)]
    assert capture_plan(M.GRAPH_MODE_NONE, LADDER, 4) == []
    assert capture_plan(M.GRAPH_MODE_FULL_AND_PIECEWISE, [], 4) == []


def test_the_default_ladder_plans_each_key_once():
    plan = capture_plan(M.GRAPH_MODE_FULL_AND_PIECEWISE, default_ladder(512), 256)
    assert len(plan) == len(set(plan)) == 3 + 32 + 51  # FULL 1, 2, 4, 8..256 by 8; PIECEWISE the whole ladder


@pytest.mark.parametrize(("mode", "full", "piecewise"), [
    (M.GRAPH_MODE_NONE, False, False), (M.GRAPH_MODE_PIECEWISE, False, True), (M.GRAPH_MODE_FULL, True, False),
    (M.GRAPH_MODE_FULL_DECODE_ONLY, True, False), (M.GRAPH_MODE_FULL_AND_PIECEWISE, True, True),
])
def test_which_runtime_modes_a_policy_mode_records(mode, full, piecewise):
    assert (mode_has_full(mode), mode_has_piecewise(mode)) == (full, piecewise)
    assert mode_has_graphs(mode) == (full or piecewise)


def test_every_graph_mode_but_none_records_graphs():
    assert {m for m in M.values() if not mode_has_graphs(m)} == {M.GRAPH_MODE_UNSPECIFIED, M.GRAPH_MODE_NONE}


# --- the controller on a CPU --------------------------------------------------------------------


def controller() -> CaptureController:
    # The dispatcher starts as if a recapture were under way, so that ``begin`` must replace its state.
    dispatcher = Dispatcher(GraphState(effective_mode=M.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=(1, 2, 4),
                                       recapturing=True))
    return CaptureController(dispatcher, WorkerMetrics(), max_num_seqs=4, max_num_batched_tokens=64,
                             inject_failures=frozenset())


def policy(mode: int = M.GRAPH_MODE_FULL_AND_PIECEWISE) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="u", generation=1, mode=mode, memory_budget_bytes=1 << 20,
                          capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT))


def test_begin_on_a_cpu_plans_no_job_and_dispatches_backend_unsupported(runner):
    c = controller()
    c.begin(policy(), runner)
    assert c.job is None and not c.active and c.graph_set is None
    state = c.dispatcher.state
    assert state.backend_unsupported and not state.recapturing and not state.captured
    assert state.ladder == tuple(default_ladder(64)) == tuple(c.ladder)
    assert c.dispatcher.dispatch(DECODE3).reason == R.FALLBACK_REASON_BACKEND_UNSUPPORTED


def test_begin_on_a_cpu_reports_the_requested_mode_and_why_none_is_effective(runner):
    c = controller()
    c.begin(policy(M.GRAPH_MODE_UNSPECIFIED), runner)
    assert c.requested_mode == M.GRAPH_MODE_FULL_AND_PIECEWISE
    assert c.effective_mode == M.GRAPH_MODE_NONE
    assert "CUDA" in c.downgrade_reason
    m = c.metrics
    assert m.graph_mode.labels("requested", "full_and_piecewise")._value.get() == 1
    assert m.graph_mode.labels("effective", "none")._value.get() == 1
    assert m.graph_memory_budget._value.get() == 1 << 20


def test_running_without_a_job_captures_nothing_and_keeps_the_dispatcher_state(runner):
    c = controller()
    c.begin(policy(), runner)
    state = c.dispatcher.state
    c.run_all()
    assert c.dispatcher.state is state
    assert c.captured_count() == 0 and c.total_seconds == 0.0 and c.last_failure == ""
    assert c.summary() == ("requested full_and_piecewise, effective none (no CUDA device: graphs cannot be "
                           "recorded); 0 graphs captured in 0.00 s")


def test_hold_eager_dispatches_recapturing_until_the_next_begin(runner):
    c = controller()
    c.begin(policy(), runner)
    c.hold_eager()
    assert c.dispatcher.dispatch(DECODE3).reason == R.FALLBACK_REASON_RECAPTURING
    c.release()
    assert c.graph_set is None and c.metrics.graph_memory._value.get() == 0
    c.begin(policy(M.GRAPH_MODE_PIECEWISE), runner)
    assert c.dispatcher.dispatch(DECODE3).reason == R.FALLBACK_REASON_BACKEND_UNSUPPORTED
