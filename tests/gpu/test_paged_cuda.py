"""The paged KV cache on a real GPU, float32 and greedy, in every graph mode: the engine's tokens
equal transformers', a cache too small for the batch preempts without changing a token, and a
prompt whose prefix comes from the prefix cache gives the tokens it gives computed from scratch.
Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import threading

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.model.loader import load_model, save_hf_directory

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]
transformers = pytest.importorskip("transformers")

MAX_LEN, MAX_NEW = 256, 32
#: random:tiny in float32: 512 bytes of keys and values per token. One scratch slot of 256 tokens
#: (a 64-token step) and 20 blocks of 16 tokens: far less than 8 sequences of up to 72 tokens hold.
TIGHT = 256 * 512 + 20 * 16 * 512
MODES = {"full_and_piecewise": pb.GRAPH_MODE_FULL_AND_PIECEWISE, "piecewise": pb.GRAPH_MODE_PIECEWISE,
         "full_decode_only": pb.GRAPH_MODE_FULL_DECODE_ONLY, "none": pb.GRAPH_MODE_NONE}
_g = torch.Generator().manual_seed(24)
PROMPTS = [torch.randint(3, 500, (n,), generator=_g).tolist() for n in (3, 9, 17, 24, 31, 38, 40, 12)]
PREFIX = torch.randint(3, 500, (50,), generator=_g).tolist()
SHARED = [PREFIX + torch.randint(3, 500, (n,), generator=_g).tolist() for n in (4, 11)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Random tiny weights as an HF directory, and transformers' greedy tokens on the GPU in float32."""
    path = tmp_path_factory.mktemp("paged-tiny")
    built = load_model("random:tiny@5", device="cpu", dtype="float32", max_positions=MAX_LEN)
    save_hf_directory(built.model, path)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    refs = {}
    for prompt in [*PROMPTS, *SHARED]:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        refs[tuple(prompt)] = out[0, len(prompt):].tolist()
    return {"path": str(path), "refs": refs}


def engine(path: str, mode: int, sizes: list[int] | None = None, **kw) -> Engine:
    policy = pb.GraphPolicy(policy_uid="paged", generation=1, mode=mode)
    if sizes:
        policy.capture_sizes.explicit.sizes.extend(sizes)
        policy.capture_sizes.max_capture_size = max(sizes)
    else:
        policy.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    settings = EngineSettings(model=path, device="cuda", dtype="float32", max_num_seqs=16, max_seq_len=MAX_LEN,
                              max_num_batched_tokens=64, policy=policy, **kw)
    e = Engine(settings)
    e.start()
    assert e.ready.wait(300) and e.failed is None, e.failed
    return e


def generate_all(e: Engine, prompts: list[list[int]]) -> list[tuple[list[int], pb.Completion]]:
    """Submits every prompt at once and waits for all of them."""
    results: list[dict] = [{"tokens": []} for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(i: int):
        def emit(tokens, end):
            results[i]["tokens"].extend(tokens)
            if end is not None:
                results[i]["end"] = end
                done[i].set()
        return emit

    for i, prompt in enumerate(prompts):
        e.submit(pb.GenerateRequest(prompt_token_ids=prompt, stopping=pb.StoppingCriteria(
            max_new_tokens=MAX_NEW, ignore_eos=True)), emitter(i))
    assert all(d.wait(180) for d in done)
    assert all(isinstance(r["end"], pb.Completion) for r in results), [r["end"] for r in results]
    return [(r["tokens"], r["end"]) for r in results]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_tight_cache_preempts_and_every_token_equals_transformers(model, mode):
    e = engine(model["path"], MODES[mode], kv_cache_memory=TIGHT, prefix_caching=False)
    try:
        assert e.status().kv_cache.blocks_total == 20
        results = generate_all(e, PROMPTS)
        for prompt, (tokens, _) in zip(PROMPTS, results, strict=True):
            assert tokens == model["refs"][tuple(prompt)], (mode, len(prompt))
        preempted = sum(c.execution.preemptions for _, c in results)
        assert preempted > 0 and e.status().kv_cache.preemptions == preempted
        if mode != "none":
            assert any(c.execution.graph_steps for _, c in results)
    finally:
        e.drain_and_stop(5)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_prefix_hit_gives_the_tokens_computed_from_scratch(model, mode):
    e = engine(model["path"], MODES[mode])
    try:
        (first, c0), = generate_all(e, SHARED[:1])
        (second, c1), = generate_all(e, SHARED[1:])
        (again, c2), = generate_all(e, SHARED[:1])
        assert c0.execution.cached_prompt_tokens == 0
        assert c1.execution.cached_prompt_tokens == 48 and c2.execution.cached_prompt_tokens == 48
        assert first == again == model["refs"][tuple(SHARED[0])]
        assert second == model["refs"][tuple(SHARED[1])]
    finally:
        e.drain_and_stop(5)


def test_track_b_sizes_the_cache_after_the_graphs_and_serves(model):
    """--gpu-memory-utilization: the KV cache is planned after a probe capture, reallocated, the graphs
    recaptured against it; the plan is within 2% of what was free for it after the final capture."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    e = engine(model["path"], pb.GRAPH_MODE_FULL_AND_PIECEWISE, sizes=[1, 2], gpu_memory_utilization=0.5)
    try:
        kv = e.status().kv_cache
        assert kv.sizing == "utilization" and kv.planned_bytes > 0
        assert abs(kv.planned_bytes - kv.free_after_capture_bytes) <= 0.02 * kv.free_after_capture_bytes, kv
        assert kv.blocks_total * kv.block_size * 512 == kv.planned_bytes
        assert e.status().captured
        (tokens, completion), = generate_all(e, PROMPTS[:1])
        assert tokens == model["refs"][tuple(PROMPTS[0])] and completion.execution.graph_steps
        # The cache took what the two small graphs left: the default ladder's graphs do not fit.
        bigger = pb.GraphPolicy(policy_uid="paged", generation=2, mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE)
        bigger.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
        with pytest.raises(PolicyError, match="beside the KV cache sized by --gpu-memory-utilization"):
            e.apply_policy(bigger)
        assert e.status().policy_generation == 1
    finally:
        e.drain_and_stop(5)
