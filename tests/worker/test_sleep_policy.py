"""Sleep after idle (pure): when the policy's ``sleep_after_idle_seconds`` puts a worker to sleep,
how the field is validated (wire and CRD spelling), and that it never changes what is captured."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    MAX_SLEEP_AFTER_IDLE_SECONDS,
    PolicyError,
    policy_from_json,
    policy_from_spec,
    policy_to_json,
    recapture_key,
    sleep_level,
    validate_policy,
)
from graphkeeper.worker.engine.control import Control, default_policy
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.sleep_policy import idle_start, seconds_until_sleep, sleep_due

LIMITS = (16, 256)  # (max_num_seqs, max_num_batched_tokens) of a worker


# --- the decision --------------------------------------------------------------------------------


def test_sleep_after_idle_zero_never_sleeps():
    assert not sleep_due(0, idle_since=0.0, now=10**9, asleep=False, requests=0)
    assert seconds_until_sleep(0, 0.0, 10**9) is None


def test_a_worker_idle_less_than_the_time_stays_awake():
    assert not sleep_due(300, idle_since=1000.0, now=1299.5, asleep=False, requests=0)
    assert seconds_until_sleep(300, 1000.0, 1299.5) == pytest.approx(0.5)


def test_a_worker_idle_for_the_time_goes_to_sleep():
    assert sleep_due(300, idle_since=1000.0, now=1300.0, asleep=False, requests=0)
    assert sleep_due(300, idle_since=1000.0, now=5000.0, asleep=False, requests=0)
    assert seconds_until_sleep(300, 1000.0, 5000.0) == 0.0


def test_a_sleeping_worker_is_not_put_to_sleep_again():
    assert not sleep_due(300, idle_since=1000.0, now=5000.0, asleep=True, requests=0)


def test_a_running_or_queued_request_keeps_the_worker_awake():
    assert not sleep_due(300, idle_since=1000.0, now=5000.0, asleep=False, requests=1)
    assert not sleep_due(300, idle_since=None, now=5000.0, asleep=False, requests=0)  # not idle yet


def test_the_idle_spell_starts_at_the_first_idle_look_and_ends_with_a_request():
    assert idle_start(None, requests=2, now=10.0) is None
    assert idle_start(None, requests=0, now=10.0) == 10.0
    assert idle_start(10.0, requests=0, now=50.0) == 10.0  # still the same spell
    assert idle_start(10.0, requests=1, now=60.0) is None  # a request ends it
    assert seconds_until_sleep(300, None, 60.0) is None  # busy: nothing to wait for


# --- validation ----------------------------------------------------------------------------------


def _policy(**fields) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="u", policy_name="ns/p", generation=1, **fields)


@pytest.mark.parametrize(("fields", "field"), [
    ({"sleep_after_idle_seconds": -1}, "sleep_after_idle_seconds"),
    ({"sleep_after_idle_seconds": MAX_SLEEP_AFTER_IDLE_SECONDS + 1}, "sleep_after_idle_seconds"),
    ({"sleep_level": 3}, "sleep_level"),
    ({"sleep_level": -1}, "sleep_level"),
])
def test_a_bad_sleep_setting_is_refused_naming_the_field(fields, field):
    with pytest.raises(PolicyError) as err:
        validate_policy(_policy(**fields))
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: must be")


def test_good_sleep_settings_are_accepted_and_an_unset_level_is_level_one():
    for fields in ({}, {"sleep_after_idle_seconds": MAX_SLEEP_AFTER_IDLE_SECONDS, "sleep_level": 2},
                   {"sleep_after_idle_seconds": 60, "sleep_level": 1}):
        validate_policy(_policy(**fields))
    assert sleep_level(_policy()) == 1 and sleep_level(_policy(sleep_level=2)) == 2


@pytest.mark.parametrize(("spec", "field"), [
    ({"sleepAfterIdleSeconds": -1}, "spec.sleepAfterIdleSeconds"),
    ({"sleepAfterIdleSeconds": "15m"}, "spec.sleepAfterIdleSeconds"),
    ({"sleepAfterIdleSeconds": MAX_SLEEP_AFTER_IDLE_SECONDS + 1}, "spec.sleepAfterIdleSeconds"),
    ({"sleepLevel": 0}, "spec.sleepLevel"),
    ({"sleepLevel": 3}, "spec.sleepLevel"),
    ({"sleepLevel": "1"}, "spec.sleepLevel"),
    ({"sleepLevel": 1.0}, "spec.sleepLevel"),
])
def test_a_bad_sleep_spec_is_refused_naming_the_crd_field(spec, field):
    with pytest.raises(PolicyError) as err:
        policy_from_spec(spec, uid="u", name="ns/p", generation=1)
    assert err.value.field == field


def test_the_spec_reaches_the_wire_and_leaving_it_out_is_off():
    off = policy_from_spec({}, uid="u", name="ns/p", generation=1)
    assert (off.sleep_after_idle_seconds, sleep_level(off)) == (0, 1)
    on = policy_from_spec({"sleepAfterIdleSeconds": 900, "sleepLevel": 2}, uid="u", name="ns/p", generation=1)
    assert (on.sleep_after_idle_seconds, on.sleep_level) == (900, 2)
    # Level 1 (the CRD's default) stays unset on the wire: a spec that leaves sleep alone pushes
    # the very bytes an operator without the field pushed, so a worker holding that generation
    # does not refuse it as "the same generation with other content".
    assert policy_from_spec({"sleepLevel": 1}, uid="u", name="ns/p", generation=1).SerializeToString() == (
        off.SerializeToString())
    assert policy_from_json(policy_to_json(on)) == on  # the ConfigMap a worker boots from


# --- nothing recaptures ----------------------------------------------------------------------------


def test_the_sleep_settings_are_not_part_of_the_recapture_key():
    sizes = pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[1, 2, 4]))
    base = _policy(capture_sizes=sizes)
    sleepy = _policy(capture_sizes=sizes, sleep_after_idle_seconds=600, sleep_level=2)
    assert recapture_key(base) == recapture_key(sleepy)  # the operator's key
    assert recapture_key(base, LIMITS) == recapture_key(sleepy, LIMITS)  # a worker's key
    other_sizes = _policy(capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[1, 2, 8])),
                          sleep_after_idle_seconds=600)
    assert recapture_key(base, LIMITS) != recapture_key(other_sizes, LIMITS)


def test_a_worker_offered_only_a_new_sleep_time_takes_it_without_a_recapture():
    control = Control(default_policy(), Lifecycle(), LIMITS)
    sizes = pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[1, 2, 4]))
    assert control.offer(_policy(capture_sizes=sizes)) == (False, True)  # new sizes: a recapture
    sleepy = pb.GraphPolicy(policy_uid="u", policy_name="ns/p", generation=2, capture_sizes=sizes,
                            sleep_after_idle_seconds=300, sleep_level=2)
    assert control.offer(sleepy) == (False, False)
    assert control.snapshot().pending is sleepy
    with pytest.raises(PolicyError, match="sleep_after_idle_seconds"):
        control.offer(pb.GraphPolicy(policy_uid="u", generation=3, sleep_after_idle_seconds=-5))
    assert control.snapshot().pending is sleepy  # the refused offer changed nothing


def test_a_policy_file_with_a_bad_sleep_time_is_refused_at_boot_naming_the_field(tmp_path):
    from graphkeeper.worker.main import read_policy_file

    path = tmp_path / "policy.json"
    path.write_text('{"policyUid": "file", "generation": 2, "sleepAfterIdleSeconds": "-60"}')
    policy, error = read_policy_file(str(path), 64)
    assert policy is None and error == (f"--policy-file {path}: sleep_after_idle_seconds: must be in "
                                        "[0, 2592000] (0: never), got -60")
    path.write_text('{"policyUid": "file", "generation": 2, "sleepAfterIdleSeconds": "60", "sleepLevel": 2}')
    policy, error = read_policy_file(str(path), 64)
    assert error is None and (policy.sleep_after_idle_seconds, policy.sleep_level) == (60, 2)
