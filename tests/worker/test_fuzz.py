"""Property-based fuzzing of everything a client can send, against one live worker process over
real gRPC.

Every call must end OK or with a status that says "your request" or "not now" (never INTERNAL
or UNKNOWN), with short error details, and the worker must still be alive and READY afterwards.
Strategies mix valid values with hostile ones (int32 extremes, NaN and infinities, long,
unicode and control-character strings, huge lists) and raw bytes sent through a generic call,
so payloads that do not even decode are covered. The example budget is fixed and derandomized:
the same examples run on every machine, in well under a minute on two cores.
"""

from __future__ import annotations

import math
from collections import Counter

import grpc
import pytest
from hardening_harness import cpu_seconds, raw_call
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from worker_harness import CONTROL_SERVICE, INFERENCE_SERVICE, Worker, generate, make_request

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.model.source import ModelSourceError, check_source

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
}
MAX_DETAILS = 1024
CALL_TIMEOUT = 60.0
VOCAB = 512  # random:tiny
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
FEW = settings(FUZZ, max_examples=40)
#: Calls each property sent to the worker, and how it answered the Generate calls: the last test
#: requires every property's whole budget, so it fails unless the fuzzing ran first.
SENT: Counter[str] = Counter()
GENERATE_ANSWERS: Counter[str] = Counter()
#: The most CPU time (every thread of the worker) one refused Generate may cost: parsing and
#: checking take milliseconds; tokenizing or copying a hostile prompt would take far more.
REFUSAL_CPU_SECONDS = 0.25

# --- strategies ---------------------------------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_INTS = st.sampled_from([0, -1, 1, 127, 128, 511, 512, 8192, 8193, 2**31 - 1, -(2**31)])
FLOAT32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 0.5, 1.0, 100.0, 100.00001, math.nan, math.inf, -math.inf]),
)
NAUGHTY = st.sampled_from([
    "", "team-a", "a" * 63, "a" * 64, "Team_A", "-team", "team-a\n", "\x00", "ok\r\nX-Injected: 1",
    "\u202e\u0000\ufeff", "😀" * 40, "../../etc/passwd", "%s%n%x", "'; DROP TABLE x; --",
])


def long_strings(low: int, high: int) -> st.SearchStrategy[str]:
    """One character repeated: cheap to draw, any size up to past the gRPC message limit."""
    return st.builds(lambda ch, n: ch * n, st.characters(codec="utf-8"), st.integers(low, high))


