"""Sampling parameters and structured output inside graph replay on a real GPU: a batch mixing
plain requests with penalties, a logit bias, min-p, log probabilities and a JSON schema runs every
step from graphs (no eager step, no recapture), and each plain request's tokens are bit for bit
what they are alone. Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # the worker tests' harness

from hardening_harness import build_chat_model  # noqa: E402

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402
from graphkeeper.worker.engine import Engine, EngineSettings  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]
pytest.importorskip("llguidance", reason="structured output needs llguidance: carry its abi3 wheel in .whl/ "
                                         "(bench/gpu_session.sh installs it)")

CORPUS = ['{"name": "ada", "age": 36, "tags": ["x", "y"]}', "the graphs replay every decode step",
          "true false null 0123456789 -+.eE"] * 20
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = [[5 + i, 17, 42, 42, 99, 3 + i] for i in range(8)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = build_chat_model(tmp_path_factory.mktemp("json-model"), 512, model="random:tiny@5", corpus=CORPUS,
                            template=None)
    settings = EngineSettings(model=str(root), device="cuda", dtype="bfloat16", max_num_seqs=32, max_seq_len=256,
                              max_num_batched_tokens=128)
    engine = Engine(settings)
    engine.start()
    assert engine.ready.wait(300) and engine.failed is None, engine.failed
    yield engine
    engine.drain_and_stop(5)


def request(prompt: list[int], new: int = 24, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt_token_ids=prompt, stopping=pb.StoppingCriteria(max_new_tokens=new,
                                                                                   ignore_eos=True))
    schema = sampling.pop("schema", None)
    if schema is not None:
        req.constraint.json_schema = json.dumps(schema)
    for key, value in sampling.items():
        if key == "logit_bias":
            req.sampling.logit_bias.update(value)
        else:
            setattr(req.sampling, key, value)
    return req


def run_together(engine: Engine, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], pb.Completion]]:
    """Submits every request before any step can finish them, and waits for all."""
    results: list = [None] * len(requests)
    done = [threading.Event() for _ in requests]

    def emitter(i: int):
        out: list[int] = []

        def emit(tokens, end):
            out.extend(tokens)
            if end is not None:
                results[i] = (out, end)
                done[i].set()
        return emit

    for i, req in enumerate(requests):
        engine.submit(req, emitter(i))
    assert all(d.wait(120) for d in done)
    return results


def test_a_mixed_batch_replays_graphs_and_keeps_plain_rows_exact(engine):
    plain = [request(PROMPTS[0]), request(PROMPTS[1], temperature=0.8, seed=3),
             request(PROMPTS[2], temperature=0.7, top_p=0.9, seed=4), request(PROMPTS[3])]
    alone = [run_together(engine, [r])[0][0] for r in plain]
    parameterised = [request(PROMPTS[4], frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2),
                     request(PROMPTS[5], logit_bias={7: 5.0}, logprobs=5),
                     request(PROMPTS[6], temperature=1.0, min_p=0.2, seed=9),
                     request(PROMPTS[7], 64, schema=SCHEMA)]
    captured_before = len(engine.status().captured)
    mixed = run_together(engine, [*plain, *parameterised])
    assert [tokens for tokens, _ in mixed[:4]] == alone
    for _, completion in mixed:
        assert not completion.execution.eager_steps, completion.execution
        assert sum(g.steps for g in completion.execution.graph_steps) == completion.generated_tokens
    assert len(engine.status().captured) == captured_before  # no capture for any request
    reply = engine.tokenizer.decode(mixed[-1][0])
    value = json.loads(reply)
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99


def test_drawing_tokens_and_processing_logits_never_stall_the_host_on_the_stream():
    """Every per-step host array (temperatures, seeds, top-k/p, penalised rows and the resets of
    their device counts, a grammar mask) reaches the device through pinned memory, and the counts
    grow and take each sampled token on the device: with torch's sync debug mode set to error, a
    blocking copy (which waits for the step queued before it) would raise here."""
    import numpy as np

    from graphkeeper.worker.executor.logits import count_sampled, process
    from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
    from graphkeeper.worker.executor.sampling import sample
    from graphkeeper.worker.plan import LogitsBatch, SamplingBatch, SamplingSpec

    rows, vocab = 4, 512
    logits = torch.randn(rows, vocab, device="cuda")
    sampling = SamplingBatch.build([SamplingSpec(temperature=0.8, top_k=20, top_p=0.9)] * rows, [1, 2, 3, 4],
                                   np.zeros(rows, np.int64))
    batch = LogitsBatch(
        rows=np.arange(2, dtype=np.int64), presence=np.full(2, 0.5, np.float32), frequency=np.full(2, 0.5, np.float32),
        repetition=np.full(2, 1.1, np.float32), min_p=np.zeros(2, np.float32),
        bias=(np.array([[0], [11]], np.int64), np.array([3.0], np.float32)),
        mask_rows=np.array([1], np.int64), masks=np.full((1, vocab // 32), -1, np.int32),
        logprobs=np.full(rows, -1, np.int64), penalised=np.arange(2, dtype=np.int64),
        penalty_slots=np.array([5, 20], np.int64), reset_slots=np.array([5, 20], np.int64),
        reset_prompt=np.array([[5, 20], [7, 9]], np.int64), reset_output=np.array([[5, 5, 20], [7, 7, 9]], np.int64))
    penalties = PenaltyCounts(vocab, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(process(logits, batch, sampling, penalties), sampling)
        count_sampled(penalties, batch, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (rows,) and int(tokens.max()) < vocab
    assert int(penalties.counts[5, 7]) >= 2 and int(penalties.counts.sum()) == 5  # 3 from the resets, 2 drawn


def test_log_probabilities_are_picked_and_sent_back_without_a_host_synchronisation():
    """A step's log probabilities at llama's vocabulary (``logprob_kernel``'s two launches over
    every row, then one copy into a pinned table) queue behind the step without waiting for it,
    and equal ``log_softmax``, ``gather`` and ``topk``: float32 logits to float32 rounding with the
    same ids, bfloat16 ones (ties are common at the top) with each id's own log probability."""
    from graphkeeper.worker.kernels import logprob_kernel

    rows, vocab = 64, 128_256
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
        tokens = torch.randint(0, vocab, (rows,), device="cuda")
        for top in (0, 5, 20):
            assert logprob_kernel.supported(logits, top)
            pinned = torch.empty(rows * (1 + 2 * top), dtype=torch.float32, pin_memory=True).view(rows, -1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                pinned.copy_(logprob_kernel.packed(logits, tokens, top), non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            done.synchronize()
            want = logprob_kernel.reference(logits, tokens, top).cpu()
            expected = logits.float().log_softmax(-1).cpu()
            assert torch.allclose(pinned[:, :1 + top], want[:, :1 + top], atol=2e-5, rtol=1e-6), (dtype, top)
            ids = pinned[:, 1 + top:].long()
            if dtype == torch.float32:
                assert torch.equal(ids, want[:, 1 + top:].long()), top
            assert torch.allclose(expected.gather(1, ids), pinned[:, 1:1 + top], atol=2e-5, rtol=1e-6), (dtype, top)


def test_host_arrays_reach_the_device_intact_through_pinned_memory():
    """``to_device`` fills a pinned block with numpy's copy (torch's would wake its CPU thread pool,
    which then spins): the device gets the same values, dtypes and shapes, a full-vocabulary
    grammar mask and a transposed (non-contiguous) array among them, with no host stall."""
    import numpy as np

    from graphkeeper.worker.executor.transfer import to_device

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-2**31, 2**31 - 1, size=(32, 4008), dtype=np.int32),  # 128,256 tokens' mask
              rng.random(7) > 0.5, rng.random((5, 3)).astype(np.float32).T, np.arange(0, dtype=np.int64)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [to_device(a, torch.device("cuda")) for a in arrays]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for array, tensor in zip(arrays, got, strict=True):
        assert tensor.is_cuda and tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
        assert tuple(tensor.shape) == array.shape and np.array_equal(tensor.cpu().numpy(), array)


def test_the_penalty_kernels_equal_the_pytorch_path_at_a_full_vocabulary():
    """The two launches penalties take on CUDA (``penalty_kernel``) against ``PenaltyCounts``'
    PyTorch operations on the same device, at llama's vocabulary: penalised rows alike to float32
    rounding, a neutral row and the rows not named bit for bit, each sampled token counted once."""
    import numpy as np

    from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
    from graphkeeper.worker.kernels import penalty_kernel as pk

    vocab, device = 128_256, torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    pen = PenaltyCounts(vocab, device)
    pen.cover(16)
    pen.counts.copy_(torch.randint(0, 4, (16, vocab), device="cuda", generator=g, dtype=torch.int32)
                     * (torch.rand(16, vocab, device="cuda", generator=g) < 0.01))
    pen.prompt.copy_(torch.rand(16, vocab, device="cuda", generator=g) < 0.005)
    sub = torch.randn(24, vocab, device="cuda", generator=g) * 4
    entries, sample_rows, slots = np.arange(0, 24, 2), np.arange(1, 25, 2), np.arange(12) + 3
    rep = np.linspace(0.7, 1.5, 12).astype(np.float32)
    freq, pres = np.linspace(-0.5, 1.0, 12).astype(np.float32), np.linspace(1.0, -0.2, 12).astype(np.float32)
    rep[5], freq[5], pres[5] = 1.0, 0.0, 0.0
    dev = {k: torch.from_numpy(v).cuda() for k, v in dict(slots=slots, rep=rep, freq=freq, pres=pres).items()}
    want = sub.clone()
    want[entries] = pen.apply(want[entries], dev["slots"], dev["rep"], dev["freq"], dev["pres"])
    got = sub.clone()
    block = torch.from_numpy(pk.params(entries, sample_rows, slots, rep, freq, pres)).cuda()
    pk.apply(got, pen.counts, pen.prompt, block, len(entries))
    assert torch.equal(got[1::2], sub[1::2]) and torch.equal(got[10], sub[10])
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)
    tokens = torch.randint(0, vocab, (25,), device="cuda", generator=g)
    expect = pen.counts.clone()
    for r, s in zip(sample_rows, slots, strict=True):
        expect[s, tokens[r]] += 1
    pk.count(tokens, pen.counts, block, len(entries))
    assert torch.equal(pen.counts, expect)
