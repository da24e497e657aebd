"""Contracts that must not drift: the generated proto code, the enum names the code uses, the metric
label values derived from the enums, the exported metric names, the worker's import direction
(``serving -> engine -> executor -> model -> kernels``), serving's front hall (the front ends share
``serving.streams`` and see the engine only as ``EngineFace``), where Triton kernels live, and lint."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name, reason_name

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
ENUM_REF = re.compile(r"\b((?:FALLBACK_REASON|GRAPH_MODE)_[A-Z0-9_]+)\b")
# Series whose labels appear only once something happens: a graph is captured (labelled by captured
# size, so never on a CPU), or a step holds a tenant the policy lists.
ABSENT_UNTIL_EVENT = {
    "graphkeeper_tenant_steps_total",
    "graphkeeper_graph_replays_total",
    "graphkeeper_graph_capture_duration_seconds",
    "graphkeeper_graph_captured",
    "graphkeeper_graph_skipped",
    # Per captured graph (none on a CPU): its step times, its padding, whether it was released.
    "graphkeeper_graph_replay_step_seconds",
    "graphkeeper_graph_eager_step_seconds",
    "graphkeeper_graph_padding_tokens_total",
    "graphkeeper_graph_released",
    # By part of a capture phase: a CPU runs none.
    "graphkeeper_graph_capture_part_seconds",
    # Set by the worker's API process at the first READY it sees; an engine built alone sets none.
    "graphkeeper_startup_stage_seconds",
    "graphkeeper_startup_cache",
}


def test_generated_proto_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a test dependency) is not installed")
    from graphkeeper.proto.generate import OUTPUTS, generate

    written = generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(OUTPUTS)
    for path in written:
        committed = PROTO_DIR / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"proto/{path.name} is stale: run `python -m graphkeeper.proto.generate`")


def test_generated_code_matches_the_proto_package():
    assert pb.DESCRIPTOR.package == "graphkeeper.worker.v1"
    assert pb.DESCRIPTOR.name == "graphkeeper/proto/worker.proto"
    assert set(pb.DESCRIPTOR.services_by_name) == {"InferenceWorker", "GraphControl"}


def test_every_enum_is_prefixed_with_unspecified_zero():
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
        assert enum.values_by_number[0].name == prefix + "UNSPECIFIED", enum.name
        for value in enum.values:
            assert value.name.startswith(prefix), value.name


def _sources() -> list[Path]:
    files = sorted((ROOT / "worker").rglob("*.py"))
    files += [p for p in sorted((ROOT / "proto").glob("*.py")) if not p.name.startswith("worker_pb2")]
    files += sorted((ROOT / "src" / "graphkeeper").glob("*.py"))
    files += sorted((ROOT / "operator").glob("*.py"))
    return files


def test_every_referenced_reason_and_mode_exists_in_the_proto():
    known = set(pb.FallbackReason.keys()) | set(pb.GraphMode.keys())
    referenced: dict[str, list[str]] = {}
    for path in _sources():
        for name in ENUM_REF.findall(path.read_text()):
            referenced.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert referenced, "the scan found no references at all: the pattern is broken"
    assert "FALLBACK_REASON_BACKEND_UNSUPPORTED" in referenced
    unknown = {name: where for name, where in referenced.items() if name not in known}
    assert not unknown, f"names the proto does not define: {unknown}"


def test_metric_label_values_derive_from_the_proto_enums():
    from graphkeeper.worker import metrics

    reasons = [v.name for v in pb.FallbackReason.DESCRIPTOR.values if v.number != 0]
    modes = [v.name for v in pb.GraphMode.DESCRIPTOR.values if v.number != 0]
    assert list(metrics.FALLBACK_REASONS) == [n.removeprefix("FALLBACK_REASON_").lower() for n in reasons]
    assert list(metrics.GRAPH_MODES) == [n.removeprefix("GRAPH_MODE_").lower() for n in modes]
    for name in reasons:
        assert reason_name(pb.FallbackReason.Value(name)) == name.removeprefix("FALLBACK_REASON_").lower()
    for name in modes:
        assert mode_name(pb.GraphMode.Value(name)) == name.removeprefix("GRAPH_MODE_").lower()
    # Every reason series exists from the start (at zero), so dashboards never see gaps.
    registry = metrics.WorkerMetrics().registry
    labels = {s.labels["fallback_reason"] for fam in registry.collect() for s in fam.samples
              if s.name == "graphkeeper_eager_steps_total"}
    assert labels == set(metrics.FALLBACK_REASONS)


def _declared_series(registry) -> set[str]:
    """The series names each registered family can export, by its type."""
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"],
                "info": ["_info"]}
    return {fam.name + s for fam in registry.collect() for s in suffixes[fam.type]}


@pytest.fixture(scope="module")
def served_metrics():
    """A real engine (random:tiny on the CPU) after one completed request: its metrics."""
    from graphkeeper.worker.engine import Engine, EngineSettings

    engine = Engine(EngineSettings(model="random:tiny", max_num_seqs=2, max_seq_len=64,
                                   max_num_batched_tokens=32))
    engine.start()
    assert engine.ready.wait(120) and engine.failed is None
    done = threading.Event()
    events = []

    def stream(tokens, end):
        events.append((tokens, end))
        if end is not None:
            done.set()

    engine.submit(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                      stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)), stream)
    assert done.wait(60)
    assert events[-1][1].finish_reason == pb.FINISH_REASON_LENGTH
    yield engine.metrics
    engine.drain_and_stop(5)


def test_registered_metrics_are_exactly_metric_names(served_metrics):
    from graphkeeper.worker.metrics import METRIC_NAMES

    assert _declared_series(served_metrics.registry) == set(METRIC_NAMES)
    assert all(name.startswith("graphkeeper_") for name in METRIC_NAMES)


def test_exported_series_after_one_request(served_metrics):
    from graphkeeper.worker.metrics import METRIC_NAMES, metric_names

    exported = {n for n in metric_names(served_metrics) if not n.endswith("_created")}
    assert exported <= set(METRIC_NAMES), f"undeclared series: {exported - set(METRIC_NAMES)}"
    assert set(METRIC_NAMES) - exported == ABSENT_UNTIL_EVENT


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff (a test dependency) is not installed")
    proc = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr


# --- the worker's rooms: imports point down one arrow only -------------------------------------

#: Rooms of ``worker/``, top first; ``main.py`` stands above them all, the leaves below them all.
ROOMS = ("main", "serving", "engine", "executor", "model", "kernels")
LEAVES = ("settings", "plan", "metrics", "log_limits")
WORKER = "graphkeeper.worker"


def _rank(module: str) -> int:
    """Height of a ``graphkeeper.worker`` module: main highest, the leaves at -1 (pure)."""
    first = module.removeprefix(WORKER + ".").split(".")[0]
    if first in LEAVES:
        return -1
    return len(ROOMS) - 1 - ROOMS.index(first)


def _imports(source: str) -> list[str]:
    """Every worker module ``source`` imports, wherever the import stands (``TYPE_CHECKING``
    blocks and function bodies included); relative imports come back as ``.relative``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(WORKER + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(".relative")
            elif node.module == WORKER:
                found += [f"{WORKER}.{a.name}" for a in node.names]
            elif node.module and node.module.startswith(WORKER + "."):
                found.append(node.module)
    return found


def import_violations(files: dict[str, str]) -> list[str]:
    """Imports that break the worker's shape, for ``{module name: source}`` (pure).

    A module may import its own room, any room below it and the leaves; a leaf imports no room;
    ``serving`` sees the engine only through its face, ``graphkeeper.worker.engine``.
    """
    problems = []
    for module, source in files.items():
        here = module.removeprefix(WORKER + ".").split(".")[0]
        for target in _imports(source):
            if target == ".relative":
                problems.append(f"{module}: relative import (use graphkeeper.worker...)")
                continue
            there = target.removeprefix(WORKER + ".").split(".")[0]
            if there == here:
                continue
            if _rank(target) > _rank(module) or (here in LEAVES and there not in LEAVES):
                problems.append(f"{module} imports {target}: up the arrow {' -> '.join(ROOMS)}")
            elif here == "serving" and there == "engine" and target != f"{WORKER}.engine":
                problems.append(f"{module} imports {target}: serving sees only graphkeeper.worker.engine")
    return problems


def _worker_files() -> dict[str, str]:
    files = {}
    for path in sorted((ROOT / "worker").rglob("*.py")):
        parts = path.relative_to(ROOT / "worker").with_suffix("").parts
        name = ".".join((WORKER, *parts)).removesuffix(".__init__")
        files[name] = path.read_text()
    return files


def test_the_worker_has_its_five_rooms_and_leaves():
    names = set(_worker_files())
    for room in ROOMS[1:]:
        assert f"{WORKER}.{room}" in names, f"worker/{room}/ is missing"
    assert {n.removeprefix(WORKER + ".").split(".")[0] for n in names - {WORKER}} <= {*ROOMS, *LEAVES}


def test_worker_imports_point_down_the_arrow_only():
    assert not import_violations(_worker_files())


def test_the_import_check_catches_upward_imports():
    typing_only = "if TYPE_CHECKING:\n    from graphkeeper.worker.engine import core\n"
    assert import_violations({f"{WORKER}.executor.runner": "from graphkeeper.worker.engine.core import Engine"})
    assert import_violations({f"{WORKER}.kernels.pdl": "import graphkeeper.worker.model.llama"})
    assert import_violations({f"{WORKER}.model.step": "def f():\n    from graphkeeper.worker import serving"})
    assert import_violations({f"{WORKER}.executor.runner": typing_only})
    assert import_violations({f"{WORKER}.plan": "from graphkeeper.worker.model.attention import X"})
    assert import_violations({f"{WORKER}.serving.grpc_server": "from graphkeeper.worker.engine.core import Engine"})
    assert import_violations({f"{WORKER}.engine.core": "from .scheduler import Scheduler"})
    assert not import_violations({f"{WORKER}.engine.core": "from graphkeeper.worker.executor.runner import X\n"
                                                          "from graphkeeper.worker.plan import StepPlan"})
    assert not import_violations({f"{WORKER}.main": "from graphkeeper.worker.serving import grpc_server"})


# --- serving's front hall and the engine's face ----------------------------------------------

#: The servers ``main`` builds; each is imported by ``main`` alone, never by another serving module.
FRONT_ENDS = ("grpc_server", "http_server", "vllm_metrics", "metrics_server")
#: What the front ends share (admission, the stream hub, the public model name), and who streams through it.
SHARED = f"{WORKER}.serving.streams"
STREAMING = ("grpc_server", "http_server")
#: The engines behind ``EngineFace``: ``main`` picks one; serving is written against the face.
CONCRETE_ENGINES = frozenset({"Engine", "EngineClient"})


def _modules(source: str) -> set[str]:
    """Every module ``source`` imports, a name imported from a package counted as its module too."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _names(source: str) -> set[str]:
    """Every name ``source`` imports or uses (annotations included), as a bare name or an attribute."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom | ast.Import):
            found |= {a.name.split(".")[-1] for a in node.names}  # under any alias
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
    return found


def front_hall_violations(files: dict[str, str]) -> list[str]:
    """Where serving breaks its front hall, for ``{module name: source}`` (pure): a serving module
    that imports a front end (the front ends share ``streams`` instead of importing each other), a
    streaming front end that does not go through ``streams``, or serving code that names a
    concrete engine instead of ``EngineFace``."""
    problems = []
    for module, source in files.items():
        if not module.startswith(f"{WORKER}.serving."):
            continue
        imported = _modules(source)
        for front in FRONT_ENDS:
            if f"{WORKER}.serving.{front}" in imported:
                problems.append(f"{module} imports the front end {front}: share {SHARED} instead")
        if module.removeprefix(f"{WORKER}.serving.") in STREAMING and SHARED not in imported:
            problems.append(f"{module} does not import {SHARED}")
        for name in sorted(_names(source) & CONCRETE_ENGINES):
            problems.append(f"{module} names {name}: serving sees an engine only as EngineFace")
    return problems


def test_serving_has_a_front_hall_and_sees_only_the_engine_face():
    files = _worker_files()
    assert SHARED in files and all(f"{WORKER}.serving.{f}" in files for f in FRONT_ENDS)
    assert not front_hall_violations(files)


def test_the_front_hall_check_catches_each_breach():
    http, grpc_server, probes = (f"{WORKER}.serving.{m}" for m in ("http_server", "grpc_server", "metrics_server"))
    shared = "from graphkeeper.worker.serving.streams import StreamHub\n"
    assert not front_hall_violations({http: shared, grpc_server: shared})
    assert front_hall_violations({http: shared + "from graphkeeper.worker.serving.grpc_server import admitted"})
    assert front_hall_violations({probes: "from graphkeeper.worker.serving import vllm_metrics"})
    assert front_hall_violations({grpc_server: "import asyncio"})  # streams without the shared hub
    assert front_hall_violations({http: shared + "from graphkeeper.worker.engine import Engine"})
    assert front_hall_violations({http: shared + "import graphkeeper.worker.engine as e\ndef f(x: e.EngineClient): 0"})
    assert front_hall_violations({f"{WORKER}.serving.streams": "def f(engine: Engine) -> None: ..."})
    assert not front_hall_violations({f"{WORKER}.main": "from graphkeeper.worker.engine import Engine, EngineClient\n"
                                                        "from graphkeeper.worker.serving import grpc_server"})


def _imports_torch(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_the_scheduler_and_the_step_plan_import_no_torch():
    """The scheduler decides on plain data (the step plan), so it and everything it imports from
    the worker stay free of torch: testable and reusable without the device stack."""
    files = _worker_files()
    seen, todo = set(), [f"{WORKER}.engine.scheduler"]
    while todo:
        module = todo.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        assert not _imports_torch(files[module]), f"{module} imports torch"
        todo += _imports(files[module])
    assert {f"{WORKER}.plan", f"{WORKER}.engine.sequence"} <= seen
    assert _imports_torch(files[f"{WORKER}.executor.runner"]), "the torch check is broken"


def test_triton_kernels_live_only_in_kernels():
    outside = [name for name, source in _worker_files().items()
               if "triton.jit" in source and not name.startswith(f"{WORKER}.kernels.")]
    inside = [name for name, source in _worker_files().items() if "@triton.jit" in source]
    assert inside, "no @triton.jit found at all: the scan is broken"
    assert not outside, f"@triton.jit outside worker/kernels/: {outside}"
