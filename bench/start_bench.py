"""Worker start to READY, cold, warm and warm again, stage by stage: from the worker process's start
until ``/readyz`` answers 200, which is after compilation (or its cache load), kernel tuning (or
its cache load) and the capture of the whole default ladder.

For each preset, three starts on one cache directory, each a new worker process as a pod restart
would be: cold (an empty compile and tuning cache), warm (the cache the cold start left) and warm
again (the same cache once more). READY is measured here, from the worker process's start (read
from /proc) to the first 200 from ``/readyz`` (polled over a new HTTP connection each time: a gRPC
health poll on one channel waits out the channel's reconnect backoff, up to seconds, after the
connections it was refused before the servers listened); the worker's own ``GraphStatus.startup`` gives the
stages, counted from the same process start, and whether its caches made it warm. The figures are
set against the issue's table (measured at 500ac3d) and its targets. Each start also records the
Triton kernels its compile cache holds, by name (``triton_variants``): after a cold start, what it
compiled, and whether a kernel compiled a variant per batch size.

Python bytecode: the worker image ships compiled bytecode (deploy/docker/Dockerfile), but a
machine whose site-packages holds none (and cannot be written) compiles torch's modules from
source at every start. The workers here write and read bytecode under ``--pycache`` instead
(PYTHONPYCACHEPREFIX). By default ("primed") the bytecode of the packages a worker imports is
compiled there before the first start, so every start, the cold one too, loads it as a pod on the
image does; "fresh" leaves the prefix empty, and the cold start then also compiles the bytecode
(about 7 s of an H100 host's cold start, by a profile: not what a pod on the image pays).

    python bench/start_bench.py --out bench/results/start-ii-h200.json
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
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit, free_port  # noqa: E402

STARTS = ("cold", "warm", "warm again")
#: READY seconds at 500ac3d (issue 36's table): what this bench is set against.
BEFORE = {"llama-1b": {"cold": 33.0, "warm": 24.1, "warm again": 20.1},
          "llama-8b": {"cold": 41.6, "warm": 27.5, "warm again": 27.6}}
#: Issue 36's acceptance: READY at most this many seconds (warm again counts as warm).
TARGETS = {"llama-1b": {"cold": 20.0, "warm": 8.0, "warm again": 8.0},
           "llama-8b": {"cold": 30.0, "warm": 12.0, "warm again": 12.0}}
STAGES = ("before_engine", "engine_process", "engine_setup", "device_context", "weights", "kv_cache", "tokenizer",
          "kernel_tuning", "compile", "warm_up", "capture_setup", "capture_prime", "capture_warm_up", "capture_record",
          "capture_validate", "capture_measure", "capture_finish", "capture_other", "after_capture", "ready")


def process_started(pid: int) -> float:
    """A process's start on the wall clock, read from /proc (as the worker reads its own)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


#: The packages a worker imports, whose bytecode "primed" compiles before the first start (the
#: worker's own subpackages by name: an editable install maps them to directories of their own).
PRIMED_PACKAGES = ("torch", "torchgen", "triton", "sympy", "mpmath", "numpy", "jinja2", "markupsafe", "networkx",
                   "grpc", "grpc_health", "grpc_reflection", "google", "prometheus_client", "safetensors", "filelock",
                   "fsspec", "tqdm", "llguidance", "graphkeeper", "graphkeeper.worker", "graphkeeper.proto",
                   "typing_extensions")


def prime_bytecode(prefix: str) -> float:
    """Compiles the bytecode of the standard library and of ``PRIMED_PACKAGES`` (those installed)
    under ``prefix``, on every CPU (test directories left out); returns the seconds it took. With a
    prefix set, the interpreter reads no bytecode from beside the sources, its own library's
    included: that is compiled here too, as the image's Python ships it."""
    import importlib.util
    import sysconfig

    paths: list[str] = [sysconfig.get_paths()["stdlib"]]
    for name in PRIMED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            paths += list(spec.submodule_search_locations or ([spec.origin] if spec.origin else []))
    began = time.time()
    skip_tests = r"[/\\]tests?[/\\]"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "-x", skip_tests, *paths], check=False,
                   env={**os.environ, "PYTHONPYCACHEPREFIX": prefix}, stdout=subprocess.DEVNULL)
    return time.time() - began


