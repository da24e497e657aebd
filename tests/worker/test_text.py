"""Text at the API layer: a model directory with tokenizer.json takes text prompts and
streams text deltas beside the token ids; the deltas add up to the decoded output, multi-byte
characters included; without a tokenizer a text prompt is refused by name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
from hardening_harness import cpu_seconds, train_tokenizer
from worker_harness import GRAPHKEEPER, generate, make_request

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.model.loader import load_model, save_hf_directory
from graphkeeper.worker.model.tokenizer import IncrementalDetokenizer
from graphkeeper.worker.model.tokenizer import Tokenizer as WorkerTokenizer

CORPUS = ["the graphs replay every decode step", "café crème brûlée — naïve façade", "日本語のテキスト 🚀 emoji",
          "kubernetes operator reconciles the policy"] * 20


def build_tokenizer(path: Path, vocab: int = 400) -> Path:
    """A small byte-level BPE: its ids fit the tiny model's vocabulary, and characters span tokens."""
    return train_tokenizer(CORPUS, path, vocab)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text-model")
    save_hf_directory(load_model("random:tiny", device="cpu", max_positions=512).model, root)
    build_tokenizer(root)
    return root


def test_deltas_add_up_to_the_decoded_ids_one_id_at_a_time(tmp_path):
    tok = WorkerTokenizer.from_file(build_tokenizer(tmp_path))
    for text in CORPUS[:4]:
        ids = tok.encode_ids(text)
        detok = IncrementalDetokenizer(tok, [])
        pieces = [detok.add([i]) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)  # an incomplete character is held back, never sent


def test_a_tokens_text_is_its_own_decoding_every_time_it_is_asked(tmp_path):
    """``token_text`` keeps what it decoded: asked again, it answers the same text, and each
    answer is the token decoded alone with special tokens kept."""
    tok = WorkerTokenizer.from_file(build_tokenizer(tmp_path))
    ids = [*tok.encode_ids(CORPUS[1]), 0, 399]
    first = [tok.token_text(i) for i in ids]
    assert first == [tok._tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [tok.token_text(i) for i in reversed(ids)] == first[::-1]


def test_a_text_prompt_streams_text_beside_the_ids(fresh_workers, text_model):
    worker = fresh_workers("--max-seq-len", "256", "--max-num-batched-tokens", "64", model=str(text_model))
    tok = WorkerTokenizer.from_file(text_model / "tokenizer.json")
    text = "café crème 🚀 the graphs"
    request = pb.GenerateRequest(prompt_text=text, stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
    ids, deltas, completion = [], [], None
    for response in worker.inference.Generate(request, timeout=60):
        if response.HasField("tokens"):
            ids.extend(response.tokens.token_ids)
            deltas.append(response.tokens.text)
        else:
            completion = response.completion
    assert completion.prompt_tokens == len(tok.encode_ids(text))
    assert len(ids) == completion.generated_tokens == 24
    assert "".join(deltas) == tok.decode(ids)
    # The same prompt as ids gives the same tokens: the worker tokenized exactly as the tokenizer does.
    same, _ = generate(worker, make_request(tok.encode_ids(text), 24))
    assert same == ids
    cli = subprocess.run([str(GRAPHKEEPER), "generate", "--target", worker.target, "--prompt", text,
                          "--max-new-tokens", "24", "--json"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    doc = json.loads(cli.stdout)
    assert (doc["token_ids"], doc["text"]) == (ids, tok.decode(ids))


def test_text_prompts_are_refused_by_name_without_a_tokenizer(worker):
    request = pb.GenerateRequest(prompt_text="hello", stopping=pb.StoppingCriteria(max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_text") and "tokenizer" in err.value.details()
    both = pb.GenerateRequest(prompt_text="hi", prompt_token_ids=[1], stopping=pb.StoppingCriteria(max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, both)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_messages_to_a_tokenizer_without_a_chat_template_are_refused_by_name(fresh_workers, text_model):
    worker = fresh_workers("--max-seq-len", "256", "--max-num-batched-tokens", "64", model=str(text_model))
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")],
                                 stopping=pb.StoppingCriteria(max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in err.value.details() and "no chat template" in err.value.details()
    tokens, _ = generate(worker, make_request([1, 2, 3], 2))
    assert len(tokens) == 2


def test_a_text_prompt_too_long_for_the_context_is_refused_before_tokenizing(fresh_workers, text_model):
    """A client looping 1 MiB prompts (1 KB gzipped) must not buy a tokenization each: the byte
    length alone shows the text cannot fit, so the refusal costs milliseconds of the worker's CPU
    (tokenizing it costs about a second here), names prompt_text, and is counted as oversize."""
    worker = fresh_workers("--max-seq-len", "256", "--max-num-batched-tokens", "64", model=str(text_model))
    request = pb.GenerateRequest(prompt_text="ab " * 340_000,
                                 stopping=pb.StoppingCriteria(max_new_tokens=1))
    before = cpu_seconds(worker.proc.pid)
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            generate(worker, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("prompt_text: "), err.value.details()
    spent = cpu_seconds(worker.proc.pid) - before
    assert spent < 0.5, f"five refusals cost {spent:.2f} s of the worker's CPU"
    assert worker.metric("graphkeeper_requests_total", outcome="oversize") == 5
    # A prompt that fits by bytes but not in tokens is refused after tokenizing, naming prompt_text too.
    words = " ".join(["graphs"] * 300)
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, pb.GenerateRequest(prompt_text=words, stopping=pb.StoppingCriteria(max_new_tokens=1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_text: tokenizes to"), err.value.details()
