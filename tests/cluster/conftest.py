"""A real control plane, a kubelet stand-in and the operator as a process, for cluster tests.

- ``cluster`` (session): ``deploy/local/cluster.sh up`` on free loopback ports in a fresh state
  directory, the GraphPolicy CRD applied, and ``down`` at the end.
- ``kubelet``: plays the kubelet's part for worker pods a test creates. It starts a real
  ``graphkeeper worker`` process on loopback (CPU, tiny random model; inference on the port
  named ``grpc``, GraphControl on the port named ``control`` with the session's bearer token
  from ``control_token``, which the operator gets too) and writes the Pod's status
  (IP, phase, Ready) through the status subresource, so the operator sees running pods.
- ``operator`` (session): ``graphkeeper operator`` as a subprocess that tests can stop and start.

Nothing here mocks the Kubernetes API. Set GRAPHKEEPER_TEST_WORKER=fake to run the workers as
``tests/fakes/fake_worker.py`` processes (GraphControl only, no model) when the real worker is
not available; the default is the real worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port  # tests/ports.py, shared by every suite

kubernetes = pytest.importorskip("kubernetes")

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402
from graphkeeper.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "deploy" / "local" / "cluster.sh"
CRD = ROOT / "deploy" / "crds" / "graphpolicy.yaml"
#: The operator's test double, run as a process by its path (it is not part of the package).
FAKE_WORKER = ROOT / "tests" / "fakes" / "fake_worker.py"
GROUP, VERSION, PLURAL = "graphkeeper.io", "v1alpha1", "graphpolicies"
INFERENCE_SERVICE = "graphkeeper.worker.v1.InferenceWorker"
WORKER_KIND = os.environ.get("GRAPHKEEPER_TEST_WORKER", "real")


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30.0,
               interval: float = 0.2) -> Any:
    """Polls ``check`` until it returns something truthy; fails with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the control plane ---------------------------------------------------------------------------


@dataclass
class Cluster:
    state: Path
    env: dict[str, str]
    kubeconfig: Path
    bin: Path
    api: Any = None

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        out = subprocess.run([str(self.bin / "kubectl"), *args], env=self.env, input=input,
                             capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out.stdout + out.stderr

    @property
    def core(self) -> Any:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def custom(self) -> Any:
        return kubernetes.client.CustomObjectsApi(self.api)


def start_cluster(state: Path, extra_env: dict[str, str] | None = None) -> Cluster:
    """``cluster.sh up`` on free loopback ports with its state in ``state``; the CRD applied."""
    env = {
        **os.environ,
        "GRAPHKEEPER_CLUSTER_DIR": str(state),
        "GRAPHKEEPER_APISERVER_PORT": str(free_port()),
        "GRAPHKEEPER_ETCD_PORT": str(free_port(3)),
        "GRAPHKEEPER_KCM_PORT": str(free_port()),
        "PYTHON": sys.executable,
        **(extra_env or {}),
    }
    up = subprocess.run([str(CLUSTER_SH), "up"], env=env, capture_output=True, text=True,
                        timeout=1800)
    if up.returncode != 0:
        subprocess.run([str(CLUSTER_SH), "down"], env=env, timeout=60)
        raise RuntimeError(f"cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    exports = subprocess.run([str(CLUSTER_SH), "env"], env=env, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    for line in exports.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", os.environ.get("PATH", ""))
    bindir = Path(exports.split("export PATH=")[1].split(":")[0])
    c = Cluster(state=state, env=env, kubeconfig=Path(env["KUBECONFIG"]), bin=bindir)
    c.api = kubernetes.config.new_client_from_config(config_file=str(c.kubeconfig))
    try:
        c.kubectl("apply", "--server-side", "-f", str(CRD))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                  f"crd/{PLURAL}.{GROUP}")
    except Exception:
        stop_cluster(c)
        raise
    return c


def stop_cluster(c: Cluster) -> None:
    subprocess.run([str(CLUSTER_SH), "down"], env=c.env, timeout=120)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = Path(os.environ.get("GRAPHKEEPER_TEST_CLUSTER_DIR")
                 or tmp_path_factory.mktemp("cluster"))
    try:
        c = start_cluster(state)
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        yield c
    finally:
        stop_cluster(c)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace with its default ServiceAccount (pods need it to be admitted)."""
    name = f"gk-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace({"metadata": {"name": name}})

    def has_sa() -> bool:
        try:
            cluster.core.read_namespaced_service_account("default", name)
            return True
        except kubernetes.client.ApiException:
            return False

    # The controller-manager's ServiceAccount controller creates it; on a loaded 2-core machine that
    # has been seen to take over 30 s late in the suite (CI, 2026-12-03).
    wait_until("the default ServiceAccount", has_sa, timeout=120)
    yield name
    with contextlib.suppress(kubernetes.client.ApiException):
        cluster.core.delete_namespace(name)


# --- the kubelet stand-in ----------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    namespace: str
    port: int
    metrics_port: int
    log: Path
    args: list[str]
    control_port: int = 0
    token: str = ""
    #: Lifecycle transitions the light stand-in reports (``<unix time> <STATE>`` lines).
    lifecycle_log: Path | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def control_target(self) -> str:
        return f"127.0.0.1:{self.control_port or self.port}"

    def graph_status(self) -> pb.GraphStatus:
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        with grpc.insecure_channel(self.control_target) as channel:
            return pb_grpc.GraphControlStub(channel).GetGraphStatus(
                pb.GetGraphStatusRequest(), timeout=5, metadata=metadata)

    def transitions(self) -> list[tuple[float, str]]:
        """The stand-in's own lifecycle report: (unix time, state) at each change."""
        if self.lifecycle_log is None or not self.lifecycle_log.exists():
            return []
        out = []
        for line in self.lifecycle_log.read_text().splitlines():
            stamp, _, state = line.partition(" ")
            out.append((float(stamp), state))
        return out

    def serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


