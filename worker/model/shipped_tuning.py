"""Kernel tuning decisions shipped with the worker, per GPU model: what a start whose tuning cache
is empty installs instead of timing every candidate kernel.

Why: a fresh node (or a pod without the shared cache volume) has no tuning cache, and measuring
compiles and times about seventy-five candidate kernels, 9 s of an H100 host's cold start. Which
tile wins depends on the GPU model and the projection's shape, which every pod of a fleet on that
GPU shares; vLLM ships its tuned kernel configurations per device name in the same way. The
winners are still compiled at the start, on several threads (``compile_ahead``), but only they.

A table's entries are tuning cache records (``tuning-<key>.json``, as a start wrote them after
measuring; ``bench/ship_tuning.py`` adds them). An entry applies to a start whose GPU name,
compute capability, PDL switch and projection shapes equal the entry's; the library versions and
kernel source that the cache's key also hashes are recorded but not compared: a tile changes how
fast a product runs, never its result, so after a library or kernel change a shipped decision may
be slower than a fresh measurement, never wrong. A tile that is no longer a candidate (the kernel's
tile list changed) makes its entry unusable, and the start measures.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from graphkeeper.worker.kernels import linear_kernel, row_kernel

log = logging.getLogger(__name__)

#: Where the tables live: one JSON file per GPU model, ``{"entries": [record, ...]}``.
TABLE_DIR = Path(__file__).parent / "tuned"
#: The facts an entry must share with a start (the rest of a record's facts say where it was measured).
MATCHED = ("device", "capability", "pdl", "shapes")


def matches(facts: dict, entry_facts: dict) -> bool:
    """Whether a table entry measured under ``entry_facts`` applies to a start with ``facts`` (pure)."""
    return all(facts.get(name) == entry_facts.get(name) for name in MATCHED)


def lookup(facts: dict, table_dir: Path | None = None) -> dict | None:
    """The first entry of the tables in ``table_dir`` (default ``TABLE_DIR``) that applies to
    ``facts`` and whose tiles are all current candidates; None when there is none. A file that does
    not parse, or an entry that is unusable, is skipped with a warning."""
    table_dir = TABLE_DIR if table_dir is None else table_dir
    for path in sorted(table_dir.glob("*.json")) if table_dir.is_dir() else ():
        try:
            entries = json.loads(path.read_text())["entries"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("shipped tuning table %s unreadable, skipped: %s", path, err)
            continue
        for entry in entries:
            if not isinstance(entry, dict) or not matches(facts, entry.get("facts") or {}):
                continue
            stale = unusable(entry)
            if stale:
                log.warning("shipped tuning table %s: the entry for this GPU and model is unusable (%s): measuring",
                            path, stale)
                continue
            return entry
    return None


def unusable(entry: dict) -> str:
    """Why an entry's decisions cannot be installed ("" when they can): malformed, or a tile that is
    no longer one the kernels would time (pure)."""
    from graphkeeper.worker.model.tuning import decode

    try:
        linear, rows = decode(entry)
    except ValueError as err:
        return str(err)
    for (_n, k, _dt, bucket), tile in linear.items():
        if tile is not None and (tile not in (linear_kernel.ONE_ROW if bucket == 1 else linear_kernel.FEW_ROWS)
                                 or k % tile.block_k):
            return f"linear tile {tile} for k={k}, {bucket} rows is not a candidate"
    for (_mode, _n, _k, _dt), tile in rows.items():
        if tile not in row_kernel.CANDIDATES:
            return f"row tile {tile} is not a candidate"
    return ""


def add(table: dict, record: dict) -> dict:
    """``table`` with ``record`` (a tuning cache record) as its entry for ``record``'s matched facts,
    replacing an entry for the same ones (pure)."""
    facts = record["facts"]
    kept = [e for e in table.get("entries", []) if not matches(facts, e.get("facts") or {})]
    entry = {"facts": facts, "linear": record["linear"], "row": record["row"]}
    return {"entries": [*kept, entry]}


def table_name(device: str) -> str:
    """The table file for a GPU model's name (pure): ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.json``."""
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{slug}.json"
