"""The paged KV cache through real workers (float32, greedy, CPU): a cache too small for the batch
preempts and recomputes without changing a token, a prompt whose prefix is cached computes only
the rest and the same tokens, and the KV cache's status and metrics say what happened."""

from __future__ import annotations

import random

import pytest
from hf_reference import hf_greedy, tiny_hf_model
from worker_harness import generate, generate_concurrently, make_request

transformers = pytest.importorskip("transformers")

MAX_NEW = 24
#: The prefix-caching preemption test's answers: long enough that any two of its sequences
#: overlapping at their ends need more than the 9 blocks (a 33-token prompt and its answer take 6,
#: a 45-token one 7, the 2 shared prefix blocks counted once), so it preempts however the requests
#: happen to arrive; with 24 it took three at once, and requests that arrived apart could all fit.
MAX_NEW_LONG = 60
_rng = random.Random(4321)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 20, 33, 47, 60)]
PREFIX = [_rng.randrange(3, 512) for _ in range(40)]  # two full blocks of 16 and 8 tokens more
SHARED = [PREFIX + [_rng.randrange(3, 512) for _ in range(n)] for n in (5, 9, 24)]
#: random:tiny in float32 keeps 512 bytes of keys and values per token (2 layers, 2 heads of 16).
TOKEN_BYTES = 512
#: The harness's --max-seq-len 128 and --max-num-batched-tokens 64 make one scratch slot of 128
#: tokens; on top of it, 9 blocks of 16 tokens: one whole context and a block, for 4 sequences of
#: up to 84 tokens each.
TINY_CACHE = str(128 * TOKEN_BYTES + 9 * 16 * TOKEN_BYTES)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Random tiny weights saved as an HF directory and transformers' greedy tokens on them."""
    path = tmp_path_factory.mktemp("hf-tiny-paged")
    hf = tiny_hf_model(path)
    refs = {tuple(p): hf_greedy(hf, p, MAX_NEW) for p in [*PROMPTS, *SHARED]}
    long_refs = {tuple(p): hf_greedy(hf, p, MAX_NEW_LONG) for p in [*SHARED, *PROMPTS[3:]]}
    return {"path": str(path), "refs": refs, "long_refs": long_refs, "hf": hf}


def requests(prompts, tag, max_new=MAX_NEW):
    return [make_request(p, max_new, request_id=f"{tag}-{i}", ignore_eos=True) for i, p in enumerate(prompts)]


