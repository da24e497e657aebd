"""The engine refuses a prompt with a token id outside the vocabulary at submit (InvalidTokens:
INVALID_ARGUMENT, 400), before the id can reach the embedding, and goes on serving. The API layers
refuse such prompts first; this is the engine's own check, for any caller that reaches it directly
(on a GPU one such id trips a device-side assert that takes the whole worker down)."""

from __future__ import annotations

import threading

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings, InvalidTokens, classify


def request(prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True))


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineSettings(model="random:tiny", max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=32))
    engine.start()
    assert engine.ready.wait(120) and engine.failed is None, engine.failed
    yield engine
    engine.drain_and_stop(5)


@pytest.mark.parametrize("bad", [512, 10**6, -1], ids=["vocab-size", "far-past", "negative"])
def test_a_token_id_outside_the_vocabulary_is_refused_and_the_engine_serves_on(engine, bad):
    vocab = engine.slot.loaded.config.vocab_size
    assert vocab == 512
    with pytest.raises(InvalidTokens, match=r"prompt_token_ids: .*\[0, 512\)"):
        engine.submit(request([5, bad, 7]), lambda tokens, end: None)
    assert classify(InvalidTokens("x")).grpc_code == "INVALID_ARGUMENT"
    done, out = threading.Event(), []

    def emit(tokens, end):
        out.extend(tokens)
        if end is not None:
            done.set()

    engine.submit(request([5, vocab - 1, 7]), emit)  # the largest id is fine
    assert done.wait(60) and len(out) == 3
