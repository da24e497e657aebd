"""The OpenAI-compatible HTTP API, driven by the real ``openai`` SDK and raw HTTP against one real
worker process (engine core in its own process, as deployed): a tiny random model with a real
byte-level BPE tokenizer and a chat template, so text, chat, streaming and stop strings all run for
real in milliseconds a token. Every refusal is followed by a request that succeeds, and the
running-sequence gauge must come back to 0: nothing leaks."""

from __future__ import annotations

import concurrent.futures
import json
import signal
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from hardening_harness import build_chat_model
from worker_harness import Worker, generate, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.model.tokenizer import load_tokenizer

CORPUS = ["the graphs replay every decode step", "café crème brûlée naïve façade",
          "kubernetes operator reconciles the policy", "user assistant system says hello"] * 20
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_SEQ_LEN = 256
#: The context of ``long_server``: requests that hold a slot for many seconds even on a fast CPU, for
#: the tests that need slots taken while other requests arrive.
LONG_SEQ_LEN = 4096
GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """random:tiny with a trained BPE tokenizer whose ids fit its vocabulary and a chat template."""
    return build_chat_model(tmp_path_factory.mktemp("chat-model"), LONG_SEQ_LEN, corpus=CORPUS, template=TEMPLATE)


@pytest.fixture(scope="module")
def server(module_workers, chat_model) -> Worker:
    return module_workers("--max-num-seqs", "4", "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-batched-tokens", "64",
                          "--max-queue", "1", "--vllm-metric-names", "--served-model-name", "tiny-chat",
                          model=str(chat_model))


@pytest.fixture(scope="module")
def long_server(module_workers, chat_model) -> Worker:
    """Four slots and a queue of one, with a context long enough that a request asking for most of
    it is still running when the requests that test admission arrive."""
    return module_workers("--max-num-seqs", "4", "--max-seq-len", str(LONG_SEQ_LEN), "--max-num-batched-tokens",
                          "64", "--max-queue", "1", "--served-model-name", "tiny-chat", model=str(chat_model))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def no_leak(server: Worker) -> None:
    """Every sequence returned its slot, and the worker still answers."""
    wait_until(lambda: server.metric("graphkeeper_running_sequences") == 0
               and server.metric("graphkeeper_queue_depth") == 0, what="the running and queued gauges back at 0")


def complete(client: openai.OpenAI, prompt, n: int = 8, **extra):
    return client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n, **GREEDY,
                                     extra_body={**NO_EOS, **extra.pop("extra_body", {})}, **extra)


