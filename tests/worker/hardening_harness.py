"""Helpers the hardening tests need beyond worker_harness (which the lead owns), kept apart so
both can change without stepping on each other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
from worker_harness import CONTROL_SERVICE, Worker


def channel_for(worker: Worker, method: str) -> grpc.Channel:
    """The channel a raw (undecoded) call to ``method`` travels on.

    GraphControl moves to its own port with a bearer token; when the harness exposes that
    channel (``Worker.control_channel``, carrying the token) raw control calls use it, so the
    bytes reach the method's decoder instead of stopping at authentication.
    """
    if method.startswith(f"/{CONTROL_SERVICE}/"):
        control = getattr(worker, "control_channel", None)
        if control is not None:
            return control
    return worker.channel


def raw_call(worker: Worker, method: str, payload: bytes, *, streaming: bool, timeout: float) -> object:
    """Sends ``payload`` as the serialized request of ``method``: bytes in, bytes (or a list) out."""
    channel = channel_for(worker, method)
    if streaming:
        return list(channel.unary_stream(method)(payload, timeout=timeout))
    return channel.unary_unary(method)(payload, timeout=timeout)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) process ``pid`` has used so far, from /proc.

    What a refusal costs is measured as work, not wall time: another process on a busy machine
    slows the wall clock, never this count.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), after pid and comm
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


CHAT_CORPUS = ["the graphs replay every decode step", "kubernetes operator reconciles the policy",
               "user assistant system says hello"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def train_tokenizer(corpus: list[str], root: Path, vocab: int = 400) -> Path:
    """A byte-level BPE trained on ``corpus`` (ids below ``vocab``, within the tiny model's
    vocabulary; characters may span tokens), saved as ``root/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = root / "tokenizer.json"
    tok.save(str(out))
    return out


def build_chat_model(root: Path, max_positions: int, *, model: str = "random:tiny",
                     corpus: list[str] = CHAT_CORPUS, template: str | None = CHAT_TEMPLATE) -> Path:
    """``model`` saved under ``root`` with a byte-level BPE trained on ``corpus`` and, unless None,
    a chat template: chat requests, text and log probabilities run for real."""
    from graphkeeper.worker.model.loader import load_model, save_hf_directory

    save_hf_directory(load_model(model, device="cpu", max_positions=max_positions).model, root)
    train_tokenizer(corpus, root)
    if template is not None:
        (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return root
