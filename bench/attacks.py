"""Issue 37's attacks as client processes for ``attack_bench.py --table``, and the trivial sink
server the same attacks are aimed at to measure what they cost the machine alone.

Each attack runs for ``seconds`` against ``ports`` (``grpc``, ``http``) and returns
``{"requests": n, "answers": {code: count}}``: an HTTP status, a gRPC code, or what became of a
connection (``held``, ``closed``: closed by the server, ``refused``: the connect failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import zlib
from collections import Counter

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
IDLE_CONNECTIONS = 2000
SLOW_CONNECTIONS = 200


def _connect(port: int, source: str = "127.0.0.1", first: bytes = b"") -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((source, 0))
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
        if first:
            s.sendall(first)
        s.setblocking(False)
        return s
    except OSError:
        s.close()
        return None


def _closed(s: socket.socket) -> bool:
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _hold(port: int, seconds: float, count: int, first: bytes, sources: tuple[str, ...]) -> dict:
    """Keeps ``count`` connections open (reopening those the server closes) for ``seconds``."""
    end = time.monotonic() + seconds
    answers: Counter = Counter()
    held: list[socket.socket] = []
    requests = 0
    while time.monotonic() < end:
        alive = []
        for s in held:
            if _closed(s):
                answers["closed"] += 1
                s.close()
            else:
                alive.append(s)
        held = alive
        while len(held) < count and time.monotonic() < end:
            requests += 1
            s = _connect(port, sources[requests % len(sources)], first)
            if s is None:
                answers["refused"] += 1
                break
            held.append(s)
        time.sleep(0.5)
    answers["held"] = len(held)
    for s in held:
        s.close()
    return {"requests": requests, "answers": dict(answers)}


def idle_h2(ports: dict, seconds: float) -> dict:
    """2,000 idle HTTP/2 connections on the gRPC port."""
    return _hold(ports["grpc"], seconds, IDLE_CONNECTIONS, H2_PREFACE, ("127.0.0.1",))


def idle_http(ports: dict, seconds: float) -> dict:
    """2,000 silent sockets on the HTTP port, from two addresses."""
    return _hold(ports["http"], seconds, IDLE_CONNECTIONS, b"", ("127.0.0.2", "127.0.0.3"))


def slowloris(ports: dict, seconds: float) -> dict:
    """200 connections sending a request head a byte a second (reopened when closed)."""
    end = time.monotonic() + seconds
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
    answers: Counter = Counter()
    conns: list[list] = []
    requests = 0
    while time.monotonic() < end:
        alive = []
        for conn in conns:
            s, sent = conn
            if _closed(s):
                answers["closed"] += 1
                s.close()
                continue
            with contextlib.suppress(OSError):
                s.send(head[sent:sent + 1])
            conn[1] += 1
            alive.append(conn)
        conns = alive
        while len(conns) < SLOW_CONNECTIONS:
            requests += 1
            s = _connect(ports["http"], "127.0.0.4")
            if s is None:
                answers["refused"] += 1
                break
            conns.append([s, 0])
        time.sleep(1.0)
    answers["held"] = len(conns)
    for s, _ in conns:
        s.close()
    return {"requests": requests, "answers": dict(answers)}


def _status(raw: bytes) -> str:
    line = raw.split(b"\r\n", 1)[0].split(b" ")
    if raw.startswith(b"HTTP/1.1 100"):  # an interim answer: the final one follows
        rest = raw.split(b"\r\n\r\n", 1)[1]
        return _status(rest) if rest else "100"
    return line[1].decode() if len(line) > 1 else "no answer"


def _exchange(port: int, payload: bytes, timeout: float = 5.0) -> str:
    """One request on a new connection: the status of the answer, or what became of it."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(payload)
            raw = s.recv(65536)
            if raw.startswith(b"HTTP/1.1 100") and b"\r\n\r\n" not in raw[25:]:
                raw += s.recv(65536)
            return _status(raw) if raw else "closed"
    except TimeoutError:
        return "timeout"
    except OSError:
        return "reset"