STRINGS = st.one_of(NAUGHTY, st.text(max_size=80), long_strings(60, 600), long_strings(4000, 5_000_000))
VALID_TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
HOSTILE_TOKENS = st.one_of(
    st.lists(st.one_of(INT32, EDGE_INTS), max_size=40),
    st.builds(lambda t, n: [t] * n, st.one_of(st.integers(0, VOCAB - 1), INT32), st.integers(100, 1_200_000)),
)


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Three valid draws to one hostile, so whole requests are often valid and reach the engine."""
    return st.one_of(valid, valid, valid, hostile)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        temperature=draw(mostly(st.sampled_from([0.0, 0.7, 1e-45, 100.0]), FLOAT32)),
        top_k=draw(mostly(st.integers(0, 50), INT32)),
        top_p=draw(mostly(st.sampled_from([0.0, 0.9, 1.0]), FLOAT32)),
    )
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        request_id=draw(mostly(st.sampled_from(["", "req-1"]), STRINGS)),
        tenant=draw(mostly(st.sampled_from(["", "team-a", "batch"]), STRINGS)),
        prompt_token_ids=draw(mostly(VALID_TOKENS, HOSTILE_TOKENS)),
        prompt_text=draw(st.one_of(st.just(""), st.just(""), st.just(""), STRINGS)),
        sampling=sampling,
        stopping=pb.StoppingCriteria(
            max_new_tokens=draw(mostly(st.integers(1, 6), st.one_of(INT32, EDGE_INTS))),
            stop_token_ids=draw(mostly(st.lists(st.integers(0, VOCAB - 1), max_size=3),
                                       st.lists(st.one_of(INT32, EDGE_INTS), max_size=80))),
            ignore_eos=draw(st.booleans()),
        ),
    )


@st.composite
def policies(draw) -> pb.GraphPolicy:
    sizes = pb.CaptureSizes(max_capture_size=draw(mostly(st.sampled_from([0, 4, 8]), st.one_of(INT32, EDGE_INTS))))
    if draw(st.booleans()):
        sizes.explicit.sizes.extend(draw(mostly(st.lists(st.integers(1, 8), min_size=1, max_size=4, unique=True),
                                                st.lists(st.one_of(INT32, EDGE_INTS), max_size=300))))
    else:
        sizes.ladder = draw(mostly(st.sampled_from([1, 2]), INT32))
    tenants = draw(st.lists(st.tuples(mostly(st.sampled_from(["team-a", "batch"]), STRINGS),
                                      mostly(st.sampled_from([1, 2]), INT32)), max_size=4))
    if draw(st.integers(0, 9)) == 0:
        tenants = [(f"t{i}", 1) for i in range(draw(st.integers(250, 2000)))]
    return pb.GraphPolicy(
        policy_uid=draw(mostly(st.sampled_from(["fuzz-a", "fuzz-b"]), STRINGS)),
        policy_name=draw(mostly(st.just("ns/fuzz"), STRINGS)),
        generation=draw(mostly(st.integers(1, 10**6), INT64)),
        mode=draw(mostly(st.integers(0, 5), INT32)),
        capture_sizes=sizes,
        memory_budget_bytes=draw(mostly(st.sampled_from([0, 1 << 30]), INT64)),
        tenants=[pb.TenantToggle(tenant=t, graphs=g) for t, g in tenants],
        default_tenant_graphs=draw(mostly(st.sampled_from([0, 1, 2]), INT32)),
    )


def refused_sources() -> st.SearchStrategy[str]:
    """Sources that must not load: a hostile string, or a plausible one that names nothing."""
    plausible = st.sampled_from(["random:nope", "random:tiny@x", "random:", "/no/such/model", ".", "/", "/proc/self",
                                 "random:tiny@99999999999999999999999", "random:" + "x" * 5000])
    return st.one_of(plausible, STRINGS)


# --- calling ------------------------------------------------------------------------------------


def check_outcome(call) -> object:
    """Runs ``call``; an error must carry an allowed code and short details. Returns the result or the error."""
    try:
        return call()
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        assert code in ALLOWED, f"{code}: {details[:300]!r}"
        assert len(details.encode()) < MAX_DETAILS, f"{code} details are {len(details)} characters long"
        return err


def drain(stream) -> list[pb.GenerateResponse]:
    return list(stream)


def assert_still_serving(worker: Worker) -> None:
    assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
    assert worker.status().state == pb.LIFECYCLE_STATE_READY
    tokens, completion = generate(worker, make_request([1, 2, 3], 3))
    assert len(tokens) == 3 == completion.generated_tokens
    assert worker.http_get("/healthz")[0] == 200


@pytest.fixture(scope="module")
def fuzz_worker(module_workers) -> Worker:
    return module_workers("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "64",
                          "--max-queue", "16")


# --- properties ---------------------------------------------------------------------------------


@FUZZ
@given(request=generate_requests())
def test_generate_never_hurts_the_worker(fuzz_worker, request):
    SENT["generate"] += 1
    before = cpu_seconds(fuzz_worker.proc.pid)
    result = check_outcome(lambda: drain(fuzz_worker.inference.Generate(request, timeout=CALL_TIMEOUT)))
    spent = cpu_seconds(fuzz_worker.proc.pid) - before
    GENERATE_ANSWERS["accepted" if isinstance(result, list) else result.code().name] += 1
    if not isinstance(result, list):  # a refusal: what it cost the worker, not only its status
        assert spent < REFUSAL_CPU_SECONDS, f"refusing ({result.code().name}) cost {spent:.3f} s of CPU"
    if isinstance(result, list):  # accepted: a whole stream whose counts add up
        assert result and result[-1].HasField("completion")
        tokens = sum(len(r.tokens.token_ids) for r in result[:-1])
        assert tokens == result[-1].completion.generated_tokens <= request.stopping.max_new_tokens


@FUZZ
@given(policy=policies())
def test_apply_graph_policy_never_hurts_the_worker(fuzz_worker, policy):
    SENT["policy"] += 1
    check_outcome(lambda: fuzz_worker.control.ApplyGraphPolicy(
        pb.ApplyGraphPolicyRequest(policy=policy), timeout=CALL_TIMEOUT))


@FEW
@given(source=refused_sources(), revision=mostly(st.just(""), STRINGS))
def test_load_model_revision_refuses_what_cannot_load(fuzz_worker, source, revision):
    try:
        check_source(source)
    except (ModelSourceError, ValueError, OSError):
        pass
    else:
        assume(False)  # this source would really load a model: not this loop's business
    SENT["load"] += 1
    result = check_outcome(lambda: fuzz_worker.control.LoadModelRevision(
        pb.LoadModelRevisionRequest(source=source, revision=revision), timeout=CALL_TIMEOUT))
    assert isinstance(result, grpc.RpcError), "a source that cannot load was accepted"


@FEW
@given(level=st.one_of(EDGE_INTS, INT32, st.sampled_from([1, 2])))
def test_sleep_at_any_level_is_refused_on_a_cpu_worker_and_wake_changes_nothing(fuzz_worker, level):
    SENT["sleep"] += 1
    result = check_outcome(lambda: fuzz_worker.control.Sleep(pb.SleepRequest(level=level), timeout=CALL_TIMEOUT))
    assert isinstance(result, grpc.RpcError), "a CPU worker accepted a sleep"
    wanted = grpc.StatusCode.FAILED_PRECONDITION if level in (1, 2) else grpc.StatusCode.INVALID_ARGUMENT
    assert result.code() == wanted, (level, result.details())
    assert not fuzz_worker.control.Wake(pb.WakeRequest(), timeout=CALL_TIMEOUT).was_asleep


def loadable(payload: bytes) -> bool:
    """Whether ``payload`` decodes to a LoadModelRevision request whose source would really load."""
    try:
        check_source(pb.LoadModelRevisionRequest.FromString(payload).source)
    except Exception:  # noqa: BLE001 - undecodable bytes or a refused source: both are fine to send
        return False
    return True


METHODS = {
    f"/{INFERENCE_SERVICE}/Generate": "unary_stream",
    f"/{INFERENCE_SERVICE}/GetModelInfo": "unary_unary",
    f"/{CONTROL_SERVICE}/ApplyGraphPolicy": "unary_unary",
    f"/{CONTROL_SERVICE}/GetGraphStatus": "unary_unary",
    f"/{CONTROL_SERVICE}/LoadModelRevision": "unary_unary",
    f"/{CONTROL_SERVICE}/Sleep": "unary_unary",
    f"/{CONTROL_SERVICE}/Wake": "unary_unary",
}


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)),
       payload=st.one_of(st.binary(max_size=64), st.binary(min_size=200, max_size=4096),
                         st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x1a\x80", b"\xff" * 16, b"\x08"])))
def test_raw_bytes_never_hurt_the_worker(fuzz_worker, method, payload):
    if method.endswith("/LoadModelRevision"):
        assume(not loadable(payload))
    streaming = METHODS[method] == "unary_stream"
    SENT["raw"] += 1
    result = check_outcome(lambda: raw_call(fuzz_worker, method, payload, streaming=streaming, timeout=CALL_TIMEOUT))
    if streaming and isinstance(result, grpc.RpcError) and (result.details() or "").startswith("request: the bytes"):
        GENERATE_ANSWERS["undecodable"] += 1


def test_four_million_ids_are_refused_before_they_are_parsed(fuzz_worker):
    """4 MB of ids (4 KB gzipped) exceed the largest request that could be valid for a 128-token
    context: the port refuses the message unparsed, for a fraction of the parse's CPU."""
    request = make_request([7] * 4_000_000, 1)
    before = cpu_seconds(fuzz_worker.proc.pid)
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            drain(fuzz_worker.inference.Generate(request, timeout=CALL_TIMEOUT, compression=grpc.Compression.Gzip))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    spent = cpu_seconds(fuzz_worker.proc.pid) - before
    assert spent < 5 * REFUSAL_CPU_SECONDS, f"five refusals cost {spent:.3f} s of the worker's CPU"


