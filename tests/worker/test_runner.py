"""The runner's host side on the CPU: each step's inputs land in the static buffers whatever came
before (two staging buffers are taken in turn), decode rows read their token from the device,
greedy sampling takes the LM head's own dtype, and the warm-up runs a prefill chunk too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.executor.sampling import sample
from graphkeeper.worker.kernels.linear_kernel import warm_rows
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import load_model
from graphkeeper.worker.plan import PrefillChunk, SamplingBatch, SamplingSpec, StepPlan

ROWS = 8


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    loaded = load_model("random:tiny", device="cpu", dtype="float32", max_positions=64)
    cache = KVCache(loaded.config, 4, 64, device=loaded.device, dtype=loaded.dtype)
    return ModelRunner(loaded, cache, max_tokens=32)


def decode_plan(slots: list[int], positions: list[int], tokens: list[int] | None) -> StepPlan:
    n = len(slots)
    return StepPlan(prompt_tokens=[], positions=np.array(positions), slots=np.array(slots), num_decode=n,
                    sample_rows=np.arange(n), sample_slots=np.array(slots),
                    decode_tokens=None if tokens is None else np.array(tokens))


def prefill_plan(slot: int, tokens: list[int]) -> StepPlan:
    n = len(tokens)
    return StepPlan(prompt_tokens=tokens, positions=np.arange(n), slots=np.full(n, slot), num_decode=0,
                    prefill=[PrefillChunk(row=0, length=n, slot=slot, start=0)],
                    sample_rows=np.array([n - 1]), sample_slots=np.array([slot]))


def row(runner: ModelRunner, name: int, rows: int = ROWS) -> list[int]:
    return runner.inputs[name, :rows].tolist()


def test_each_step_finds_its_own_inputs_whatever_ran_before(runner):
    dummy = runner.cache.dummy_slot
    steps = [decode_plan([0, 2, 3], [5, 9, 1], [11, 12, 13]), prefill_plan(1, [21, 22, 23, 24, 25]),
             decode_plan([2], [10], [14]), decode_plan([0, 2, 3], [6, 10, 2], [15, 16, 17])]
    for plan in steps:  # more steps than staging buffers, of different shapes, back to back
        runner.prepare(plan, ROWS)
        n = plan.num_tokens
        want_tokens = list(plan.decode_tokens) if plan.decode_tokens is not None else plan.prompt_tokens
        assert row(runner, runner.TOKENS) == [*want_tokens, *[0] * (ROWS - n)]
        assert row(runner, runner.POSITIONS) == [*plan.positions.tolist(), *[0] * (ROWS - n)]
        assert row(runner, runner.SLOTS) == [*plan.slots.tolist(), *[dummy] * (ROWS - n)]
        assert row(runner, runner.LENGTHS) == [p + 1 for p in row(runner, runner.POSITIONS)]
        ns = plan.num_samples
        assert row(runner, runner.SAMPLE_SLOTS, ns) == plan.sample_slots.tolist()


def test_decode_rows_take_their_slots_latest_token_on_the_device(runner):
    runner.last_tokens[:4] = torch.tensor([40, 41, 42, 43])
    runner.prepare(decode_plan([3, 0, 2], [4, 4, 4], None), ROWS)
    assert row(runner, runner.TOKENS, 3) == [43, 40, 42]


def test_greedy_takes_any_float_dtype_and_drawing_computes_in_float32():
    logits = torch.randn(5, 300).to(torch.bfloat16)
    assert torch.equal(sample(logits, None), logits.float().argmax(-1))
    batch = SamplingBatch.build([SamplingSpec(temperature=0.8, top_k=20, top_p=0.9)] * 5, [7, 8, 9, 10, 11],
                                np.arange(5))
    assert torch.equal(sample(logits, batch), sample(logits.float(), batch))


def test_warm_up_runs_a_prefill_chunk_as_well_as_a_decode_step(runner):
    cache = runner.cache
    dummy = cache.dummy_slot
    cache.k[:, cache.table_host[dummy]] = 0
    runner.warm_up(4)  # the decode rows write position 0 only; the chunk writes the positions after it
    rows = torch.from_numpy(cache.row_index(dummy, np.arange(cache.max_seq_len)))
    written = cache.k[0].flatten(0, 1)[rows].abs().sum(dim=(-1, -2))
    assert written[0] > 0 and (written[1:16] > 0).all()


def test_the_gpu_warm_up_runs_the_decode_step_at_every_row_count_on_the_dummy_slot(runner):
    """What a GPU's warm-up adds (a decode step at each row count Triton specializes on, up to the
    runner's token budget) runs on CPU too, and leaves every real slot's keys as they were."""
    cache = runner.cache
    dummy = cache.dummy_slot
    real = torch.from_numpy(np.concatenate([cache.row_index(s, np.arange(cache.max_seq_len)) for s in range(dummy)]))
    cache.k[0].flatten(0, 1)[real] = 1.0
    before = cache.k[0].flatten(0, 1)[real].clone()
    counts = warm_rows(runner.max_tokens)
    assert counts[-1] == runner.max_tokens == 32 and len(counts) == 18  # 1..17, then 32
    ran = []
    forward = runner.forward_eager
    runner.forward_eager = lambda meta, rows: ran.append(rows) or forward(meta, rows)
    try:
        runner.warm_up(4, every_row_count=True)
    finally:
        del runner.forward_eager
    assert ran[0] == 4 and ran[1:1 + len(counts)] == counts  # the traced call first, then every count
    assert torch.equal(cache.k[0].flatten(0, 1)[real], before)
    assert cache.k[0].flatten(0, 1)[torch.from_numpy(cache.row_index(dummy, np.arange(1)))].abs().sum() > 0


def test_every_step_writes_the_varlen_work_list_and_zeros_past_it(runner):
    """A PIECEWISE graph that recorded the attention launches a program per row of its size and
    reads the work list whatever the step holds, a uniform decode step included: each step writes
    its blocks, and the entries past them hold no rows (a longer step before must not leak in)."""
    runner.prepare(prefill_plan(1, list(range(20, 40))), 24)  # 20 rows: two blocks, then padding
    meta = runner.prepare(decode_plan([0, 2, 3], [5, 9, 1], [11, 12, 13]), ROWS)
    assert meta.num_blocks == 3
    assert row(runner, runner.BLOCK_ROW) == [1, 0, 2, 0, 0, 0, 0, 0]  # the longest context first
    assert row(runner, runner.BLOCK_LEN) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert row(runner, runner.BLOCK_SLOT) == [2, 0, 3, 0, 0, 0, 0, 0]
    assert row(runner, runner.BLOCK_POS) == [9, 5, 1, 0, 0, 0, 0, 0]


def test_the_work_list_holds_the_chunks_blocks_first_then_decode_rows_longest_first(runner):
    """A launch runs its programs about in the work list's order: the chunks' blocks (the longest
    programs) are listed first, then the decode rows from the longest context down; every row of
    the step is in exactly one block."""
    chunk = PrefillChunk(row=3, length=20, slot=1, start=30)
    plan = StepPlan(prompt_tokens=list(range(20)), positions=np.array([4, 12, 8, *range(30, 50)]),
                    slots=np.array([0, 2, 3, *[1] * 20]), num_decode=3, prefill=[chunk],
                    sample_rows=np.array([0, 1, 2, 22]), sample_slots=np.array([0, 2, 3, 1]),
                    decode_tokens=np.array([11, 12, 13]))
    meta = runner.prepare(plan, 24)
    assert meta.num_blocks == 5
    assert row(runner, runner.BLOCK_ROW, 6) == [3, 19, 1, 2, 0, 0]
    assert row(runner, runner.BLOCK_LEN, 6) == [16, 4, 1, 1, 1, 0]
    assert row(runner, runner.BLOCK_SLOT, 6) == [1, 1, 2, 3, 0, 0]
    assert row(runner, runner.BLOCK_POS, 6) == [30, 46, 12, 8, 4, 0]
    firsts, lengths = row(runner, runner.BLOCK_ROW, 5), row(runner, runner.BLOCK_LEN, 5)
    covered = sorted(r for first, n in zip(firsts, lengths, strict=True) for r in range(first, first + n))
    assert covered == list(range(23))


def test_a_mixed_probe_is_decode_rows_then_a_chunk_per_scratch_slot(runner):
    """A PIECEWISE key is validated and timed on the step it serves: half decode rows, the rest
    prefill chunks over consecutive scratch positions, each chunk's last row sampled; its eager
    step runs on the CPU too."""
    from graphkeeper.worker.executor.graphs.capture import probe_chunks, probe_plan

    span = runner.cache.max_seq_len
    where = np.array([[7, span - 2], [7, span - 1], [8, 0], [8, 1], [8, 2]])
    assert probe_chunks(where, 3) == [PrefillChunk(row=3, length=2, slot=7, start=span - 2),
                                      PrefillChunk(row=5, length=3, slot=8, start=0)]
    decode = probe_plan(runner, 6)
    assert decode.num_decode == 6 and not decode.prefill
    plan = probe_plan(runner, 6, mixed=True)
    assert plan.num_decode == 3 and plan.num_tokens == 6
    assert plan.prefill == [PrefillChunk(row=3, length=3, slot=runner.cache.dummy_slot, start=3)]
    assert plan.sample_rows.tolist() == [0, 1, 2, 5]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5]
    hidden = runner.forward_eager(runner.prepare(plan, 8), 8)
    assert torch.isfinite(hidden[:6]).all()


def test_the_warm_up_runs_every_kind_of_logits_processing_and_forgets_its_counts(runner, monkeypatch):
    """The warm-up's last steps ask for a grammar mask, the three penalties and log probabilities
    on every row, at each penalised row count the penalty kernels specialize on, so their kernels
    load before the worker is ready; the penalty rows they counted are dropped after."""
    from graphkeeper.worker.executor import runner as runner_module

    seen, real = [], runner_module.sample_processed

    def recording(head, batch, sampling, penalties):
        seen.append((len(batch.rows), len(batch.mask_rows), len(batch.penalised), batch.top_logprobs, sampling))
        return real(head, batch, sampling, penalties)

    monkeypatch.setattr(runner_module, "sample_processed", recording)
    runner.warm_up(4)
    assert seen == [(n, n, n, 5, None) for n in runner.WARM_LOGITS_ROWS]
    assert runner.penalties.counts.shape[0] == 0 and runner.penalties.prompt.shape[0] == 0


def test_a_failed_logits_warm_up_is_logged_and_the_worker_goes_on(runner, monkeypatch, caplog):
    from graphkeeper.worker.executor import runner as runner_module

    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(runner_module, "sample_processed", broken)
    runner.warm_up_logits()
    assert "logits-processing warm-up failed" in caplog.text and "no such kernel" in caplog.text
    assert runner.penalties.counts.shape[0] == 0


def test_compiling_the_attention_ahead_is_cuda_only_and_a_failure_is_logged(runner, monkeypatch, caplog):
    """On a CPU nothing is compiled; where it runs (a GPU, stood in for by the device's type here),
    each split count's decode variant is launched once (``variant_rows``), then the varlen kernel
    once at the runner's token budget, and a failure is logged: the warm-up goes on."""
    from graphkeeper.worker.kernels import decode_kernel, varlen_kernel

    launched = []
    monkeypatch.setattr(decode_kernel, "decode_attention", lambda q, *args: launched.append(q.shape[0]))
    monkeypatch.setattr(varlen_kernel, "varlen_attention", lambda q, *args: launched.append(("varlen", q.shape[0])))
    runner.compile_attention_ahead([1, 2, 64])
    assert launched == []  # a CPU: nothing to compile
    monkeypatch.setattr(runner.attention, "triton_decode", True)
    monkeypatch.setattr(runner.attention, "triton_varlen", True)
    monkeypatch.setattr(runner, "device", SimpleNamespace(type="cuda"))
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: torch.zeros(*shape, dtype=kw.get("dtype")))
    runner.compile_attention_ahead([1, 2, 64])
    rows = decode_kernel.variant_rows([1, 2, 64], runner.attention.n_kv, runner.cache.max_blocks_per_seq
                                      * runner.cache.block_size, runner.loaded.dtype)
    assert rows == [1]  # float32 never splits: one variant for every row count
    assert launched == [1, ("varlen", runner.max_tokens)]

    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(decode_kernel, "decode_attention", broken)
    runner.compile_attention_ahead([1, 2, 64])
    assert "compiling the attention ahead failed" in caplog.text and "no compiler" in caplog.text