def test_models_health_and_a_text_completion_equal_to_grpc(server, client):
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert httpx.get(server.http_url + "/health").status_code == 200
    prompt = "the graphs replay"
    raw = client.completions.with_raw_response.create(model="tiny-chat", prompt=prompt, max_tokens=12, **GREEDY,
                                                     extra_body=NO_EOS)
    resp = raw.parse()
    assert resp.object == "text_completion" and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    # The same request over gRPC gives the same text: one engine, one admission, one detokenizer.
    request = pb.GenerateRequest(prompt_text=prompt, stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    text = "".join(r.tokens.text for r in server.inference.Generate(request, timeout=60) if r.HasField("tokens"))
    assert resp.choices[0].text == text
    # The graph execution summary, as gRPC's Completion carries it: in the body and in a header.
    ext = resp.model_extra["graphkeeper"]
    steps = sum(int(e["steps"]) for e in ext["execution"].get("eager_steps", []))
    steps += sum(int(g["steps"]) for g in ext["execution"].get("graph_steps", []))
    assert steps >= 12 and ext["time_to_first_token_seconds"] > 0
    assert json.loads(raw.headers["x-graphkeeper-execution"]) == ext["execution"]


def test_token_id_prompts_and_streaming_give_the_same_text(server, client, chat_model):
    whole = complete(client, "kubernetes operator", 16)
    chunks = list(client.completions.create(model="tiny-chat", prompt="kubernetes operator", max_tokens=16, **GREEDY,
                                            stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len([t for t in texts if t]) >= 2  # streamed as it was made, not at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16  # the usage chunk comes last
    assert "graphkeeper" in chunks[-2].model_extra  # the summary rides on the finishing chunk
    # vLLM's continuous_usage_stats (GuideLLM sends it): every chunk carries the usage so far.
    body = {"prompt": "kubernetes operator", "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [json.loads(line[6:]) for line in httpx.post(server.http_url + "/v1/completions", json=body,
                                                         timeout=60).text.splitlines()
              if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6 and all("usage" in e for e in events)
    # A prompt as token ids: the ids gRPC tokenizes the text into give the same completion.
    request = pb.GenerateRequest(prompt_text="kubernetes operator", stopping=pb.StoppingCriteria(max_new_tokens=1))
    completion = [r.completion for r in server.inference.Generate(request, timeout=60) if r.HasField("completion")][0]
    assert completion.prompt_tokens == whole.usage.prompt_tokens
    ids_prompt = _tokenize(chat_model, "kubernetes operator")
    by_ids = complete(client, ids_prompt, 16)
    assert by_ids.choices[0].text == whole.choices[0].text
    no_leak(server)


def _tokenize(model: Path, text: str) -> list[int]:
    return load_tokenizer(str(model)).encode_ids(text)


def test_chat_completions_render_the_template_stream_and_not(server, client):
    messages = [{"role": "system", "content": "the graphs"}, {"role": "user", "content": "say hello"}]
    resp = client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=10, **GREEDY,
                                          extra_body=NO_EOS)
    message = resp.choices[0].message
    assert resp.object == "chat.completion" and message.role == "assistant" and message.content
    assert resp.usage.completion_tokens == 10 and resp.choices[0].finish_reason == "length"
    # The prompt is the template's rendering: gRPC messages are tokenized the same way.
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages],
                                 stopping=pb.StoppingCriteria(max_new_tokens=10, ignore_eos=True))
    grpc_text = "".join(r.tokens.text for r in server.inference.Generate(request, timeout=60) if r.HasField("tokens"))
    assert message.content == grpc_text
    stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, **GREEDY,
                                            stream=True, extra_body=NO_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without max_tokens the context left after the prompt is the limit.
    long = client.chat.completions.create(model="tiny-chat", messages=messages, **GREEDY, extra_body=NO_EOS)
    assert long.usage.prompt_tokens + long.usage.completion_tokens == MAX_SEQ_LEN
    assert long.choices[0].finish_reason == "length"


def test_stop_strings_end_the_text_before_the_match_and_free_the_slot(server, client, chat_model):
    whole = complete(client, "the graphs replay", 40).choices[0].text
    stop = whole[12:15]
    expected = whole[:whole.find(stop)]
    resp = complete(client, "the graphs replay", 40, stop=[stop, "never-seen-here"])
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 40
    streamed = list(client.completions.create(model="tiny-chat", prompt="the graphs replay", max_tokens=40, **GREEDY,
                                              stop=stop, stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    # Stop token ids (vLLM's extension): generation ends after the id, which is counted.
    ids, _ = generate(server, make_request(_tokenize(chat_model, "the graphs replay"), 12))
    target = ids[5]
    by_id = complete(client, "the graphs replay", 12, extra_body={"stop_token_ids": [target]})
    assert by_id.usage.completion_tokens == ids.index(target) + 1 and by_id.choices[0].finish_reason == "stop"
    no_leak(server)


def test_a_stop_string_is_counted_as_a_stop_not_a_cancellation(server, client):
    """The API ends a sequence whose text matched a stop string early (its slot returns at once),
    but the request finished normally: requests_total counts it under outcome="stop", as a stop
    token id is, and never as a client's cancellation."""
    whole = complete(client, "the graphs replay", 40).choices[0].text
    stop = whole[12:15]
    counts = {o: server.metric("graphkeeper_requests_total", outcome=o) for o in ("stop", "cancelled")}
    complete(client, "the graphs replay", 40, stop=stop)
    list(client.completions.create(model="tiny-chat", prompt="the graphs replay", max_tokens=40, **GREEDY, stop=stop,
                                   stream=True, extra_body=NO_EOS))
    no_leak(server)  # each response came after the engine's completion, which is counted before it is sent
    after = {o: server.metric("graphkeeper_requests_total", outcome=o) for o in ("stop", "cancelled")}
    assert after == {"stop": counts["stop"] + 2, "cancelled": counts["cancelled"]}


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 6}, 400, "logprobs"),
    ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"suffix": " the end"}, 400, "suffix"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"max_tokens": MAX_SEQ_LEN}, 400, "max_tokens"),
])
def test_refusals_are_openai_errors_naming_the_field(server, client, kwargs, status, param):
    args = {"model": "tiny-chat", "prompt": "the graphs", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**args)
    assert err.value.status_code == status
    body = err.value.body
    assert body["param"] == param and param in body["message"], body
    assert set(body) == {"message", "type", "param", "code"}
    assert complete(client, "the graphs", 2).usage.completion_tokens == 2


