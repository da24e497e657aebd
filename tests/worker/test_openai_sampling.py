"""The sampling parameters tools use, through the real ``openai`` SDK against a real worker
process, each checked against a reference computed here from ``transformers`` logits on the same
float32 weights (never against the worker's own output): penalties, ``logit_bias``, ``min_p``,
log probabilities, ``n`` with per-choice seeds; and a batch mixing plain and parameterised
requests leaves the plain ones' tokens exactly as they are alone.

The worker serves ``random:tiny@11`` without a tokenizer, so every choice carries its token ids
(``token_ids``) and the comparison is token by token.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import openai
import pytest
import torch
from hf_reference import tiny_hf_model
from worker_harness import Worker

from graphkeeper.proto import worker_pb2 as pb

PROMPT = [17, 42, 42, 99, 17, 3, 250, 42, 17, 5]
NEW = 12
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-hf")
    hf = tiny_hf_model(path)
    return path, hf


@pytest.fixture(scope="module")
def server(module_workers, model_dir) -> Worker:
    return module_workers("--max-num-seqs", "8", "--max-seq-len", "128", "--max-num-batched-tokens", "64",
                          "--served-model-name", "tiny", model=str(model_dir[0]))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(model_dir):
    return model_dir[1]


def next_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for the token after ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(hf, prompt: list[int], n: int, *, presence=0.0, frequency=0.0, repetition=1.0,
                     bias: dict[int, float] | None = None) -> list[int]:
    """Greedy tokens with vLLM's processing, written out plainly: bias, then the repetition
    penalty over prompt and output tokens, then frequency and presence over output tokens."""
    out: list[int] = []
    for _ in range(n):
        logits = next_logits(hf, prompt + out).clone()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(prompt) | set(out):
            value = logits[token]
            logits[token] = value / repetition if value > 0 else value * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


def complete(client: openai.OpenAI, max_tokens: int = NEW, **extra):
    body = {**NO_EOS, **extra.pop("extra_body", {})}
    temperature = extra.pop("temperature", 0)
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=temperature,
                                     extra_body=body, **extra)


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


CASES = {
    "frequency_penalty": ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
    "presence_penalty": ({"presence_penalty": -2.0}, {"presence": -2.0}),
    "repetition_penalty": ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition": 1.8}),
    "logit_bias": ({"logit_bias": {"7": 3.0, "300": -100}}, {"bias": {7: 3.0, 300: -100.0}}),
    "bias_and_every_penalty": ({"logit_bias": {"7": 6.0}, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                                "extra_body": {"repetition_penalty": 1.2}},
                               {"bias": {7: 6.0}, "frequency": 1.5, "presence": 0.5, "repetition": 1.2}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_penalties_and_logit_bias_equal_the_transformers_reference(client, hf, case):
    request, reference = CASES[case]
    expected = reference_greedy(hf, PROMPT, NEW, **reference)
    assert expected != reference_greedy(hf, PROMPT, NEW), "the case must change the greedy tokens"
    assert ids(complete(client, **request).choices[0]) == expected


def test_logprobs_equal_transformers_log_softmax(client, hf):
    resp = complete(client, 6, logprobs=5)
    choice = resp.choices[0]
    tokens = ids(choice)
    lp = choice.logprobs
    assert lp.tokens == [str(t) for t in tokens]  # a model without a tokenizer names tokens by id
    for i, token in enumerate(tokens):
        expected = next_logits(hf, PROMPT + tokens[:i]).log_softmax(-1)
        assert lp.token_logprobs[i] == pytest.approx(float(expected[token]), abs=1e-4)
        top = expected.topk(5)
        assert list(lp.top_logprobs[i]) == [str(t) for t in top.indices.tolist()]
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    # The raw distribution: a penalty changes the tokens, never the log probabilities' meaning.
    biased = complete(client, 3, logprobs=0, logit_bias={"9": 100})
    assert ids(biased.choices[0]) == [9, 9, 9]
    expected = next_logits(hf, PROMPT).log_softmax(-1)[9]
    assert biased.choices[0].logprobs.token_logprobs[0] == pytest.approx(float(expected), abs=1e-4)
    assert biased.choices[0].logprobs.top_logprobs[0] == {}


def test_streamed_logprobs_equal_the_whole_response(client):
    whole = complete(client, 5, logprobs=2).choices[0].logprobs
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                            stream=True, extra_body=NO_EOS))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == whole.tokens
    assert [v for s in streamed for v in s.token_logprobs] == whole.token_logprobs


def test_min_p_keeps_only_tokens_near_the_most_likely(client, hf):
    # min_p 1 keeps only the most likely token: a drawn request becomes greedy.
    drawn = complete(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0})
    assert ids(drawn.choices[0]) == reference_greedy(hf, PROMPT, NEW)
    # min_p 0.8 at temperature 0.5: every drawn token is within that ratio of the most likely
    # under transformers' probabilities, and the draw is not greedy everywhere.
    tokens = ids(complete(client, 16, temperature=0.5, seed=11, extra_body={"min_p": 0.8}).choices[0])
    ratios = []
    for i, token in enumerate(tokens):
        probs = (next_logits(hf, PROMPT + tokens[:i]) / 0.5).softmax(-1)
        ratios.append(float(probs[token] / probs.max()))
    assert min(ratios) >= 0.8 - 1e-4
    assert min(ratios) < 1.0


def test_n_choices_are_seeded_per_choice_and_reproducible(client):
    resp = complete(client, 8, temperature=1.0, seed=21, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 24
    for i, c in enumerate(resp.choices):
        alone = complete(client, 8, temperature=1.0, seed=21 + i)
        assert ids(c) == ids(alone.choices[0])
    assert len({tuple(ids(c)) for c in resp.choices}) == 3
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=21,
                                            n=3, stream=True, extra_body=NO_EOS))
    by_index: dict[int, list[int]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            by_index.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
    assert by_index == {i: ids(c) for i, c in enumerate(resp.choices)}


def test_a_mixed_batch_leaves_plain_requests_exactly_as_alone(client):
    plain = [dict(), dict(temperature=0.9, seed=5), dict(temperature=0.7, seed=8, top_p=0.9)]
    alone = [ids(complete(client, 10, **dict(p)).choices[0]) for p in plain]
    parameterised = [dict(frequency_penalty=1.0), dict(logprobs=3), dict(logit_bias={"11": 5}),
                     dict(temperature=0.8, seed=2, extra_body={"min_p": 0.5}),
                     dict(extra_body={"repetition_penalty": 1.5})]
    requests = [*plain, *parameterised, *plain]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: ids(complete(client, 10, **dict(r)).choices[0]), requests))
    assert results[:3] == alone and results[-3:] == alone


def test_echo_with_logprobs_gives_the_prompts_log_probabilities(client, hf):
    prompt = [(7 * i + 3) % 500 + 3 for i in range(100)]  # longer than a step's 64 tokens: chunked
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for _ in range(2):  # the second time the prefix cache holds the prompt: it is computed again
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                         logprobs=2, extra_body=NO_EOS)
        lp = resp.choices[0].logprobs
        assert lp.tokens[:100] == [str(t) for t in prompt] and len(lp.tokens) == 102
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, 100):
            assert lp.token_logprobs[i] == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)
            assert list(lp.top_logprobs[i]) == [str(t) for t in expected[i - 1].topk(2).indices.tolist()]
        generated = ids(resp.choices[0])
        assert lp.token_logprobs[100] == pytest.approx(float(expected[99, generated[0]]), abs=1e-4)


REFUSED = {
    "best_of": ({"n": 1, "best_of": 2}, "best_of"),
    "tools": ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
    "suffix": ({"suffix": "x"}, "suffix"),
    "logprobs_over_5": ({"logprobs": 6}, "logprobs"),
    "presence_out_of_range": ({"presence_penalty": 2.5}, "presence_penalty"),
    "repetition_zero": ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    "min_p_over_1": ({"extra_body": {"min_p": 1.5}}, "min_p"),
    "logit_bias_key": ({"logit_bias": {"seven": 1}}, "logit_bias"),
    "logit_bias_value": ({"logit_bias": {"7": 101}}, "logit_bias.7"),
    "logit_bias_outside_vocab": ({"logit_bias": {"100000": 1}}, "logit_bias"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_refusals_are_400_naming_the_field_and_counted_once(server, client, case):
    request, param = REFUSED[case]
    before = server.metric("graphkeeper_requests_total", outcome="invalid")
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, 2, **request)
    assert err.value.status_code == 400
    assert err.value.body["param"].startswith(param)
    assert server.metric("graphkeeper_requests_total", outcome="invalid") == before + 1
    assert ids(complete(client, 2).choices[0])  # the worker still serves



def _prompt_lp(hf, i: int) -> float:
    """transformers' log probability of ``PROMPT[i]`` after the tokens before it."""
    return float(next_logits(hf, PROMPT[:i]).log_softmax(-1)[PROMPT[i]])


def test_grpc_generate_takes_the_same_parameters_and_streams_logprobs(server, hf):
    sampling = pb.SamplingParams(frequency_penalty=2.0, logprobs=2)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling,
                                 stopping=pb.StoppingCriteria(max_new_tokens=NEW, ignore_eos=True))
    chunks = [r.tokens for r in server.inference.Generate(request, timeout=60) if r.HasField("tokens")]
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference_greedy(hf, PROMPT, NEW, frequency=2.0)
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 2 for lp in logprobs)
    expected = next_logits(hf, PROMPT).log_softmax(-1)
    assert logprobs[0].logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-4)
    request.sampling.prompt_logprobs = 0
    completion = [r.completion for r in server.inference.Generate(request, timeout=60) if r.HasField("completion")][0]
    assert [e.token_id for e in completion.prompt_logprobs] == PROMPT[1:]
    assert completion.prompt_logprobs[0].logprob == pytest.approx(_prompt_lp(hf, 1), abs=1e-4)
    bad = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(min_p=2.0),
                             stopping=pb.StoppingCriteria(max_new_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        list(server.inference.Generate(bad, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.min_p" in err.value.details()
