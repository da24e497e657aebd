"""The local cluster's fixed ports, and the ports the tests draw, stay out of Linux's ephemeral range.

A port in that range can be the local end of any outgoing connection on the machine when a
component binds it; ``cluster.sh``'s check sees only listening sockets, so the component then fails
to start. Once, the end-to-end suite's etcd metrics port (then 33892) was taken that way and every
test of the suite errored in the node fixture.
"""

from __future__ import annotations

import re
from pathlib import Path

from e2e.conftest import NODE_PORTS, PROMETHEUS_PORT
from ports import HIGH, LOW, ephemeral_low, free_port

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "deploy" / "local"
ETCD_SPAN = 3  # client, peer (+1) and metrics (+2)


def expand(name: str, port: int) -> list[int]:
    return list(range(port, port + ETCD_SPAN)) if "ETCD" in name else [port]


def script_defaults() -> dict[str, int]:
    """The ``${GRAPHKEEPER_*_PORT:-N}`` defaults of the local scripts."""
    found: dict[str, int] = {}
    for script in ("cluster.sh", "prometheus.sh"):
        text = (LOCAL / script).read_text()
        for name, port in re.findall(r"\$\{(GRAPHKEEPER_\w+_PORT):-(\d+)\}", text):
            found[name] = int(port)
    return found


def test_the_scripts_declare_their_port_defaults():
    assert {"GRAPHKEEPER_APISERVER_PORT", "GRAPHKEEPER_ETCD_PORT", "GRAPHKEEPER_KCM_PORT",
            "GRAPHKEEPER_KUBELET_PORT", "GRAPHKEEPER_SCHEDULER_PORT",
            "GRAPHKEEPER_PROMETHEUS_PORT"} <= set(script_defaults())


def test_every_fixed_port_is_below_the_ephemeral_range():
    low = ephemeral_low()
    fixed = {**{k: int(v) for k, v in NODE_PORTS.items()},
             "GRAPHKEEPER_PROMETHEUS_PORT (e2e)": PROMETHEUS_PORT}
    ports = {f"{name}={p}" for name, port in [*fixed.items(), *script_defaults().items()]
             for p in expand(name, port) if p >= low}
    assert not ports, f"ports in the ephemeral range (from {low}): {sorted(ports)}"


def test_the_end_to_end_ports_differ_from_the_default_cluster_s():
    """The suite's node runs beside ``make demo``'s cluster: no port of one is a port of the other."""
    ours = {p for name, v in NODE_PORTS.items() for p in expand(name, int(v))} | {PROMETHEUS_PORT}
    theirs = {p for name, v in script_defaults().items() for p in expand(name, v)}
    assert not ours & theirs


def test_drawn_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice():
    low = ephemeral_low()
    drawn = [free_port() for _ in range(50)] + [free_port(3)]
    assert all(LOW <= p < min(HIGH, low) for p in drawn)
    assert drawn[-1] + 2 < min(HIGH, low)
    handed = [*drawn[:-1], *range(drawn[-1], drawn[-1] + 3)]
    assert len(set(handed)) == len(handed)


def test_no_benchmark_draws_its_ports_from_the_ephemeral_range():
    """A benchmark's worker ports come from ``ports.free_port`` too: a port handed out by binding
    port 0 once lost a race with an outgoing connection and failed the budget sweep's second worker
    ("cannot bind the metrics port ... address already in use")."""
    port_zero = re.compile(r"""\.bind\(\s*\(\s*["'][^"']*["']\s*,\s*0\s*\)\s*\)""")
    drawing = sorted(p.name for p in (ROOT / "bench").glob("*.py") if port_zero.search(p.read_text()))
    assert not drawing, f"benchmarks that bind port 0 to choose a port: {drawing}"
