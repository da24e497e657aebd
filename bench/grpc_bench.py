"""End-to-end streaming through gRPC: a real worker process, 1 and 64 concurrent Generate
streams, eager versus CUDA graphs. Client-side timings: time to first token, inter-token
latency, aggregate generated tokens per second.

    python bench/grpc_bench.py --out bench/results/grpc.json      # on the GPU machine
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ports import free_port  # noqa: E402  (tests/ports.py: below the ephemeral range, never handed out twice)


def start_worker(args: argparse.Namespace, mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "graphkeeper"), "worker", "--model", f"random:{args.preset}",
           "--device", args.device, "--port", str(port), "--metrics-port", "0", "--max-num-seqs", "64",
           "--max-seq-len", "1024", "--max-num-batched-tokens", "512", "--graph-mode", mode,
           "--control-port", str(free_port()), "--http-port", "0"]
    if not (Path(sys.executable).parent / "graphkeeper").exists():
        cmd = [sys.executable, "-m", "graphkeeper.cli", *cmd[1:]]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service="graphkeeper.worker.v1.InferenceWorker"),
                               timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return proc, target
        except grpc.RpcError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("worker exited during startup")
        time.sleep(0.5)
    raise RuntimeError("worker did not become ready")


def one_stream(stub, prompt_len: int, new_tokens: int, rng: random.Random) -> dict:
    req = pb.GenerateRequest(prompt_token_ids=[rng.randrange(3, 500) for _ in range(prompt_len)],
                             stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    stamps = []
    for response in stub.Generate(req, timeout=600):
        if response.HasField("tokens"):
            stamps.extend([time.perf_counter()] * len(response.tokens.token_ids))
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - start, "itl": gaps, "tokens": len(stamps)}


def level(target: str, concurrency: int, args: argparse.Namespace) -> dict:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.InferenceWorkerStub(channel)
    results, lock = [], threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        for _ in range(args.requests_per_client):
            r = one_stream(stub, args.prompt_tokens, args.new_tokens, rng)
            with lock:
                results.append(r)

    one_stream(stub, 8, 4, random.Random(99))  # warm the channel
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    itl = sorted(g for r in results for g in r["itl"])
    return {
        "concurrency": concurrency, "requests": len(results), "seconds": elapsed,
        "generated_tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_median_ms": 1e3 * statistics.median(r["ttft"] for r in results),
        "itl_median_ms": 1e3 * statistics.median(itl), "itl_p90_ms": 1e3 * itl[(9 * len(itl)) // 10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default="None,FullAndPiecewise")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "preset": args.preset, "runs": []}
    for mode in args.modes.split(","):
        proc, target = start_worker(args, mode)
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                row = {"graph_mode": mode, **level(target, c, args)}
                report["runs"].append(row)
                print(f"  {mode:<16} concurrency {c:>3}: {row['generated_tokens_per_s']:.0f} tok/s, "
                      f"TTFT {row['ttft_median_ms']:.1f} ms, ITL {row['itl_median_ms']:.2f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