def _post(body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n").encode() + body


BAD_BODIES = (
    _post(b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"),
    _post(b"this is not gzip", {"Content-Encoding": "gzip"}),
    _post(b"this is not deflate", {"Content-Encoding": "deflate"}),
    _post(b'{"prompt": [1], "temperature": NaN}'),
    _post(json.dumps({"prompt": [1], "k" * (1 << 20): 1}).encode()),
)


def _loop(seconds: float, payloads: tuple[bytes, ...], port: int) -> dict:
    end = time.monotonic() + seconds
    answers: Counter = Counter()
    requests = 0
    while time.monotonic() < end:
        answers[_exchange(port, payloads[requests % len(payloads)])] += 1
        requests += 1
    return {"requests": requests, "answers": dict(answers)}


def bad_bodies(ports: dict, seconds: float) -> dict:
    """Bodies that made 500s: a 5,000-digit integer, gzip and deflate that are not, NaN, a 1 MiB key."""
    return _loop(seconds, BAD_BODIES, ports["http"])


def unparseable(ports: dict, seconds: float) -> dict:
    """Requests aiohttp cannot parse: a bad request line, a header without a colon."""
    return _loop(seconds, (b"GET /\x00\x01 HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"),
                 ports["http"])


def expect_oversize(ports: dict, seconds: float) -> dict:
    """``Expect: 100-continue`` announcing 50 MB."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    return _loop(seconds, (head,), ports["http"])


def write_bomb(path: str) -> None:
    """A 1 MB gzip body that inflates to 1 GiB, written once (building it takes seconds)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
    zeros = bytes(1 << 20)
    with open(path, "wb") as f:
        for _ in range(1024):
            f.write(packer.compress(zeros))
        f.write(packer.flush())


def gzip_bomb(ports: dict, seconds: float) -> dict:
    """A 1 MB gzip body that inflates to 1 GiB (``ports["bomb"]``: the file ``write_bomb`` wrote)."""
    with open(ports["bomb"], "rb") as f:
        request = _post(f.read(), {"Content-Encoding": "gzip"})
    return _loop(seconds, (request,), ports["http"])


def refused_prompts(ports: dict, seconds: float) -> dict:
    """Issue 22's flood: Generate with a 1 MiB prompt_text, refused after tokenization."""
    import grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pb_grpc

    stub = pb_grpc.InferenceWorkerStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
    req = pb.GenerateRequest(prompt_text="a" * (1 << 20), stopping=pb.StoppingCriteria(max_new_tokens=1))
    end = time.monotonic() + seconds
    answers: Counter = Counter()
    requests = 0
    while time.monotonic() < end:
        requests += 1
        try:
            for _ in stub.Generate(req, timeout=30, compression=grpc.Compression.Gzip):
                pass
            answers["OK"] += 1
        except grpc.RpcError as err:
            answers[err.code().name] += 1
    return {"requests": requests, "answers": dict(answers)}


ATTACKS = {f.__name__: f for f in (idle_h2, idle_http, slowloris, bad_bodies, unparseable, expect_oversize,
                                   gzip_bomb, refused_prompts)}


# --- the trivial sink ------------------------------------------------------------------------


async def _sink_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads and discards; answers 400 to each complete request head."""
    seen = b""
    with contextlib.suppress(Exception):
        while data := await reader.read(65536):
            seen += data
            if b"\r\n\r\n" in seen:
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                break
            seen = seen[-3:]
    writer.close()


def sink_server(ports: dict, ready) -> None:
    """The same ports' worth of server with no work behind it: gRPC refuses every call with
    INVALID_ARGUMENT, HTTP discards what it reads and answers 400."""
    import grpc

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sink")

    class Refuser(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_stream_rpc_method_handler(refuse)

    async def main() -> None:
        server = grpc.aio.server(options=(("grpc.max_receive_message_length", 64 << 20),))
        server.add_generic_rpc_handlers((Refuser(),))
        server.add_insecure_port(f"127.0.0.1:{ports['grpc']}")
        await server.start()
        http = await asyncio.start_server(_sink_http, "127.0.0.1", ports["http"], backlog=1024)
        ready.set()
        async with http:
            await http.serve_forever()

    asyncio.run(main())
