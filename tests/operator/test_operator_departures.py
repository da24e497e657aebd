"""When a departed worker's probe frees its rollout slot: only a refused connection shows its
process gone; a timeout, or a channel the operator itself closed (pruning the deleted pod's
connection), keeps the slot and asks again (a third worker recapturing under a limit of 2 was seen
when a pruned channel's cancelled call read as "gone")."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from graphkeeper.operator import departures
from graphkeeper.operator.departures import Departures, process_gone
from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.workerclient import ErrorKind, WorkerError
from graphkeeper.proto import worker_pb2 as pb

CLOSED = WorkerError(ErrorKind.UNREACHABLE, "GetGraphStatus: its channel was closed")
TIMED_OUT = WorkerError(ErrorKind.UNREACHABLE, "GetGraphStatus: DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED)
REFUSED = WorkerError(ErrorKind.UNREACHABLE, "GetGraphStatus: UNAVAILABLE", grpc.StatusCode.UNAVAILABLE)


def test_only_a_refused_connection_shows_the_process_gone():
    assert process_gone(REFUSED)
    assert not process_gone(CLOSED) and not process_gone(TIMED_OUT)
    assert not process_gone(WorkerError(ErrorKind.ERROR, "GetGraphStatus: INTERNAL", grpc.StatusCode.INTERNAL))


class Answers:
    """A GraphControl client that answers the probe from a script, one entry per call."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)

    async def get_status(self, target: str) -> pb.GraphStatus:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


RECAPTURING = pb.GraphStatus(state=pb.LIFECYCLE_STATE_RECAPTURING)
READY = pb.GraphStatus(state=pb.LIFECYCLE_STATE_READY)


@pytest.mark.parametrize(("script", "reason"), [
    ((CLOSED, TIMED_OUT, RECAPTURING, READY), "its worker finished"),
    ((RECAPTURING, CLOSED, TIMED_OUT, REFUSED), "its address no longer answers"),
])
def test_the_slot_is_kept_through_doubt_and_freed_by_proof(monkeypatch, script, reason):
    monkeypatch.setattr(departures, "PROBE_SECONDS", 0.01)

    async def scenario() -> tuple[list[str], str]:
        woken = asyncio.Event()
        table = Departures(Answers(*script), woken.set)
        pod = WorkerPod(namespace="ns", name="w0", uid="pod-0", labels={}, address="10.0.0.1", ready=True)
        table.add(pod, started=0.0, known=frozenset({"pod-0"}), policies=frozenset({"p"}))
        await asyncio.sleep(0.025)  # the doubtful answers come first: still holding its slot
        held = table.holding("p", {}, now=1.0, deadline=600.0)
        assert table.probing(pod.control_target)  # its channel is not pruned while it is probed
        await asyncio.wait_for(woken.wait(), 5)
        why = table.entries[pod.key].freed
        assert table.holding("p", {}, now=1.0, deadline=600.0) == []
        assert not table.probing(pod.control_target)
        await table.close()
        return held, why

    held, why = asyncio.run(scenario())
    assert held == ["ns/w0"] and why == reason
