"""The dispatcher's decisions (pure): a graph step pads to the captured size that fits, and an eager
step carries exactly one fallback reason, the first in a fixed order; every reason the proto
declares has a case."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import padding_table
from graphkeeper.worker.executor.graphs.dispatcher import (
    FULL,
    NONE,
    PIECEWISE,
    BatchDescriptor,
    Decision,
    Dispatcher,
    GraphState,
    decide,
)

R = pb.FallbackReason

LADDER = (1, 2, 4, 8, 16)
TABLE = padding_table(list(LADDER))
DECODE3 = BatchDescriptor(num_tokens=3, uniform_decode=True, graphs_allowed=True)
MIXED5 = BatchDescriptor(num_tokens=5, uniform_decode=False, graphs_allowed=True)


def _captured(*pairs):
    return frozenset(pairs)


ALL_CAPTURED = _captured(*[(FULL, n) for n in (1, 2, 4)], *[(PIECEWISE, n) for n in LADDER])
READY = GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER, captured=ALL_CAPTURED)

# One case per reason the proto lists: (descriptor, state, expected reason).
REASON_CASES = {
    "backend_unsupported": (DECODE3, GraphState(backend_unsupported=True, ladder=LADDER),
                            R.FALLBACK_REASON_BACKEND_UNSUPPORTED),
    "recapturing": (DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER,
                                        recapturing=True), R.FALLBACK_REASON_RECAPTURING),
    "mode_none": (DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_NONE, ladder=LADDER),
                  R.FALLBACK_REASON_MODE_EXCLUDES_STEP),
    "full_decode_only_mixed_step": (
        MIXED5, GraphState(effective_mode=pb.GRAPH_MODE_FULL_DECODE_ONLY, ladder=LADDER,
                           captured=_captured((FULL, 8))), R.FALLBACK_REASON_MODE_EXCLUDES_STEP),
    "full_mixed_step": (MIXED5, GraphState(effective_mode=pb.GRAPH_MODE_FULL, ladder=LADDER,
                                           captured=_captured((FULL, 8))),
                        R.FALLBACK_REASON_MODE_EXCLUDES_STEP),
    "tenant_disabled": (DECODE3._replace(graphs_allowed=False), READY, R.FALLBACK_REASON_TENANT_DISABLED),
    "exceeds_max_capture_size": (MIXED5._replace(num_tokens=17), READY,
                                 R.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE),
    "compute_bound": (MIXED5._replace(num_tokens=17),
                      GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER,
                                 captured=ALL_CAPTURED, compute_bound_above=True),
                      R.FALLBACK_REASON_COMPUTE_BOUND),
    "no_ladder": (DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_PIECEWISE, ladder=()),
                  R.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE),
    "size_over_budget": (
        MIXED5, GraphState(effective_mode=pb.GRAPH_MODE_PIECEWISE, ladder=LADDER,
                           captured=_captured((PIECEWISE, 1), (PIECEWISE, 2), (PIECEWISE, 4)),
                           skipped={(PIECEWISE, 8): R.FALLBACK_REASON_SIZE_OVER_BUDGET,
                                    (PIECEWISE, 16): R.FALLBACK_REASON_SIZE_OVER_BUDGET}),
        R.FALLBACK_REASON_SIZE_OVER_BUDGET),
    "size_capture_failed": (
        DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_FULL_DECODE_ONLY, ladder=LADDER,
                            captured=_captured((FULL, 1), (FULL, 2)),
                            skipped={(FULL, 4): R.FALLBACK_REASON_SIZE_CAPTURE_FAILED}),
        R.FALLBACK_REASON_SIZE_CAPTURE_FAILED),
    "size_over_max_graphs": (
        MIXED5, GraphState(effective_mode=pb.GRAPH_MODE_PIECEWISE, ladder=LADDER,
                           captured=_captured((PIECEWISE, 1), (PIECEWISE, 16)),
                           skipped={(PIECEWISE, n): R.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS for n in (2, 4, 8)}),
        R.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS),
    "graph_released_idle": (
        DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_FULL_DECODE_ONLY, ladder=LADDER,
                            captured=_captured((FULL, 1), (FULL, 2)), released=_captured((FULL, 4))),
        R.FALLBACK_REASON_GRAPH_RELEASED_IDLE),
    "size_missing_without_record": (
        DECODE3, GraphState(effective_mode=pb.GRAPH_MODE_FULL_DECODE_ONLY, ladder=LADDER,
                            captured=_captured((FULL, 1))), R.FALLBACK_REASON_SIZE_CAPTURE_FAILED),
}


@pytest.mark.parametrize("case", sorted(REASON_CASES))
def test_dispatcher_reason(case):
    desc, state, reason = REASON_CASES[case]
    decision = decide(desc, state, padding_table(list(state.ladder)))
    assert decision == Decision(NONE, desc.num_tokens, reason)
    assert decision.eager


def test_every_fallback_reason_has_a_dispatcher_case():
    covered = {reason for _, _, reason in REASON_CASES.values()}
    declared = set(R.values()) - {R.FALLBACK_REASON_UNSPECIFIED}
    assert covered == declared


def test_a_released_graph_falls_back_to_a_captured_piecewise_one():
    # The FULL graph of 4 was released while idle; the PIECEWISE graph of 4 still serves the step.
    state = GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER,
                       captured=ALL_CAPTURED - {(FULL, 4)}, released=_captured((FULL, 4)))
    assert decide(DECODE3, state, TABLE) == Decision(PIECEWISE, 4)
    gone = GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER,
                      captured=ALL_CAPTURED - {(FULL, 4), (PIECEWISE, 4)},
                      released=_captured((FULL, 4), (PIECEWISE, 4)))
    assert decide(DECODE3, gone, TABLE) == Decision(NONE, 3, R.FALLBACK_REASON_GRAPH_RELEASED_IDLE)


def test_reasons_are_checked_in_a_fixed_order():
    # A step with every problem at once gets exactly one reason: the first in the order.
    bad = BatchDescriptor(num_tokens=100, uniform_decode=False, graphs_allowed=False)
    everything = GraphState(effective_mode=pb.GRAPH_MODE_NONE, ladder=LADDER,
                            backend_unsupported=True, recapturing=True)
    assert decide(bad, everything, TABLE).reason == R.FALLBACK_REASON_BACKEND_UNSUPPORTED
    no_backend_issue = GraphState(effective_mode=pb.GRAPH_MODE_NONE, ladder=LADDER, recapturing=True)
    assert decide(bad, no_backend_issue, TABLE).reason == R.FALLBACK_REASON_RECAPTURING
    mode_none = GraphState(effective_mode=pb.GRAPH_MODE_NONE, ladder=LADDER)
    assert decide(bad, mode_none, TABLE).reason == R.FALLBACK_REASON_MODE_EXCLUDES_STEP
    assert decide(bad, READY, TABLE).reason == R.FALLBACK_REASON_TENANT_DISABLED
    assert decide(bad._replace(graphs_allowed=True), READY, TABLE).reason == (
        R.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE)


def test_graph_decisions_pad_to_the_captured_size():
    assert decide(DECODE3, READY, TABLE) == Decision(FULL, 4)
    assert decide(MIXED5, READY, TABLE) == Decision(PIECEWISE, 8)
    exact = BatchDescriptor(16, True, True)
    # No FULL graph of 16 (decode buckets stop at max_num_seqs): PIECEWISE serves the decode step.
    assert decide(exact, READY, TABLE) == Decision(PIECEWISE, 16)
    piecewise_only = GraphState(effective_mode=pb.GRAPH_MODE_PIECEWISE, ladder=LADDER,
                                captured=_captured(*[(PIECEWISE, n) for n in LADDER]))
    assert decide(DECODE3, piecewise_only, TABLE) == Decision(PIECEWISE, 4)
    full_only = GraphState(effective_mode=pb.GRAPH_MODE_FULL, ladder=LADDER, captured=_captured((FULL, 4)))
    assert decide(DECODE3, full_only, TABLE) == Decision(FULL, 4)
    for decision in (decide(DECODE3, READY, TABLE), decide(MIXED5, READY, TABLE)):
        assert not decision.eager
        assert decision.reason == R.FALLBACK_REASON_UNSPECIFIED


def test_dispatcher_default_state_is_backend_unsupported():
    dispatcher = Dispatcher()
    assert dispatcher.dispatch(DECODE3).reason == R.FALLBACK_REASON_BACKEND_UNSUPPORTED
    dispatcher.update(READY)
    assert dispatcher.dispatch(DECODE3) == Decision(FULL, 4)
    assert dispatcher.table == TABLE
