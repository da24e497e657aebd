"""The pure rules behind issue 37's limits: connection admission, descriptor planning, the step
watchdog, rate-limited logging, body parsing, torch threads from the CPU quota, a bounded load."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.cpu_quota import quota_cpus, thread_count
from graphkeeper.worker.engine.reload import load_bounded
from graphkeeper.worker.engine.watchdog import StepWatchdog, progressed, stalled_for
from graphkeeper.worker.log_limits import RateLimitFilter, rate_key
from graphkeeper.worker.serving.control_gate import Relay, to_evict
from graphkeeper.worker.serving.grpc_limits import server_options
from graphkeeper.worker.serving.http_limits import (
    Connection,
    ConnectionGate,
    admission,
    clipped,
    encoding_error,
    handler_error,
    parse_json,
    unsent_bytes,
    write_overdue,
)
from graphkeeper.worker.serving.limits import BASE_FDS, ConnectionLimits, fd_plan, fds_needed, limits_errors
from graphkeeper.worker.serving.openai_api import ApiError

LIMITS = ConnectionLimits(max_connections=10, max_connections_per_peer=4)


# --- connections -----------------------------------------------------------------------------


@pytest.mark.parametrize(("open_count", "peer_count", "evictable", "verdict"), [
    (3, 0, False, "admit"),
    (9, 3, False, "admit"),
    (10, 0, True, "evict"),     # at the cap: the idlest gives way
    (10, 0, False, "refuse"),   # at the cap, every connection busy
    (2, 4, True, "refuse"),     # the peer holds its share
])
def test_http_admission(open_count, peer_count, evictable, verdict):
    assert admission(open_count, peer_count, LIMITS, evictable) == verdict


def test_a_new_control_connection_replaces_the_least_recently_active():
    def relay(peer: str, active: float) -> Relay:
        return Relay(peer, client=None, last_active=active)

    a1, a2, b1 = relay("a", 5.0), relay("a", 1.0), relay("b", 3.0)
    assert to_evict([a1, a2, b1], "c", per_peer=2, cap=4) is None        # room
    assert to_evict([a1, a2, b1], "a", per_peer=2, cap=4) is a2          # a's share: its own idlest
    assert to_evict([a1, b1], "c", per_peer=2, cap=2) is b1              # full: anyone's idlest
    assert to_evict([a1, a2, b1], "b", per_peer=2, cap=3) is a2


def test_the_descriptor_limit_is_raised_to_what_the_caps_need():
    need = fds_needed(LIMITS, http=True)
    assert need == BASE_FDS + 10 + 10 + 3 * 64 + 256  # a control connection: the client's and the relay's two
    assert fd_plan(LIMITS, True, soft=1024, hard=1 << 20) == (need, LIMITS)
    assert fd_plan(LIMITS, True, soft=1 << 16, hard=1 << 20) == (1 << 16, LIMITS)  # never lowered


def test_below_the_caps_need_the_caps_shrink_not_the_descriptors():
    limits = ConnectionLimits()
    soft, served = fd_plan(limits, True, soft=1024, hard=4096)
    assert soft == 4096
    assert fds_needed(served, True) <= 4096
    assert served.max_connections_per_peer <= served.max_connections


def test_bad_limits_are_named():
    errors = limits_errors(ConnectionLimits(max_connections=0, max_connections_per_peer=0, header_seconds=0,
                                            body_seconds=float("nan")))
    assert any("--max-connections must" in e for e in errors)
    assert any("--max-connections-per-peer" in e for e in errors)
    assert any("--header-timeout" in e for e in errors)
    assert any("--body-timeout" in e for e in errors)
    assert any("--write-timeout" in e for e in limits_errors(ConnectionLimits(write_seconds=0)))
    assert limits_errors(ConnectionLimits()) == []


def test_grpc_options_evict_idle_and_half_open_connections():
    options = dict(server_options(ConnectionLimits(idle_seconds=30, header_seconds=5), 77))
    assert options["grpc.max_allowed_incoming_connections"] == 77
    assert options["grpc.max_connection_idle_ms"] == 30_000
    assert options["grpc.server_handshake_timeout_ms"] == 5_000
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.http2.max_ping_strikes"] > 0


def test_a_response_the_client_takes_nothing_of_is_overdue_after_the_write_timeout():
    now = [100.0]
    gate = ConnectionGate(ConnectionLimits(write_seconds=5.0), clock=lambda: now[0])
    transport = SimpleNamespace(get_write_buffer_size=lambda: 70_000, get_extra_info=lambda key: None)
    conn = Connection("10.0.0.1", transport=transport, handler=None)
    assert not write_overdue(conn, 1e9, 5.0, 70_000)            # writing never paused
    gate.writing(conn, paused=True)
    now[0] = 104.0
    gate.writing(conn, paused=True)                             # paused again: the clock keeps its start
    assert conn.paused_since == 100.0
    assert not write_overdue(conn, 104.9, 5.0, 70_000) and write_overdue(conn, 105.1, 5.0, 70_000)
    assert not write_overdue(conn, 105.2, 5.0, 69_000)          # the client took bytes: the clock restarts
    assert not write_overdue(conn, 110.0, 5.0, 69_000) and write_overdue(conn, 110.3, 5.0, 69_000)
    gate.writing(conn, paused=False)                            # resumed: no longer waiting on it
    assert not write_overdue(conn, 1e9, 5.0, 69_000)


def test_unsent_bytes_shrink_as_soon_as_a_slow_client_reads():
    """The socket's send queue counts: reading a few KB moves it, though the buffers hold MBs."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(server.getsockname())
        conn, _ = server.accept()
        with conn:
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    conn.send(b"x" * 65536)
            transport = SimpleNamespace(get_write_buffer_size=lambda: 100, get_extra_info=lambda key: conn)
            full = unsent_bytes(transport)
            assert full > 65536
            for _ in range(16):
                client.recv(4096)
            time.sleep(0.3)  # the window update and the acknowledgement
            assert unsent_bytes(transport) < full


