"""The step budget sweep: time to first token against inter-token latency for each (token budget,
inter-token target) setting, under long-prompt, mixed and decode-only load.

Every cell is a fresh worker (``load_bench.run_cell``: clients in their own processes, every prompt
drawn fresh, so no request hits the prefix cache; the row says whether any did) run with
``--max-num-batched-tokens <budget>`` and, unless the target is ``default``, ``--itl-target-ms
<target>``. Per cell: TTFT p50/p99, ITL p50/p99 and generated tokens/s from the clients' clocks;
graph-step coverage, eager steps by reason and steps stretched by the TTFT guard from the worker's
/metrics; the budget, target and TTFT guard the worker says it runs with (GraphStatus.step_budget,
with where the target came from: a CPU worker measures no step times and keeps a fixed budget,
whatever the target asked). ``--worker-args`` passes the TTFT guard's flags to every cell, e.g.
``--worker-args="--ttft-target-ms 1000000"`` for a guard that never stretches (the target alone).

Each figure also stands as a ratio to what the GPU allows: tokens/s and ITL against the FULL-graph
decode step at the cell's stream count, timed in this process after the workers stopped (as
``load_bench`` does; ``--no-step-times`` skips it); TTFT p50 and p99 against one step carrying the
scenario's middle and longest prompt alone, predicted from the step times the cell's worker
measured at capture (``step_budget.StepTimeModel``, the model its scheduler uses; none on a CPU).

Writes ``<out>.json`` (after every cell, so a cut-short run keeps what it measured) and ``<out>.md``;
``bench/plot_budget_sweep.py <out>.json`` draws TTFT against ITL p99 (a separate step: the GPU
machine has no matplotlib).

    python bench/budget_sweep.py --budgets 512,2048,8192 --itl-targets default,5,8,12 \\
        --out bench/results/budget-sweep-h200                                  # the whole grid, H200
    python bench/budget_sweep.py --settings 512:default,8192:default,8192:12 --out /tmp/bs  # chosen pairs
    python bench/budget_sweep.py --device cpu --dtype float32 --preset tiny --scenarios long,mixed,decode \\
        --settings 64:default,256:5 --seconds 2 --client-procs 2 --out /tmp/budget-sweep-cpu   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
import load_bench  # noqa: E402 - the worker, the client processes and the step-time ratios

from graphkeeper.worker.engine.step_budget import StepTimeModel  # noqa: E402


@dataclass(frozen=True)
class Setting:
    """One cell's worker flags: tokens a step, and the inter-token target (0: the worker's own)."""

    budget: int
    itl_target_ms: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.budget}/{f'{self.itl_target_ms:g}ms' if self.itl_target_ms else 'default'}"

    def worker_flags(self, scenario: str) -> load_bench.WorkerFlags:
        target = ("--itl-target-ms", f"{self.itl_target_ms:g}") if self.itl_target_ms else ()
        return load_bench.scenario_flags(scenario, self.budget, extra=target)


def parse_target(text: str) -> float:
    """``default`` or ``0``: the worker's own target; else milliseconds, more than 0."""
    if text.strip() in ("default", "0"):
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise SystemExit(f"ITL target {text!r}: milliseconds more than 0, or 'default' (the worker's own)")
    return value


