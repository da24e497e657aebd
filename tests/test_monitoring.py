"""The Grafana dashboard, the Prometheus rules and the metrics docs against the metrics the code exports.

Names, label names and label values come from ``graphkeeper.worker.metrics`` and
``graphkeeper.operator.metrics`` (never restated here), so a renamed series, label or proto enum value
fails this file. The rules also go through the real Prometheus engine: ``promtool check rules`` and
``promtool test rules tests/promtool/alerts-test.yaml`` (promtool is built once by
``deploy/local/build-promtool.sh``). The chart's copies must equal the deploy/ files, and
``helm template`` must render the dashboard ConfigMap and the PrometheusRule from them.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from graphkeeper.operator import metrics as operator_metrics
from graphkeeper.operator.status import WorkerState
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker import metrics as worker_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "graphkeeper-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "graphkeeper-alerts.yaml"
CHART = ROOT / "charts" / "graphkeeper"
CHART_DASHBOARD = CHART / "dashboards" / "graphkeeper.json"
CHART_RULES = CHART / "rules" / "graphkeeper-alerts.yaml"
PROMTOOL_TESTS = ROOT / "tests" / "promtool" / "alerts-test.yaml"
DOCS = ROOT / "docs" / "metrics.md"

#: Labels Prometheus attaches to every scraped series (target labels), plus the name itself.
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance", "container", "endpoint", "service",
                           "__name__"})
MODEL_INFO_LABELS = worker_metrics.MODEL_INFO_LABELS

NAME_RE = re.compile(r"\bgraphkeeper[_:][A-Za-z0-9_:]*[A-Za-z0-9_]")
SELECTOR_RE = re.compile(r"\b(graphkeeper[_:][A-Za-z0-9_:]*[A-Za-z0-9_])\s*(?:\{([^}]*)\})?")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_REPLACE_RE = re.compile(r'label_replace\s*\(.*?,\s*"([A-Za-z_][A-Za-z0-9_]*)"', re.S)
LABEL_VALUES_RE = re.compile(r"label_values\(\s*(graphkeeper_[a-z0-9_]+)[^,]*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")
LITERAL_RE = re.compile(r"^[A-Za-z0-9_.:+-]+$")


@dataclass
class Series:
    """One exported series name: its label names and, where the code has a closed list, their values."""

    labels: frozenset[str]
    values: dict[str, frozenset[str]] = field(default_factory=dict)


def _series_names(metric: MetricWrapperBase) -> list[str]:
    name, kind = metric._name, metric._type
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
    if kind == "info":
        return [f"{name}_info"]
    return [name]


def _export(metrics: list[MetricWrapperBase], values: dict[tuple[str, str], tuple[str, ...]]) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for metric in metrics:
        labels = set(metric._labelnames)
        if metric._type == "info":
            labels |= set(MODEL_INFO_LABELS)
        for name in _series_names(metric):
            extra = {"le"} if name.endswith("_bucket") else set()
            closed = {label: frozenset(v) for (base, label), v in values.items() if base == metric._name}
            out[name] = Series(frozenset(labels | extra), closed)
    return out


def _worker_series() -> dict[str, Series]:
    m = worker_metrics.WorkerMetrics()
    wm = worker_metrics
    stages = tuple(pb.LedgerStage.Name(v).removeprefix("LEDGER_STAGE_").lower()
                   for v in pb.LedgerStage.values() if v != pb.LEDGER_STAGE_UNSPECIFIED)
    values = {
        ("graphkeeper_requests", "outcome"): wm.OUTCOMES,
        ("graphkeeper_step_duration_seconds", "execution_mode"): wm.EXECUTION_MODES,
        ("graphkeeper_step_duration_seconds", "attention_backend"): wm.ATTENTION_BACKENDS,
        ("graphkeeper_step_tokens", "kind"): wm.STEP_KINDS,
        ("graphkeeper_step_sequences", "kind"): wm.STEP_KINDS,
        ("graphkeeper_eager_steps", "fallback_reason"): wm.FALLBACK_REASONS,
        ("graphkeeper_graph_skipped", "fallback_reason"): wm.FALLBACK_REASONS,
        ("graphkeeper_lifecycle_state", "state"): wm.LIFECYCLE_STATES,
        ("graphkeeper_memory_ledger_bytes", "kind"): wm.LEDGER_KINDS,
        ("graphkeeper_memory_ledger_bytes", "stage"): stages,
        ("graphkeeper_graph_mode", "kind"): wm.MODE_KINDS,
        ("graphkeeper_recaptures", "cause"): wm.RECAPTURE_CAUSES,
        ("graphkeeper_tenant_steps", "execution"): wm.TENANT_EXECUTIONS,
    }
    for base in ("graphkeeper_graph_replays", "graphkeeper_graph_mode", "graphkeeper_graph_captured",
                 "graphkeeper_graph_skipped", "graphkeeper_graph_capture_duration_seconds",
                 "graphkeeper_graph_replay_step_seconds", "graphkeeper_graph_eager_step_seconds",
                 "graphkeeper_graph_padding_tokens", "graphkeeper_graph_released"):
        values[(base, "mode")] = wm.GRAPH_MODES
    metrics = [v for v in vars(m).values() if isinstance(v, MetricWrapperBase)]
    return _export(metrics, values)


def _operator_series() -> dict[str, Series]:
    metrics = [v for v in vars(operator_metrics).values() if isinstance(v, MetricWrapperBase)]
    values = {("graphkeeper_operator_workers", "state"): tuple(str(s) for s in WorkerState),
              ("graphkeeper_operator_expected_coverage_ratio", "sizes"): operator_metrics.COVERAGE_SIZES}
    return _export(metrics, values)


WORKER = _worker_series()
OPERATOR = _operator_series()
EXPORTED = {**WORKER, **OPERATOR}


def _rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def _recorded() -> dict[str, Series]:
    """Recorded series (``graphkeeper:...``): labels and values of the exported series they derive from."""
    out: dict[str, Series] = {}
    for group in _rules()["groups"]:
        for rule in group["rules"]:
            if "record" not in rule:
                continue
            labels: set[str] = set()
            values: dict[str, set[str]] = {}
            for name in NAME_RE.findall(rule["expr"]):
                source = out.get(name) or EXPORTED.get(name)
                if source is None:
                    continue
                labels |= source.labels
                for label, vals in source.values.items():
                    values.setdefault(label, set()).update(vals)
            out[rule["record"]] = Series(frozenset(labels), {k: frozenset(v) for k, v in values.items()})
    return out


RECORDED = _recorded()
KNOWN = {**EXPORTED, **RECORDED}


def _dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panel targets, annotations, variables."""
    found: list[tuple[str, str]] = []

    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            here = node.get("title") or node.get("name") or where
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append((f"{here}.{key}", value))
                elif key == "query" and isinstance(value, str) and "graphkeeper" in value:
                    found.append((f"{here}.query", value))
                else:
                    walk(value, here)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    walk(json.loads(DASHBOARD.read_text()), "dashboard")
    return found


