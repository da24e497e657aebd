"""The OpenAI API's pure rules (request parsing, stop strings) and the vLLM metric aliases, without a
worker: every decision the HTTP server makes is made here."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.serving.http_server import TextEvents, sse
from graphkeeper.worker.serving.openai_api import (
    ApiError,
    StopMatcher,
    choice,
    envelope,
    finish_reason,
    parse_chat,
    parse_completion,
    usage,
)
from graphkeeper.worker.serving.vllm_metrics import WithVllmNames, vllm_aliases


def test_a_completion_body_becomes_a_generate_request():
    parsed = parse_completion({"model": "m", "prompt": "hello", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                               "seed": 3, "stop": "\n", "ignore_eos": True, "stop_token_ids": [5], "user": "team-a",
                               "stream": True, "stream_options": {"include_usage": True}, "n": 1, "logprobs": None})
    r = parsed.request
    assert (r.prompt_text, r.stopping.max_new_tokens, r.stopping.ignore_eos, list(r.stopping.stop_token_ids)) == (
        "hello", 7, True, [5])
    assert (r.sampling.temperature, round(r.sampling.top_p, 5), r.sampling.seed, r.tenant) == (0.5, 0.9, 3, "team-a")
    assert (parsed.model, parsed.stream, parsed.include_usage, parsed.stop, parsed.fill_context) == (
        "m", True, True, ("\n",), False)
    assert parse_completion({"prompt": [[1, 2, 3]]}).request.prompt_token_ids == [1, 2, 3]  # a batch of one
    assert parse_completion({"prompt": "x"}).request.stopping.max_new_tokens == 16  # OpenAI's default
    assert parse_completion({"prompt": "x"}).request.sampling.temperature == 1.0  # OpenAI's default
    # vLLM's continuous_usage_stats (benchmark clients send it): usage in every chunk.
    assert parse_completion({"prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}).continuous_usage


def test_a_chat_body_becomes_messages_and_fills_the_context_without_max_tokens():
    parsed = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                   {"type": "text", "text": "there"}]}]})
    assert [(m.role, m.content) for m in parsed.request.messages] == [("system", "be brief"), ("user", "hi there")]
    assert parsed.fill_context and parsed.chat
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9,
                       "max_tokens": 3}).request.stopping.max_new_tokens == 9
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert chat.max_tokens_param == "max_tokens"  # errors about the length name the field the client sent


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "stop": [1]}, 400, "stop[0]"),
    ({"prompt": "x", "stop": [""]}, 400, "stop[0]"),
    ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"extra": 1}}, 400, "stream_options.extra"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage"),
    ({"prompt": ""}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 2}}, 400, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids[0]"),
    ({"prompt": "x", "messages": []}, 400, "messages"),
    ({"prompt": "x", "zzz": 1, "aaa": 2}, 400, "aaa"),
    ({"prompt": "x", "max_tokens": 10**40}, 400, "max_tokens"),
    ({"prompt": "x", "top_k": 2**31}, 400, "top_k"),
    ({"prompt": "x", "temperature": 10**400}, 400, "temperature"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
])
def test_completion_refusals_name_the_field(body, status, param):
    with pytest.raises(ApiError) as err:
        parse_completion(body)
    assert (err.value.status, err.value.param) == (status, param)
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("body", "status", "param"), [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "mood": "ok"}]}, 400, "messages[0].mood"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 3}}}}, 400,
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400, "max_completion_tokens"),
])
def test_chat_refusals_name_the_field(body, status, param):
    with pytest.raises(ApiError) as err:
        parse_chat(body)
    assert (err.value.status, err.value.param) == (status, param)


def test_sampling_fields_reach_the_engine_request():
    echo = parse_completion({"prompt": "x", "echo": True})
    assert echo.choices.echo and echo.choices.logprobs is None
    parsed = parse_completion({"prompt": "x", "n": 3, "best_of": 3, "presence_penalty": 0.5,
                               "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
                               "logit_bias": {"7": -100}, "logprobs": 2})
    s = parsed.request.sampling
    assert (parsed.choices.n, parsed.choices.logprobs) == (3, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.logprobs) == (0.5, -1.0, pytest.approx(0.1), 2)
    assert s.repetition_penalty == pytest.approx(1.2) and dict(s.logit_bias) == {7: -100.0}
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4,
                       "response_format": {"type": "json_object"}, "tool_choice": "none"})
    assert chat.choices.logprobs == 4 and chat.request.constraint.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    guided = parse_chat({"messages": [{"role": "user", "content": "x"}], "guided_json": schema})
    assert json.loads(guided.request.constraint.json_schema) == schema
    plain = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False})
    assert plain.choices.logprobs is None and not plain.request.sampling.HasField("logprobs")
    assert not plain.request.HasField("constraint")


def test_the_tenant_header_wins_over_user():
    assert parse_completion({"prompt": "x", "user": "a"}, tenant_header="b").request.tenant == "b"
    assert parse_completion({"prompt": "x", "user": "a"}).request.tenant == "a"


def test_null_is_not_set():
    parsed = parse_completion({"prompt": "x", "max_tokens": None, "stop": None, "seed": None, "n": None,
                               "stream_options": None, "logit_bias": None, "suffix": None})
    assert parsed.request.stopping.max_new_tokens == 16 and not parsed.request.sampling.HasField("seed")


def test_a_stop_string_ends_the_text_before_it_even_across_deltas():
    m = StopMatcher(("STOP",))
    out = [m.feed(d) for d in ("hello S", "TO", "P and more")]
    assert "".join(out) == "hello " and m.stopped and m.feed("x") == "" and m.flush() == ""
    m = StopMatcher(("ab", "xyz"))
    assert m.feed("xa") == "" and m.feed("b") == "x" and m.stopped  # held back as long as the longest could match
    m = StopMatcher(("xyz",))
    assert "".join([m.feed("xy"), m.feed("q"), m.flush()]) == "xyq" and not m.stopped
    assert StopMatcher(()).feed("abc") == "abc"


@given(st.text(alphabet="abcS", max_size=40), st.lists(st.integers(1, 5), max_size=12),
       st.sampled_from(["S", "ab", "cab", "Sa"]))
def test_stop_strings_match_the_whole_text_however_it_is_split(text, cuts, stop):
    """Fed in any pieces, the output is the text before the first stop string (all of it when
    there is none), exactly as if matched on the whole text."""
    pieces, i = [], 0
    for n in cuts:
        pieces.append(text[i:i + n])
        i += n
    pieces.append(text[i:])
    m = StopMatcher((stop,))
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    cut = text.find(stop)
    assert out == (text[:cut] if cut >= 0 else text) and m.stopped == (cut >= 0)


@given(st.text(), st.booleans(), st.sampled_from(["tiny-chat", "org/Model \"q\" é", "a\\b"]), st.booleans(),
       st.integers(0, 2**31), st.integers(0, 2**31))
def test_a_pre_encoded_text_chunk_is_the_chunk_byte_for_byte(text, chat, model, with_usage, prompt, generated):
    """The streaming fast path writes exactly what the chunk's dict would encode to."""
    events = TextEvents("cmpl-0a1b", chat, 1764763200, model, with_usage)
    chunk = envelope("cmpl-0a1b", chat, 1764763200, model, [choice(chat, text, None, delta=True)], chunk=True)
    if with_usage:
        chunk["usage"] = usage(prompt, generated)
    assert events.text(text, prompt, generated) == sse(chunk)


