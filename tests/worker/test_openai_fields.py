"""Fields OpenAI and vLLM define that change no output are accepted, a refusal is never a 5xx, and
the tenant is the header or a label made from ``user``: the pure rules, without a worker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphkeeper.proto.policy import valid_tenant
from graphkeeper.worker.serving.openai_api import ApiError, parse_chat, parse_completion, unsupported
from graphkeeper.worker.serving.openai_fields import tenant_from_user

HI = [{"role": "user", "content": "hi"}]


def test_fields_that_change_no_output_are_accepted_on_chat():
    parsed = parse_chat({"messages": HI, "store": True, "metadata": {"team": "search", "run": "7"},
                         "user": "alice@example.com", "service_tier": "auto", "safety_identifier": "u-123",
                         "prompt_cache_key": "k", "parallel_tool_calls": False})
    assert [(m.role, m.content) for m in parsed.request.messages] == [("user", "hi")]
    assert parsed.request.tenant == "alice-example-com"
    plain = parse_chat({"messages": HI})
    assert parsed.request.sampling == plain.request.sampling and parsed.request.stopping == plain.request.stopping


def test_the_developer_role_is_a_system_message():
    parsed = parse_chat({"messages": [{"role": "developer", "content": "be brief"}, *HI]})
    assert [m.role for m in parsed.request.messages] == ["system", "user"]


@pytest.mark.parametrize(("body", "param"), [
    ({"store": "yes"}, "store"),
    ({"metadata": ["a"]}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"user": 7}, "user"),
    ({"safety_identifier": {}}, "safety_identifier"),
])
def test_a_neutral_field_of_the_wrong_type_is_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": HI, **body})
    assert (err.value.status, err.value.param, err.value.type) == (400, param, "invalid_request_error")


def test_null_neutral_fields_are_not_set():
    assert parse_chat({"messages": HI, "store": None, "metadata": None, "user": None}).request.tenant == ""


def test_a_refusal_of_what_is_not_supported_is_400_never_5xx():
    """The openai SDK retries 5xx answers (twice by default): a refusal must be a 4xx to reach the
    worker once."""
    err = unsupported("suffix", "insertion (suffix) is not supported")
    assert err.status == 400 and err.body()["error"] == {
        "message": "suffix: insertion (suffix) is not supported", "type": "invalid_request_error",
        "param": "suffix", "code": "unsupported_parameter"}
    for body in ({"prompt": "x", "suffix": "y"}, {"prompt": ["a", "b"]}):
        with pytest.raises(ApiError) as raised:
            parse_completion(body)
        assert raised.value.status == 400
    with pytest.raises(ApiError) as raised:
        parse_chat({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert (raised.value.status, raised.value.param) == (400, "messages[0].content[0].type")


@pytest.mark.parametrize(("user", "tenant"), [
    ("team-a", "team-a"),
    ("alice@example.com", "alice-example-com"),
    ("Alice@Example.COM", "alice-example-com"),
    ("  spaced  out  ", "spaced-out"),
    ("user_42", "user-42"),
    ("Zoë", "zo"),
    ("", ""),
    ("@@@", ""),
])
def test_user_becomes_a_label_deterministically(user, tenant):
    assert tenant_from_user(user) == tenant
    assert parse_completion({"prompt": "x", "user": user}).request.tenant == tenant


def test_a_long_user_keeps_its_head_and_a_hash_of_the_whole():
    a, b = "x" * 100 + "a", "x" * 100 + "b"
    ta, tb = tenant_from_user(a), tenant_from_user(b)
    assert len(ta) == 63 and ta.startswith("x" * 54 + "-") and ta != tb and tenant_from_user(a) == ta


@given(st.text(max_size=300))
def test_every_user_string_makes_a_valid_tenant(user):
    assert valid_tenant(tenant_from_user(user))


def test_the_header_is_the_tenant_as_sent():
    """The header is graphkeeper's own and names a policy's tenant: it is kept as sent, and
    admission refuses one that is not a label, naming the header."""
    assert parse_completion({"prompt": "x", "user": "alice@example.com"}, tenant_header="team-b").request.tenant == (
        "team-b")
    assert parse_completion({"prompt": "x"}, tenant_header="Team B").request.tenant == "Team B"