def _rule_queries() -> list[tuple[str, str]]:
    return [(rule.get("alert") or rule.get("record"), rule["expr"])
            for group in _rules()["groups"] for rule in group["rules"]]


QUERIES = [("dashboard", w, q) for w, q in _dashboard_queries()] + [("rules", w, q) for w, q in _rule_queries()]


def _problems(expr: str) -> list[str]:
    problems = []
    names = set(NAME_RE.findall(expr))
    for name in names:
        if name not in KNOWN:
            problems.append(f"series {name} is not exported (nor recorded by the rules)")
    if problems:
        return problems
    in_scope = set(TARGET_LABELS) | set(LABEL_REPLACE_RE.findall(expr))
    for name in names:
        in_scope |= KNOWN[name].labels
    for name, body in SELECTOR_RE.findall(expr):
        series = KNOWN[name]
        for label, op, value in MATCHER_RE.findall(body or ""):
            if label not in series.labels | TARGET_LABELS:
                problems.append(f"{name} has no label {label!r}")
                continue
            allowed = series.values.get(label)
            if allowed is None or "$" in value or op in ("!=", "!~"):
                continue
            alternatives = value.split("|") if op == "=~" else [value]
            if op == "=~" and not all(LITERAL_RE.match(a) for a in alternatives):
                problems.append(f"{name}{{{label}=~{value!r}}}: only plain alternations are checked; use them")
                continue
            problems += [f"{name}{{{label}={a!r}}}: {a!r} is not one of {sorted(allowed)}"
                         for a in alternatives if a not in allowed]
    for group in GROUPING_RE.findall(expr):
        for label in filter(None, (s.strip() for s in group.split(","))):
            if label not in in_scope:
                problems.append(f"grouping label {label!r} is on none of {sorted(names)}")
    for name, label in LABEL_VALUES_RE.findall(expr):
        if label not in KNOWN[name].labels | TARGET_LABELS:
            problems.append(f"label_values: {name} has no label {label!r}")
    return problems