def test_what_aiohttp_answers_itself_becomes_an_openai_error():
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    err = handler_error(400, BadHttpMessage("Invalid header value char:\n\n  b'\\x01'\n    ^"), None)
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", "malformed_http")
    assert "Invalid header value char" in err.message and "\n" not in err.message
    assert handler_error(400, LineTooLong("line", "8190"), None).status == 400
    assert handler_error(500, RuntimeError("bug"), None).body()["error"]["type"] == "server_error"
    assert handler_error(504, None, None).status == 504


# --- the watchdog ----------------------------------------------------------------------------


def test_stalled_for_starts_when_work_appears_or_at_the_last_progress():
    assert stalled_for(100.0, None, 0.0) == 0.0              # no work: never a stall
    assert stalled_for(100.0, 90.0, 10.0) == 10.0            # idle for long, work since 90
    assert stalled_for(100.0, 90.0, 97.0) == 3.0             # progress since


def test_tokens_and_completions_are_progress_refusals_are_not():
    assert progressed([(None, [5], None)])
    assert progressed([(None, [], pb.Completion())])
    assert not progressed([(None, [], RuntimeError("queue full"))])
    assert not progressed([])


def test_the_watchdog_flags_a_stall_and_clears_it_on_progress():
    now = [0.0]
    pending = [0]
    seen: list[bool] = []
    dog = StepWatchdog(lambda: pending[0], stall_seconds=2.0, clock=lambda: now[0])
    dog.subscribe(seen.append)
    publish = dog.wrap(lambda updates: None)
    now[0] = 50.0
    assert not dog.poll()                       # idle for 50 s: fine
    pending[0] = 1
    assert not dog.poll()
    now[0] = 51.5
    publish([(None, [1], None)])
    now[0] = 53.0
    assert not dog.poll()                       # 1.5 s since the token
    publish([(None, [], RuntimeError("refused"))])
    now[0] = 53.6
    assert dog.poll()                           # 2.1 s: a refusal is no progress
    assert not dog.wedged()
    now[0] = 60.0
    assert dog.wedged()                         # 8.5 s > 4 x 2 s: /healthz fails too
    publish([(None, [2], None)])
    assert not dog.poll()
    assert seen == [True, False]


# --- logging ---------------------------------------------------------------------------------


def _record(msg: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, msg, None, None)
    record.__dict__.update(extra)
    return record


def test_the_rate_limit_passes_a_burst_per_key_and_says_what_it_dropped():
    now = [0.0]
    limiter = RateLimitFilter(burst=2, total=100, interval=10.0, clock=lambda: now[0])
    passed = [limiter.filter(_record("same")) for _ in range(5)]
    assert passed == [True, True, False, False, False]
    assert limiter.filter(_record("other"))     # another template has its own burst
    now[0] = 10.0
    record = _record("same")
    assert limiter.filter(record)
    assert "3 similar record(s) dropped" in record.getMessage()


def test_the_rate_limit_bounds_all_keys_together_and_the_keys_it_remembers():
    limiter = RateLimitFilter(burst=1, total=3, interval=10.0, max_keys=5, clock=lambda: 0.0)
    passed = sum(limiter.filter(_record("m", **rate_key("client", str(i)))) for i in range(100))
    assert passed == 3
    assert len(limiter._keys) <= 5


# --- bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"a": ' + b"9" * 5000 + b"}", "5000 digits"),
    (b'{"a": NaN}', "a: NaN is not a JSON number"),
    (b'{"m": [{"x": -Infinity}]}', "m[0].x: -Infinity is not a JSON number"),
    (b"NaN", "the request body: NaN is not a JSON number"),
    (b"\xff", "not UTF-8"),
    (b"{", "not valid JSON"),
    (b"[" * 100_000, "nests too deeply"),
])
def test_a_body_that_is_not_json_is_a_400_naming_the_body(raw, says):
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400
    assert "request body" in err.value.message and says in err.value.message


def test_json_integers_of_ordinary_size_parse():
    assert parse_json(b'{"a": [1, -2, 2147483647]}') == {"a": [1, -2, 2147483647]}