def test_a_cache_too_small_for_the_batch_preempts_and_changes_no_token(module_workers, model):
    worker = module_workers("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "64",
                            "--kv-cache-memory", TINY_CACHE, "--no-prefix-caching", model=model["path"])
    kv = worker.status().kv_cache
    assert (kv.block_size, kv.blocks_total, kv.prefix_caching) == (16, 9, False)
    results = generate_concurrently(worker, requests(PROMPTS, "tight"))
    for prompt, (tokens, completion) in zip(PROMPTS, results, strict=True):
        assert tokens == model["refs"][tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert completion.generated_tokens == MAX_NEW
    preempted = sum(c.execution.preemptions for _, c in results)
    assert preempted > 0, "9 blocks for 4 sequences of up to 84 tokens must preempt"
    assert worker.status().kv_cache.preemptions == preempted
    assert worker.metric("graphkeeper_preemptions_total") == preempted
    assert worker.metric("graphkeeper_kv_cache_blocks") == 9
    assert worker.metric("graphkeeper_kv_cache_block_size_tokens") == 16
    assert worker.metric("graphkeeper_kv_cache_used_blocks") == 0  # every sequence ended
    assert worker.metric("graphkeeper_kv_cache_usage_ratio") == 0


def test_a_prefix_served_from_the_cache_gives_the_same_tokens(module_workers, model):
    worker = module_workers(model=model["path"])
    kv = worker.status().kv_cache
    assert kv.prefix_caching and kv.block_size == 16 and kv.blocks_total > 0
    first, completion = generate(worker, requests(SHARED[:1], "first")[0])
    assert first == model["refs"][tuple(SHARED[0])] and completion.execution.cached_prompt_tokens == 0
    hits = 0
    for i, prompt in enumerate(SHARED[1:] + SHARED[:1]):
        tokens, completion = generate(worker, make_request(prompt, MAX_NEW, request_id=f"hit-{i}", ignore_eos=True))
        assert tokens == model["refs"][tuple(prompt)], f"prompt of {len(prompt)} tokens"
        # The two full blocks of the shared prefix come from the cache (and, for the 64-token
        # prompt sent before as the first request, nothing more: its own blocks were never computed).
        assert completion.execution.cached_prompt_tokens >= 32
        hits += completion.execution.cached_prompt_tokens
    kv = worker.status().kv_cache
    assert kv.prefix_hit_tokens == hits and kv.prefix_query_tokens == sum(map(len, SHARED)) + len(SHARED[0])
    assert kv.blocks_used == 0 and kv.blocks_cached > 0
    assert worker.metric("graphkeeper_prefix_cache_hits_tokens_total") == hits
    assert worker.metric("graphkeeper_prefix_cache_queries_tokens_total") == kv.prefix_query_tokens
    assert worker.metric("graphkeeper_kv_cache_cached_blocks") == kv.blocks_cached


def test_a_chat_turn_reuses_the_blocks_the_previous_answer_filled_and_gives_the_same_tokens(module_workers, model):
    """The next turn of a chat sends the previous prompt, the model's answer and a new user turn:
    the blocks filled by decoding the answer are served from the cache too (33 prompt tokens and
    24 generated fill 3 blocks of 16, not only the prompt's 2), and the tokens are transformers'."""
    worker = module_workers(model=model["path"])
    prompt = PROMPTS[3]
    answer, completion = generate(worker, make_request(prompt, MAX_NEW, request_id="turn-1", ignore_eos=True))
    assert answer == model["refs"][tuple(prompt)] and completion.execution.cached_prompt_tokens == 0
    turn = prompt + answer + [5, 6, 7]  # 60 tokens
    tokens, completion = generate(worker, make_request(turn, MAX_NEW, request_id="turn-2", ignore_eos=True))
    assert completion.execution.cached_prompt_tokens == 48  # the prompt's 2 blocks and the answer's
    assert tokens == hf_greedy(model["hf"], turn, MAX_NEW)


def test_without_prefix_caching_nothing_is_reused_and_the_tokens_are_the_same(module_workers, model):
    worker = module_workers("--no-prefix-caching", model=model["path"])
    for i, prompt in enumerate(SHARED + SHARED[:1]):
        tokens, completion = generate(worker, make_request(prompt, MAX_NEW, request_id=f"off-{i}", ignore_eos=True))
        assert tokens == model["refs"][tuple(prompt)]
        assert completion.execution.cached_prompt_tokens == 0
    kv = worker.status().kv_cache
    assert not kv.prefix_caching and kv.prefix_hit_tokens == 0 and kv.blocks_cached == 0
    assert worker.metric("graphkeeper_prefix_cache_queries_tokens_total") == 0


def test_a_block_size_that_is_not_a_power_of_two_is_refused_at_boot(tmp_path):
    import subprocess

    from worker_harness import GRAPHKEEPER

    out = subprocess.run([str(GRAPHKEEPER), "worker", "--model", "random:tiny", "--kv-block-size", "24"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and "--kv-block-size must be a power of two" in out.stderr and "24" in out.stderr


def test_preemption_with_prefix_caching_changes_no_token_and_every_block_returns(module_workers, model):
    """A tight cache with prefix caching on: prompts sharing a prefix preempt one another, a
    recompute finds its own blocks (and the shared ones) in the cache, and the tokens are still
    transformers' own. Each prompt is one lookup, no request reports more cached prompt tokens
    than it could, and once every request ends no block is held."""
    worker = module_workers("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "64",
                            "--kv-cache-memory", TINY_CACHE, model=model["path"])
    prompts = [*SHARED, *PROMPTS[3:]]
    results = generate_concurrently(worker, requests(prompts, "tight-prefix", MAX_NEW_LONG))
    for prompt, (tokens, completion) in zip(prompts, results, strict=True):
        assert tokens == model["long_refs"][tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert 0 <= completion.execution.cached_prompt_tokens <= len(prompt) - 1
    assert sum(c.execution.preemptions for _, c in results) > 0, "9 blocks for any 2 of these sequences must preempt"
    kv = worker.status().kv_cache
    assert kv.prefix_caching and kv.blocks_used == 0 and kv.blocks_cached > 0
    assert kv.prefix_query_tokens == sum(map(len, prompts))
    assert kv.prefix_hit_tokens == sum(c.execution.cached_prompt_tokens for _, c in results)
    assert worker.metric("graphkeeper_kv_cache_used_blocks") == 0