# ---------------------------------------------------------------- the contract ----------------------


def test_derived_names_match_metric_names():
    """This file's view of the worker's series is the worker's own list."""
    assert set(WORKER) == set(worker_metrics.METRIC_NAMES)


def test_dashboard_and_rules_have_queries():
    assert sum(1 for src, _, _ in QUERIES if src == "dashboard") > 30
    assert sum(1 for src, _, _ in QUERIES if src == "rules") > 15


@pytest.mark.parametrize(("source", "where", "expr"), QUERIES, ids=[f"{s}:{w}" for s, w, _ in QUERIES])
def test_query_references_exported_series(source, where, expr):
    assert _problems(expr) == []


@pytest.mark.parametrize("path", [DASHBOARD, RULES, DOCS], ids=lambda p: p.name)
def test_every_name_mentioned_is_exported(path):
    """Prose too: descriptions, comments and docs name only real series."""
    unknown = sorted({n for n in NAME_RE.findall(path.read_text()) if n not in KNOWN})
    assert unknown == []


@pytest.mark.parametrize("expr", [
    'rate(graphkeeper_eager_steps_total{fallback_reason="exceeds_max_size"}[5m])',
    'graphkeeper_lifecycle_state{state=~"ready|serving"}',
    "sum by (reason) (graphkeeper_eager_steps_total)",
    'graphkeeper_graph_replays_total{execution_mode="full"}',
    'graphkeeper_graph_mode{kind="device_used"}',
    "graphkeeper_eager_steps",
    'graphkeeper_operator_workers{state="Ready"}',
])
def test_checker_catches_drift(expr):
    """The checker above is not vacuous: each of these is wrong in one way."""
    assert _problems(expr) != []


def test_dashboard_shape():
    d = json.loads(DASHBOARD.read_text())
    assert d["schemaVersion"] >= 38
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "pod"} <= set(variables)
    panels = [p for p in d["panels"] if p["type"] != "row"]
    panels += [c for p in d["panels"] if p["type"] == "row" for c in p.get("panels", [])]
    ids = [p["id"] for p in d["panels"]] + [c["id"] for p in d["panels"] for c in p.get("panels", [])]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]


