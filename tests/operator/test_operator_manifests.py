"""The CRD, the plain manifests and the Helm chart agree with each other and with the code."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from graphkeeper.cli import build_parser
from graphkeeper.proto.policy import (
    LADDER_BY_NAME,
    MODE_BY_NAME,
    TENANT_GRAPHS_BY_NAME,
    policy_from_spec,
)

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crds" / "graphpolicy.yaml"
CHART = ROOT / "charts" / "graphkeeper"
K8S_BIN = Path(os.environ.get("GRAPHKEEPER_K8S_BIN")
               or Path.home() / ".cache" / "graphkeeper" / "bin" / "k8s-v1.36.3")


def spec_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_in_deploy_and_in_the_chart_are_identical():
    assert (CHART / "crds" / "graphpolicy.yaml").read_bytes() == CRD.read_bytes()


def test_crd_enums_are_the_policy_models_names():
    props = spec_schema()["properties"]
    assert set(props["mode"]["enum"]) == set(MODE_BY_NAME)
    assert set(props["captureSizes"]["properties"]["ladder"]["enum"]) == set(LADDER_BY_NAME)
    assert set(props["defaultTenantGraphs"]["enum"]) == set(TENANT_GRAPHS_BY_NAME)
    tenant = props["tenants"]["items"]["properties"]
    assert set(tenant["graphs"]["enum"]) == set(TENANT_GRAPHS_BY_NAME)
    assert props["mode"]["default"] == "FullAndPiecewise"


def test_every_list_and_string_in_the_spec_is_bounded():
    def walk(schema: dict, path: str) -> list[str]:
        missing = []
        kind = schema.get("type")
        if kind == "array" and "maxItems" not in schema:
            missing.append(path)
        if kind == "string" and "enum" not in schema and "maxLength" not in schema:
            missing.append(path)
        if kind == "object" and "additionalProperties" in schema and "maxProperties" not in schema:
            missing.append(path)
        for name, sub in (schema.get("properties") or {}).items():
            missing += walk(sub, f"{path}.{name}")
        if isinstance(schema.get("items"), dict):
            missing += walk(schema["items"], f"{path}[]")
        if isinstance(schema.get("additionalProperties"), dict):
            missing += walk(schema["additionalProperties"], f"{path}{{}}")
        return missing

    assert walk(spec_schema(), "spec") == []


def test_the_example_policies_are_valid_for_the_operator():
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "GraphPolicy":
                policy_from_spec(doc["spec"], uid="u", name="ns/x", generation=1)


def helm() -> str:
    found = K8S_BIN / "helm" if (K8S_BIN / "helm").exists() else shutil.which("helm")
    if not found:
        pytest.skip("helm is not built (deploy/local/build-bins.sh)")
    return str(found)


CHART_VALUES = [
    [],
    ["--set", "workers.enabled=true", "--set", "workers.modelRevision=r1",
     "--set", "workers.podMonitor.enabled=true", "--set", "operator.serviceMonitor.enabled=true"],
    ["--set", "operator.watchNamespaces={team-a,team-b}"],
]


@pytest.mark.parametrize("values", CHART_VALUES, ids=["defaults", "workers", "namespaced"])
def test_helm_lint_passes(values: list[str]):
    out = subprocess.run([helm(), "lint", "--strict", str(CHART), *values],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def render(*values: str) -> list[dict]:
    out = subprocess.run([helm(), "template", "gk", str(CHART), "--namespace", "gk-system",
                          "--kube-version", "1.36.3", *values],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_chart_runs_the_operator_with_flags_the_cli_accepts():
    docs = render("--set", "operator.watchNamespaces={team-a}")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.namespace == ["team-a"]
    # Replicas may overlap (two by default, and a rolling update): the Lease lets one act.
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"] for e in container["env"]}
    assert "GRAPHKEEPER_LEADER_ELECTION_NAMESPACE" in env
    roles = {(d["kind"], d["metadata"].get("namespace")) for d in docs if "Role" in d["kind"]}
    assert ("Role", "team-a") in roles and ("RoleBinding", "team-a") in roles


def test_the_chart_workers_mount_the_rendered_policy_and_probe_the_metrics_port():
    docs = render("--set", "workers.enabled=true")
    policy = next(d for d in docs if d["kind"] == "GraphPolicy")
    policy_from_spec(policy["spec"], uid="u", name="ns/x", generation=1)
    worker = next(d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"].endswith("-worker"))
    pod = worker["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in policy["spec"]["selector"]["matchLabels"].items())
    container = pod["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.policy_file == "/etc/graphkeeper/policy/policy.json"
    volume = pod["spec"]["volumes"][0]["configMap"]["name"]
    assert volume == f"{policy['metadata']['name']}-graphpolicy"
    # Probes ask the port the worker serves /readyz on, never an inference port a client can fill.
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    metrics_port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert metrics_port == args.metrics_port and metrics_port not in (args.port, args.http_port)


def test_the_chart_policy_takes_sizes_or_a_ladder_without_null_tricks():
    def policy_spec(*values: str) -> dict:
        docs = render("--set", "workers.enabled=true", *values)
        return next(d for d in docs if d["kind"] == "GraphPolicy")["spec"]

    sizes = policy_spec("--set", "workers.policy.captureSizes.sizes={1,2,4}")
    assert sizes["captureSizes"] == {"sizes": [1, 2, 4]}
    assert policy_from_spec(sizes, uid="u", name="ns/x", generation=1).capture_sizes.explicit.sizes
    ladder = policy_spec("--set", "workers.policy.captureSizes.ladder=Interactivity")
    assert ladder["captureSizes"] == {"ladder": "Interactivity"}
    assert "captureSizes" not in policy_spec(), "omitted: the CRD's Default ladder"
    both = subprocess.run(
        [helm(), "template", "gk", str(CHART), "--kube-version", "1.36.3",
         "--set", "workers.enabled=true", "--set", "workers.policy.captureSizes.sizes={8}",
         "--set", "workers.policy.captureSizes.ladder=Default"],
        capture_output=True, text=True, timeout=120)
    assert both.returncode != 0 and "captureSizes" in both.stderr, "both at once is refused"


def test_the_chart_rbac_holds_only_the_verbs_the_operator_uses():
    docs = render()
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    assert verbs[("", "configmaps")] == {"get", "create", "patch"}
    assert verbs[("graphkeeper.io", "graphpolicies/status")] == {"patch"}
    assert verbs[("", "events")] == {"create"}
    assert ("events.k8s.io", "events") not in verbs
    assert verbs[("", "pods")] == verbs[("", "namespaces")] == {"list", "watch"}
    assert verbs[("apiextensions.k8s.io", "customresourcedefinitions")] == {"list", "watch"}


def test_the_chart_gives_the_operator_its_control_token_file():
    deployment = next(d for d in render() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.control_token_file == "/var/run/graphkeeper/control/token"


def test_the_crd_declares_the_rollout_section():
    rollout = spec_schema()["properties"]["rollout"]["properties"]
    assert rollout["maxUnavailable"]["x-kubernetes-int-or-string"] is True
    assert rollout["maxUnavailable"]["x-kubernetes-validations"]


def test_notes_print_real_commands_for_this_release(tmp_path):
    # helm template skips NOTES.txt; render it through a ConfigMap in a copy of the chart.
    chart = tmp_path / "graphkeeper"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}' + notes + "{{- end -}}")
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data:\n  notes: {{ include "notes" . | quote }}\n')
    out = subprocess.run([helm(), "template", "gk", str(chart), "--namespace", "gk-system",
                          "--kube-version", "1.36.3", "--show-only", "templates/notes.yaml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = yaml.safe_load(out.stdout)["data"]["notes"]
    assert "https://..." not in text and "<" not in text, text
    commands = [line.strip() for line in text.splitlines() if line.startswith("  ")]
    assert "kubectl logs -n gk-system deploy/gk-graphkeeper-operator" in commands
    assert "helm show crds charts/graphkeeper | kubectl apply --server-side -f -" in commands
    assert all(c.split()[0] in ("kubectl", "helm", "curl") for c in commands), commands
    rendered = {d["metadata"]["name"] for d in render()}
    assert "gk-graphkeeper-operator" in rendered and "gk-graphkeeper-operator-metrics" in rendered