def test_worker_is_still_serving_after_the_fuzzing(fuzz_worker):
    """Runs last in this module (pytest keeps file order): every property above ran its whole budget
    against this worker, the worker counted the Generate requests it saw, and it is still healthy."""
    budgets = {"generate": FUZZ.max_examples, "policy": FUZZ.max_examples, "load": FEW.max_examples,
               "sleep": FEW.max_examples, "raw": FUZZ.max_examples}
    assert {name: SENT[name] for name in budgets} == budgets, "the fuzzing did not run (in full) before this test"
    assert GENERATE_ANSWERS["accepted"] > 0, "no fuzzed Generate request reached the engine"
    counted = sum(v for (name, _), v in fuzz_worker.metrics().items() if name == "graphkeeper_requests_total")
    assert counted >= GENERATE_ANSWERS["accepted"] + GENERATE_ANSWERS["INVALID_ARGUMENT"]
    assert GENERATE_ANSWERS["undecodable"] > 0, "no raw Generate payload failed to decode"
    assert fuzz_worker.metric("graphkeeper_requests_total", outcome="undecodable") == GENERATE_ANSWERS["undecodable"]
    assert_still_serving(fuzz_worker)
    for name, labels in fuzz_worker.metrics():
        for value in dict(labels).values():
            assert len(value) <= 64, f"{name} carries a {len(value)}-character label value"