@dataclass
class StandIn:
    """Options for a light GraphControl stand-in (``tests/fakes/fake_worker.py``): no model,
    the worker's policy contract, simulated capture and reload times and capture failures."""

    capture_seconds: float = 0.0
    load_seconds: float = 0.0
    fail_sizes: tuple[int, ...] = ()
    #: Simulated traffic (``8:decode:100,40:mixed:5``, steps per second) and a file of the same
    #: form that the stand-in reads again when it changes.
    traffic: str = ""
    traffic_file: str = ""
    #: Step speed (1: the simulated step time), and the speed while holding exactly some explicit
    #: sizes (``1,8,40=0.9``): how a test makes a canary slower or faster.
    speed: float = 1.0
    speed_with_sizes: str = ""


@dataclass
class Kubelet:
    """Starts a worker process per Pod a test creates, and writes the Pod's status."""

    cluster: Cluster
    logs: Path
    token_file: Path | None = None
    workers: dict[str, Worker] = field(default_factory=dict)

    def create_worker(self, namespace: str, name: str, labels: dict[str, str],
                      annotations: dict[str, str] | None = None, policy_file: str = "",
                      model_revision: str = "", standin: StandIn | None = None,
                      wait: bool = True) -> Worker:
        """A pod and its process: the real worker, or a light stand-in when ``standin`` is
        given (or GRAPHKEEPER_TEST_WORKER=fake)."""
        port, metrics_port, control = free_port(), free_port(), free_port()
        fake = standin is not None or WORKER_KIND == "fake"
        standin = standin or StandIn()
        # Inference on the port named grpc, GraphControl on the port named control (with the
        # bearer token), as the chart's worker pods declare them.
        ports = [{"name": "grpc", "containerPort": port},
                 {"name": "control", "containerPort": control},
                 {"name": "metrics", "containerPort": metrics_port}]
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "worker", "image": "graphkeeper:dev",
                                     "ports": ports}]},
        }
        self.cluster.core.create_namespaced_pod(namespace, pod)
        token_args = ["--control-token-file", str(self.token_file)] if self.token_file else []
        lifecycle = self.logs / f"{namespace}-{name}.lifecycle" if fake else None
        if fake:
            args = [sys.executable, str(FAKE_WORKER), "--port", str(port),
                    "--control-port", str(control), "--max-num-batched-tokens", "64",
                    "--capture-seconds", str(standin.capture_seconds),
                    "--load-seconds", str(standin.load_seconds),
                    "--fail-sizes", ",".join(map(str, standin.fail_sizes)),
                    "--lifecycle-log", str(lifecycle), "--traffic", standin.traffic,
                    "--traffic-file", standin.traffic_file, "--speed", str(standin.speed),
                    "--speed-with-sizes", standin.speed_with_sizes, *token_args]
        else:
            args = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", "random:tiny",
                    "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
                    str(metrics_port), "--device", "cpu", "--max-num-seqs", "4",
                    "--max-seq-len", "128", "--max-num-batched-tokens", "64",
                    "--drain-seconds", "0", "--http-port", "0"]
            args += ["--control-port", str(control), *token_args]
        if model_revision:
            args += ["--model-revision", model_revision]
        if policy_file:
            args += ["--policy-file", policy_file]
        token = self.token_file.read_text().strip() if self.token_file else ""
        worker = Worker(name=name, namespace=namespace, port=port, metrics_port=metrics_port,
                        log=self.logs / f"{namespace}-{name}.log", args=args,
                        control_port=control, token=token,
                        lifecycle_log=lifecycle)
        self.workers[f"{namespace}/{name}"] = worker
        self._start(worker, wait=wait)
        return worker

    def wait_ready(self, worker: Worker) -> None:
        def up() -> bool:
            if worker.process.poll() is not None:
                raise AssertionError(f"worker {worker.name} exited: {worker.log.read_text()[-3000:]}")
            return worker.serving()

        wait_until(f"worker {worker.name} to serve", up, timeout=180, interval=0.25)
        self.set_ready(worker, True)

    def _start(self, worker: Worker, wait: bool = True) -> None:
        with open(worker.log, "ab") as log:
            worker.process = subprocess.Popen(worker.args, stdout=log, stderr=subprocess.STDOUT,
                                              env=self.cluster.env, start_new_session=True)
        if wait:
            self.wait_ready(worker)

    def set_ready(self, worker: Worker, ready: bool) -> None:
        flag = "True" if ready else "False"
        status = {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "hostIP": "127.0.0.1", "startTime": now(),
            "conditions": [{"type": t, "status": flag, "lastTransitionTime": now()}
                           for t in ("Ready", "ContainersReady")],
            "containerStatuses": [{
                "name": "worker", "ready": ready, "restartCount": worker.restarts,
                "image": "graphkeeper:dev", "imageID": "", "started": ready,
                "state": {"running": {"startedAt": now()}} if ready else
                {"waiting": {"reason": "CrashLoopBackOff"}},
            }],
        }
        self.cluster.core.patch_namespaced_pod_status(
            worker.name, worker.namespace, {"status": status},
            _content_type="application/merge-patch+json")

    def kill(self, worker: Worker) -> None:
        """The process dies; the pod still says Ready (the kubelet has not noticed yet)."""
        if worker.process and worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait(timeout=30)

    def stop(self, worker: Worker) -> None:
        """The process dies and the pod is marked not ready."""
        self.kill(worker)
        self.set_ready(worker, False)

    def restart(self, worker: Worker) -> None:
        """A new process for the same pod (container restart: same IP and port)."""
        self.kill(worker)
        worker.restarts += 1
        self._start(worker)

    def close(self) -> None:
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                self.kill(worker)


