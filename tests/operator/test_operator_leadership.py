"""Which replica may take the Lease, on its own clock (``operator/leadership.py``), without a cluster.
The hand-over itself, with two operator processes and a ``kill -9``, is tests/cluster/test_leadership.py."""

from __future__ import annotations

from graphkeeper.operator.leadership import LEASE_SECONDS, Seen, may_take, observe


def test_a_free_or_own_lease_is_taken_at_once_and_a_held_one_only_once_it_stopped_moving():
    fresh = observe(None, "41", now=100.0)
    assert may_take("", "b", fresh, now=100.0, duration=LEASE_SECONDS), "free"
    assert may_take("b", "b", fresh, now=100.0, duration=LEASE_SECONDS), "ours already"
    assert not may_take("a", "b", fresh, now=100.0 + LEASE_SECONDS, duration=LEASE_SECONDS), "a renews in time"
    assert may_take("a", "b", fresh, now=100.1 + LEASE_SECONDS, duration=LEASE_SECONDS), "a stopped renewing"


def test_a_renewal_seen_restarts_the_standbys_clock_and_the_holders_clock_is_never_read():
    seen = observe(None, "41", now=100.0)
    assert observe(seen, "41", now=105.0) == seen, "unchanged: the clock keeps running from the first sight"
    renewed = observe(seen, "42", now=107.0)
    assert renewed == Seen("42", 107.0)
    assert not may_take("a", "b", renewed, now=100.0 + LEASE_SECONDS + 1, duration=LEASE_SECONDS)
