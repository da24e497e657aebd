"""Issue 4, CPU: capture-size ladders, the padding table, the dispatcher's reasons, mode downgrade,
the lifecycle state machine and policy validation, as pure functions."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    PolicyError,
    default_ladder,
    default_max_capture_size,
    disabled_tenants,
    interactivity_ladder,
    mode_name,
    padding_table,
    parse_quantity,
    policy_from_json,
    policy_from_spec,
    policy_to_json,
    reason_name,
    resolve_capture_sizes,
    tenant_allows_graphs,
    validate_policy,
)
from graphkeeper.worker.engine.lifecycle import (
    ALLOWED,
    SERVING_STATES,
    IllegalTransition,
    Lifecycle,
    check_transition,
)
from graphkeeper.worker.engine.recorder import StepRecorder
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
from graphkeeper.worker.executor.graphs.modes import downgrade_mode, full_sizes
from graphkeeper.worker.metrics import WorkerMetrics

R = pb.FallbackReason
S = pb.LifecycleState
ALL_MODES = [m for m in pb.GraphMode.values() if m != pb.GRAPH_MODE_UNSPECIFIED]

# --- ladders ------------------------------------------------------------------------------------


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


def test_full_sizes_are_the_decode_buckets():
    assert full_sizes(default_ladder(8), 4) == [1, 2, 4]
    assert full_sizes(default_ladder(512), 3) == [1, 2, 4]
    assert full_sizes([5, 10], 7) == [5, 10]
    assert full_sizes([], 4) == []


# --- the dispatcher -----------------------------------------------------------------------------

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


def test_recorder_counts_every_decision_once_for_status_metrics_and_requests():
    dispatcher, recorder = Dispatcher(READY), StepRecorder(WorkerMetrics())
    recorder.listed_tenants = frozenset({"gold"})
    steps = [DECODE3, DECODE3, MIXED5, MIXED5._replace(num_tokens=40),
             DECODE3._replace(graphs_allowed=False)]
    seq = SimpleNamespace(graph_steps=Counter(), eager_steps=Counter())
    decisions = [dispatcher.dispatch(d) for d in steps]
    for desc, decision in zip(steps, decisions, strict=True):
        recorder.record(decision, desc, [seq], {"gold", "other"}, 0.001)
    assert [d.mode for d in decisions] == [FULL, FULL, PIECEWISE, NONE, NONE]
    assert recorder.graph_steps == seq.graph_steps == {(FULL, 4): 2, (PIECEWISE, 8): 1}
    assert recorder.eager_steps == seq.eager_steps == {R.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE: 1,
                                                       R.FALLBACK_REASON_TENANT_DISABLED: 1}
    assert recorder.real_tokens == 3 + 3 + 5 + 40 + 3
    assert recorder.padded_tokens == 4 + 4 + 8 + 40 + 3
    m = recorder.metrics
    assert m.padded_tokens._value.get() == recorder.padded_tokens
    assert m.tenant_steps.labels("gold", "graph")._value.get() == 3
    assert m.tenant_steps.labels("gold", "eager")._value.get() == 2


def test_dispatcher_default_state_is_backend_unsupported():
    dispatcher = Dispatcher()
    assert dispatcher.dispatch(DECODE3).reason == R.FALLBACK_REASON_BACKEND_UNSUPPORTED
    dispatcher.update(READY)
    assert dispatcher.dispatch(DECODE3) == Decision(FULL, 4)
    assert dispatcher.table == TABLE


# --- mode downgrade -----------------------------------------------------------------------------

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


# --- lifecycle ----------------------------------------------------------------------------------

HAPPY_PATH = [S.LIFECYCLE_STATE_LOADING, S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_WARMED,
              S.LIFECYCLE_STATE_CAPTURED, S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING,
              S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING, S.LIFECYCLE_STATE_DRAINING]
STATES = [s for s in S.values() if s != S.LIFECYCLE_STATE_UNSPECIFIED]
LEGAL = {(a, b) for a, b in zip(HAPPY_PATH, HAPPY_PATH[1:], strict=False)} | {
    (s, S.LIFECYCLE_STATE_DRAINING) for s in STATES if s != S.LIFECYCLE_STATE_DRAINING}


def test_lifecycle_happy_path_and_listeners():
    seen = []
    lifecycle = Lifecycle()
    lifecycle.subscribe(seen.append)
    for state in HAPPY_PATH[1:]:
        lifecycle.move(state)
    assert seen == HAPPY_PATH
    assert lifecycle.state == S.LIFECYCLE_STATE_DRAINING
    assert not lifecycle.serving


@pytest.mark.parametrize("current", STATES, ids=lambda s: S.Name(s))
def test_lifecycle_transition_table(current):
    for new in STATES:
        if (current, new) in LEGAL:
            check_transition(current, new)
        else:
            with pytest.raises(IllegalTransition, match="is not a lifecycle transition"):
                check_transition(current, new)
    assert {n for c, n in LEGAL if c == current} == set(ALLOWED[current])


def test_illegal_move_leaves_the_state_alone():
    lifecycle = Lifecycle()
    with pytest.raises(IllegalTransition, match="LOADING -> READY"):
        lifecycle.move(S.LIFECYCLE_STATE_READY)
    assert lifecycle.state == S.LIFECYCLE_STATE_LOADING


def test_only_ready_and_recapturing_serve():
    assert {S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING} == SERVING_STATES


# --- policy validation --------------------------------------------------------------------------


def _policy(**kwargs) -> pb.GraphPolicy:
    base = dict(policy_uid="uid-1", policy_name="ns/p", generation=1, mode=pb.GRAPH_MODE_FULL,
                capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT))
    return pb.GraphPolicy(**(base | kwargs))


def _explicit(*sizes, max_size=0):
    return pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=list(sizes)), max_capture_size=max_size)


T = pb.TenantToggle
BAD_POLICIES = [
    (dict(policy_uid=""), "policy_uid"),
    (dict(generation=0), "generation"),
    (dict(mode=42), "mode"),
    (dict(capture_sizes=pb.CaptureSizes(max_capture_size=-1)), "capture_sizes.max_capture_size"),
    (dict(capture_sizes=pb.CaptureSizes(max_capture_size=9000)), "capture_sizes.max_capture_size"),
    (dict(capture_sizes=pb.CaptureSizes(ladder=9)), "capture_sizes.ladder"),
    (dict(capture_sizes=_explicit()), "capture_sizes.explicit.sizes"),
    (dict(capture_sizes=_explicit(*range(1, 258))), "capture_sizes.explicit.sizes"),
    (dict(capture_sizes=_explicit(4, 0)), "capture_sizes.explicit.sizes[1]"),
    (dict(capture_sizes=_explicit(4, 8, 4)), "capture_sizes.explicit.sizes[2]"),
    (dict(capture_sizes=_explicit(4, 64, max_size=32)), "capture_sizes.explicit.sizes[1]"),
    (dict(memory_budget_bytes=-5), "memory_budget_bytes"),
    (dict(tenants=[T(tenant="Bad_Name", graphs=pb.TENANT_GRAPHS_DISABLED)]), "tenants[0].tenant"),
    (dict(tenants=[T(tenant="a", graphs=pb.TENANT_GRAPHS_DISABLED),
                   T(tenant="a", graphs=pb.TENANT_GRAPHS_ENABLED)]), "tenants[1].tenant"),
    (dict(tenants=[T(tenant="a")]), "tenants[0].graphs"),
    (dict(tenants=[T(tenant=f"t{i}", graphs=1) for i in range(257)]), "tenants"),
]


@pytest.mark.parametrize(("change", "field"), BAD_POLICIES, ids=[f for _, f in BAD_POLICIES])
def test_validate_policy_names_the_field(change, field):
    with pytest.raises(PolicyError) as err:
        validate_policy(_policy(**change))
    assert err.value.field == field
    assert str(err.value).startswith(field + ": ")


def test_validate_policy_accepts_good_policies():
    validate_policy(_policy())
    validate_policy(_policy(mode=pb.GRAPH_MODE_UNSPECIFIED, capture_sizes=_explicit(1, 2, 64),
                            memory_budget_bytes=1 << 30,
                            tenants=[T(tenant="team-a", graphs=pb.TENANT_GRAPHS_DISABLED)]))


def test_worker_refuses_sizes_beyond_its_token_budget():
    policy = _policy(capture_sizes=_explicit(8, 128))
    validate_policy(policy)
    with pytest.raises(PolicyError) as err:
        validate_policy(policy, max_num_batched_tokens=64)
    assert err.value.field == "capture_sizes.explicit.sizes[1]"
    assert "token budget" in err.value.message


BAD_SPECS = [
    ({"mode": "Sometimes"}, "spec.mode"),
    ({"captureSizes": {"sizes": [1], "ladder": "Default"}}, "spec.captureSizes"),
    ({"captureSizes": {"ladder": "Fast"}}, "spec.captureSizes.ladder"),
    ({"captureSizes": {"sizes": [1, 0]}}, "spec.captureSizes.sizes[1]"),
    ({"captureSizes": {"sizes": []}}, "spec.captureSizes.sizes"),
    ({"captureSizes": {"maxCaptureSize": 9000}}, "spec.captureSizes.maxCaptureSize"),
    ({"memoryBudget": "lots"}, "spec.memoryBudget"),
    ({"memoryBudget": "100m"}, "spec.memoryBudget"),
    ({"memoryBudget": -1}, "spec.memoryBudget"),
    ({"defaultTenantGraphs": "Maybe"}, "spec.defaultTenantGraphs"),
    ({"tenants": [{"name": "a", "graphs": "Off"}]}, "spec.tenants[0].graphs"),
    ({"tenants": [{"name": "Not A Label", "graphs": "Disabled"}]}, "spec.tenants[0].name"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]}, "spec.tenants[1].name"),
]


@pytest.mark.parametrize(("spec", "field"), BAD_SPECS, ids=[f for _, f in BAD_SPECS])
def test_policy_from_spec_names_the_crd_field(spec, field):
    with pytest.raises(PolicyError) as err:
        policy_from_spec(spec, uid="u", name="ns/p", generation=3)
    assert err.value.field == field


def test_policy_from_spec_builds_the_wire_message():
    spec = {"mode": "FullDecodeOnly", "captureSizes": {"sizes": [8, 1, 4], "maxCaptureSize": 16},
            "memoryBudget": "256Mi", "defaultTenantGraphs": "Disabled",
            "tenants": [{"name": "team-a", "graphs": "Enabled"}, {"name": "batch", "graphs": "Disabled"}]}
    policy = policy_from_spec(spec, uid="u-1", name="ns/p", generation=3)
    assert (policy.policy_uid, policy.policy_name, policy.generation) == ("u-1", "ns/p", 3)
    assert policy.mode == pb.GRAPH_MODE_FULL_DECODE_ONLY
    assert list(policy.capture_sizes.explicit.sizes) == [8, 1, 4]
    assert policy.capture_sizes.max_capture_size == 16
    assert policy.memory_budget_bytes == 256 * 2**20
    assert policy.default_tenant_graphs == pb.TENANT_GRAPHS_DISABLED
    assert tenant_allows_graphs(policy, "team-a")
    assert not tenant_allows_graphs(policy, "batch")
    assert not tenant_allows_graphs(policy, "anyone-else")
    assert disabled_tenants(policy) == {"batch"}
    defaults = policy_from_spec({}, uid="u", name="n", generation=1)
    assert defaults.mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE
    assert defaults.capture_sizes.ladder == pb.CAPTURE_LADDER_DEFAULT
    assert tenant_allows_graphs(defaults, "anyone")


@pytest.mark.parametrize(("text", "expected"), [
    ("1024", 1024), ("1Ki", 1024), ("256Mi", 256 * 2**20), ("1G", 10**9), ("1.5Gi", 3 * 2**29), (7, 7),
])
def test_parse_quantity(text, expected):
    assert parse_quantity(text) == expected


def test_policy_file_round_trip_and_errors():
    policy = _policy(generation=7, capture_sizes=_explicit(1, 4),
                     tenants=[T(tenant="a", graphs=pb.TENANT_GRAPHS_DISABLED)])
    assert policy_from_json(policy_to_json(policy)) == policy
    with pytest.raises(PolicyError) as err:
        policy_from_json("{not json")
    assert err.value.field == "policy_file"
    with pytest.raises(PolicyError) as err:
        policy_from_json(policy_to_json(_policy(generation=0)))
    assert err.value.field == "generation"


def test_label_names():
    assert mode_name(pb.GRAPH_MODE_FULL_AND_PIECEWISE) == "full_and_piecewise"
    assert mode_name(pb.GRAPH_MODE_NONE) == "none"
    assert reason_name(R.FALLBACK_REASON_TENANT_DISABLED) == "tenant_disabled"
    assert reason_name(R.FALLBACK_REASON_BACKEND_UNSUPPORTED) == "backend_unsupported"


def test_moves_after_draining_began_are_ignored():
    # Shutdown can start while the engine thread is still capturing; its next move must not crash it.
    lifecycle = Lifecycle()
    lifecycle.move(S.LIFECYCLE_STATE_MODEL_LOADED)
    lifecycle.move(S.LIFECYCLE_STATE_DRAINING)
    lifecycle.move(S.LIFECYCLE_STATE_WARMED)
    assert lifecycle.state == S.LIFECYCLE_STATE_DRAINING
