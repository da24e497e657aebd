"""Loading at the checkpoint's size: parameters are allocated once in the target dtype
and filled tensor by tensor, so the host's peak while loading a bf16 checkpoint stays near the
weights' size; sharded checkpoints (``model.safetensors.index.json``) load the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphkeeper.worker.model.config import ModelConfig
from graphkeeper.worker.model.loader import (
    INDEX_FILE,
    ModelSourceError,
    _empty_model,
    _fill_random,
    load_model,
    save_hf_directory,
)
from graphkeeper.worker.model.source import check_source

# ~150 MB in bf16: large enough that the interpreter's own noise is a few percent of it.
BIG = ModelConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=4096,
                  max_position_embeddings=4096)
SMALL = ModelConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_size=128,
                    tie_word_embeddings=True, max_position_embeddings=512)


def write_checkpoint(config: ModelConfig, path: Path, dtype: torch.dtype, seed: int = 3) -> int:
    """A random checkpoint of ``config`` in ``dtype``; returns the weights' bytes."""
    model = _empty_model(config, 64, torch.device("cpu"), dtype)
    _fill_random(model, seed, torch.device("cpu"))
    save_hf_directory(model, path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shard(path: Path, parts: int) -> None:
    """Splits ``model.safetensors`` into ``parts`` files with an index, as Hugging Face writes them."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i::parts]}
        save_file(chunk, str(path / file))
        weight_map |= dict.fromkeys(chunk, file)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from graphkeeper.worker.model.loader import load_model
    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
        return out
    load_model("random:tiny", device="cpu", dtype="bfloat16", max_positions=64)  # warm every code path
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS: the peak below is this load's own
    before = status()
    loaded = load_model(sys.argv[1], device="cpu", dtype="bfloat16", max_positions=64)
    after = status()
    print(json.dumps({"before": before, "after": after,
                      "params": sum(p.numel() * p.element_size() for p in loaded.model.parameters())}))
""")


def test_peak_host_memory_while_loading_bf16_stays_near_the_weights(tmp_path):
    weights = write_checkpoint(BIG, tmp_path, torch.bfloat16)
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=True)
    ledger = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = ledger["before"], ledger["after"]
    assert ledger["params"] == weights
    # Library pages the kernel dropped under memory pressure and the load faulted back in are
    # not the loader's: they show as file-backed resident memory that grew.
    refaulted = max(0, after["RssFile"] - before["RssFile"])
    growth = after["VmHWM"] - before["VmRSS"] - refaulted
    # 1.1x the weights, plus 8 MiB for the interpreter's own allocations.
    assert growth <= 1.1 * weights + (8 << 20), f"peak grew {growth / weights:.2f}x the weights: {ledger}"
    assert after["VmRSS"] - before["VmRSS"] >= 0.9 * weights  # the weights really are resident


def _state(path: Path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    loaded = load_model(str(path), device="cpu", dtype=dtype, max_positions=64)
    return {k: v.clone() for k, v in loaded.model.state_dict().items() if not k.startswith("rope")}


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    write_checkpoint(SMALL, single, torch.bfloat16)
    write_checkpoint(SMALL, sharded, torch.bfloat16)
    shard(sharded, 3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    check_source(str(sharded))
    a, b = _state(single), _state(sharded)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # bf16 values widened to float32 exactly; the tied head is the embedding.
    loaded = load_model(str(sharded), device="cpu", dtype="float32", max_positions=64)
    assert loaded.model.output.weight is loaded.model.tok_embeddings.weight
    assert load_model(str(sharded), device="cpu", max_positions=64).revision.startswith("sha256:")


def test_broken_checkpoints_are_refused_with_the_reason(tmp_path):
    write_checkpoint(SMALL, tmp_path, torch.float16)
    shard(tmp_path, 2)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    missing = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / missing).rename(tmp_path / "elsewhere.bin")
    with pytest.raises(ModelSourceError, match="names files that are not in"):
        check_source(str(tmp_path))
    (tmp_path / "elsewhere.bin").rename(tmp_path / missing)
    # A tensor of the wrong shape is named, not copied out of bounds.
    tensors = load_file(str(tmp_path / missing))
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3, dtype=torch.float16)
    save_file(tensors, str(tmp_path / missing))
    with pytest.raises(ModelSourceError, match="has shape"):
        load_model(str(tmp_path), device="cpu", max_positions=64)
    (tmp_path / missing).write_bytes(b"\x01")
    with pytest.raises(ModelSourceError, match="not a safetensors file"):
        load_model(str(tmp_path), device="cpu", max_positions=64)


def test_fp16_checkpoint_converts_on_the_fly(tmp_path):
    write_checkpoint(SMALL, tmp_path, torch.float16, seed=9)
    ref = load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path), device="cpu", dtype="bfloat16", max_positions=64)
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.layers[1].feed_forward.w2.weight,
                       ref["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16))
    q_rows = SMALL.n_heads * SMALL.head_dim
    assert torch.equal(loaded.model.layers[2].attention.wqkv.weight[q_rows:q_rows + SMALL.n_kv_heads * SMALL.head_dim],
                       ref["model.layers.2.self_attn.k_proj.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("source", ["/" + "a" * 5000, "/models/a\x00b", "/tmp/" + "d/" * 3000])
def test_sources_the_os_refuses_are_model_source_errors_with_short_messages(source):
    for attempt in (lambda: check_source(source), lambda: load_model(source, device="cpu", max_positions=16)):
        with pytest.raises(ModelSourceError) as err:
            attempt()
        assert len(str(err.value)) < 200