def test_an_encoded_body_is_refused_naming_the_header():
    assert encoding_error({"Content-Encoding": "identity"}) is None
    err = encoding_error({"Content-Encoding": "gzip"})
    assert err is not None and err.status == 400 and err.param == "Content-Encoding"


def test_errors_echo_at_most_a_clipped_param_and_message():
    key = "k" * (3 << 20)
    err = clipped(ApiError(400, f"{key}: unknown field", key))
    assert len(err.param) < 200 and len(err.message) < 2200
    small = ApiError(400, "temperature: must be a number", "temperature")
    assert clipped(small) is small


# --- torch threads ---------------------------------------------------------------------------


@pytest.mark.parametrize(("cpu_max", "v1", "quota"), [
    ("200000 100000\n", (None, None), 2.0),
    ("max 100000\n", (None, None), None),
    ("150000 100000", (None, None), 1.5),
    (None, ("50000\n", "100000\n"), 0.5),
    (None, ("-1\n", "100000\n"), None),
    (None, (None, None), None),
])
def test_the_cpu_quota_is_read_from_cgroup_v2_or_v1(cpu_max, v1, quota):
    assert quota_cpus(cpu_max, *v1) == quota


def test_torch_threads_follow_the_quota_the_affinity_and_omp():
    assert thread_count(2.0, 64, None) == 2          # a 2-CPU pod on a 64-core node
    assert thread_count(1.5, 64, None) == 2
    assert thread_count(0.5, 64, None) == 1
    assert thread_count(None, 8, None) == 8
    assert thread_count(16.0, 4, None) == 4
    assert thread_count(8.0, 64, "1") == 1


# --- a reload's load -------------------------------------------------------------------------


def test_a_load_that_blocks_fails_the_reload_instead_of_wedging_the_engine():
    release = threading.Event()

    def blocked_load(source, revision):
        release.wait(10)  # a read from a FIFO or a hung volume
        return "never used"

    engine = SimpleNamespace(device=SimpleNamespace(type="cpu"), slot=SimpleNamespace(load=blocked_load))
    reload = SimpleNamespace(source="/models/x", revision="")
    with pytest.raises(TimeoutError, match="did not load within"):
        load_bounded(engine, reload, timeout=0.2)
    release.set()
    engine.slot.load = lambda source, revision: (source, revision)
    assert load_bounded(engine, reload, timeout=5) == ("/models/x", "")


# --- the field blamed ------------------------------------------------------------------------


def test_a_prompt_that_fills_the_context_is_blamed_not_max_tokens():
    from graphkeeper.worker.engine.sequence import Limits
    from graphkeeper.worker.serving.admission import AdmissionError, validate_prompt_length

    limits = Limits(1000, 128)
    with pytest.raises(AdmissionError) as err:
        validate_prompt_length(100_000, 16, limits)
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(AdmissionError) as err:
        validate_prompt_length(100, 100, limits)  # room for some new tokens, not that many
    assert err.value.field == "stopping.max_new_tokens"


@pytest.mark.parametrize(("body", "field"), [
    ({"echo": {}}, "echo"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"top_logprobs": True}, "top_logprobs"),
    ({"logit_bias": []}, "logit_bias"),
])
def test_fields_accepted_only_at_their_neutral_value_still_need_their_type(body, field):
    from graphkeeper.worker.serving.openai_types import type_error

    err = type_error({"prompt": "x", **body})
    assert err is not None and err.status == 400 and err.param == field


def test_neutral_fields_of_the_right_type_or_null_pass():
    from graphkeeper.worker.serving.openai_types import type_error

    assert type_error({"echo": False, "parallel_tool_calls": True, "suffix": None, "top_logprobs": 0,
                       "logit_bias": {}, "tools": []}) is None


# --- the metrics port --------------------------------------------------------------------------


def test_a_scrape_that_waits_on_the_engine_core_never_holds_the_probes():
    """/metrics asks the engine core (up to 5 s when it does not answer): it runs on a worker thread,
    so /readyz on the same server is answered meanwhile."""
    import urllib.request

    from graphkeeper.worker.serving.metrics_server import MetricsServer

    release = threading.Event()

    def slow_metrics():
        release.wait(10)
        return 200, b"x 1\n", "text/plain"

    server = MetricsServer({"/metrics": slow_metrics, "/healthz": lambda: (200, b"ok\n", "text/plain"),
                            "/readyz": lambda: (200, b"READY\n", "text/plain")}, "127.0.0.1", 0, timeout=10)
    server.start()
    try:
        scrape = threading.Thread(target=lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{server.port}/metrics", timeout=15).read())
        scrape.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/readyz", timeout=3) as resp:
            assert resp.status == 200
        assert scrape.is_alive(), "the scrape is still waiting while the probe was answered"
        release.set()
        scrape.join(15)
    finally:
        release.set()
        server.stop()


def test_the_in_process_engine_s_work_is_its_running_waiting_and_submitted_sequences():
    from graphkeeper.worker.engine.watchdog import in_process_pending

    engine = SimpleNamespace(scheduler=SimpleNamespace(running=[1, 2], waiting=[3]), mailbox=[4, 5, 6])
    assert in_process_pending(engine) == 6
