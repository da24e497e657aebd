"""One distribution, import names under ``graphkeeper.*`` only: the wheel and the editable install map
``operator/``, ``worker/`` and ``proto/`` under ``graphkeeper`` and never shadow the standard library's
``operator``."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import importlib.util, json, operator, sys
import graphkeeper, graphkeeper.operator, graphkeeper.proto, graphkeeper.worker
print(json.dumps({
    "graphkeeper": graphkeeper.__file__,
    "operator_pkg": graphkeeper.operator.__file__,
    "worker_pkg": graphkeeper.worker.__file__,
    "proto_pkg": graphkeeper.proto.__file__,
    "stdlib_operator": operator.__file__,
    "itemgetter": hasattr(operator, "itemgetter") and hasattr(operator, "attrgetter"),
    "top_level": {name: importlib.util.find_spec(name) is not None for name in ("worker", "proto", "src")},
    "stdlib": sys.base_prefix,
}))
"""


def _probe(python: Path | str, cwd: Path) -> dict:
    proc = subprocess.run([str(python), "-I", "-c", PROBE], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _assert_stdlib_operator(found: dict) -> None:
    assert found["itemgetter"], "`import operator` did not give the standard library's module"
    assert Path(found["stdlib_operator"]).is_relative_to(found["stdlib"])
    assert found["top_level"] == {"worker": False, "proto": False, "src": False}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("graphkeeper-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_only_the_graphkeeper_namespace(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = zf.read(entry_points).decode()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"graphkeeper"}
    for needed in ("graphkeeper/cli.py", "graphkeeper/operator/__init__.py", "graphkeeper/worker/main.py",
                   "graphkeeper/proto/worker_pb2.py", "graphkeeper/proto/worker_pb2_grpc.py",
                   "graphkeeper/proto/worker.proto", "graphkeeper/proto/policy.py"):
        assert needed in names, needed
    # Every module of the worker's rooms ships (pyproject.toml lists each subpackage).
    worker = ROOT / "worker"
    modules = {"graphkeeper/worker/" + str(p.relative_to(worker)) for p in worker.rglob("*.py")}
    assert "graphkeeper/worker/engine/core.py" in modules
    assert not modules - set(names), f"worker modules missing from the wheel: {sorted(modules - set(names))}"
    assert not [n for n in names if n.startswith("graphkeeper/src/") or "/tests/" in n]
    assert not [n for n in names if "fake" in n or n.endswith("/testing.py")], "a test double ships in the wheel"
    assert "graphkeeper = graphkeeper.cli:main" in scripts


def test_wheel_install_maps_the_packages(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    found = _probe(python, neutral)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for key, rel in (("graphkeeper", "graphkeeper/__init__.py"),
                     ("operator_pkg", "graphkeeper/operator/__init__.py"),
                     ("worker_pkg", "graphkeeper/worker/__init__.py"),
                     ("proto_pkg", "graphkeeper/proto/__init__.py")):
        assert Path(found[key]) == Path(site) / rel, key
    _assert_stdlib_operator(found)
    script = venv / "bin" / "graphkeeper"
    assert script.is_file()
    # The console script runs from the wheel (subcommands import their room lazily).
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=neutral,
                               timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    for command in ("worker", "generate", "status", "operator"):
        assert command in help_text.stdout


def test_editable_install_maps_the_packages(tmp_path):
    found = _probe(sys.executable, tmp_path)
    assert Path(found["graphkeeper"]) == ROOT / "src" / "graphkeeper" / "__init__.py"
    assert Path(found["operator_pkg"]) == ROOT / "operator" / "__init__.py"
    assert Path(found["worker_pkg"]) == ROOT / "worker" / "__init__.py"
    assert Path(found["proto_pkg"]) == ROOT / "proto" / "__init__.py"
    _assert_stdlib_operator(found)
    assert (Path(sys.executable).parent / "graphkeeper").is_file()


#: Import name -> distribution, where they differ.
DISTRIBUTIONS = {"yaml": "pyyaml", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                 "grpc_reflection": "grpcio-reflection", "google": "protobuf", "prometheus_client": "prometheus-client",
                 "kubernetes": "kubernetes", "jinja2": "jinja2"}
#: Imported only by the test tooling that generates code (proto/generate.py: grpcio-tools), or
#: optional behind a guard: Triton comes with torch's CUDA wheels (kernels/triton_support.py).
TOOLING = {"grpc_tools", "triton"}


def _third_party_imports(paths: list[Path]) -> set[str]:
    import ast

    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "graphkeeper" and n != "__future__"}


def test_every_module_the_shipped_code_imports_is_a_declared_dependency():
    """The image installs graphkeeper[operator] and nothing else: a module the worker imports but
    pyproject.toml does not declare (tokenizers once came only with the tests' transformers) is
    missing there, and the worker answers a text prompt with 'no tokenizer'."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower()
                for d in project["dependencies"] + project["optional-dependencies"]["operator"]}
    sources = [p for d in ("worker", "operator", "proto", "src") for p in (ROOT / d).rglob("*.py")]
    imported = _third_party_imports(sources) - TOOLING
    missing = {name for name in imported if DISTRIBUTIONS.get(name, name).lower() not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
    assert {"tokenizers", "jinja2", "gguf"} <= imported  # the check sees what the worker reads text with
