"""bench/start_bench.py's reading of a compile cache (the bench itself needs a GPU for its figures):
which kernels a start compiled, and how many variants of each."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from start_bench import triton_variants  # noqa: E402


def test_variants_are_counted_per_kernel_from_the_triton_cache_only(tmp_path):
    triton = tmp_path / "step-key" / "triton"
    for digest, name in (("a1", "_decode_kernel"), ("b2", "_decode_kernel"), ("c3", "triton_poi_fused_0")):
        (triton / digest).mkdir(parents=True)
        for suffix in (".cubin", ".json", ".ptx"):
            (triton / digest / f"{name}{suffix}").write_text("")
        (triton / digest / f"__grp__{name}.json").write_text("")
    (tmp_path / "step-key" / "inductor" / "x").mkdir(parents=True)  # Inductor's own copies are not counted
    (tmp_path / "step-key" / "inductor" / "x" / "_decode_kernel.cubin").write_text("")
    assert triton_variants(str(tmp_path)) == {"_decode_kernel": 2, "triton_poi_fused_0": 1}
    assert triton_variants(str(tmp_path / "missing")) == {}