def test_rules_shape():
    rules = [r for g in _rules()["groups"] for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert len({r["alert"] for r in alerts}) == len(alerts)
    docs = DOCS.read_text()
    for rule in alerts:
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith("docs/metrics.md#" + rule["alert"].lower())
        assert f"### {rule['alert']}\n" in docs, rule["alert"]


def test_docs_list_every_metric():
    docs = DOCS.read_text()
    missing = sorted(n for n in worker_metrics.METRIC_NAMES if f"`{n}`" not in docs)
    assert missing == []
    op = sorted(n for n in OPERATOR if not n.endswith(("_sum", "_count")) and f"`{n}`" not in docs)
    assert op == []


def test_chart_copies_are_identical():
    assert CHART_DASHBOARD.read_bytes() == DASHBOARD.read_bytes(), "cp deploy/grafana/... charts/.../dashboards/"
    assert CHART_RULES.read_bytes() == RULES.read_bytes(), "cp deploy/prometheus/... charts/.../rules/"


# ---------------------------------------------------------------- promtool ----------------------------


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool as ``deploy/local/build-promtool.sh`` built it (``.ci/run`` does, before the tests).

    The fixture builds nothing: the script with GRAPHKEEPER_NO_BUILD=1 prints the cached binary's
    path or fails at once; then the tests skip, which CI turns into failures (tests/conftest.py).
    """
    script = ROOT / "deploy" / "local" / "build-promtool.sh"
    out = subprocess.run(["bash", str(script)], env={**os.environ, "GRAPHKEEPER_NO_BUILD": "1"},
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"promtool is not built: {out.stderr.strip()}")
    return Path(out.stdout.strip().splitlines()[-1])


def _promtool(promtool: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_promtool_check_rules(promtool):
    out = _promtool(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests(promtool):
    out = _promtool(promtool, "test", "rules", str(PROMTOOL_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_tests_cover_every_alert():
    alerts = {r["alert"] for g in _rules()["groups"] for r in g["rules"] if "alert" in r}
    spec = yaml.safe_load(PROMTOOL_TESTS.read_text())
    fired = {case["alertname"] for t in spec["tests"] for case in t.get("alert_rule_test", [])
             if case.get("exp_alerts")}
    waited = {case["alertname"] for t in spec["tests"] for case in t.get("alert_rule_test", [])
              if not case.get("exp_alerts")}
    assert alerts - fired == set(), "alerts no promtool test makes fire"
    assert fired <= alerts
    assert len(waited) >= 10  # most alerts are also shown silent before their `for:` has passed


def test_promtool_tests_fail_when_a_threshold_moves(promtool, tmp_path):
    """The unit tests are not vacuous: a rule file with one threshold moved fails them."""
    text = RULES.read_text()
    assert ") > 0.2\n" in text
    (tmp_path / "rules.yaml").write_text(text.replace(") > 0.2\n", ") > 0.5\n", 1))
    spec = yaml.safe_load(PROMTOOL_TESTS.read_text())
    spec["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec))
    out = _promtool(promtool, "test", "rules", str(tmp_path / "tests.yaml"))
    assert out.returncode != 0
    assert "GraphkeeperEagerFallbackHigh" in out.stdout + out.stderr


# ---------------------------------------------------------------- helm --------------------------------




def _template(helm: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [str(helm), "template", "gk", str(CHART), "--namespace", "llm", "--kube-version", "1.36.3"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_helm_renders_monitoring(helm):
    out = _template(helm, "monitoring.dashboard.enabled=true", "monitoring.prometheusRule.enabled=true",
                    "monitoring.prometheusRule.additionalLabels.release=kps",
                    "monitoring.dashboard.namespace=grafana")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    configmaps = [d for d in docs if d["kind"] == "ConfigMap" and "graphkeeper.json" in d.get("data", {})]
    assert len(configmaps) == 1
    cm = configmaps[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "grafana"
    assert json.loads(cm["data"]["graphkeeper.json"]) == json.loads(DASHBOARD.read_text())
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert len(rules) == 1
    assert rules[0]["apiVersion"] == "monitoring.coreos.com/v1"
    assert rules[0]["metadata"]["labels"]["release"] == "kps"
    assert rules[0]["metadata"]["namespace"] == "llm"
    assert rules[0]["spec"]["groups"] == _rules()["groups"]


def test_helm_monitoring_off_by_default(helm):
    out = _template(helm)
    assert out.returncode == 0, out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout) if d]
    assert "PrometheusRule" not in kinds
    assert "grafana_dashboard" not in out.stdout


def test_helm_schema_rejects_unknown_monitoring_keys(helm):
    out = _template(helm, "monitoring.prometheusRule.enable=true")
    assert out.returncode != 0


# ------------------------------------------------------- serving states: code, alerts and docs ----


def _lifecycle():
    """The worker's lifecycle module, wherever the worker package keeps it (imported here only)."""
    for name in ("graphkeeper.worker.engine.lifecycle", "graphkeeper.worker.lifecycle"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not name.startswith(err.name or "\0"):
                raise  # the module exists but something it imports does not
    raise AssertionError("no graphkeeper.worker lifecycle module")


def _health() -> dict[str, bool]:
    """Each lifecycle state's name (READY, RECAPTURING, ...), from the proto enum -> whether the
    worker's SERVING_STATES hold it (its health is SERVING)."""
    serving = _lifecycle().SERVING_STATES
    return {pb.LifecycleState.Name(s).removeprefix("LIFECYCLE_STATE_"): s in serving
            for s in pb.LifecycleState.values() if s != pb.LIFECYCLE_STATE_UNSPECIFIED}


HEALTH_WORD_RE = re.compile(r"\bNOT_SERVING\b|(?<!NOT_)\bSERVING\b")
WHILE_RE = re.compile(r"\bwhile\s+((?:[A-Za-z_`]+)(?:\s*(?:,|\bor\b|\band\b)\s*[A-Za-z_`]+)*)")
#: Docs that say which lifecycle states serve. docs/architecture.md joins once its sentence on
#: recapturing is fixed in the worker restructure.
HEALTH_DOCS = [DOCS, ROOT / "docs" / "architecture.md", CHART / "README.md", CHART / "templates" / "workers.yaml"]


def _health_claims(text: str, states: set[str]) -> list[tuple[str, str, str]]:
    """(health word, state, clause) for each "SERVING ... while <state>[ or <state>...]" in ``text``:
    the health word closest before the "while" in the same clause is what the text says of that state."""
    claims = []
    flat = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())
    for clause in re.split(r"[.;](?:\s|$)", flat):
        for m in WHILE_RE.finditer(clause):
            said = HEALTH_WORD_RE.findall(clause[:m.start()])
            if not said:
                continue
            for word in re.split(r"\s*(?:,|\bor\b|\band\b)\s*", m.group(1)):
                state = word.strip("`").upper()
                if state not in states:
                    break
                claims.append((said[-1], state, clause.strip()))
    return claims


def _lifecycle_alerts() -> list[tuple[dict, set[str]]]:
    """Alerts that fire on a lifecycle state alone, with the states they select."""
    found = []
    for group in _rules()["groups"]:
        for rule in group["rules"]:
            m = re.fullmatch(r'max by \(namespace, pod\) \(graphkeeper_lifecycle_state\{state=~?"([a-z_|]+)"\}\) == 1',
                             " ".join(rule.get("expr", "").split()))
            if "alert" in rule and m:
                found.append((rule, {s.upper() for s in m.group(1).split("|")}))
    return found


def test_the_serving_states_come_from_the_code():
    health = _health()
    assert health["READY"] is True and health["DRAINING"] is False and health["LOADING"] is False
    assert set(health) >= {"LOADING", "MODEL_LOADED", "WARMED", "CAPTURED", "READY", "RECAPTURING", "DRAINING"}


def test_lifecycle_alerts_say_the_health_the_code_reports():
    """An alert on a lifecycle state says whether the worker is SERVING meanwhile, as the code has it;
    so does its section in docs/metrics.md."""
    health = _health()
    docs = DOCS.read_text()
    alerts = _lifecycle_alerts()
    assert {a["alert"] for a, _ in alerts} >= {"GraphkeeperRecaptureTooLong", "GraphkeeperWorkerDrainingTooLong",
                                                "GraphkeeperWorkerNotReady"}
    for alert, states in alerts:
        serving = {health[s] for s in states}
        assert len(serving) == 1, f"{alert['alert']} mixes serving and not serving states: {states}"
        want = "SERVING" if serving.pop() else "NOT_SERVING"
        section = docs.split(f"### {alert['alert']}\n", 1)[1].split("\n### ", 1)[0]
        for where, text in (("description", alert["annotations"]["description"]), ("docs/metrics.md", section)):
            said = set(HEALTH_WORD_RE.findall(text))
            assert said == {want}, f"{alert['alert']} ({', '.join(sorted(states))}) {where}: says {said}, " \
                                   f"the code reports {want}:\n{text}"


@pytest.mark.parametrize("path", HEALTH_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_say_the_health_the_code_reports(path):
    health = _health()
    claims = _health_claims(path.read_text(), set(health))
    assert claims, f"{path.name} no longer says which states serve: update HEALTH_DOCS"
    wrong = [(word, state, clause) for word, state, clause in claims
             if (word == "SERVING") != health[state]]
    assert wrong == [], "\n".join(f"{path.name}: {word} while {state}, the code says "
                                  f"{'SERVING' if health[state] else 'NOT_SERVING'}: {clause}"
                                  for word, state, clause in wrong)


def test_the_health_checker_catches_the_old_sentence():
    health = _health()
    old = ("(SERVING only once every graph the policy names is captured; NOT_SERVING again while "
           "recapturing or draining)")
    claims = _health_claims(old, set(health))
    assert ("NOT_SERVING", "RECAPTURING") in {(w, s) for w, s, _ in claims}
    assert [s for w, s, _ in claims if (w == "SERVING") != health[s]] == ["RECAPTURING"]
