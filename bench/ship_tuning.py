"""Adds kernel tuning measured on a GPU to the tables the worker ships (worker/model/tuned/).

A worker that measured its kernel tuning wrote ``tuning-<key>.json`` under its compile cache
directory; each such file found under the paths given becomes the entry, for its GPU model and
model shapes, of ``<table dir>/<gpu>.json`` (an entry for the same GPU, PDL switch and shapes is
replaced). A later start on that GPU model with no tuning cache installs the entry instead of
timing every candidate (worker/model/shipped_tuning.py).

    python bench/ship_tuning.py /tmp/compile-caches            # after bench/start_bench.py --cache-root
    python bench/ship_tuning.py --table-dir DIR tuning-abc.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from graphkeeper.worker.model import shipped_tuning


def records(paths: list[str]) -> list[tuple[Path, dict]]:
    """The tuning cache files at or under ``paths``, parsed (a file that does not parse is named and skipped)."""
    found: list[tuple[Path, dict]] = []
    for given in map(Path, paths):
        for path in sorted(given.rglob("tuning-*.json")) if given.is_dir() else [given]:
            try:
                data = json.loads(path.read_text())
                data["facts"]["device"], data["linear"], data["row"]  # noqa: B018 - the fields an entry needs
            except (OSError, ValueError, KeyError, TypeError) as err:
                print(f"skipped {path}: {err}", file=sys.stderr)
                continue
            found.append((path, data))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="tuning-*.json files, or directories to search")
    parser.add_argument("--table-dir", default=str(shipped_tuning.TABLE_DIR))
    args = parser.parse_args()
    table_dir = Path(args.table_dir)
    table_dir.mkdir(parents=True, exist_ok=True)
    found = records(args.paths)
    for path, record in found:
        reason = shipped_tuning.unusable(record)
        if reason:
            print(f"skipped {path}: {reason}", file=sys.stderr)
            continue
        table = table_dir / shipped_tuning.table_name(record["facts"]["device"])
        current = json.loads(table.read_text()) if table.is_file() else {"entries": []}
        table.write_text(json.dumps(shipped_tuning.add(current, record), indent=1) + "\n")
        shapes = ", ".join(f"{s[0]} {s[1]}x{s[2]}" for s in record["facts"]["shapes"] if len(s) > 3)
        print(f"{table}: {record['facts']['device']}, pdl {record['facts']['pdl']}: {shapes}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
