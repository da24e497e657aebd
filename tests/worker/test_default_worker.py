"""A default worker (``graphkeeper worker`` with no size flags, as ``make run`` starts it: the
SmolLM2-135M model, a 2 GiB KV cache, the CPU's default of 128 sequences) driven by the real
``openai`` SDK: 32 concurrent streams all run at once while blocks are free, a gateway finds vLLM's
metric names, a refused call reaches the worker once (a 4xx is never retried), and fields that
change no output are accepted."""

from __future__ import annotations

import threading

import openai
import pytest
from worker_harness import Worker, wait_until

from graphkeeper.worker.settings import DEFAULT_MODEL

STREAMS = 32
#: More tokens than any stream gets before the test closes it: none ends on its own meanwhile.
LONG = 2000
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_worker(module_workers) -> Worker:
    return module_workers(model=DEFAULT_MODEL, base_args=False)


def sdk(worker: Worker, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.http_url + "/v1", api_key="unused", timeout=300, **kwargs)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


class Stream(threading.Thread):
    """One streaming chat request: records its first token, reads until told to stop, then closes
    the connection (which cancels the sequence)."""

    def __init__(self, client: openai.OpenAI, model: str, i: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.i, self.stop = client, model, i, stop
        self.first_token = threading.Event()
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            messages = [{"role": "user", "content": f"Count from {self.i} upwards."}]
            stream = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=LONG,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
            with stream:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.first_token.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        self.finish_reason = chunk.choices[0].finish_reason
                    if self.stop.is_set():
                        break
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err
        finally:
            self.first_token.set()


def test_the_default_worker_states_its_fixed_sequence_count_at_startup(default_worker):
    assert "128 sequences (the cpu default; admitted by blocks)" in default_worker.log()


def test_32_concurrent_streams_all_run_at_once_with_no_queue(default_worker):
    """Admission by blocks: every stream holds only the blocks its prompt (and a block of output)
    needs, so all 32 run together; the worker's own gauges, and vLLM's names for them, say so."""
    client = sdk(default_worker, max_retries=0)
    model = model_name(client)
    stop = threading.Event()
    streams = [Stream(client, model, i, stop) for i in range(STREAMS)]
    for s in streams:
        s.start()
    try:
        for s in streams:
            assert s.first_token.wait(timeout=300), f"stream {s.i} got no token"
        assert [s.error for s in streams if s.error] == []
        assert [s.finish_reason for s in streams] == [None] * STREAMS  # every one still running
        wait_until(lambda: default_worker.metric("graphkeeper_running_sequences") == STREAMS, timeout=60,
                   what=f"{STREAMS} running sequences")
        metrics = default_worker.metrics()
        assert metrics[("graphkeeper_queue_depth", frozenset())] == 0
        assert metrics[("vllm:num_requests_running", frozenset({("model_name", model)}))] == STREAMS
        assert metrics[("vllm:num_requests_waiting", frozenset({("model_name", model)}))] == 0
        kv = metrics[("graphkeeper_kv_cache_usage_ratio", frozenset())]
        assert 0 < kv < 0.5 and metrics[("vllm:kv_cache_usage_perc", frozenset({("model_name", model)}))] == kv
        assert metrics.get(("graphkeeper_preemptions_total", frozenset()), 0) == 0
    finally:
        stop.set()
        for s in streams:
            s.join(timeout=120)
    wait_until(lambda: default_worker.metric("graphkeeper_running_sequences") == 0, timeout=60,
               what="every stream's sequence freed")


def test_a_default_worker_exports_the_gateways_metric_names(default_worker):
    text = default_worker.metrics_text()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"\n{name}{{" in text, name


@pytest.mark.parametrize("call", ["suffix", "image"])
def test_a_refused_call_reaches_the_worker_once_with_the_sdks_retries_on(default_worker, call):
    """The SDK retries 5xx answers (twice by default) and never a 400: a refusal is counted once."""
    client = sdk(default_worker)  # the SDK's default retries
    assert client.max_retries == 2
    model = model_name(client)
    before = default_worker.metric("graphkeeper_requests_total", outcome="invalid")
    with pytest.raises(openai.BadRequestError) as err:
        if call == "suffix":
            client.completions.create(model=model, prompt="The capital of France is", suffix=".", max_tokens=4)
        else:
            client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert err.value.status_code == 400
    assert err.value.body["param"] == ("suffix" if call == "suffix" else "messages[0].content[0].type")
    assert default_worker.metric("graphkeeper_requests_total", outcome="invalid") == before + 1


def test_fields_that_change_no_output_are_accepted_and_change_none(default_worker):
    client = sdk(default_worker, max_retries=0)
    model = model_name(client)
    plain = client.chat.completions.create(
        model=model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer in one sentence."}, *QUESTION])
    dressed = client.chat.completions.create(
        model=model, max_tokens=12, temperature=0, store=True, metadata={"team": "search"},
        user="alice@example.com", parallel_tool_calls=False, service_tier="auto",
        messages=[{"role": "developer", "content": "Answer in one sentence."}, *QUESTION])
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    assert "Paris" in plain.choices[0].message.content
