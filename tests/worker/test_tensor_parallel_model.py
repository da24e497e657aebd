"""Tensor parallelism of the model on the CPU: two real rank processes over Gloo, each holding half
the heads and MLP channels, run the same step plans (batched prefill, a prefix-cache hit beside
decoding rows, greedy decode steps, paged KV) and compute what one process holding the whole
model computes: the same greedy tokens, float32 logits within 1e-5, from a random preset and
from a safetensors directory. Loading a shard reads exactly the whole model's weights, split;
sizes that cannot split a model are refused with the reason."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy
from tp_harness import DECODE_STEPS, PROMPTS, run_ranks, single, traced_setup

from graphkeeper.worker.model import llama
from graphkeeper.worker.model.catalog import DEFAULT_BUILTIN
from graphkeeper.worker.model.config import PRESETS
from graphkeeper.worker.model.loader import (
    ModelSourceError,
    Part,
    TensorEntry,
    load_model,
    part_byte_ranges,
    rank_part,
    save_hf_directory,
)
from graphkeeper.worker.model.tensor_parallel import (
    SINGLE,
    TensorParallel,
    all_reduce,
    shard_config,
    tp_config_error,
)

SOURCE = "random:tiny@5"
TOLERANCE = 1e-5


def assert_ranks_equal_one_process(ranks: list[dict], whole: dict, heads=(2, 1, 64), tolerance=TOLERANCE) -> None:
    """Rank 0 computes the whole model's tokens and logits; every other rank the very same bits.
    ``heads``: each rank's (query heads, kv heads, MLP channels), by default tiny's 4, 2, 128 halved."""
    assert [r["heads"] for r in ranks] == [heads] * len(ranks)
    assert all(r["kv_cache_shape"][3] == heads[1] for r in ranks)  # each rank's cache holds its kv heads
    assert [r["agreed"] for r in ranks] == ["rank 0's choice"] * len(ranks)  # a timing decision is rank 0's
    first = ranks[0]
    assert first["tokens"] == whole["tokens"]
    for got, want in zip(first["logits"], whole["logits"], strict=True):
        assert (got - want).abs().max().item() <= tolerance
    # Every rank samples for itself, so every rank must compute the very same logits.
    for other in ranks[1:]:
        assert other["tokens"] == first["tokens"]
        for a, b in zip(other["logits"], first["logits"], strict=True):
            assert torch.equal(a, b)


def test_two_gloo_ranks_compute_the_one_process_tokens_and_logits(tmp_path):
    whole = single(SOURCE, "cpu")
    assert len(whole["tokens"]) == 2 + DECODE_STEPS
    assert_ranks_equal_one_process(run_ranks(2, SOURCE, "cpu", tmp_path), whole)


def test_two_ranks_with_compiled_pieces_trace_the_all_reduce_and_compute_the_same(tmp_path):
    """torch.compile traces each rank's pieces with the functional all-reduce inside: one graph
    per piece (``fullgraph=True``: no break around the collective; no recompilation across the
    steps' sizes), and the same tokens and logits."""
    ranks = run_ranks(2, SOURCE, "cpu", tmp_path, setup=traced_setup)
    assert [r["compiled_graphs"] for r in ranks] == [3, 3]  # first, middle, last
    assert_ranks_equal_one_process(ranks, single(SOURCE, "cpu"))


def test_two_ranks_loading_a_safetensors_directory_match_one_process_and_transformers(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    save_hf_directory(load_model(SOURCE, device="cpu", dtype="float32", max_positions=64).model, checkpoint)
    whole = single(str(checkpoint), "cpu")
    out = tmp_path / "ranks"
    out.mkdir()
    ranks = run_ranks(2, str(checkpoint), "cpu", out)
    assert_ranks_equal_one_process(ranks, whole)
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for slot, prompt in enumerate(PROMPTS):  # each sequence's greedy tokens, step by step
        ours = [step[slot] for step in ranks[0]["tokens"]]
        assert ours == hf_greedy(hf, prompt, len(ours)), f"prompt {slot}"


def test_three_ranks_of_the_builtin_gguf_model_compute_the_one_process_tokens(tmp_path):
    """SmolLM2-135M (9 query heads, 3 key/value heads, 1536 channels) split three ways: each rank
    dequantizes a tensor at a time and keeps its third."""
    whole = single(DEFAULT_BUILTIN, "cpu")
    ranks = run_ranks(3, DEFAULT_BUILTIN, "cpu", tmp_path)
    # Its logits reach about 30 (tiny's stay below one): 1e-5 of their scale, as float32 rounding goes.
    scale = max(logits.abs().max().item() for logits in whole["logits"])
    assert_ranks_equal_one_process(ranks, whole, heads=(3, 1, 512), tolerance=TOLERANCE * scale)


@pytest.mark.parametrize("source", ["random", "safetensors"])
def test_each_rank_loads_exactly_its_part_of_the_whole_models_weights(tmp_path, source):
    whole = load_model(SOURCE, device="cpu", dtype="float32", max_positions=64)
    where = SOURCE
    if source == "safetensors":
        where = str(tmp_path)
        save_hf_directory(whole.model, tmp_path)
    params = dict(whole.model.named_parameters())
    revision = load_model(where, device="cpu", dtype="float32", max_positions=64).revision
    for rank in range(2):
        tp = TensorParallel(rank, 2)  # loading needs no process group
        shard = load_model(where, device="cpu", dtype="float32", max_positions=64, tp=tp)
        assert shard.full_config == whole.config and shard.config == shard_config(whole.config, 2)
        assert shard.tp == tp and shard.revision == revision
        for name, param in shard.model.named_parameters():
            assert torch.equal(param, rank_part(name, params[name], whole.config, tp)), name
    wqkv = rank_part("layers.0.attention.wqkv.weight", params["layers.0.attention.wqkv.weight"], whole.config,
                     TensorParallel(1, 2))
    head_dim = whole.config.head_dim  # rank 1: query heads 2-3, kv head 1
    q, k, v = params["layers.0.attention.wqkv.weight"].split([4 * head_dim, 2 * head_dim, 2 * head_dim])
    assert torch.equal(wqkv, torch.cat([q[2 * head_dim:], k[head_dim:], v[head_dim:]]))


@pytest.mark.parametrize(("size", "reason"), [
    (3, "4 attention heads do not split evenly over tensor parallel size 3"),
    (4, "2 key/value heads do not split evenly over tensor parallel size 4"),
    (0, "tensor parallel size 0 is not a positive integer"),
])
def test_a_size_that_cannot_split_the_model_is_refused_with_the_reason(size, reason):
    config = PRESETS["tiny"]
    assert reason in tp_config_error(config, size)
    with pytest.raises(ValueError, match=reason):
        shard_config(config, size)
    with pytest.raises(ModelSourceError, match=reason):
        load_model("random:tiny", device="cpu", max_positions=64, tp=TensorParallel(0, size))


def test_intermediate_channels_must_split_too():
    config = dataclasses.replace(PRESETS["tiny"], intermediate_size=129)
    assert tp_config_error(config, 2) == ("the model's 129 MLP intermediate channels do not split evenly over "
                                          "tensor parallel size 2")
    assert tp_config_error(PRESETS["llama-8b"], 8) is None  # 32 heads, 8 kv heads, 14336 channels
    assert tp_config_error(PRESETS["llama-8b"], 16) is not None


def test_shard_config_divides_heads_and_channels_and_keeps_the_rest():
    config = PRESETS["llama-8b"]
    shard = shard_config(config, 2)
    assert (shard.n_heads, shard.n_kv_heads, shard.intermediate_size) == (16, 4, 7168)
    assert (shard.dim, shard.head_dim, shard.vocab_size, shard.n_layers) == (4096, 128, 128256, 32)
    assert shard_config(config, 1) is config


def test_one_rank_adds_no_collective_to_the_step(monkeypatch):
    """TP=1 is the step as it was: the all-reduce is never called, and ``all_reduce`` itself
    returns its input untouched without touching torch.distributed."""
    x = torch.ones(3)
    assert all_reduce(x, SINGLE) is x

    def forbidden(*args, **kwargs):
        raise AssertionError("a one-rank step called the all-reduce")

    monkeypatch.setattr(llama, "all_reduce", forbidden)
    loaded = load_model(SOURCE, device="cpu", dtype="float32", max_positions=64)
    hidden = loaded.model(torch.tensor([5, 6, 7]), torch.arange(3),
                          lambda layer, q, k, v: q.reshape(q.shape[0], -1))
    assert hidden.shape == (3, loaded.config.dim)


def test_a_shard_cannot_be_saved_as_a_whole_model(tmp_path):
    shard = load_model(SOURCE, device="cpu", dtype="float32", max_positions=64, tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match="one tensor-parallel rank's shard"):
        save_hf_directory(shard.model, tmp_path)


def test_the_builtin_gguf_model_splits_over_three_ranks_but_not_two():
    config = load_model(DEFAULT_BUILTIN, device="cpu", dtype="float32", max_positions=64).config
    assert tp_config_error(config, 3) is None
    assert tp_config_error(config, 2) == "the model's 9 attention heads do not split evenly over tensor parallel size 2"


def test_fp8_shards_keep_the_one_process_scales_of_their_rows():
    """Per-channel fp8: a column-parallel shard's rows and scales are exactly the one-process
    model's (a row's scale is its own); a row-parallel shard scales its columns of every row."""
    whole = load_model(SOURCE, device="cpu", dtype="float32", max_positions=64, quantization="fp8")
    tp = TensorParallel(1, 2)
    shard = load_model(SOURCE, device="cpu", dtype="float32", max_positions=64, quantization="fp8", tp=tp)
    for name in ("attention.wqkv", "feed_forward.w13"):
        mine = shard.model.get_submodule(f"layers.0.{name}")
        full = whole.model.get_submodule(f"layers.0.{name}")
        weight = f"layers.0.{name}.weight"
        assert torch.equal(mine.scale, rank_part(weight, full.scale, whole.config, tp))
        assert torch.equal(mine.weight.view(torch.uint8),
                           rank_part(weight, full.weight.view(torch.uint8), whole.config, tp))
    wo = shard.model.layers[0].attention.wo
    assert wo.scale.shape == (whole.config.dim,) and wo.weight.shape == (whole.config.dim, 2 * whole.config.head_dim)


@pytest.mark.parametrize("quantization", ["fp8", "fp8-tensor"])
def test_fp8_ranks_stay_as_close_to_float32_as_one_fp8_process(tmp_path, quantization):
    """Each rank quantizes its own shard: the prefill's logits are as far from float32's as one
    process's fp8 logits are (about 0.02 on tiny), not further. (Later steps are not compared:
    fp8 rounding may turn a near-tie the other way and the sequences part.)"""
    exact = single(SOURCE, "cpu")["logits"][0]
    one = single(SOURCE, "cpu", quantization=quantization)["logits"][0]
    ranks = run_ranks(2, SOURCE, "cpu", tmp_path, quantization=quantization)
    bound = 2 * (one - exact).abs().max().item()
    assert 0 < (ranks[0]["logits"][0] - exact).abs().max().item() <= bound
    assert torch.equal(ranks[1]["logits"][0], ranks[0]["logits"][0])


ROW_PIECES_RANK = textwrap.dedent('''
    import sys
    import torch
    from graphkeeper.worker.model.llama import make_row_pieces
    from graphkeeper.worker.model.loader import load_model
    from graphkeeper.worker.model.tensor_parallel import end_rank, init_tensor_parallel, shard_range

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    rank, init_method = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, init_method, "cpu")
    whole = load_model("random:tiny@4", device="cpu", dtype="float16", max_positions=32).model
    shard = load_model("random:tiny@4", device="cpu", dtype="float16", max_positions=32, tp=tp).model
    row = make_row_pieces(shard.config, tp)
    tokens, positions = torch.tensor([17]), torch.tensor([3])
    cos, sin = whole.rope(positions)
    width = whole.config.n_heads * whole.config.head_dim
    attn = torch.randn(1, width, dtype=torch.float16, generator=torch.Generator().manual_seed(1))
    mine = attn[:, shard_range(width, tp)].contiguous()  # what this rank's heads attended to

    def run(model, pieces, attn_out):
        h = pieces.first(tokens, cos, sin, model.tok_embeddings.weight, *model.layers[0].head_weights())[0]
        h = pieces.middle(h, attn_out, cos, sin, *model.layers[0].tail_weights(), *model.layers[1].head_weights())
        return h[0], pieces.last(h[0], attn_out, *model.layers[-1].tail_weights(), model.norm.weight)

    want = run(whole, whole.pieces, attn)
    general, fused = run(shard, shard.pieces, mine), run(shard, row, mine)
    for got in (*general, *fused):
        assert got.shape == (1, whole.config.dim)
    for got, expected in zip((*general, *fused), (*want, *want)):
        assert rel(got, expected) < 5e-3, rel(got, expected)
    print("ok", flush=True)
    end_rank(tp)
''')


def test_fused_row_pieces_split_over_two_ranks_compute_the_whole_models_step(tmp_path):
    """The one-token step's fused row kernels (Triton's interpreter, two Gloo ranks): under tensor
    parallelism the residual is added after the all-reduce, and a layer's output and the final
    hidden state equal the whole model's general pieces on the same input."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    init_method = f"file://{tmp_path / 'rendezvous'}"
    ranks = [subprocess.Popen([sys.executable, "-c", ROW_PIECES_RANK, str(rank), init_method], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0 and out.strip().endswith("ok"), out[-2000:] + err[-4000:]


DEAD_PEER_RANK = textwrap.dedent('''
    import os, sys, time
    import torch
    from graphkeeper.worker.model.tensor_parallel import all_reduce, init_tensor_parallel

    rank, init_method, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    tp = init_tensor_parallel(rank, 2, init_method, "cpu", timeout_s=4)
    if rank == 1:
        if fault == "stalls":
            time.sleep(60)  # alive, connected, and never joins the collective
        os._exit(0)  # dies without leaving the group, as a crashed rank does
    start = time.monotonic()
    try:
        all_reduce(torch.ones(4), tp)
    except RuntimeError as err:
        print(f"raised after {time.monotonic() - start:.1f} s: {str(err).splitlines()[0]}", flush=True)
        os._exit(3)  # as a failing rank ends: its own code, no barrier, no teardown of the broken group
    print("no error")
''')


@pytest.mark.parametrize(("fault", "within_s", "says"), [("dies", 3.0, "Connection"), ("stalls", 30.0, "Timed out")])
def test_a_dead_or_stalled_peer_makes_the_all_reduce_raise_not_hang(tmp_path, fault, within_s, says):
    """A rank that dies without a word: its peer's next all-reduce raises at once (Gloo sees the
    connection reset). A rank that stalls: the all-reduce raises after the group's timeout (4 s
    here). Either way the survivor gets an error naming the cause, and decides how to end."""
    init_method = f"file://{tmp_path / 'rendezvous'}"
    ranks = [subprocess.Popen([sys.executable, "-c", DEAD_PEER_RANK, str(rank), init_method, fault],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    assert ranks[0].returncode == 3 and out.startswith("raised after"), out + err[-3000:]
    assert says.lower() in out.lower(), out
    assert float(out.split()[2]) < within_s, out


def test_a_shard_reads_only_its_rows_or_columns_of_a_safetensors_tensor():
    """A [4, 6] float32 tensor at byte 100: rank 1 of 2 reads rows 2-3 in one read, or columns
    3-5 of each row in one read per row (12 bytes at 100 + 12 + 24 i)."""
    entry = TensorEntry(Path("x.safetensors"), 100, 100 + 4 * 6 * 4, torch.float32, (4, 6))
    tp = TensorParallel(1, 2)
    assert part_byte_ranges(entry, Part(0, tp), 48) == [(148, slice(0, 48))]
    assert part_byte_ranges(entry, Part(1, tp), 48) == [(100 + 12 + 24 * i, slice(12 * i, 12 * (i + 1)))
                                                   for i in range(4)]
    assert part_byte_ranges(entry, None, 96) == [(100, slice(0, 96))]
    assert Part(1, tp).full_shape((4, 3)) == (4, 6) and Part(0, tp).full_shape((2, 6)) == (4, 6)