def test_finish_reasons():
    assert finish_reason(pb.Completion(finish_reason=pb.FINISH_REASON_LENGTH), False) == "length"
    assert finish_reason(pb.Completion(finish_reason=pb.FINISH_REASON_EOS), False) == "stop"
    assert finish_reason(pb.Completion(finish_reason=pb.FINISH_REASON_STOP), False) == "stop"
    assert finish_reason(pb.Completion(finish_reason=pb.FINISH_REASON_CANCELLED), True) == "stop"


def test_vllm_names_repeat_the_gauges_with_the_model_name_and_skip_absent_sources():
    registry = CollectorRegistry()
    Gauge("graphkeeper_queue_depth", "q", registry=registry).set(3)
    Gauge("graphkeeper_running_sequences", "r", registry=registry).set(5)
    text = generate_latest(WithVllmNames(registry, lambda: "llama")).decode()
    assert 'vllm:num_requests_waiting{model_name="llama"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="llama"} 5.0' in text
    assert "graphkeeper_queue_depth 3.0" in text  # the source series stay
    assert "kv_cache" not in text  # no KV source yet: no KV alias
    # Once the KV cache exports its gauges, both of vLLM's KV names and its cache config follow.
    Gauge("graphkeeper_kv_cache_usage_ratio", "u", registry=registry).set(0.25)
    Gauge("graphkeeper_kv_cache_block_size_tokens", "b", registry=registry).set(16)
    Gauge("graphkeeper_kv_cache_blocks", "n", registry=registry).set(1000)
    text = generate_latest(WithVllmNames(registry, lambda: "llama")).decode()
    assert 'vllm:kv_cache_usage_perc{model_name="llama"} 0.25' in text
    assert 'vllm:gpu_cache_usage_perc{model_name="llama"} 0.25' in text
    assert 'vllm:cache_config_info{block_size="16",model_name="llama",num_gpu_blocks="1000"} 1.0' in text
    assert vllm_aliases([], "llama") == []