def parse_budget(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise SystemExit(f"token budget {text!r}: a whole number of tokens, 1 or more")
    return int(text)


def parse_settings(budgets: str, targets: str, settings: str = "") -> list[Setting]:
    """The cells' settings: ``settings`` (``budget:target`` pairs) when given, else every budget
    with every target."""
    if settings:
        pairs = [item.split(":", 1) for item in settings.split(",") if item.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise SystemExit(f"--settings {settings!r}: comma-separated budget:target pairs, e.g. 8192:default,8192:12")
        chosen = [Setting(parse_budget(b), parse_target(t)) for b, t in pairs]
    else:
        chosen = [Setting(parse_budget(b), parse_target(t))
                  for b in budgets.split(",") if b.strip() for t in targets.split(",") if t.strip()]
    if not chosen:
        raise SystemExit("no settings: give --budgets and --itl-targets, or --settings")
    return list(dict.fromkeys(chosen))


def parse_scenarios(text: str) -> list[str]:
    """Scenarios whose prompts are drawn fresh (a shared-prefix scenario would measure the prefix
    cache, not the budget)."""
    names = [s for s in text.split(",") if s]
    for name in names:
        load_bench.scenario_spec(name)  # exits on an unknown name
        if name in load_bench.SHARED_PREFIX:
            raise SystemExit(f"--scenarios: {name!r} shares a prompt prefix; the sweep needs fresh prompts")
    return names


def prefill_allowed_ms(step_times: list[dict], tokens: int, skipped: list[dict] = ()) -> float | None:
    """Predicted time of one step carrying ``tokens`` prompt tokens alone, from a worker's
    capture-time measurements (its graphs' timings, and the eager timings of sizes left without a
    graph, as the worker's own model reads them); None where it measured none (a CPU worker)."""
    eager = {s["size"]: s["eager_seconds"] for s in skipped if s.get("eager_seconds", 0) > 0}
    model = StepTimeModel.from_captured([SimpleNamespace(**g) for g in step_times], eager)
    return None if model is None else 1e3 * model.seconds(tokens)


def sweep_row(scenario: str, setting: Setting, row: dict) -> dict:
    """``run_cell``'s row with the setting, the target the worker reports, whether every prompt was
    fresh, and TTFT against the prefill the GPU allows."""
    reported = row.get("step_budget") or {}
    prompt = load_bench.scenario_spec(scenario)[1]
    out = dict(row, setting=setting.label, budget=setting.budget, itl_target_ms_requested=setting.itl_target_ms,
               itl_target_ms_reported=reported.get("itl_target_ms"), target_source=reported.get("source"),
               fresh_prompts=row.get("prefix_cache_hits_tokens_total", 0.0) == 0)
    allowed = {"p50": ((prompt[0] + prompt[1]) // 2, "middle"), "p99": (prompt[1], "longest")}
    out["prefill_allowed_ms"] = {}
    for pct, (tokens, which) in allowed.items():
        ms = prefill_allowed_ms(row.get("step_times", []), tokens, row.get("skipped", []))
        out["prefill_allowed_ms"][pct] = {"prompt_tokens": tokens, "prompt": which, "ms": ms}
        if ms and row["ttft_ms"].get(pct):
            out[f"ttft_{pct}_over_prefill"] = row["ttft_ms"][pct] / ms
    return out


def markdown(results: dict) -> str:
    lines = [f"# Step budget sweep: random:{results['preset']} on {results['gpu']}", "",
             f"{results['date']}, commit `{results['commit'][:12]}`, {results['seconds']:g} s a cell, "
             f"{results['client_procs']} client processes, fresh prompts. Ratios: tok/s to streams over the "
             "FULL decode step (wall); ITL over that step; TTFT over one step of the middle (p50) or longest "
             "(p99) prompt alone, predicted from the worker's capture timings.", "",
             "| scenario | budget | target asked ms | target run ms (source) | tokens with decode | tok/s "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms | coverage | eager steps | stretched steps | tok/s vs GPU "
             "| ITL p50 / p99 vs step "
             "| TTFT p50 / p99 vs prefill | fresh | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r: dict, key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "–"

    for r in results["cells"]:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['budget']} | {r['itl_target_ms_requested']:g} | {r['error']} |")
            continue
        eager = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["eager_steps"].items())) or "0"
        run = r["itl_target_ms_reported"]
        lines.append(
            f"| {r['scenario']} | {r['budget']} | {r['itl_target_ms_requested'] or 'default'} "
            f"| {f'{run:.2f}' if run else 'none'} ({r['target_source']}) "
            f"| {(r.get('step_budget') or {}).get('tokens_with_decode', '–')} | {r['tokens_per_s']:.0f} "
            f"| {r['ttft_ms'].get('p50', 0):.1f} / {r['ttft_ms'].get('p99', 0):.1f} "
            f"| {r['itl_ms'].get('p50', 0):.2f} / {r['itl_ms'].get('p99', 0):.2f} | {100 * r['coverage']:.1f}% "
            f"| {eager} | {r.get('steps_stretched_total', 0):.0f} | {ratio(r, 'ratio_to_gpu_median_ms')} "
            f"| {ratio(r, 'itl_p50_over_step')} / {ratio(r, 'itl_p99_over_step')} "
            f"| {ratio(r, 'ttft_p50_over_prefill')} / {ratio(r, 'ttft_p99_over_prefill')} "
            f"| {'yes' if r['fresh_prompts'] else 'NO'} | {r['errors'] or 0} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    load_bench.add_worker_arguments(parser, preset="llama-1b")
    parser.add_argument("--scenarios", default="long,mixed,decode")
    parser.add_argument("--budgets", default="512,2048,8192", help="tokens a step, comma list")
    parser.add_argument("--itl-targets", default="default",
                        help="inter-token targets in ms, comma list ('default' or 0: the worker's own)")
    parser.add_argument("--settings", default="",
                        help="budget:target pairs instead of the --budgets x --itl-targets grid")
    parser.add_argument("--seconds", type=float, default=10.0, help="load per cell")
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--no-step-times", action="store_true", help="skip timing the FULL-graph step afterwards")
    parser.add_argument("--logs", default="", help="directory for the workers' logs (default: a new temp dir)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True, help="path without extension: writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    from graphkeeper.worker.model.config import PRESETS

    scenarios = parse_scenarios(args.scenarios)
    settings = parse_settings(args.budgets, args.itl_targets, args.settings)
    vocab = PRESETS[args.preset].vocab_size
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="budget-sweep-"))
    logs.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                     "commit": load_bench._commit(), "label": args.label, "preset": args.preset, "dtype": args.dtype,
                     "gpu": load_bench._gpu_name(args.device), "host": platform.node(), "seconds": args.seconds,
                     "client_procs": args.client_procs, "settings": [s.label for s in settings], "cells": []}
    for scenario in scenarios:
        for setting in settings:
            name = f"{scenario}-{setting.budget}-{setting.itl_target_ms:g}"
            try:
                row = load_bench.run_cell(args, scenario, setting.worker_flags(scenario), logs / f"{name}.log", vocab)
                cell = sweep_row(scenario, setting, row)
            except RuntimeError as err:  # a worker that did not start: say so, sweep on
                cell = {"scenario": scenario, "setting": setting.label, "budget": setting.budget,
                        "itl_target_ms_requested": setting.itl_target_ms, "error": str(err)[-500:]}
            results["cells"].append(cell)
            print(f"  {setting.label}: target asked {setting.itl_target_ms:g} ms, run "
                  f"{cell.get('itl_target_ms_reported') or 0:.2f} ms ({cell.get('target_source', cell.get('error'))})"
                  f"{'' if cell.get('fresh_prompts', True) else ', SOME PROMPTS HIT THE PREFIX CACHE'}", flush=True)
            write(results, out)
    measured = [c for c in results["cells"] if "error" not in c]
    if measured and not args.no_step_times:
        results["full_step"] = load_bench.add_gpu_ratios(args, measured)
    write(results, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}; plot: python bench/plot_budget_sweep.py "
          f"{out.with_suffix('.json')}", flush=True)
    return 0 if len(measured) == len(results["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