def test_a_start_compiles_ahead_the_attention_at_every_row_count_the_warm_up_runs(runner, monkeypatch):
    """What a start launches dry while it tunes kernels is the attention at the rows the warm-up
    runs: its first row count, then every count a GPU's warm-up adds."""
    from graphkeeper.worker.kernels import decode_kernel

    counts = []
    monkeypatch.setattr(decode_kernel, "variant_rows", lambda rows, *args: counts.append(rows) or [])
    runner.attention_launches(runner.warm_up_rows(4))
    assert counts == []  # a CPU: nothing compiles ahead
    monkeypatch.setattr(runner.attention, "triton_decode", True)
    monkeypatch.setattr(runner, "device", SimpleNamespace(type="cuda"))
    runner.attention_launches(runner.warm_up_rows(4))
    assert counts == [[4, *warm_rows(runner.max_tokens)]]


def test_a_start_compiles_ahead_the_warm_up_s_sampling_launches_on_a_gpu_only(runner, monkeypatch):
    """``launches_ahead`` (made dry while a start tunes its kernels) is the warm-up's attention and,
    on a GPU, its sampling launches: the same method the warm-up itself runs after its steps."""
    calls = []
    monkeypatch.setattr(runner, "attention_launches", lambda rows: calls.append(("attention", rows)))
    monkeypatch.setattr(runner, "warm_up_sampling", lambda: calls.append("sampling"))
    runner.launches_ahead(4)
    assert calls == [("attention", runner.warm_up_rows(4))]  # a CPU: its sampling has no kernels to compile
    calls.clear()
    monkeypatch.setattr(runner, "device", SimpleNamespace(type="cuda"))
    runner.last_tokens.fill_(7)  # what dry launches would have left there
    runner.launches_ahead(4)
    assert calls == [("attention", [4, *warm_rows(runner.max_tokens)]), "sampling"]
    assert not runner.last_tokens.any()


def test_the_warm_up_samples_through_the_method_a_start_compiles_ahead(runner, monkeypatch):
    """The warm-up's sampling launches are ``warm_up_sampling``'s, the ones ``launches_ahead``
    compiles: one list, so what is compiled ahead cannot drift from what the warm-up launches."""
    calls = []
    monkeypatch.setattr(runner, "warm_up_sampling", lambda: calls.append("sampling"))
    runner.warm_up(4)
    assert calls == ["sampling"]
