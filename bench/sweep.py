"""The graph-economics sweep: what each graph mode x capture ladder x memory budget costs and buys.

Every cell is a fresh worker process (``graphkeeper worker --policy-file``), as the worksheet asks:
one variable per cell, nothing carried over. Per cell it records, from the worker's own
GraphStatus: the requested and effective mode (and any downgrade), the sizes captured and
skipped, capture time, graph memory, the KV cache's tokens; then it drives the same load through
gRPC (``load_bench``'s client processes) and records decode tokens/s, inter-token latency p50 and
p99, and the dispatcher's coverage and padding from the worker's /metrics ("served"). Coverage and
padding are also predicted for the cell's sizes on the traffic profile (``traffic_sizes.evaluate_sizes``).
Coverage has one meaning in both columns: the share of all steps that replayed a graph, given the
mode (a mixed step that FullDecodeOnly runs eager lowers both).

Ladders: ``default`` (the Default ladder), ``traffic`` (sizes chosen from the traffic profile by
``traffic_sizes.choose_sizes`` within ``--traffic-max-graphs``), and fixed lists (``fixed:8,16,32``).
The traffic profile is a StepHistogram as JSON (``--traffic-profile``; ``graphkeeper status --json``
prints a worker's), or, without one, the histogram the first cell's worker observed under the load.

Writes ``<out>.json`` and ``<out>.md``; ``bench/plot_sweep.py <out>.json`` draws the plot (a separate
step: the GPU machine has no matplotlib).

    python bench/sweep.py --device cpu --preset tiny --modes Piecewise --ladders default,fixed:4,8 \
        --seconds 2 --out /tmp/sweep-cpu                                   # CPU smoke: no graph captures
    graphkeeper sweep --preset llama-1b --out bench/results/sweep-llama1b-h200   # the same, via the CLI
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import SCENARIOS, _commit, _gpu_name, coverage, drive, free_port, scrape  # noqa: E402

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402
from graphkeeper.proto.policy import MODE_BY_NAME, default_ladder, parse_quantity, policy_to_json  # noqa: E402
from graphkeeper.proto.traffic_sizes import (  # noqa: E402
    CostModel,
    choose_sizes,
    evaluate_sizes,
    measurements_from,
    merge_histograms,
)

INFERENCE = "graphkeeper.worker.v1.InferenceWorker"


def parse_ladders(text: str) -> list[str]:
    """``default,traffic,fixed:8,16,32`` -> ["default", "traffic", "fixed:8,16,32"] (a fixed list
    swallows the numbers after it)."""
    out: list[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit() and out and out[-1].startswith("fixed:"):
            out[-1] += f",{item}"
        elif item in ("default", "traffic") or item.startswith("fixed:"):
            out.append(item)
        else:
            raise SystemExit(f"--ladders: {item!r} is not default, traffic or fixed:<sizes>")
    return out


def load_profile(path: str) -> pb.StepHistogram | None:
    if not path:
        return None
    from google.protobuf import json_format

    data = json.loads(Path(path).read_text())
    data = data.get("graphs", data)  # graphkeeper status --json: {"model": ..., "graphs": GraphStatus}
    data = data.get("traffic", data)  # a whole GraphStatus, or the histogram itself
    return json_format.ParseDict(data, pb.StepHistogram(), ignore_unknown_fields=True)


def ladder_sizes(ladder: str, mode: int, max_size: int, profile: pb.StepHistogram | None, max_graphs: int,
                 measured: list[pb.CapturedSize], max_num_seqs: int) -> tuple[list[int], str]:
    """The sizes a cell captures, and how they were chosen."""
    if ladder == "default":
        return default_ladder(max_size), "the Default ladder"
    if ladder.startswith("fixed:"):
        return sorted({int(s) for s in ladder[6:].split(",")}), "fixed"
    if profile is None or not profile.shapes:
        return [], "no traffic profile: pass --traffic-profile or run a default cell first"
    choice = choose_sizes(merge_histograms([profile]), mode=mode, max_capture_size=max_size, max_graphs=max_graphs,
                          model=CostModel(mode, measurements_from(measured)), full_limit=max_num_seqs)
    return list(choice.sizes), (f"chosen from traffic ({choice.note or f'coverage {choice.coverage:.1%}'}; "
                                f"expected {choice.throughput_vs_default:.3f}x the Default ladder's throughput "
                                f"with {choice.graphs} of its {choice.default_graphs} graphs)")


def start_worker(args: argparse.Namespace, policy_file: Path, log: Path) -> tuple[subprocess.Popen, str, str, str]:
    """A fresh worker for one cell; returns (process, inference target, control target, metrics URL)
    once it serves (its graphs are captured before it does)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, control, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", f"random:{args.preset}",
           "--device", args.device, "--dtype", args.dtype, "--port", str(port), "--control-port", str(control),
           "--metrics-port", str(metrics), "--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", "1024",
           "--max-num-batched-tokens", str(args.budget), "--max-queue", "4096", "--log-level", "WARNING",
           "--policy-file", str(policy_file), *args.worker_args.split()]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    target = f"127.0.0.1:{port}"
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited during startup:\n{log.read_text()[-3000:]}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE), timeout=2).status == 1:
                return proc, target, f"127.0.0.1:{control}", f"http://127.0.0.1:{metrics}/metrics"
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"worker did not serve within {args.start_timeout:.0f}s")


