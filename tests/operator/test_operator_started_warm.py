"""Per worker, whether it started warm (GraphStatus.startup) and across how many tensor parallel
ranks it runs: shown in the GraphPolicy's status.workers[], and declared by the CRD so the API
server keeps them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status import WorkerState, build_status
from graphkeeper.operator.sync import observe, started_warm
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import policy_from_spec

CRD = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "graphpolicy.yaml"
POLICY = policy_from_spec({"selector": {"matchLabels": {"app": "w"}}, "mode": "Full"}, uid="uid-1", name="ns/p",
                          generation=1)
POD = WorkerPod(namespace="ns", name="w0", uid="pod-uid", address="10.0.0.1", port=50051, control_port=50052,
                phase="Running", ready=True)


def worker_summary(caches: str) -> dict:
    status = pb.GraphStatus(state=pb.LIFECYCLE_STATE_READY, policy_uid="uid-1", policy_generation=1,
                            startup=pb.StartupStatus(caches=caches) if caches else None)
    seen = observe(POD, status, POLICY)
    assert seen.state == WorkerState.CAPTURED
    (summary,) = build_status(generation=1, observations=[seen], previous=None, now=datetime.now(UTC))["workers"]
    return summary


@pytest.mark.parametrize(("caches", "shown"), [("warm", True), ("cold", False)])
def test_a_worker_that_used_caches_shows_whether_it_started_warm(caches, shown):
    assert worker_summary(caches)["startedWarm"] is shown


@pytest.mark.parametrize("caches", ["none", ""])
def test_a_worker_that_used_no_cache_or_has_not_said_shows_nothing(caches):
    assert "startedWarm" not in worker_summary(caches)
    assert started_warm(pb.StartupStatus(caches=caches)) is None


def test_a_worker_shows_the_ranks_it_shards_across_and_an_older_worker_nothing():
    status = pb.GraphStatus(state=pb.LIFECYCLE_STATE_READY, policy_uid="uid-1", policy_generation=1,
                            tensor_parallel_size=2, graph_memory_bytes=1 << 20)
    (summary,) = build_status(generation=1, observations=[observe(POD, status, POLICY)], previous=None,
                              now=datetime.now(UTC))["workers"]
    assert summary["tensorParallelSize"] == 2 and summary["graphMemoryBytes"] == 1 << 20  # one rank's
    assert "tensorParallelSize" not in worker_summary("warm")  # a worker that does not report it


def test_the_crd_declares_every_field_of_a_worker_summary():
    crd = yaml.safe_load(CRD.read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    declared = status["properties"]["workers"]["items"]["properties"]
    summary = worker_summary("warm")
    summary["tensorParallelSize"] = 2
    assert set(summary) <= set(declared), set(summary) - set(declared)
    assert declared["startedWarm"]["type"] == "boolean"
