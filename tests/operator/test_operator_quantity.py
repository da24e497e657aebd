"""memoryBudget is parsed as a Kubernetes quantity, exactly (integer bytes, never a float), by
the same rule as the CRD's: both are held to ``tests/memory_budget_cases.py``."""

from __future__ import annotations

import pytest
from memory_budget_cases import ACCEPTED, REFUSED  # tests/, shared with tests/cluster/test_crd.py

from graphkeeper.proto.policy import PolicyError, parse_quantity, policy_from_spec


@pytest.mark.parametrize(("value", "expected"), ACCEPTED, ids=[repr(v) for v, _ in ACCEPTED])
def test_a_quantity_is_exact_integer_bytes(value, expected):
    assert parse_quantity(value) == expected


@pytest.mark.parametrize("value", REFUSED, ids=[repr(v) for v in REFUSED])
def test_a_quantity_that_is_not_whole_bytes_in_range_is_refused_naming_the_field(value):
    with pytest.raises(PolicyError) as caught:
        parse_quantity(value)
    assert caught.value.field == "memoryBudget"


def test_the_wire_policy_carries_the_exact_budget():
    spec = {"selector": {"matchLabels": {"a": "b"}}, "memoryBudget": "1.5Gi"}
    assert policy_from_spec(spec, uid="u", name="n", generation=1).memory_budget_bytes == 1_610_612_736


@pytest.mark.parametrize("value", [2**63, "8Ei", "1.1Gi"])
def test_a_budget_the_crd_would_refuse_is_reported_under_spec_memory_budget(value):
    """A stale CRD may let these through; the operator names the field, not spec.rollout."""
    spec = {"selector": {"matchLabels": {"a": "b"}}, "memoryBudget": value}
    with pytest.raises(PolicyError) as caught:
        policy_from_spec(spec, uid="u", name="n", generation=1)
    assert caught.value.field == "spec.memoryBudget"
    assert str(caught.value).startswith("spec.memoryBudget")
