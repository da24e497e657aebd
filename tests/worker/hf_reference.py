"""The reference the worker's tokens are checked against: Hugging Face ``transformers`` greedy
decoding on the same random tiny weights the worker loads (saved as an HF directory)."""

from __future__ import annotations

from pathlib import Path

import torch

from graphkeeper.worker.model.loader import load_model, save_hf_directory


def tiny_hf_model(path: Path):
    """``random:tiny@11`` in float32 saved to ``path`` and loaded back by ``transformers``, with its
    EOS cleared: the worker is asked to ignore EOS for the requests compared with it."""
    import transformers

    built = load_model("random:tiny@11", device="cpu", dtype="float32", max_positions=256)
    save_hf_directory(built.model, path)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens after ``prompt``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
