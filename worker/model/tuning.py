"""Kernel tuning at startup, and the on-disk cache that lets a restart skip it.

Two decisions are measured on the GPU the worker runs on, for each projection shape of its model:
cuBLAS or the skinny kernel (and which tile) per row bucket (``linear_kernel.tune``), and the
tile of the one-row fused product (``row_kernel.tune``). Timing every candidate takes seconds, and
a restarted pod on the same GPU, libraries and kernel source would measure the same thing, so the
results are kept in ``<cache dir>/tuning-<key>.json``. The key hashes the GPU's name and compute
capability, the torch/triton/CUDA/driver versions, the kernels' source, whether programmatic
dependent launch is on, and the shapes; the file records them, and one whose record differs is
ignored (never installed), as is one that does not parse: tuning measures again and rewrites it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkeeper.worker.kernels import compile_ahead, linear_kernel, pdl, row_kernel, timing
from graphkeeper.worker.kernels.linear_kernel import Tile
from graphkeeper.worker.kernels.row_kernel import RowTile
from graphkeeper.worker.model import shipped_tuning
from graphkeeper.worker.model.cache_key import (
    differences,
    key_of,
    library_versions,
    source_digest,
    write_json_atomically,
)
from graphkeeper.worker.model.tensor_parallel import TensorParallel, first_ranks

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Shape:
    """One projection to tune: its name, its weight (and fp8 scale), and the row-kernel mode."""

    name: str
    weight: torch.Tensor
    scale: torch.Tensor | None
    mode: int  # row_kernel.PLAIN/GLU/ROPE; -1: not a decoder projection (the LM head)
    half: int = 0  # half a head's width, for ROPE


@dataclass
class TuningReport:
    summary: str = ""  # e.g. "skinny 4/20": row buckets where the skinny kernel beat cuBLAS
    cache: str = "off"  # off | hit | shipped (the worker's table for this GPU) | miss
    seconds: float = 0.0
    path: str = ""


def model_shapes(model) -> list[Shape]:
    """The decoder's four projections (one layer stands for all) and the LM head."""
    layer = model.layers[0]
    a, f = layer.attention, layer.feed_forward
    return [Shape("wqkv", a.wqkv.weight, a.wqkv.scale, row_kernel.ROPE, model.config.head_dim // 2),
            Shape("wo", a.wo.weight, a.wo.scale, row_kernel.PLAIN),
            Shape("w13", f.w13.weight, f.w13.scale, row_kernel.GLU),
            Shape("w2", f.w2.weight, f.w2.scale, row_kernel.PLAIN),
            Shape("output", model.output.weight, model.output.scale, -1)]


def shape_facts(shapes: list[Shape], row_pieces: bool, dtype: torch.dtype) -> list[tuple]:
    """What tuning measures, besides the GPU: each projection's shape and dtype, whether its fp8
    scale is per channel, whether the row kernel is tuned, and the activations' dtype (pure)."""
    return [(s.name, *s.weight.shape, str(s.weight.dtype), s.scale is not None and s.scale.numel() > 1)
            for s in shapes] + [("rows", row_pieces), ("dtype", str(dtype))]


def tuning_facts(device_name: str, capability: str, versions: dict[str, str], source: str, pdl_on: bool,
                 shapes: list[tuple]) -> dict:
    """Everything that changes what tuning would measure or choose (pure): what the cache is keyed by."""
    return {"device": device_name, "capability": capability, "versions": versions, "source": source,
            "pdl": pdl_on, "shapes": sorted(map(list, shapes))}


def tuning_key(device_name: str, capability: str, versions: dict[str, str], source: str, pdl_on: bool,
               shapes: list[tuple]) -> str:
    """The cache key (pure): a hex digest of ``tuning_facts``."""
    return key_of(tuning_facts(device_name, capability, versions, source, pdl_on, shapes))


def kernel_source_digest() -> str:
    """The source of the modules that decide what the tuned kernels are."""
    return source_digest([linear_kernel, row_kernel, pdl, timing, sys.modules[__name__]])


def encode(linear: dict, rows: dict) -> dict:
    """The tuning decisions as JSON-ready lists (pure)."""
    return {
        "linear": [[n, k, dt, b, None if t is None else [t.block_n, t.block_k, t.warps, t.stages]]
                   for (n, k, dt, b), t in sorted(linear.items(), key=str)],
        "row": [[mode, n, k, dt, t.block_n, t.warps] for (mode, n, k, dt), t in sorted(rows.items(), key=str)],
    }


def decode(data: dict) -> tuple[dict, dict]:
    """The inverse of ``encode``; raises ValueError on anything malformed (pure)."""
    try:
        linear = {(int(n), int(k), str(dt), int(b)): None if t is None else Tile(*map(int, t))
                  for n, k, dt, b, t in data["linear"]}
        rows = {(int(m), int(n), int(k), str(dt)): RowTile(int(bn), int(w)) for m, n, k, dt, bn, w in data["row"]}
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed tuning cache: {err}") from err
    return linear, rows


def tune_model(model, cache_root: str, row_pieces: bool) -> TuningReport:
    """Tunes ``model``'s projections (the row kernel's only when ``row_pieces``), or installs what
    the cache holds for the same key, or else what the worker's shipped table holds for this GPU and
    these shapes (``shipped_tuning``; its tiles are compiled here, nothing is timed)."""
    shapes = model_shapes(model)
    dtype = model.tok_embeddings.weight.dtype
    device = model.tok_embeddings.weight.device
    facts = tuning_facts(torch.cuda.get_device_name(device),
                         ".".join(map(str, torch.cuda.get_device_capability(device))), library_versions(),
                         kernel_source_digest(), pdl.enabled(), shape_facts(shapes, row_pieces, dtype))
    key = key_of(facts)
    path = Path(os.path.expanduser(cache_root)) / f"tuning-{key}.json"
    report = TuningReport(cache="miss", path=str(path))
    start = time.perf_counter()
    if load(path, key, facts):
        report.cache = "hit"
    elif install_shipped(shapes, facts, dtype, row_pieces):
        report.cache = "shipped"
    else:
        _measure(shapes, dtype, row_pieces)
        _save(path, key, facts)
    report.seconds = time.perf_counter() - start
    report.summary = _summary(shapes)
    where = "the worker's table for this GPU; not written to the node's cache" if report.cache == "shipped" else path
    log.info("kernel tuning %s in %.1f s (%s): %s", report.cache, report.seconds, where, report.summary)
    return report


def install_shipped(shapes: list[Shape], facts: dict, dtype: torch.dtype, row_pieces: bool) -> bool:
    """Installs the shipped table's decisions for these facts, when it has usable ones, and compiles
    the tiles they chose (on ``compile_ahead``'s threads); False when it has none. Not written to
    the node's cache: the cache holds what was measured on the node, and a newer worker's table
    must not be shadowed by an older one's copy."""
    entry = shipped_tuning.lookup(facts)
    if entry is None:
        return False
    linear, rows = decode(entry)
    halves = {(s.mode, *s.weight.shape, str(s.weight.dtype)): s.half for s in shapes if s.mode >= 0}
    for (mode, n, k, dt), tile in rows.items():
        if not row_kernel.fits(tile, mode, k, halves.get((mode, n, k, dt), 0)):
            log.warning("shipped tuning: row tile %s does not fit mode %d, k=%d: measuring", tile, mode, k)
            return False
    _install(linear, rows)
    with compile_ahead.compiling("shipped tuning's tiles"):
        _compile_chosen(shapes, dtype, row_pieces)
    return True


def _compile_chosen(shapes: list[Shape], dtype: torch.dtype, row_pieces: bool) -> None:
    """Launches each projection's installed tiles once, as tuning launches its candidates: inside
    ``compile_ahead.compiling`` the launches only compile."""
    _each_projection(shapes, dtype, row_pieces, linear_kernel.compile_chosen, row_kernel.compile_chosen)


def _measure(shapes: list[Shape], dtype: torch.dtype, row_pieces: bool) -> None:
    _each_projection(shapes, dtype, row_pieces, linear_kernel.tune, row_kernel.tune)


def _each_projection(shapes: list[Shape], dtype: torch.dtype, row_pieces: bool, linear, row) -> None:
    """``linear(weight, scale, dtype)`` once per distinct weight shape and dtype, and (with
    ``row_pieces``) ``row(mode, weight, scale, dtype, half)`` for every decoder projection: what
    tuning measures, and what installed decisions compile."""
    seen = set()
    for s in shapes:
        key = (tuple(s.weight.shape), s.weight.dtype)
        if key not in seen:
            seen.add(key)
            linear(s.weight, s.scale, dtype)
        if row_pieces and s.mode >= 0:
            row(s.mode, s.weight, s.scale, dtype, s.half)


def _summary(shapes: list[Shape]) -> str:
    choices = linear_kernel.choices()
    won = total = 0
    for n, k, dt in {(*s.weight.shape, str(s.weight.dtype)) for s in shapes}:
        for b in linear_kernel.BUCKETS:
            if (n, k, dt, b) in choices:
                total += 1
                won += choices[(n, k, dt, b)] is not None
    return f"skinny {won}/{total}" if total else ""


def load(path: Path, key: str, facts: dict) -> bool:
    """Installs the decisions ``path`` holds, when it was written for ``key`` and ``facts``.

    A file written for other facts (another GPU, driver or library; copied in from elsewhere, or
    without a record of its facts) is ignored with a warning naming what differs, and nothing of
    it is installed; a file that does not parse is measured again.
    """
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        diff = ["key"] if data.get("key") != key else differences(facts, data.get("facts"))
        if diff:
            log.warning("tuning cache %s was written for other facts (it differs in %s): ignored, measuring again",
                        path, ", ".join(diff))
            return False
        linear, rows = decode(data)
    except (OSError, ValueError) as err:
        log.warning("tuning cache %s unreadable, measuring again: %s", path, err)
        return False
    _install(linear, rows)
    return True


def _install(linear: dict, rows: dict) -> None:
    for (n, k, dt, b), tile in linear.items():
        linear_kernel.remember(n, k, dt, b, tile)
    for (mode, n, k, dt), tile in rows.items():
        row_kernel.remember(mode, n, k, dt, tile)


def adopt_first_ranks(tp: TensorParallel) -> None:
    """Installs rank 0's decisions on every tensor-parallel rank (nothing with one rank): the
    ranks' shards have the same shapes, so rank 0's tiles fit them all, and the ranks then run
    the same kernels where they must compute the same bits (``first_ranks``)."""
    if tp.enabled:
        _install(*decode(first_ranks(encode(linear_kernel.choices(), row_kernel.choices()), tp)))


def _save(path: Path, key: str, facts: dict) -> None:
    """Written atomically under a name of this process's own: workers on one node share the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        decisions = encode(linear_kernel.choices(), row_kernel.choices())
        write_json_atomically(path, {"key": key, "facts": facts, **decisions})
    except OSError as err:  # a read-only cache costs the next start its tuning, nothing else
        log.warning("tuning cache %s not written: %s", path, err)