def graph_status(control: str) -> pb.GraphStatus:
    import grpc

    from graphkeeper.proto import worker_pb2_grpc as pbg

    with grpc.insecure_channel(control) as channel:
        return pbg.GraphControlStub(channel).GetGraphStatus(pb.GetGraphStatusRequest(), timeout=10)


def run_cell(args: argparse.Namespace, cell: dict, sizes: list[int], logs: Path, vocab: int) -> dict:
    """One fresh worker: capture what the cell asks for, serve the load, report."""
    mode = MODE_BY_NAME[cell["mode"]]
    policy = pb.GraphPolicy(policy_uid="sweep", policy_name="bench/sweep", generation=1, mode=mode,
                            memory_budget_bytes=cell["budget_bytes"])
    if mode != pb.GRAPH_MODE_NONE:
        policy.capture_sizes.explicit.sizes.extend(sizes)
    name = f"{cell['mode']}-{cell['ladder'].replace(':', '').replace(',', '_')}-{cell['budget']}"
    policy_file = logs / f"{name}.json"
    policy_file.write_text(policy_to_json(policy))
    began = time.perf_counter()
    proc, target, control, metrics = start_worker(args, policy_file, logs / f"{name}.log")
    row = dict(cell, sizes=sizes, seconds_to_ready=time.perf_counter() - began)
    try:
        status = graph_status(control)
        row.update(
            effective_mode=pb.GraphMode.Name(status.effective_mode).removeprefix("GRAPH_MODE_"),
            downgrade_reason=status.mode_downgrade_reason,
            graphs_captured=len(status.captured),
            captured_sizes=sorted({c.size for c in status.captured}),
            skipped=[{"size": s.size, "reason": pb.FallbackReason.Name(s.reason), "message": s.message}
                     for s in status.skipped],
            capture_seconds=status.total_capture_seconds,
            graph_memory_bytes=status.graph_memory_bytes,
            kv_tokens=(status.kv_cache.blocks_total * status.kv_cache.block_size
                       if status.HasField("kv_cache") else None),
        )
        if not status.captured and status.effective_mode == pb.GRAPH_MODE_NONE and mode != pb.GRAPH_MODE_NONE:
            row["note"] = f"no graph captured: {status.mode_downgrade_reason or 'effective mode NONE'}"
        before = scrape(metrics)
        load = drive(target, args.scenario, args.seconds, vocab, args.client_procs)
        row.update(tokens_per_s=load["tokens_per_s"], itl_ms=load["itl_ms"], ttft_ms=load["ttft_ms"],
                   errors=load["errors"], dispatch=coverage(before, scrape(metrics)))
        # The worker's whole exposition after the load (step times by size, eager reasons): the
        # figures behind a cell's throughput, for reading when a cell surprises.
        (logs / f"{name}.metrics.txt").write_bytes(urllib.request.urlopen(metrics, timeout=10).read())
        after = graph_status(control)
        row["observed_traffic_steps"] = after.traffic.steps
        row["_traffic"] = after.traffic
        row["_captured"] = list(after.captured)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return row


def expected_on_profile(row: dict, profile: pb.StepHistogram | None, measured: list[pb.CapturedSize],
                        max_num_seqs: int, max_size: int) -> None:
    """Coverage, padding and expected throughput against the Default ladder of the sizes the cell
    captured, on the traffic profile, with the step times the workers measured."""
    if profile is None or not profile.shapes:
        return
    mode = MODE_BY_NAME[row["mode"]]
    sizes = row.get("captured_sizes") or row["sizes"]  # on CPU nothing captures: judge the asked-for sizes
    traffic, model = merge_histograms([profile]), CostModel(mode, measurements_from(measured))
    choice = evaluate_sizes(traffic, sizes, mode, model, full_limit=max_num_seqs)
    default = evaluate_sizes(traffic, default_ladder(max_size), mode, model, full_limit=max_num_seqs)
    row["profile"] = {"coverage": choice.coverage, "eligible_coverage": choice.eligible_coverage,
                      "expected_throughput_vs_default": default.cost / choice.cost if choice.cost else 0.0,
                      "padding_waste": choice.padding_waste,
                      "padded_tokens": choice.padded_tokens, "graphs": choice.graphs,
                      "judged_sizes": "captured" if row.get("captured_sizes") else "requested (none captured)"}