@pytest.fixture(scope="session")
def control_token(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bearer token the operator sends and the workers require (a Secret, in a cluster)."""
    path = tmp_path_factory.mktemp("control") / "token"
    path.write_text(uuid.uuid4().hex + "\n")
    return path


@pytest.fixture
def kubelet(cluster: Cluster, tmp_path: Path, control_token: Path) -> Iterator[Kubelet]:
    k = Kubelet(cluster, tmp_path, token_file=control_token)
    yield k
    k.close()


# --- the operator ----------------------------------------------------------------------------


@dataclass
class Operator:
    cluster: Cluster
    log: Path
    metrics_port: int = 0
    process: subprocess.Popen | None = None
    status_interval: float = 1.0
    #: Short here, so that a worker killed behind a Ready pod is noticed within seconds (in a
    #: cluster its readiness probe tells the operator); the default is 60 s.
    resync_interval: float = 2.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None

    def start(self) -> None:
        if self.running:
            return
        self.metrics_port = free_port()
        args = [sys.executable, "-m", "graphkeeper.cli", "operator", "--metrics-port",
                str(self.metrics_port), "--status-interval", str(self.status_interval),
                "--resync-interval", str(self.resync_interval),
                "--rpc-timeout", "5", "--log-level", "INFO", *self.extra_args]
        with open(self.log, "ab") as log:
            log.write(f"\n===== start {now()} =====\n".encode())
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env or self.cluster.env,
                                            start_new_session=True)
        wait_until("the operator's /healthz", self.healthy, timeout=60)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if not self.running:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"the operator exited:\n{self.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz",
                                        timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` matching ``labels`` (0 when there are none)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    total += sample.value
        return total

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""


@pytest.fixture(scope="session")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory,
             control_token: Path) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log",
                  extra_args=["--control-token-file", str(control_token)])
    op.start()
    yield op
    op.stop()


@pytest.fixture
def no_operator(operator: Operator) -> Operator:
    """The session operator stopped, for tests that write a policy's status themselves."""
    operator.stop()
    return operator


@pytest.fixture
def running_operator(operator: Operator) -> Operator:
    """The session operator, started again if an earlier test left it stopped."""
    operator.start()
    return operator


# --- GraphPolicy helpers -----------------------------------------------------------------------


class Policies:
    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace

    def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GraphPolicy",
                "metadata": {"name": name}, "spec": spec}
        return self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body)

    def get(self, name: str) -> dict[str, Any]:
        return self.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                                PLURAL, name)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec},
            _content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                            PLURAL, name)

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return False
            raise

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        status = self.get(name).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})

    def wait_condition(self, name: str, kind: str, value: str, reason: str | None = None,
                       generation: int | None = None, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = self.get(name)
            status = obj.get("status") or {}
            want_gen = generation or obj["metadata"]["generation"]
            if status.get("observedGeneration") != want_gen:
                return None
            cond = next((c for c in status.get("conditions") or [] if c["type"] == kind), {})
            if cond.get("status") == value and (reason is None or cond.get("reason") == reason):
                return obj
            return None

        try:
            return wait_until(f"{name} {kind}={value} ({reason})", check, timeout=timeout)
        except AssertionError as err:
            status = json.dumps(self.get(name).get("status"))
            raise AssertionError(f"{err}\nstatus: {status}") from None

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.cluster.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}").items
        return [{"reason": e.reason, "type": e.type, "message": e.message} for e in items]


@pytest.fixture
def policies(cluster: Cluster, namespace: str) -> Policies:
    return Policies(cluster, namespace)
