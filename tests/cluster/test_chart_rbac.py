"""The chart's RBAC is enough: the operator runs as the chart's ServiceAccount, namespaced."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import Cluster, Kubelet, Operator, Policies, wait_until

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
SPEC = {"selector": {"matchLabels": {"app": "worker"}}, "captureSizes": {"sizes": [1, 2, 4]}}


def token_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", account, "-n", namespace).strip()
    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": server}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "sa"}}],
        "current-context": "c",
    }))
    return path


def test_the_operator_works_with_only_the_charts_namespaced_rbac(
        operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster,
        tmp_path: Path, control_token: Path):
    helm = cluster.bin / "helm"
    if not helm.exists():
        pytest.skip("helm is not built")
    ns = policies.namespace
    rendered = subprocess.run(
        [str(helm), "template", "gk", str(ROOT / "charts" / "graphkeeper"), "--namespace", ns,
         "--kube-version", "1.36.3", "--set", f"operator.watchNamespaces={{{ns}}}"],
        capture_output=True, text=True, check=True, timeout=120).stdout
    rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS]
    for doc in rbac:  # cluster-scoped names must not clash between test runs
        if doc["kind"].startswith("Cluster"):
            doc["metadata"]["name"] += f"-{ns}"
            if doc["kind"] == "ClusterRoleBinding":
                doc["roleRef"]["name"] += f"-{ns}"
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(rbac))
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, ns, account, tmp_path / "sa.kubeconfig")

    operator.stop()  # one operator at a time
    limited = Operator(cluster, tmp_path / "limited.log",
                       extra_args=["--namespace", ns, "--control-token-file", str(control_token)],
                       env={**cluster.env, "KUBECONFIG": str(kubeconfig)})
    try:
        limited.start()
        worker = kubelet.create_worker(ns, "w", {"app": "worker"})
        policy = policies.create("p", SPEC)
        policies.wait_condition("p", "Ready", "True", timeout=30)
        status = worker.graph_status()
        assert status.policy_uid == policy["metadata"]["uid"]
        assert cluster.core.read_namespaced_config_map("p-graphpolicy", ns).data["policy.json"]
        wait_until("the PolicyPushed Event",
                   lambda: "PolicyPushed" in {e["reason"] for e in policies.events("p")})
        log = limited.log_tail(20000)
        assert "Forbidden" not in log and "403" not in log, log
    finally:
        limited.stop()
        if os.environ.get("KEEP_LOGS"):
            print(limited.log_tail())
        operator.start()
