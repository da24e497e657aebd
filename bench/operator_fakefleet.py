"""SIMULATION: many light GraphControl servers in one process, standing in for workers.

Each server is ``tests/fakes/fake_worker.py``'s ``FakeWorkerServer`` (the worker's policy
bookkeeping, no model, no capture). The fleet writes its ports as one JSON line on stdout, then
one line per policy it accepts: ``applied <port> <policy_uid> <generation> <unix time>``, so the
benchmark learns when each simulated worker acknowledged a generation without polling it.
With ``--capture-seconds`` each simulated capture takes that long (RECAPTURING meanwhile), and
every lifecycle change is reported as ``state <port> <STATE> <unix time>``, plus
``ready <port> <policy_uid> <generation> <unix time>`` when a generation is adopted and READY.
Used by ``bench/operator_reconcile.py``; never a claim about the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

# The operator's test double lives with the tests (it never ships in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.fake_worker import FakeGraphControl, FakeWorkerServer, FakeWorkerState  # noqa: E402


class ReportingFake(FakeGraphControl):
    port = 0

    async def _recapture(self) -> None:
        await super()._recapture()
        held = self.state.policy
        if held is not None:
            print(f"ready {self.port} {held.policy_uid} {held.generation} {time.time():.6f}",
                  flush=True)

    async def ApplyGraphPolicy(self, request, context):  # noqa: N802 (gRPC method name)
        reply = await super().ApplyGraphPolicy(request, context)
        if not reply.unchanged:
            print(f"applied {self.port} {request.policy.policy_uid} {request.policy.generation} "
                  f"{time.time():.6f}", flush=True)
        return reply


async def main(count: int, capture_seconds: float) -> None:
    servers = []
    for _ in range(count):
        state = FakeWorkerState(max_num_batched_tokens=None, capture_seconds=capture_seconds)
        server = FakeWorkerServer(state, servicer=ReportingFake)
        server.servicer.port = port = server.port
        state.on_transition = (lambda t, name, port=port:
                               print(f"state {port} {name} {t:.6f}", flush=True))
        servers.append(await server.start())
    print(json.dumps({"ports": [s.port for s in servers]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await asyncio.gather(*(s.stop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--capture-seconds", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.count, args.capture_seconds))
