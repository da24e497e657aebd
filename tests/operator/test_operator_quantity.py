"""memoryBudget is parsed as a Kubernetes quantity, exactly (integer bytes, never a float)."""

from __future__ import annotations

import pytest

from graphkeeper.proto.policy import PolicyError, parse_quantity, policy_from_spec


@pytest.mark.parametrize(("text", "expected"), [
    ("1.001k", 1001), ("1024", 1024), ("256Mi", 256 * 2**20), ("1.5Gi", 3 * 2**29),
    ("0.5Ki", 512), ("2G", 2 * 10**9), ("9007199254740993", 9007199254740993),
    ("8.000000000000001E", 8000000000000001000), (4096, 4096),
])
def test_a_quantity_is_exact_integer_bytes(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["1.5", "0.0001k", "1.0001k", "100m", "lots", "1e9", -1])
def test_a_quantity_that_is_not_whole_bytes_is_refused(text):
    with pytest.raises(PolicyError):
        parse_quantity(text)


def test_the_wire_policy_carries_the_exact_budget():
    spec = {"selector": {"matchLabels": {"a": "b"}}, "memoryBudget": "1.001k"}
    assert policy_from_spec(spec, uid="u", name="n", generation=1).memory_budget_bytes == 1001
