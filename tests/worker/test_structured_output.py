"""Structured output through the real ``openai`` SDK against a real worker process: every reply
to ``response_format`` ``json_schema`` parses and validates with ``jsonschema`` against its
schema (20 schemas, greedy and drawn), ``json_object`` replies parse as objects, vLLM's
``guided_json`` and ``structured_outputs`` are the same constraint, a bad schema is a 400 naming
the field, and a constrained request in a batch leaves an unconstrained one's tokens as they
are alone.

The model is ``random:tiny`` with a byte-level BPE tokenizer: its replies are nonsense, so a
valid reply is the grammar's doing, not the model's.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hardening_harness import build_chat_model
from worker_harness import Worker

CORPUS = ['{"name": "ada", "age": 36, "tags": ["x", "y"]}', "the graphs replay every decode step",
          "true false null 0123456789 -+.eE", "kubernetes operator reconciles the policy"] * 20
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NAME = {"type": "string", "maxLength": 8}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


SCHEMAS = [
    obj({"name": NAME}),
    obj({"age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"colour": {"enum": ["red", "green", "blue"]}}),
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}}),
    obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                       "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    obj({"kind": {"const": "graph"}, "size": {"type": "integer", "minimum": 1, "maximum": 512}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    obj({"nothing": {"type": "null"}}),
    obj({"name": NAME, "nick": NAME}, required=["name"]),
    obj({"items": {"type": "array", "items": obj({"id": {"type": "integer", "minimum": 0, "maximum": 9}}),
                   "maxItems": 2}}),
    obj({"mode": {"enum": ["none", "piecewise", "full"]}, "sizes": {"type": "array", "maxItems": 4,
                                                                    "items": {"enum": [1, 2, 4, 8]}}}),
    obj({"code": {"type": "string", "pattern": "^[a-z]{2,4}$"}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"user": obj({"name": NAME, "admin": {"type": "boolean"}})}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no"]},
    obj({"id": {"type": "string", "format": "uuid"}}),
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("json-model"), 512, model="random:tiny@5", corpus=CORPUS,
                            template=TEMPLATE)


@pytest.fixture(scope="module")
def server(module_workers, chat_model) -> Worker:
    return module_workers("--max-num-seqs", "8", "--max-seq-len", "512", "--max-num-batched-tokens", "64",
                          "--served-model-name", "tiny-json", model=str(chat_model))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, max_tokens: int = 300, **extra):
    return client.chat.completions.create(
        model="tiny-json", messages=[{"role": "user", "content": "reply in JSON"}], max_completion_tokens=max_tokens,
        temperature=extra.pop("temperature", 0), **extra)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_replies_validate(client, index):
    schema = SCHEMAS[index]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
    for sampling in ({}, {"temperature": 0.8, "seed": index}):
        resp = ask(client, response_format=fmt, **sampling)
        reply = resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply), schema)


def test_json_object_replies_are_objects(client):
    for seed in range(3):
        reply = ask(client, 400, response_format={"type": "json_object"}, temperature=0.5, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_vllm_guided_json_and_structured_outputs_are_the_same_constraint(client):
    schema = SCHEMAS[4]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    expected = ask(client, response_format=fmt).choices[0].message.content
    assert ask(client, extra_body={"guided_json": schema}).choices[0].message.content == expected
    assert ask(client, extra_body={"structured_outputs": {"json": schema}}).choices[0].message.content == expected


def test_a_constrained_request_leaves_unconstrained_ones_as_alone(client):
    plain = [dict(), dict(temperature=0.9, seed=4)]
    alone = [ask(client, 24, **dict(p)).choices[0].message.content for p in plain]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[5]}}
    requests = [*plain, dict(response_format=fmt), dict(response_format={"type": "json_object"}), *plain]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        replies = list(pool.map(lambda r: ask(client, 24, **dict(r)).choices[0].message.content, requests))
    assert replies[:2] == alone and replies[-2:] == alone


def test_chat_logprobs_name_tokens_by_their_text(client):
    resp = ask(client, 6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)


def test_echo_puts_the_prompt_before_the_completion(server):
    body = {"prompt": "the graphs", "max_tokens": 4, "temperature": 0, "echo": True, "ignore_eos": True}
    echoed = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    plain = httpx.post(server.http_url + "/v1/completions", json={**body, "echo": False},
                       timeout=60).json()["choices"][0]["text"]
    assert echoed == "the graphs" + plain


BAD = {
    "schema_not_json": ({"guided_json": "{not json"}, "guided_json"),
    "schema_not_a_schema": ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                            "response_format.json_schema"),
    "unknown_format": ({"response_format": {"type": "yaml"}}, "response_format"),
    "two_constraints": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
                         "guided_json": {}}, "guided_json"),
    "tool_choice": ({"tool_choice": "required"}, "tool_choice"),
    "top_logprobs_alone": ({"top_logprobs": 2}, "top_logprobs"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_constraints_are_400_naming_the_field(server, client, case):
    extra, param = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, 4, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert ask(client, 2).choices[0].message.content is not None  # the worker still serves


def test_chat_n_choices_each_seeded_and_streamed_by_index(client):
    resp = ask(client, 8, n=2, temperature=1.0, seed=40, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    for i, c in enumerate(resp.choices):
        assert c.message.content == ask(client, 8, temperature=1.0, seed=40 + i,
                                        extra_body={"ignore_eos": True}).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="tiny-json", messages=[{"role": "user", "content": "reply in JSON"}], max_completion_tokens=8, n=2,
        temperature=1.0, seed=40, stream=True, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {i: c.message.content for i, c in enumerate(resp.choices)}
    assert len({chunk.id for chunk in chunks}) == 1  # one response, whatever its number of choices