def test_chat_refusals_name_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "robot", "content": "hi"}], max_tokens=2)
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert err.value.status_code == 400 and err.value.body["param"] == "tools"


def test_the_tenant_comes_from_the_header_or_user(server, client):
    """Steps are counted per tenant for the tenants a policy lists: the request's tenant is the
    header's, else ``user``'s made a label (any string is a valid ``user``)."""
    held = server.status()
    listed = pb.GraphPolicy(policy_uid=held.policy_uid or "uid-t", policy_name="default/graphs",
                            generation=held.policy_generation + 1, mode=pb.GRAPH_MODE_FULL,
                            tenants=[pb.TenantToggle(tenant=t, graphs=pb.TENANT_GRAPHS_DISABLED)
                                     for t in ("team-a", "team-b")])
    server.control.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(policy=listed), timeout=30)
    wait_until(lambda: server.metric("graphkeeper_policy_generation") == listed.generation, what="policy adopted")
    before = server.metric("graphkeeper_tenant_steps_total", tenant="team-a", execution="eager")
    complete(client, "the graphs", 3, user="team-a")
    after = server.metric("graphkeeper_tenant_steps_total", tenant="team-a", execution="eager")
    assert after >= before + 3
    complete(client, "the graphs", 3, user="Team_A")  # OpenAI lets user be any string: it maps to team-a
    assert server.metric("graphkeeper_tenant_steps_total", tenant="team-a", execution="eager") >= after + 3
    complete(client, "the graphs", 3, user="ignored-by-the-header", extra_headers={"X-Graphkeeper-Tenant": "team-b"})
    assert server.metric("graphkeeper_tenant_steps_total", tenant="team-b", execution="eager") >= 3
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, "the graphs", 3, extra_headers={"X-Graphkeeper-Tenant": "Team_B"})
    assert err.value.body["param"] == "X-Graphkeeper-Tenant"


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server, client):
    cancelled = server.metric("graphkeeper_requests_total", outcome="cancelled")
    body = {"model": "tiny-chat", "prompt": "the graphs", "max_tokens": MAX_SEQ_LEN - 16, "stream": True,
            "ignore_eos": True, **GREEDY}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.http_url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
    # The connection is closed: the worker cancels the sequence, well before its 240 tokens.
    wait_until(lambda: server.metric("graphkeeper_requests_total", outcome="cancelled") == cancelled + 1,
               what="the disconnected stream cancelled")
    no_leak(server)
    assert complete(client, "the graphs", 2).usage.completion_tokens == 2


def test_a_request_cancelled_while_queued_leaves_the_queue(long_server):
    """Four long streams hold the four slots; a fifth request waits in the queue (no header sent
    yet) and its client goes away: it leaves the queue at once, streaming or not, and the four run on."""
    server = long_server
    long = {"model": "tiny-chat", "prompt": "the graphs", "max_tokens": LONG_SEQ_LEN - 16, "stream": True,
            "ignore_eos": True}
    cancelled = server.metric("graphkeeper_requests_total", outcome="cancelled")
    with httpx.Client(timeout=30) as http:
        holders = [http.stream("POST", server.http_url + "/v1/completions", json=long) for _ in range(4)]
        try:
            for holder in holders:
                assert holder.__enter__().status_code == 200
            wait_until(lambda: server.metric("graphkeeper_running_sequences") == 4, what="four slots taken")
            for stream in (True, False):
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    queued = pool.submit(httpx.post, server.http_url + "/v1/completions",
                                         json={**long, "stream": stream}, timeout=0.5)
                    wait_until(lambda: server.metric("graphkeeper_queue_depth") == 1, what="the fifth request queued")
                    with pytest.raises(httpx.ReadTimeout):  # nothing was sent: it was queued, not served
                        queued.result()
                wait_until(lambda: server.metric("graphkeeper_queue_depth") == 0, what="the queued request gone")
                assert server.metric("graphkeeper_running_sequences") == 4
        finally:
            for holder in holders:
                holder.__exit__(None, None, None)
    wait_until(lambda: server.metric("graphkeeper_requests_total", outcome="cancelled") == cancelled + 6,
               what="the two queued requests and the four holders cancelled")
    no_leak(server)
    assert httpx.post(server.http_url + "/v1/completions", json={**long, "stream": False, "max_tokens": 2},
                      timeout=60).json()["usage"]["completion_tokens"] == 2


