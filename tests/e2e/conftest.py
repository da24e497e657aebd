"""The end-to-end suite's world: a real node, the image, the chart installed with helm, Prometheus.

- ``node`` (session): ``deploy/local/cluster.sh up --node`` with its own state directory, ports and
  bridge (gkbr1, 198.18.2.0/24), so it can run beside ``make demo``; ``down`` at the end, which
  removes the bridge, the DNAT rule, the containers and the mounts.
- ``images`` (session): the images ``make images`` built, loaded into the node.

No fixture builds anything (``GRAPHKEEPER_NO_BUILD=1``): ``make test-e2e`` builds the node's
binaries, Prometheus and the images before pytest starts (its ``e2e-deps``).
- ``release`` (session): ``helm install`` of charts/graphkeeper with deploy/local/values-local-node.yaml
  (two CPU workers) and deploy/examples/graphpolicy.yaml applied with kubectl.
- ``prometheus`` (session): ``deploy/local/prometheus.sh`` scraping the release's namespace.

Collected only with GRAPHKEEPER_E2E=1 (``make test-e2e``); tests run in file order and share
the release, as a person trying the chart would.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "deploy" / "local" / "cluster.sh"
PROMETHEUS_SH = ROOT / "deploy" / "local" / "prometheus.sh"
BUILD_IMAGES = ROOT / "deploy" / "docker" / "build-images.sh"
CHART = ROOT / "charts" / "graphkeeper"
VALUES = ROOT / "deploy" / "local" / "values-local-node.yaml"
EXAMPLE = ROOT / "deploy" / "examples" / "graphpolicy.yaml"
CACHE = Path(os.environ.get("GRAPHKEEPER_CACHE", Path.home() / ".cache" / "graphkeeper"))
NAMESPACE = "gk-e2e"
RELEASE = "graphkeeper"
POLICY = "decode"
WORKER_LABEL = "app.kubernetes.io/component=inference-worker"
OPERATOR_LABEL = "app.kubernetes.io/component=operator"
PROMETHEUS_PORT = 29190
# The node's fixed ports, all below Linux's ephemeral range (32768-60999 by default): a port in it
# can be the local end of any outgoing connection when a component binds it. etcd's metrics port
# 33892 was, once, and the whole suite failed in the fixture ("bind: address already in use").
NODE_PORTS = {
    "GRAPHKEEPER_APISERVER_PORT": "26543",
    "GRAPHKEEPER_ETCD_PORT": "23890",  # peer and metrics: +1, +2
    "GRAPHKEEPER_KCM_PORT": "30357",
    "GRAPHKEEPER_SCHEDULER_PORT": "30359",
    "GRAPHKEEPER_KUBELET_PORT": "10350",
}


def wait_until(what: str, check: Callable[[], Any], timeout: float = 120.0,
               interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@dataclass
class Node:
    env: dict[str, str]
    bin: Path
    state: Path

    def run(self, tool: str, *args: str, check: bool = True, input: str | None = None,
            timeout: float = 300) -> str:
        out = subprocess.run([str(self.bin / tool), *args], env=self.env, input=input,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out.stdout

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.run("kubectl", *args, **kw)

    def helm(self, *args: str, **kw: Any) -> str:
        return self.run("helm", *args, **kw)

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def pods(self, label: str, ns: str = NAMESPACE) -> list[dict[str, Any]]:
        return [p for p in self.get("pods", "-n", ns, "-l", label)["items"]
                if not p["metadata"].get("deletionTimestamp")]

    def policy(self) -> dict[str, Any]:
        return self.get("graphpolicy", POLICY, "-n", NAMESPACE)


def ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    state = Path(os.environ.get("GRAPHKEEPER_E2E_DIR", CACHE / "e2e"))
    env = {
        **os.environ,
        "GRAPHKEEPER_CLUSTER_DIR": str(state),
        **NODE_PORTS,
        "GRAPHKEEPER_NODE_BRIDGE": "gkbr1",
        "GRAPHKEEPER_NODE_NET": "198.18.2",
        "GRAPHKEEPER_PROMETHEUS_PORT": str(PROMETHEUS_PORT),
        "GRAPHKEEPER_CONTAINERD_SOCK": str(state / "node" / "containerd" / "containerd.sock"),
        "PYTHON": sys.executable,
        # Every request's metadata in logs/audit.log: which RBAC rules the operator's pod uses.
        "GRAPHKEEPER_AUDIT": "1",
        # The suite builds nothing: `make test-e2e` (e2e-deps) and .ci/run build the binaries and
        # images first; a missing one fails the fixture at once, naming the step, instead of a
        # build racing a fixture's timeout.
        "GRAPHKEEPER_NO_BUILD": "1",
    }
    # One run at a time: a second would tear down the first one's node.
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / ".e2e.lock", "w")  # noqa: SIM115 (held for the session)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pytest.fail(f"another end-to-end run holds {state}/.e2e.lock")
    # A clean API (no objects from an earlier run); the node's image store stays (its cache).
    subprocess.run([str(CLUSTER_SH), "down"], env=env, capture_output=True, timeout=300)
    shutil.rmtree(state / "etcd", ignore_errors=True)
    (state / "logs" / "audit.log").unlink(missing_ok=True)
    up = subprocess.run([str(CLUSTER_SH), "up", "--node"], env=env, capture_output=True,
                        text=True, timeout=2400)
    if up.returncode != 0:
        subprocess.run([str(CLUSTER_SH), "down"], env=env, timeout=300)
        pytest.fail(f"cluster.sh up --node failed:\n{up.stdout[-3000:]}\n{up.stderr[-6000:]}")
    exports = subprocess.run([str(CLUSTER_SH), "env"], env=env, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    for line in exports.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", os.environ.get("PATH", ""))
    bindir = Path(exports.split("export PATH=")[1].split(":")[0])
    try:
        yield Node(env=env, bin=bindir, state=state)
    finally:
        subprocess.run([str(PROMETHEUS_SH), "down"], env=env, timeout=60)
        subprocess.run([str(CLUSTER_SH), "down"], env=env, timeout=300)


@pytest.fixture(scope="session")
def images(node: Node) -> str:
    out = subprocess.run([str(BUILD_IMAGES)], env=node.env, capture_output=True, text=True,
                         timeout=3000)
    assert out.returncode == 0, out.stderr[-6000:]
    return out.stdout.strip().splitlines()[-1]


def example_policy() -> dict[str, Any]:
    """deploy/examples/graphpolicy.yaml, recommending after one step instead of a thousand: the
    suite's few requests are all the traffic the recommendation panels get."""
    policy = yaml.safe_load(EXAMPLE.read_text())
    policy["spec"]["captureSizes"]["fromTraffic"]["minSteps"] = 1
    return policy


@pytest.fixture(scope="session")
def release(node: Node, images: str) -> Iterator[Node]:
    node.helm("upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
              "-f", str(VALUES), "--wait=false")
    node.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(example_policy()))
    yield node
    # Whatever a failed test left behind goes with the node; nothing to do here.


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=20) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=20) as r:
            return json.load(r)["data"]


@pytest.fixture(scope="session")
def prometheus(release: Node) -> Prometheus:
    out = subprocess.run([str(PROMETHEUS_SH), "up", NAMESPACE], env=release.env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return Prometheus(out.stdout.strip().splitlines()[-1])


def manifest(node: Node) -> list[dict[str, Any]]:
    text = node.helm("get", "manifest", RELEASE, "-n", NAMESPACE)
    return [d for d in yaml.safe_load_all(text) if d]
