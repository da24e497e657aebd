"""Admission bounds (pure): oversized or malformed strings are refused naming the field,
and what an error repeats of a refused value is clipped, never the whole value."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.proto.policy import PolicyError, validate_policy
from graphkeeper.worker.serving.admission import (
    MAX_PROMPT_TEXT_BYTES,
    MAX_STOP_IDS,
    AdmissionError,
    Limits,
    Oversize,
    max_request_bytes,
    validate_prompt_length,
    validate_reload_request,
    validate_request,
    validate_tokenized,
)

LIMITS = Limits(vocab_size=512, max_seq_len=128)
TEXT_LIMITS = Limits(vocab_size=512, max_seq_len=128, text_prompts=True)
HUGE = "x" * (10 << 20)
MAX_ERROR = 512


def request(**kw) -> pb.GenerateRequest:
    base = {"prompt_token_ids": [1, 2, 3], "stopping": pb.StoppingCriteria(max_new_tokens=4)}
    return pb.GenerateRequest(**(base | kw))


def refused(fn, *args) -> ValueError:
    with pytest.raises((AdmissionError, PolicyError)) as err:
        fn(*args)
    assert len(str(err.value)) < MAX_ERROR, "an error message echoed a refused value whole"
    return err.value


def test_clipped_repr_elides_long_values_and_escapes_control_characters():
    assert clipped_repr("abc") == "'abc'"
    long = clipped_repr("a" * 1000)
    assert long.startswith("'" + "a" * 64 + "'...") and "1000 characters" in long
    assert "\n" not in clipped_repr("evil\nINFO forged log line")


@pytest.mark.parametrize(("kw", "field"), [
    ({"request_id": "r" * 129}, "request_id"),
    ({"request_id": "é" * 65}, "request_id"),  # 130 bytes on the wire
    ({"request_id": "id\nforged"}, "request_id"),
    ({"tenant": HUGE}, "tenant"),
    ({"tenant": "team-a\n"}, "tenant"),  # ``$`` would accept a trailing newline
    ({"tenant": "a" * 64}, "tenant"),
    ({"prompt_token_ids": [], "prompt_text": ""}, "prompt_token_ids"),
    ({"prompt_text": "hello"}, "prompt_text"),  # both set
    ({"prompt_token_ids": [1] * 100_000}, "prompt_token_ids"),  # the prompt alone overflows (issue 37)
])
def test_bad_generate_fields_are_refused_naming_the_field(kw, field):
    err = refused(validate_request, request(**kw), LIMITS)
    assert str(err).startswith(field + ":"), str(err)


def test_edges_are_accepted():
    validate_request(request(request_id="r" * 128, tenant="a" * 63), LIMITS)
    validate_request(request(prompt_token_ids=[1] * 124), LIMITS)
    validate_request(request(prompt_token_ids=[], prompt_text="héllo"), TEXT_LIMITS)
    validate_request(request(prompt_token_ids=[], prompt_text="x" * MAX_PROMPT_TEXT_BYTES), TEXT_LIMITS)


def test_text_prompt_rules():
    text_only = request(prompt_token_ids=[], prompt_text="hello")
    assert "tokenizer" in str(refused(validate_request, text_only, LIMITS))
    big = request(prompt_token_ids=[], prompt_text="é" * (MAX_PROMPT_TEXT_BYTES // 2 + 1))
    assert str(refused(validate_request, big, TEXT_LIMITS)).startswith("prompt_text: at most")
    no_room = request(prompt_token_ids=[], prompt_text="hi", stopping=pb.StoppingCriteria(max_new_tokens=128))
    assert str(refused(validate_request, no_room, TEXT_LIMITS)).startswith("stopping.max_new_tokens")
    # After tokenization the engine checks the real count.
    validate_prompt_length(100, 28, LIMITS)
    refused(validate_prompt_length, 101, 28, LIMITS)


def test_a_text_prompt_that_cannot_fit_is_refused_from_its_byte_length():
    """With tokens of at most 16 bytes, 128 - 4 tokens hold at most 1984 bytes of text: one byte
    more is refused naming prompt_text, as oversize, without any tokenizer being asked."""
    limits = Limits(vocab_size=512, max_seq_len=128, text_prompts=True, max_token_bytes=16)
    fits = request(prompt_token_ids=[], prompt_text="x" * (16 * 124))
    validate_request(fits, limits)
    err = refused(validate_request, request(prompt_token_ids=[], prompt_text="x" * (16 * 124 + 1)), limits)
    assert isinstance(err, Oversize) and str(err).startswith("prompt_text: 1985 bytes of text make at least 125")
    huge = refused(validate_request, request(prompt_token_ids=[], prompt_text="é" * MAX_PROMPT_TEXT_BYTES), limits)
    assert isinstance(huge, Oversize) and huge.field == "prompt_text"


def test_a_tokenized_text_prompt_is_judged_naming_prompt_text():
    validate_tokenized([1] * 124, 4, LIMITS)
    assert str(refused(validate_tokenized, [1] * 125, 4, LIMITS)).startswith("prompt_text: tokenizes to 125")
    assert str(refused(validate_tokenized, [1, 512], 4, LIMITS)).startswith("prompt_text: the tokenizer made id 512")
    assert str(refused(validate_tokenized, [], 4, LIMITS)).startswith("prompt_text: tokenizes to no tokens")


def test_a_huge_id_list_is_refused_without_being_copied():
    """Four million ids (4 KB gzipped on the wire) are refused by their count: the check allocates
    a few kilobytes, where a copy of the list would take tens of megabytes."""
    import tracemalloc

    req = request(prompt_token_ids=[7] * 4_000_000)
    tracemalloc.start()
    try:
        err = refused(validate_request, req, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(err, Oversize)
    assert peak < 64 << 10, f"refusing the request allocated {peak} bytes"


def test_oversized_prompt_is_refused_before_its_tokens_are_scanned():
    # Every id is out of the vocabulary: the length check must answer first.
    err = refused(validate_request, request(prompt_token_ids=[10**6] * 200_000), LIMITS)
    assert err.field == "prompt_token_ids" and "leave no room" in str(err)


@pytest.mark.parametrize(("req", "field"), [
    (pb.LoadModelRevisionRequest(), "source"),
    (pb.LoadModelRevisionRequest(source="/m/" + "d" * 5000), "source"),
    (pb.LoadModelRevisionRequest(source="/models/a\x00b"), "source"),
    (pb.LoadModelRevisionRequest(source="random:tiny", revision="v" * 129), "revision"),
    (pb.LoadModelRevisionRequest(source="random:tiny", revision="v1\r\nx"), "revision"),
])
def test_bad_reload_requests_are_refused_naming_the_field(req, field):
    err = refused(validate_reload_request, req)
    assert err.field == field and str(err).startswith(field + ":")


def test_good_reload_requests_pass():
    validate_reload_request(pb.LoadModelRevisionRequest(source="random:tiny@5"))
    validate_reload_request(pb.LoadModelRevisionRequest(source="/models/llama-3-8b", revision="v" * 128))


def policy(**kw) -> pb.GraphPolicy:
    return pb.GraphPolicy(**({"policy_uid": "uid", "policy_name": "ns/p", "generation": 1} | kw))


@pytest.mark.parametrize(("kw", "field"), [
    ({"policy_uid": HUGE}, "policy_uid"),
    ({"policy_uid": "u\x1b[31m"}, "policy_uid"),
    ({"policy_name": "n" * 318}, "policy_name"),
    ({"tenants": [pb.TenantToggle(tenant=HUGE, graphs=pb.TENANT_GRAPHS_ENABLED)]}, "tenants[0].tenant"),
    ({"tenants": [pb.TenantToggle(tenant="", graphs=pb.TENANT_GRAPHS_ENABLED)]}, "tenants[0].tenant"),
    ({"tenants": [pb.TenantToggle(tenant="a\n", graphs=pb.TENANT_GRAPHS_ENABLED)]}, "tenants[0].tenant"),
])
def test_policy_string_bounds(kw, field):
    err = refused(validate_policy, policy(**kw))
    assert err.field == field


def test_policy_string_edges_pass():
    validate_policy(policy(policy_uid="u" * 128, policy_name=f"{'n' * 63}/{'p' * 253}"))


def test_the_largest_valid_request_fits_the_message_cap():
    """The inference port refuses messages past ``max_request_bytes`` before parsing them: no
    request that could be valid may be that large, whatever the context."""
    for max_seq_len in (128, 4096, 1 << 20):
        common = dict(request_id="é" * 64, tenant="a" * 63,
                      sampling=pb.SamplingParams(temperature=1.0, top_k=2**31 - 1, top_p=0.5, seed=2**64 - 1),
                      stopping=pb.StoppingCriteria(max_new_tokens=2**31 - 1, stop_token_ids=[2**31 - 1] * MAX_STOP_IDS,
                                                   ignore_eos=True))
        ids = pb.GenerateRequest(prompt_token_ids=[2**31 - 1] * max_seq_len, **common)
        text = pb.GenerateRequest(prompt_text="😀" * (MAX_PROMPT_TEXT_BYTES // 4), **common)
        for req in (ids, text):
            assert req.ByteSize() <= max_request_bytes(max_seq_len)
    assert max_request_bytes(128) < 4_000_000  # four million ids are refused unparsed