def test_a_full_queue_is_429_and_the_worker_serves_on(long_server):
    """Eight long requests at once on four slots and a queue of one (--max-queue 1): those past the
    queue are 429, refused by the engine core in its own process before any header went out; the
    others complete whole."""
    server, tokens = long_server, 1024  # none can end before all eight arrived
    body = {"model": "tiny-chat", "prompt": [1, 2, 3], "max_tokens": tokens, "ignore_eos": True}

    def post(stream: bool) -> tuple[int, dict | str]:
        with httpx.Client(timeout=120) as http:
            resp = http.post(server.http_url + "/v1/completions", json={**body, "stream": stream})
            return resp.status_code, resp.json() if resp.status_code != 200 or not stream else resp.text

    queue_full = server.metric("graphkeeper_requests_total", outcome="queue_full")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, [False, True] * 4))
    refused = [r for status, r in results if status == 429]
    served = [r for status, r in results if status == 200]
    # The four slots and the one queue place take five.
    assert (len(served), len(refused)) == (5, 3), results
    assert all(r["error"]["type"] == "rate_limit_error" and r["error"]["code"] == "queue_full" for r in refused)
    # Each refusal counted once (the engine core counts it; the API process must not count it again).
    assert server.metric("graphkeeper_requests_total", outcome="queue_full") == queue_full + len(refused)
    for r in served:  # each admitted request ran to the end: a whole body, or a stream to [DONE]
        if isinstance(r, dict):
            assert r["usage"]["completion_tokens"] == tokens
        else:
            assert r.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r
    no_leak(server)
    assert httpx.post(server.http_url + "/v1/completions", json={**body, "max_tokens": 2},
                      timeout=60).json()["usage"]["completion_tokens"] == 2


def _post(server: Worker, content: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.http_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize(("content", "status", "words"), [
    (b'{"prompt": "the", "max_tokens": 2', 400, "not valid JSON"),
    (b'{"prompt": "caf\xe9", "max_tokens": 2}', 400, "not UTF-8"),
    (b'[1, 2, 3]', 400, "JSON object"),
    (b'{"prompt": "the", "max_tokens": "2"}', 400, "max_tokens"),
    (b'{"prompt": "the", "max_tokens": 2, "stream": "yes"}', 400, "stream"),
    (b'{"prompt": {"text": "the"}, "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": "the", "max_tokens": 2, "temprature": 0}', 400, "temprature"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "surrogate"),
    (b'{"prompt": [1, -5], "max_tokens": 2}', 400, "prompt[1]"),
    (b'{"prompt": [100000], "max_tokens": 2}', 400, "prompt[0]"),
    (json.dumps({"prompt": [1] * (MAX_SEQ_LEN + 10), "max_tokens": 2}).encode(), 400, "context"),
    (json.dumps({"prompt": "the graphs " * 2000, "max_tokens": 2}).encode(), 400, "context"),
    (b'[' * 100_000, 400, "JSON"),
    (b'{"prompt": "the", "max_tokens": 1' + b"0" * 50 + b"}", 400, "max_tokens"),
    (b'{"prompt": "the", "max_tokens": 2, "temperature": 1e999}', 400, "temperature"),
    (b'{"prompt": "the", "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "the", "max_tokens": 2, "temperature": Infinity}', 400, "temperature"),
    (b'{"prompt": "the", "max_tokens": 2, "top_p": NaN}', 400, "top_p"),
    (b'{"prompt": "the", "max_tokens": 2, "stop_token_ids": [100000]}', 400, "stop_token_ids"),
    (b'{"prompt": "the", "max_tokens": 2, "seed": 1.5}', 400, "seed"),
])
def test_bad_bodies_are_clear_4xx_and_the_worker_serves_on(server, client, content, status, words):
    resp = _post(server, content)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert complete(client, "the graphs", 2).usage.completion_tokens == 2


def test_a_huge_body_is_413_and_the_worker_serves_on(server, client):
    resp = _post(server, b'{"prompt": "' + b"a" * (8 << 20) + b'"}')
    assert resp.status_code == 413 and "larger than" in resp.json()["error"]["message"]
    assert complete(client, "the graphs", 2).usage.completion_tokens == 2
    assert _post(server, b"{}", "/v1/nothing").status_code == 404
    assert httpx.get(server.http_url + "/v1/completions").json()["error"]["type"] == "invalid_request_error"
    no_leak(server)


def test_vllm_metric_names_repeat_graphkeepers_gauges(server):
    for text in (server.metrics_text(), httpx.get(server.http_url + "/metrics").text):
        lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                 if line and not line.startswith("#")}
        assert lines['vllm:num_requests_waiting{model_name="tiny-chat"}'] == lines["graphkeeper_queue_depth"]
        assert lines['vllm:num_requests_running{model_name="tiny-chat"}'] == lines["graphkeeper_running_sequences"]
        kv = lines.get("graphkeeper_kv_cache_usage_ratio")
        if kv is not None:  # the KV gauges exist once the paged KV cache exports them
            assert lines['vllm:kv_cache_usage_perc{model_name="tiny-chat"}'] == kv
            assert lines['vllm:gpu_cache_usage_perc{model_name="tiny-chat"}'] == kv
        else:
            assert not any(name.startswith("vllm:kv_cache") for name in lines)


