"""The decoder computes what Hugging Face transformers' LlamaForCausalLM computes on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphkeeper.worker.model.attention import AttentionMetadata, SlotAttention
from graphkeeper.worker.model.config import PRESETS, ModelConfig
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import load_model, save_hf_directory
from graphkeeper.worker.plan import PrefillChunk

transformers = pytest.importorskip("transformers")

TINY = PRESETS["tiny"]
CONFIGS = {
    "gqa-untied-llama3-rope": TINY,
    "tied-embeddings": dataclasses.replace(TINY, tie_word_embeddings=True, n_kv_heads=4),
    "plain-rope-mha-3-layers": dataclasses.replace(
        TINY, rope_scaling={}, rope_theta=10000.0, n_kv_heads=6, n_layers=3, dim=96, n_heads=6
    ),
    "gqa-8-to-2-llama3-rope": dataclasses.replace(
        TINY, n_heads=8, n_kv_heads=2, dim=128, rope_scaling={**TINY.rope_scaling, "factor": 8.0}
    ),
}


def ours_from_config(config: ModelConfig, tmp_path, seed: int = 7):
    """Random weights in our layout, saved as an HF directory and loaded back through the loader."""
    from graphkeeper.worker.model import config as config_module

    name = f"parity-{seed}"
    config_module.PRESETS[name] = config
    try:
        built = load_model(f"random:{name}@{seed}", device="cpu", dtype="float32", max_positions=256)
    finally:
        del config_module.PRESETS[name]
    save_hf_directory(built.model, tmp_path)
    return load_model(str(tmp_path), device="cpu", dtype="float32", max_positions=256)


def prefill_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """Logits for every prompt position through our model, one prefill chunk in slot 0."""
    cache = KVCache(loaded.config, num_slots=1, max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32)
    attention = SlotAttention(loaded.config, cache)
    n = len(prompt)
    positions = torch.arange(n)
    attention.bind(AttentionMetadata(
        slots=torch.zeros(n, dtype=torch.long), positions=positions,
        lengths=torch.zeros(0, dtype=torch.long), kv_rows=positions, num_decode=0,
        prefill=[PrefillChunk(row=0, length=n, slot=0, start=0)],
    ))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(prompt), positions, attention)
        return loaded.model.logits(hidden)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_within_1e4_relative(name, tmp_path):
    loaded = ours_from_config(CONFIGS[name], tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = torch.randint(0, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(loaded, prompt)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].float()
    rel = (ours - theirs).norm() / theirs.norm()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