def markdown(results: dict) -> str:
    lines = [f"# Graph-economics sweep: {results['model']} on {results['gpu']}", "",
             f"{results['date']}, commit `{results['commit'][:12]}`, scenario `{results['scenario']}` "
             f"({results['seconds']:.0f} s a cell), token budget {results['budget']}, "
             f"max {results['max_num_seqs']} sequences; profile: {results['profile_source']}.", "",
             "| mode | ladder | budget | sizes | graphs | capture s | graph MiB | KV tokens | coverage predicted "
             "| coverage served | padding predicted | padding served | expected x Default | tok/s | ITL p50 ms "
             "| ITL p99 ms | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cells"]:
        prof = r.get("profile") or {}
        disp = r.get("dispatch") or {}
        pct = lambda v: f"{100 * v:.1f}%" if isinstance(v, int | float) else "–"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['ladder']} | {r['budget']} | {len(r['sizes'])} | {r.get('graphs_captured', '–')} "
            f"| {r.get('capture_seconds', 0):.2f} | {r.get('graph_memory_bytes', 0) / 2**20:.1f} "
            f"| {r.get('kv_tokens') if r.get('kv_tokens') is not None else '–'} | {pct(prof.get('coverage'))} "
            f"| {pct(disp.get('coverage'))} | {pct(prof.get('padding_waste'))} | {pct(disp.get('padding_waste'))} "
            f"| {prof.get('expected_throughput_vs_default', 0):.3f} | {r.get('tokens_per_s', 0):.0f} "
            f"| {(r.get('itl_ms') or {}).get('p50', 0):.2f} | {(r.get('itl_ms') or {}).get('p99', 0):.2f} "
            f"| {r.get('note') or r.get('error') or r.get('how', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b", help="random:<preset> weights")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="FullAndPiecewise,FullDecodeOnly,Piecewise")
    parser.add_argument("--ladders", default="default,traffic,fixed:1,2,4,8,16,32,64")
    parser.add_argument("--budgets", default="0", help="graph memory budgets, e.g. 0,64Mi (0: unlimited)")
    parser.add_argument("--traffic-profile", default="", help="a StepHistogram (or GraphStatus) as JSON")
    parser.add_argument("--traffic-max-graphs", type=int, default=16, help="the traffic ladder's maxGraphs")
    parser.add_argument("--scenario", default="mixed", choices=sorted(SCENARIOS))
    parser.add_argument("--seconds", type=float, default=15.0, help="load per cell")
    parser.add_argument("--budget", type=int, default=512, help="the worker's token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--worker-args", default="")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--logs", default="")
    parser.add_argument("--out", required=True, help="path without extension: writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    from graphkeeper.worker.model.config import PRESETS

    vocab = PRESETS[args.preset].vocab_size
    ladders = parse_ladders(args.ladders)
    budgets = [(b, parse_quantity(b, "--budgets") if b != "0" else 0) for b in args.budgets.split(",") if b]
    max_size = min(args.budget, 512)
    profile = load_profile(args.traffic_profile)
    source = args.traffic_profile or "the first cell's observed traffic"
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="sweep-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                     "commit": _commit(), "model": f"random:{args.preset}", "gpu": _gpu_name(args.device),
                     "scenario": args.scenario, "seconds": args.seconds, "budget": args.budget,
                     "max_num_seqs": args.max_num_seqs, "profile_source": source, "cells": []}
    measured: list[pb.CapturedSize] = []
    # "traffic" cells last, so that a profile observed by earlier cells is there to choose from.
    order = sorted(((m, lad, b) for m in args.modes.split(",") for lad in ladders for b in budgets),
                   key=lambda c: c[1] == "traffic")
    for mode_name, ladder, (budget_text, budget_bytes) in order:
        mode = MODE_BY_NAME[mode_name]
        sizes, how = ladder_sizes(ladder, mode, max_size, profile, args.traffic_max_graphs, measured,
                                  args.max_num_seqs)
        cell = {"mode": mode_name, "ladder": ladder, "budget": budget_text, "budget_bytes": budget_bytes, "how": how}
        if mode != pb.GRAPH_MODE_NONE and not sizes:
            results["cells"].append(dict(cell, sizes=[], error=how))
            print(f"{mode_name:<16} {ladder:<12} {budget_text:>6}: skipped ({how})", flush=True)
            continue
        try:
            row = run_cell(args, cell, sizes, logs, vocab)
        except RuntimeError as err:
            row = dict(cell, sizes=sizes, error=str(err)[-500:])
        traffic, captured = row.pop("_traffic", None), row.pop("_captured", [])
        measured += captured
        if profile is None and traffic is not None and traffic.shapes:
            profile, results["profile"] = traffic, {"observed_in": f"{mode_name}/{ladder}/{budget_text}"}
        results["cells"].append(row)
        print(f"{mode_name:<16} {ladder:<12} {budget_text:>6}: {len(sizes)} sizes, "
              f"{row.get('graphs_captured', 0)} graphs, {row.get('capture_seconds', 0):.2f} s, "
              f"{row.get('graph_memory_bytes', 0) / 2**20:.1f} MiB, {row.get('tokens_per_s', 0):.0f} tok/s"
              f"{', ' + row['note'] if row.get('note') else ''}{', ' + row['error'] if row.get('error') else ''}",
              flush=True)
    for row in results["cells"]:
        expected_on_profile(row, profile, measured, args.max_num_seqs, max_size)
    if profile is not None:
        from google.protobuf import json_format

        results["traffic_profile"] = json_format.MessageToDict(profile, preserving_proto_field_name=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}; plot: python bench/plot_sweep.py "
          f"{out.with_suffix('.json')}", flush=True)
    return 0 if all("error" not in r for r in results["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
