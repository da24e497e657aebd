"""Worker start to READY, cold and warm: process start until the gRPC health check says SERVING,
which is after compilation (or its cache load) and the capture of the whole default ladder.

For each preset: a cold start with an empty compile cache (-O2), a warm start on the cache that
start left (same key), and an -O1 start (graphs, no compilation) for reference. Each start is a
new worker process, as a pod restart would be; the GraphStatus's compile section says whether the
cache was hit, and the worker's "startup:" log line where the time went.

Python bytecode: the worker image ships compiled bytecode (deploy/docker/Dockerfile), but a
machine whose site-packages holds none (and cannot be written) compiles torch's modules from
source at every start. The workers here write and read bytecode under ``--pycache`` instead
(PYTHONPYCACHEPREFIX), so the first (cold) start of the run compiles it and later starts load it,
as a pod on the image would.

    python bench/start_bench.py --out bench/results/start-h200.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit, free_port  # noqa: E402


def start(preset: str, flags: list[str], cache_dir: str, log_path: Path, max_num_seqs: int, pycache: str) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pbg

    port, control = free_port(), free_port()
    cmd = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", f"random:{preset}", "--device", "cuda",
           "--port", str(port), "--control-port", str(control), "--metrics-port", "0", "--http-port", "0",
           "--max-num-seqs", str(max_num_seqs), "--max-seq-len", "1024", "--compile-cache-dir", cache_dir,
           "--log-level", "INFO", *flags]
    began = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = pycache
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited during startup:\n{log_path.read_text()[-3000:]}")
            if time.perf_counter() - began > 900:
                raise RuntimeError("worker did not become ready in 900 s")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service="graphkeeper.worker.v1.InferenceWorker"),
                                     timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - began
        status = pbg.GraphControlStub(grpc.insecure_channel(f"127.0.0.1:{control}")).GetGraphStatus(
            pb.GetGraphStatusRequest(), timeout=10)
    finally:
        proc.terminate()
        proc.wait(60)
    c = status.compile
    lines = log_path.read_text().splitlines()
    phases = [line.split("startup: ", 1)[1].strip() for line in lines if "startup: " in line]
    return {"phases": phases[-1] if phases else "", "seconds_to_ready": ready,
            "optimization_level": c.optimization_level, "compiled": c.enabled,
            "cache": c.cache, "compile_seconds": c.seconds, "compiled_graphs": c.compiled_graphs, "kernels": c.kernels,
            "capture_seconds": status.total_capture_seconds, "graphs_captured": len(status.captured)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-1b,llama-8b")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--pycache", default="fresh",
                        help="PYTHONPYCACHEPREFIX for the workers: 'fresh' (a new empty directory, the default), "
                             "a directory, or 'none' (the environment's bytecode handling)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": _commit(), "rows": []}
    pycache = {"fresh": tempfile.mkdtemp(prefix="pycache-"), "none": ""}.get(args.pycache, args.pycache)
    report["pycache"] = args.pycache
    logs = Path(tempfile.mkdtemp(prefix="start-bench-"))
    for preset in args.presets.split(","):
        cache = tempfile.mkdtemp(prefix="compile-cache-")
        for label, flags in (("cold (-O2, empty cache)", ["-O", "2"]), ("warm (-O2, cache from the cold start)",
                             ["-O", "2"]), ("-O1 (no compile)", ["-O", "1"])):
            row = start(preset, flags, cache, logs / f"{preset}-{len(report['rows'])}.log", args.max_num_seqs,
                        pycache)
            row.update(preset=preset, start=label)
            report["rows"].append(row)
            print(f"{preset:<9} {label:<38} READY after {row['seconds_to_ready']:6.1f} s (compile "
                  f"{row['compile_seconds']:.1f} s, cache {row['cache']}, {row['compiled_graphs']} graphs; "
                  f"{row['graphs_captured']} CUDA graphs in {row['capture_seconds']:.1f} s)\n    {row['phases']}",
                  flush=True)
        shutil.rmtree(cache, ignore_errors=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