def test_the_grpc_api_is_unchanged_beside_http(server):
    tokens, completion = generate(server, make_request([1, 2, 3], 4))
    assert len(tokens) == completion.generated_tokens == 4
    with pytest.raises(grpc.RpcError):
        generate(server, make_request([], 4))


def test_the_in_process_engine_serves_http_alike(fresh_workers, chat_model):
    """--no-engine-process: the same server on the engine thread's facade (a full queue is then
    refused at submit, before the stream exists)."""
    worker = fresh_workers("--no-engine-process", "--max-num-seqs", "2", "--max-seq-len", str(MAX_SEQ_LEN),
                           "--max-num-batched-tokens", "64", "--served-model-name", "tiny-chat", model=str(chat_model))
    client = openai.OpenAI(base_url=worker.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    whole = complete(client, "the graphs replay", 12)
    streamed = list(client.completions.create(model="tiny-chat", prompt="the graphs replay", max_tokens=12, **GREEDY,
                                              stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text and whole.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=4, extra_body=NO_EOS)
    assert chat.usage.completion_tokens == 4
    body = {"prompt": "the graphs", "max_tokens": MAX_SEQ_LEN - 16, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", worker.http_url + "/v1/completions", json=body) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    wait_until(lambda: worker.metric("graphkeeper_requests_total", outcome="cancelled") == 1,
               what="the disconnected stream cancelled")
    no_leak(worker)


def test_sigterm_drains_an_http_stream_and_refuses_new_requests(fresh_workers, chat_model):
    """While draining: /health is 503, a new request is 503 ``not_ready`` naming the state, and the
    stream already running goes on to its last token and ``[DONE]``; then the worker exits 0."""
    worker = fresh_workers("--max-num-seqs", "2", "--max-seq-len", "512", "--max-num-batched-tokens", "64",
                           "--served-model-name", "tiny-chat", model=str(chat_model))
    body = {"model": "tiny-chat", "prompt": "the graphs", "max_tokens": 480, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", worker.http_url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(worker.http_url + "/health").status_code == 503, what="/health 503 while draining")
        refused = httpx.post(worker.http_url + "/v1/completions", json={"prompt": "the", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready", refused.text
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 480
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert worker.proc.wait(timeout=60) == 0


def test_a_failing_step_is_a_500_error_object_and_the_worker_serves_on(fresh_workers, chat_model):
    """A request whose step raises fails alone, before its first token: a 500 ``step_failed`` error
    object (streaming or not, since a stream's headers wait for its first token), counted once as
    an error; its slot returns and the next request is served."""
    worker = fresh_workers("--max-num-seqs", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-batched-tokens", "64",
                           "--served-model-name", "tiny-chat", model=str(chat_model),
                           env={"GRAPHKEEPER_INJECT_STEP_FAILURE": "399"})
    errors = worker.metric("graphkeeper_requests_total", outcome="error")
    for stream in (False, True):
        resp = httpx.post(worker.http_url + "/v1/completions", timeout=60,
                          json={"prompt": [5, 399, 6], "max_tokens": 4, "stream": stream})
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "step_failed" and "failed" in error["message"]
    assert worker.metric("graphkeeper_requests_total", outcome="error") == errors + 2
    no_leak(worker)
    client = openai.OpenAI(base_url=worker.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert complete(client, "the graphs", 2).usage.completion_tokens == 2
