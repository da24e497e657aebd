"""Each operator decision has one owner: the spec is parsed in ``desired``, the ConfigMap and the
status are written by the reconcile run alone, the default graph mode is the proto's, and the
reconciler stays a shell (a new concern gets its own module, called from one line)."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def _calls(name: str) -> set[str]:
    """The operator modules that call a function or method called ``name``."""
    out = set()
    for path in sorted(OPERATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == name:
                    out.add(path.name)
    return out


def test_the_spec_is_parsed_in_one_place():
    for parse in ("policy_from_spec", "from_traffic_settings", "rollout_settings", "selector_error"):
        assert _calls(parse) == {"desired.py"}, parse


def test_the_configmap_and_the_status_have_one_writer():
    assert _calls("write_configmap") == {"reconciler.py"}
    assert _calls("patch_policy_status") == {"reconciler.py"}
    assert _calls("build_status") == {"reconciler.py"}


def test_the_operator_never_spells_the_default_graph_mode():
    assert not [p.name for p in OPERATOR.glob("*.py") if "FullAndPiecewise" in p.read_text()]


def test_the_reconciler_stays_a_shell():
    tree = ast.parse((OPERATOR / "reconciler.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Reconciler"]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 20, [m.name for m in methods]