def ready_now(metrics_port: int) -> bool:
    """Whether /readyz answers 200: a new HTTP connection each poll, so nothing like a gRPC
    channel's reconnect backoff (up to seconds after a refused connect) delays seeing READY."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=1) as reply:
            return reply.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def start(preset: str, flags: list[str], cache_dir: str, log_path: Path, max_num_seqs: int, pycache: str,
          device: str = "cuda", python: str = sys.executable, pythonpath: str = "") -> dict:
    """One worker start (``python``: the interpreter whose installed worker starts; ``pythonpath``
    put first on its path: another tree's worker, a baseline) until READY; ``preset`` is a random
    preset's name, or any ``--model`` source (``builtin:...``, a path)."""
    import grpc
    from google.protobuf import json_format

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pbg

    port, control, metrics = free_port(), free_port(), free_port()
    model = preset if ":" in preset or "/" in preset else f"random:{preset}"
    cmd = [python, "-m", "graphkeeper.cli", "worker", "--model", model, "--device", device,
           "--port", str(port), "--control-port", str(control), "--metrics-port", str(metrics), "--http-port", "0",
           "--max-num-seqs", str(max_num_seqs), "--max-seq-len", "1024", "--compile-cache-dir", cache_dir,
           "--log-level", "INFO", *flags]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = pycache
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    began = process_started(proc.pid)
    try:
        while not ready_now(metrics):
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited during startup:\n{log_path.read_text()[-3000:]}")
            if time.time() - began > 900:
                raise RuntimeError("worker did not become ready in 900 s")
            time.sleep(0.02)
        ready = time.time() - began
        status = pbg.GraphControlStub(grpc.insecure_channel(f"127.0.0.1:{control}")).GetGraphStatus(
            pb.GetGraphStatusRequest(), timeout=10)
    finally:
        proc.terminate()
        proc.wait(60)
    c, s = status.compile, status.startup
    lines = [line.split("startup: ", 1)[1].strip() for line in log_path.read_text().splitlines() if "startup: " in line]
    return {"seconds_to_ready": ready, "worker_ready_seconds": s.ready_seconds,
            "stages": {x.stage: x.seconds for x in s.stages}, "caches": s.caches, "compile_cache": s.compile_cache,
            "tuning_cache": s.tuning_cache, "startup_line": lines[-1] if lines else "",
            "compile": json_format.MessageToDict(c, preserving_proto_field_name=True),
            "capture_parts": {p.part: p.seconds for p in status.capture_parts},
            "capture_seconds": status.total_capture_seconds, "graphs_captured": len(status.captured)}


def triton_variants(cache_dir: str) -> dict[str, int]:
    """Kernels compiled into a compile cache's Triton cache (``<cache>/<key>/triton``, Inductor's and
    the worker's own kernels), by name, most variants first: what a cold start spent compiling, and
    which kernel compiled a variant per batch size."""
    counts = Counter(p.stem for p in Path(cache_dir).glob("*/triton/*/*.cubin"))
    return dict(counts.most_common())


def stage_table(rows: list[dict]) -> list[str]:
    """Markdown: one column per start, one row per stage, READY and the issue's figures last (pure)."""
    head = [f"{r['preset']} {r['start']}" for r in rows]
    out = ["| stage | " + " | ".join(head) + " |", "|---" * (len(rows) + 1) + "|"]
    for stage in STAGES:
        if any(stage in r["stages"] for r in rows):
            out.append(f"| {stage} | " + " | ".join(f"{r['stages'].get(stage, 0.0):.1f}" for r in rows) + " |")
    out.append("| **READY (measured)** | " + " | ".join(f"**{r['seconds_to_ready']:.1f}**" for r in rows) + " |")
    out.append("| caches | " + " | ".join(r["caches"] for r in rows) + " |")
    out.append("| at 500ac3d | " + " | ".join(f"{r['before']}" for r in rows) + " |")
    out.append("| target | " + " | ".join(f"<= {r['target']:.0f} ({'met' if r['met'] else 'not met'})"
                                         if r["target"] else "-" for r in rows) + " |")
    return out


def default_presets(device: str) -> str:
    """The presets a start or sleep bench runs when none are named: the two of the issue's table on
    a GPU; on a CPU (the bench's own check) the tiny one, the only one that starts there."""
    return "tiny" if device == "cpu" else "llama-1b,llama-8b"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="", help="default: llama-1b,llama-8b on a GPU, tiny on a CPU")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu checks the bench itself (random:tiny), nothing more")
    parser.add_argument("--worker-args", default="-O2", help="flags every worker gets (space-separated)")
    parser.add_argument("--pycache", default="primed",
                        help="PYTHONPYCACHEPREFIX for the workers: 'primed' (a new directory holding the bytecode "
                             "of what a worker imports, as the image ships it: the default), 'fresh' (a new empty "
                             "directory), a directory, or 'none' (the environment's bytecode handling)")
    parser.add_argument("--starts", default=",".join(STARTS),
                        help="which starts, in order (with --cache-root filled by an earlier run: 'warm,warm again')")
    parser.add_argument("--cache-root", default="",
                        help="compile caches under DIR/<preset>, kept (default: a fresh one per preset, removed)")
    parser.add_argument("--worker-pythonpath", default="",
                        help="first on the workers' PYTHONPATH: another tree's worker (a baseline)")
    parser.add_argument("--label", default="")
    parser.add_argument("--logs", default="", help="keep each worker's log here (default: a temporary directory)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.presets = args.presets or default_presets(args.device)
    import torch

    gpu = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": gpu,
              "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": _commit(), "label": args.label, "worker_pythonpath": args.worker_pythonpath,
              "pycache": args.pycache, "before": BEFORE, "targets": TARGETS, "rows": []}
    pycache = (tempfile.mkdtemp(prefix="pycache-") if args.pycache in ("fresh", "primed")
               else "" if args.pycache == "none" else args.pycache)
    if args.pycache == "primed":
        report["pycache_primed_seconds"] = prime_bytecode(pycache)
        print(f"bytecode primed under {pycache} in {report['pycache_primed_seconds']:.1f} s", flush=True)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="start-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    for preset in args.presets.split(","):
        cache = str(Path(args.cache_root) / preset) if args.cache_root else tempfile.mkdtemp(prefix="compile-cache-")
        for label in args.starts.split(","):
            row = start(preset, args.worker_args.split(), cache, logs / f"{preset}-{len(report['rows'])}.log",
                        args.max_num_seqs, pycache, args.device, pythonpath=args.worker_pythonpath)
            target = TARGETS.get(preset, {}).get(label)
            row.update(preset=preset, start=label, before=BEFORE.get(preset, {}).get(label, "-"),
                       target=target or 0.0, met=target is not None and row["seconds_to_ready"] <= target)
            row["triton_variants"] = triton_variants(cache)
            report["rows"].append(row)
            print(f"{preset:<9} {label:<11} READY after {row['seconds_to_ready']:6.1f} s (worker says "
                  f"{row['worker_ready_seconds']:.1f} s; caches {row['caches']}: compile {row['compile_cache']}, "
                  f"tuning {row['tuning_cache']}; {row['graphs_captured']} CUDA graphs)\n    {row['startup_line']}",
                  flush=True)
            variants = row["triton_variants"]
            top = ", ".join(f"{name} {n}" for name, n in list(variants.items())[:6])
            print(f"    Triton cache: {sum(variants.values())} kernels compiled" + (f": {top}" if top else ""),
                  flush=True)
        if not args.cache_root:
            shutil.rmtree(cache, ignore_errors=True)
        report["table"] = stage_table(report["rows"])
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(report.get("table", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
