"""SIMULATION: many light GraphControl servers in one process, standing in for workers.

Each server is ``graphkeeper.operator.testing.FakeWorkerServer`` (the worker's policy
bookkeeping, no model, no capture). The fleet writes its ports as one JSON line on stdout, then
one line per policy it accepts: ``applied <port> <policy_uid> <generation> <unix time>``, so the
benchmark learns when each simulated worker acknowledged a generation without polling it.
Used by ``bench/operator_reconcile.py`` for the 200-worker figure; never a claim about the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from graphkeeper.operator.testing import FakeGraphControl, FakeWorkerServer, FakeWorkerState


class ReportingFake(FakeGraphControl):
    port = 0

    async def ApplyGraphPolicy(self, request, context):  # noqa: N802 (gRPC method name)
        reply = await super().ApplyGraphPolicy(request, context)
        if not reply.unchanged:
            print(f"applied {self.port} {request.policy.policy_uid} {request.policy.generation} "
                  f"{time.time():.6f}", flush=True)
        return reply


async def main(count: int) -> None:
    servers = []
    for _ in range(count):
        server = FakeWorkerServer(FakeWorkerState(max_num_batched_tokens=None),
                                  servicer=ReportingFake)
        server.servicer.port = server.port
        servers.append(await server.start())
    print(json.dumps({"ports": [s.port for s in servers]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await asyncio.gather(*(s.stop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    asyncio.run(main(parser.parse_args().count))
