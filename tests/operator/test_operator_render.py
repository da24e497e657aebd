"""The objects the operator writes, built by pure functions."""

from __future__ import annotations

import json

from graphkeeper.operator.render import build_configmap, build_status_patch, configmap_differs
from graphkeeper.operator.selection import PolicyRef
from graphkeeper.proto.policy import policy_from_json, policy_from_spec

REF = PolicyRef(namespace="ns", name="decode", uid="uid-1", generation=2,
                spec={"selector": {"matchLabels": {"app": "w"}}, "mode": "Full",
                      "captureSizes": {"sizes": [1, 2, 4]}})


def wire():
    return policy_from_spec(REF.spec, uid=REF.uid, name=REF.key, generation=REF.generation)


def test_configmap_is_named_for_the_policy_owned_by_it_and_holds_the_policy_file():
    cm = build_configmap(REF, wire())
    assert cm["metadata"]["name"] == "decode-graphpolicy"
    assert cm["metadata"]["namespace"] == "ns"
    owner = cm["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "GraphPolicy", "decode", "uid-1", True)
    assert owner["apiVersion"] == "graphkeeper.io/v1alpha1"
    policy = policy_from_json(cm["data"]["policy.json"])
    assert policy.generation == 2 and list(policy.capture_sizes.explicit.sizes) == [1, 2, 4]
    json.loads(cm["data"]["policy.json"])


def test_configmap_is_rewritten_only_when_it_differs():
    desired = build_configmap(REF, wire())
    assert configmap_differs(None, desired)
    assert not configmap_differs(json.loads(json.dumps(desired)), desired)
    stale = json.loads(json.dumps(desired))
    stale["data"]["policy.json"] = "{}"
    assert configmap_differs(stale, desired)
    orphan = json.loads(json.dumps(desired))
    orphan["metadata"]["ownerReferences"] = []
    assert configmap_differs(orphan, desired)


def test_status_patch_nulls_keys_that_disappeared():
    patch = build_status_patch({"observedGeneration": 2}, {"observedGeneration": 1,
                                                           "lastFailure": {"worker": "x"}})
    assert patch == {"status": {"observedGeneration": 2, "lastFailure": None}}


def test_an_api_outage_logs_one_line_however_often_requests_fail_and_flap(caplog):
    import logging

    from graphkeeper.operator.outage import Outage

    outage = Outage()
    retry = logging.LogRecord("kopf._cogs.clients.api", logging.ERROR, __file__, 1,
                              "Request attempt #3 failed; will retry: GET x -> refused", (), None)
    # A status write in flight when the server went: the kubernetes client's urllib3 retries.
    urllib3_retry = logging.LogRecord(
        "urllib3.connectionpool", logging.WARNING, __file__, 1,
        "Retrying (Retry(total=2, connect=None, read=None, redirect=None, status=None)) after "
        "connection broken by 'NewConnectionError(...: Connection refused)': /apis/x/status",
        (), None)
    with caplog.at_level(logging.WARNING, logger="graphkeeper.operator"):
        for _ in range(5):
            assert outage.filter(retry) is False, "kopf's retry lines are folded"
            assert outage.filter(urllib3_retry) is False, "so are the client's"
            outage.failed(RuntimeError("patch failed"))
        outage.ok()
        outage.failed(RuntimeError("storage is (re)initializing"))  # the server still starting
        outage.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in line for line in lines) == 1, lines
    assert sum("answers again" in line for line in lines) == 1, lines
    assert not outage.active
