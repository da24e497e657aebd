"""Draws a step budget sweep's plot from its JSON (``bench/budget_sweep.py`` writes it; this step
needs matplotlib, the ``bench`` extra, and runs anywhere: the GPU machine has none).

One panel per scenario: time to first token (p50 filled, p99 hollow, joined) against inter-token
latency p99, one point per setting, labelled ``budget/target``. The settings worth having sit
bottom-left; a setting that buys TTFT with ITL moves up-left or down-right of its neighbours.

    python bench/plot_budget_sweep.py bench/results/budget-sweep-h200.json   # writes ...-h200.png beside it
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
from plot_sweep import draw_from_json  # noqa: E402 - the plot scripts' one command line


class Point(NamedTuple):
    label: str  # budget/target
    itl_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float


def points(results: dict) -> dict[str, list[Point]]:
    """The plot's input: per scenario (in the sweep's order), one point per setting that ran and
    measured both a first token and a gap between tokens (a failed cell has no point)."""
    out: dict[str, list[Point]] = {}
    for cell in results["cells"]:
        ttft, itl = cell.get("ttft_ms") or {}, cell.get("itl_ms") or {}
        if "error" in cell or "p50" not in ttft or "p99" not in itl:
            continue
        out.setdefault(cell["scenario"], []).append(Point(cell["setting"], itl["p99"], ttft["p50"], ttft["p99"]))
    return out


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = points(results)
    if not panels:
        raise SystemExit("no cell measured TTFT and ITL: nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8), squeeze=False)
    for ax, (scenario, pts) in zip(axes[0], panels.items(), strict=True):
        colours = [plt.get_cmap("tab10")(i % 10) for i in range(len(pts))]
        for p, colour in zip(pts, colours, strict=True):
            ax.plot([p.itl_p99_ms] * 2, [p.ttft_p50_ms, p.ttft_p99_ms], color=colour, linewidth=1, alpha=0.6)
            ax.scatter(p.itl_p99_ms, p.ttft_p50_ms, color=colour, s=50, zorder=3)
            ax.scatter(p.itl_p99_ms, p.ttft_p99_ms, facecolors="none", edgecolors=colour, s=50, zorder=3)
            ax.annotate(p.label, (p.itl_p99_ms, p.ttft_p50_ms), textcoords="offset points", xytext=(5, -10),
                        fontsize="small")
        ax.set(xlabel="ITL p99 (ms)", ylabel="TTFT (ms): p50 filled, p99 hollow", title=scenario)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"step budget sweep: random:{results['preset']} on {results['gpu']}\n"
                 f"commit {results['commit'][:8]}, {results['seconds']:g} s a cell; labels: budget/ITL target",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    return draw_from_json(plot, __doc__, argv)

if __name__ == "__main__":
    sys.exit(main())
