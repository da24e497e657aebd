"""Draws a sweep's plot from its JSON (``bench/sweep.py`` writes it; this step needs matplotlib,
the ``bench`` extra, and runs anywhere: the GPU machine has none).

Left: predicted coverage (the share of the profile's steps replayed) against graph memory, one
point per cell (the cells worth having sit top-left). Right: generated tokens/s against the capture
stage. Marker shape is the graph mode,
colour the ladder.

    python bench/plot_sweep.py bench/results/sweep-llama1b-h200.json   # writes ...-h200.png beside it
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

MARKERS = {"FullAndPiecewise": "o", "FullDecodeOnly": "s", "Piecewise": "^", "Full": "D", "None": "x"}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in results["cells"] if "error" not in c]
    ladders = sorted({c["ladder"] for c in cells})
    colours = {lad: plt.get_cmap("tab10")(i % 10) for i, lad in enumerate(ladders)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for c in cells:
        style = {"marker": MARKERS.get(c["mode"], "o"), "color": colours[c["ladder"]], "s": 60}
        coverage = (c.get("profile") or {}).get("coverage")
        if coverage is not None:
            left.scatter(c.get("graph_memory_bytes", 0) / 2**20, 100 * coverage, **style)
        right.scatter(c.get("capture_seconds", 0), c.get("tokens_per_s", 0), **style)
    left.set(xlabel="graph memory (MiB)", ylabel="coverage predicted: steps replayed (%)", title="what the graphs buy")
    right.set(xlabel="capture stage (s)", ylabel="generated tokens/s", title="what they cost at startup")
    handles = [plt.Line2D([], [], color=colours[lad], marker="o", linestyle="", label=lad) for lad in ladders]
    handles += [plt.Line2D([], [], color="grey", marker=MARKERS.get(m, "o"), linestyle="", label=m)
                for m in sorted({c["mode"] for c in cells})]
    right.legend(handles=handles, loc="best", fontsize="small")
    fig.suptitle(f"{results['model']} on {results['gpu']} ({results['scenario']}, commit {results['commit'][:8]})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def draw_from_json(draw: Callable[[dict, Path], None], doc: str, argv: list[str] | None = None) -> int:
    """The command line of a plot script: a results JSON in, a PNG beside it (or ``--out``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--out", default="", help="PNG path (default: the JSON's, .png)")
    args = parser.parse_args(argv)
    source = Path(args.json)
    out = Path(args.out) if args.out else source.with_suffix(".png")
    draw(json.loads(source.read_text()), out)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return draw_from_json(plot, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
