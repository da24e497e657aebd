#!/usr/bin/env bash
# The wheels bench/openai_bench.py installs on the GPU machine (no network there), for CPython 3.12
# on x86_64: GuideLLM's closure less what the GPU image has, and aiohttp's (the worker's HTTP API).
# pyarrow alone is 55 MB, so it goes in a directory of its own: .benchwhl-a (pyarrow), .benchwhl-b
# (the rest, about 32 MiB), each under a device call's 64 MiB carry (bench/openai_bench.py says how).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
all=$root/.benchwhl
mkdir -p "$all" "$root/.benchwhl-a" "$root/.benchwhl-b"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$all" -r "$root/bench/openai_bench_wheels.txt"
rm -f "$root"/.benchwhl-a/*.whl "$root"/.benchwhl-b/*.whl
for w in "$all"/*.whl; do
  case $(basename "$w") in
    pyarrow-*) cp "$w" "$root/.benchwhl-a/" ;;
    *) cp "$w" "$root/.benchwhl-b/" ;;
  esac
done
du -sh "$root/.benchwhl-a" "$root/.benchwhl-b"
