"""GraphPolicy validation (pure): a bad policy or CRD spec is refused naming the exact field, a good
one builds the wire message, quantities parse, the policy file round-trips, and label names are
the short lower-case forms."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name, reason_name
from graphkeeper.proto.policy import (
    PolicyError,
    disabled_tenants,
    parse_quantity,
    policy_from_json,
    policy_from_spec,
    policy_to_json,
    tenant_allows_graphs,
    validate_policy,
)

R = pb.FallbackReason


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
    (dict(default_tenant_graphs=9), "default_tenant_graphs"),
    (dict(default_tenant_graphs=-1), "default_tenant_graphs"),
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
    ceiling = _policy(capture_sizes=_explicit(8, 64, max_size=8192))
    validate_policy(ceiling)
    with pytest.raises(PolicyError) as err:
        validate_policy(ceiling, max_num_batched_tokens=512)
    assert err.value.field == "capture_sizes.max_capture_size" and "token budget" in err.value.message
    validate_policy(_policy(capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT, max_capture_size=8192)),
                    max_num_batched_tokens=512)  # a ladder's ceiling is only a cap: the budget cuts it anyway


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
