"""Compiling the step before it is captured, as vLLM does: ``torch.compile`` of the pieces between
attention calls, one compilation per piece for every batch size, recorded afterwards in the
worker's own CUDA graphs.

- **Presets** trade startup for speed (``-O``): ``presets.resolve`` decides, and says why.
- **Dynamic batch dimension.** The activations' first dimension is marked dynamic at the first
  call, which happens at the largest warm-up size; backed sizes are treated size-obliviously, so
  size 1 needs no specialised recompilation. After capture the engine forbids recompiles
  (``torch.compiler.set_stance("fail_on_recompile")``): a recompile at run time is an error, not a
  silent stall.
- **On-disk cache.** Inductor's and Triton's caches live under ``<cache dir>/<key>``, where the
  key hashes everything that changes the generated code: the model config, dtype, quantization,
  the kernel choice, the GPU's name and compute capability, the torch, triton, CUDA and driver
  versions and the source of the modules the step runs; ``key.json`` in the directory records
  them, and a directory whose record differs is set aside, never used. A second start with the
  same key loads the compiled kernels instead of generating them; whether it did is read from
  Inductor's own counters.
- **Tensor parallelism.** Every rank compiles and tunes its own shard (the shards have the same
  shapes, so they share one cache key), then runs rank 0's timing decisions: kernel tiles and the
  one-token step (``tensor_parallel.first_ranks``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.kernels import (
    choice,
    compile_ahead,
    decode_kernel,
    linear_kernel,
    norm_kernel,
    pdl,
    row_kernel,
    varlen_kernel,
)
from graphkeeper.worker.kernels.timing import replay_seconds
from graphkeeper.worker.model import compiler_import, llama, precompiled, tensor_parallel, tuning
from graphkeeper.worker.model.cache_key import differences, key_of, library_versions, source_digest
from graphkeeper.worker.model.config import ModelConfig
from graphkeeper.worker.model.llama import PieceFunctions, make_pieces, make_row_pieces, row_pieces_fit
from graphkeeper.worker.model.tensor_parallel import first_ranks

log = logging.getLogger(__name__)
#: The record of a compile cache directory's key and the facts it hashes.
KEY_FILE = "key.json"
#: The step's compiled pieces and how many of each one's leading arguments have a dynamic batch
#: dimension: tokens/cos/sin in ``first``, h/attn_out/cos/sin in ``middle``, h/attn_out in ``last``.
DYNAMIC_ARGS = {"first": 3, "middle": 4, "last": 2}
#: One graph each when nothing recompiles.
PIECES = len(DYNAMIC_ARGS)

def step_modules() -> list[ModuleType]:
    """The modules whose source is the compiled step: a change to any of them changes the key."""
    return [llama, tensor_parallel, choice, linear_kernel, norm_kernel, sys.modules[__name__], decode_kernel,
            varlen_kernel, row_kernel, pdl, precompiled]


def cache_facts(config: ModelConfig, dtype: torch.dtype, quantization: str, kernels: str, capability: str,
                versions: dict[str, str], source: str, device_name: str = "") -> dict:
    """Everything that changes the generated code (pure): what the compile cache is keyed by."""
    return {"config": config.as_dict(), "dtype": str(dtype), "quantization": quantization, "kernels": kernels,
            "capability": capability, "device": device_name, "versions": versions, "source": source}


def cache_key(config: ModelConfig, dtype: torch.dtype, quantization: str, kernels: str, capability: str,
              versions: dict[str, str], source: str, device_name: str = "") -> str:
    """The compile cache's key (pure): a hex digest of ``cache_facts``."""
    return key_of(cache_facts(config, dtype, quantization, kernels, capability, versions, source, device_name))


@dataclass
class CompileReport:
    """What compilation did, for GraphStatus and the metrics."""

    enabled: bool = False
    level: int = 2
    reason: str = ""
    key: str = ""
    cache_dir: str = ""
    cache: str = "off"  # off | hit | miss | partial
    seconds: float = 0.0
    graphs: int = 0  # graphs Dynamo compiled (one per piece when nothing recompiled)
    tuning: tuning.TuningReport | None = None
    row_step: str = ""  # the one-token step's choice and the two timings behind it
    precompiled: str = ""  # which pieces loaded precompiled and which were compiled ahead and saved

    def read_counters(self, before: dict[str, int]) -> None:
        """Cache outcome and graph count from torch's counters since ``before`` was taken."""
        now = compile_counters()
        hits = now["hits"] - before["hits"]
        misses = now["misses"] - before["misses"]
        self.graphs = now["graphs"] - before["graphs"]
        self.cache = "miss" if not hits else "partial" if misses else "hit"

    def read_precompiled(self, outcomes: precompiled.Outcomes) -> None:
        """A step whose every piece loaded precompiled is a cache hit of its pieces (Dynamo, which
        the counters count, never ran); one that compiled any piece ahead keeps the counters'."""
        if outcomes.every_piece_loaded(PIECES):
            self.cache, self.graphs = "hit", PIECES
        if outcomes.loaded or outcomes.compiled:
            self.precompiled = (f"loaded {', '.join(outcomes.loaded) or 'none'}; "
                                f"compiled ahead {', '.join(outcomes.compiled) or 'none'}")

    def to_proto(self, kernels: str, quantization: str) -> pb.CompileStatus:
        return pb.CompileStatus(optimization_level=self.level, enabled=self.enabled, reason=self.reason,
                                cache=self.cache, cache_key=self.key, seconds=self.seconds,
                                compiled_graphs=self.graphs, kernels=kernels, quantization=quantization)


def forbid_recompiles() -> None:
    """From now on a recompile raises instead of stalling the step (process-wide: the worker
    has one engine); ``prepare_step`` lifts it while it compiles a new model."""
    torch.compiler.set_stance("fail_on_recompile")


def default_stance() -> contextlib.AbstractContextManager:
    """Dynamo's default stance for a block (compiling allowed again), when Dynamo is loaded. A
    stance is Dynamo's state: in a process that never imported it (no step compiled, so no
    stance set) there is nothing to lift, and importing it here would cost a second of the start
    for nothing."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default")


def compile_counters() -> dict[str, int]:
    """Cache hits and misses (Inductor's FX graph cache or AOTAutograd's cache above it, whichever
    answered) and the graphs Dynamo has compiled."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"hits": max(inductor["fxgraph_cache_hit"], aot["autograd_cache_hit"]),
            "misses": max(inductor["fxgraph_cache_miss"], aot["autograd_cache_miss"]),
            "graphs": counters["stats"]["unique_graphs"]}


def compile_timers() -> dict[str, float]:
    """Seconds Dynamo's own timers have counted so far, by phase (tracing, AOT, Inductor's lowering,
    code generation, kernel compilation; process-wide totals, and the phases nest)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def timer_summary(before: dict[str, float], after: dict[str, float], top: int = 10) -> str:
    """The phases that took longest between two readings of ``compile_timers``, longest first
    (pure): where a cold compile's seconds went, in every worker's log."""
    spent = ((after[name] - before.get(name, 0.0), name) for name in after)
    ranked = sorted((item for item in spent if item[0] >= 0.05), reverse=True)[:top]
    return ", ".join(f"{name} {seconds:.1f} s" for seconds, name in ranked) or "none over 0.05 s"


def use_cache_dir(root: str, key: str, facts: dict) -> str:
    """Points Inductor's and Triton's caches at ``root/key`` (created); returns that directory.

    The directory's ``key.json`` records the facts of its key. A directory whose record differs,
    or that has none, is not used: it is set aside as ``<key>.ignored-<time>`` with a warning
    naming what differs, and a new one takes its place. A new directory appears whole (made under
    another name, then renamed), so workers starting together on one node never see one half made.
    """
    path = Path(os.path.expanduser(root)) / key
    if path.exists():
        found = _read_json(path / KEY_FILE)
        diff = ["key.json"] if found is None else [] if found.get("key") == key else ["key"]
        diff = diff or differences(facts, found.get("facts"))
        if diff:
            aside = path.with_name(f"{key}.ignored-{int(time.time())}")
            log.warning("compile cache %s was written for another step (it differs in %s): ignored, set aside as %s",
                        path, ", ".join(diff), aside.name)
            with contextlib.suppress(OSError):  # another worker set it aside first
                path.rename(aside)
    if not path.exists():
        _create_cache_dir(path, {"key": key, "facts": facts})
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return str(path)


def _create_cache_dir(path: Path, record: dict) -> None:
    """``path`` with its record and empty caches, made under another name and renamed into place
    (when another worker made it first, theirs stays)."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.new")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "inductor").mkdir(parents=True)
    (staging / "triton").mkdir()
    (staging / KEY_FILE).write_text(json.dumps(record, sort_keys=True))
    try:
        staging.rename(path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def compile_in_process() -> None:
    """Inductor compiles in this process, with no pool of compile-worker processes (as vLLM
    sets it). A pool outlives the compilation: its processes hold memory while the worker
    serves, and its shutdown at exit waits for them, which kept a worker that had compiled
    cold alive for over a minute after SIGTERM."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


def dynamic_batch(fn: Callable, dynamic_args: int, backend: str = "inductor") -> Callable:
    """``torch.compile(fn)`` whose first ``dynamic_args`` arguments have a dynamic first dimension.

    The dimension is marked on the first call only (that call traces); later calls of any size
    pass the compiled code's guards without a recompile. ``backend`` other than Inductor is for
    tests that check the tracing on a CPU (``aot_eager``: no code generated, no C++ toolchain).
    """
    compiled = jit_compiled(fn, backend)
    traced = False

    def call(*args):
        nonlocal traced
        if not traced:
            precompiled.mark_batch_dynamic(args, dynamic_args)
            traced = True
        return compiled(*args)

    return call


def jit_compiled(fn: Callable, backend: str) -> Callable:
    """How a piece is compiled, whether it then runs jit (``dynamic_batch``) or is compiled ahead
    and saved (``precompiled.PrecompiledPiece``): one graph, shapes static but for the batch."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


def compile_pieces(pieces: PieceFunctions, backend: str = "inductor", saved: Path | None = None,
                   outcomes: precompiled.Outcomes | None = None) -> PieceFunctions:
    """The same pieces, compiled, each with its batch dimensions dynamic (``DYNAMIC_ARGS``).
    ``saved``: each piece precompiled there instead, loaded by a later start
    (``model/precompiled.py``; what each first call did goes into ``outcomes``)."""
    torch.fx.experimental._config.backed_size_oblivious = True
    if saved is not None:
        done = outcomes if outcomes is not None else precompiled.Outcomes()
        ahead = {name: precompiled.PrecompiledPiece(functools.partial(jit_compiled, getattr(pieces, name), backend),
                                                    n, saved, name, done) for name, n in DYNAMIC_ARGS.items()}
        return PieceFunctions(**ahead)
    return PieceFunctions(**{name: dynamic_batch(getattr(pieces, name), n, backend)
                             for name, n in DYNAMIC_ARGS.items()})


def prepare_step(model, *, compile: bool, cache_root: str, quantization: str, warm_up: Callable[[], None],
                 level: int, reason: str, ahead: Callable[[], None] | None = None) -> CompileReport:
    """Installs the model's step functions (fused kernels or compiled) and runs ``warm_up`` once,
    which is when a compiled step is traced and compiled (or loaded from the cache). On CUDA the
    kernels are tuned first (or their tuning read from the cache), and the one-token step runs the
    fused row pieces where they measured faster than the others. ``ahead`` (CUDA only): launches
    the warm-up will make, made dry once the compile cache is chosen (their kernels land there) and
    PDL probed, and compiled on threads while the kernels are tuned (``_tune_kernels``), waited for
    before the warm-up."""
    device = model.tok_embeddings.weight.device
    kernels = choice.choose_kernels(device.type, compile)
    pieces = make_pieces(model.config, kernels.add_rms_norm, model.tp)
    report = CompileReport(enabled=compile, level=level, reason=reason)
    rows = device.type == "cuda" and row_pieces_fit(model.config, model.tok_embeddings.weight.dtype)
    if compile:  # first: every Triton kernel from here on (the PDL probe's too) is kept in the cache
        _use_compile_cache(model, report, kernels.name, quantization, cache_root)
    imported = compiler_import.ahead() if compile else None
    wait_ahead = _tune_kernels(model, report, cache_root, rows, ahead) if device.type == "cuda" else None
    tuned = report.tuning.summary if report.tuning else ""
    name = "+".join(n for n in (kernels.name, tuned) if n)
    outcomes = precompiled.Outcomes()
    if imported is not None:
        imported()
        compile_in_process()
        torch.compiler.reset()  # one engine per process: its previous step's compiled code is dropped
        pieces = compile_pieces(pieces, saved=_precompiled_dir(model, report), outcomes=outcomes)
    model.use_pieces(pieces, name)
    before = compile_counters() if compile else {}
    timers = compile_timers() if compile else {}
    start = time.perf_counter()
    if wait_ahead is not None:
        wait_ahead()
    with default_stance():
        warm_up()
    if compile:
        report.seconds = time.perf_counter() - start
        report.read_counters(before)
        report.read_precompiled(outcomes)
        log.info("compiled the step in %.1f s (%d graphs, cache %s at %s%s)", report.seconds, report.graphs,
                 report.cache, report.cache_dir, f"; precompiled: {report.precompiled}" if report.precompiled else "")
        log.info("compile phases (Dynamo's timers, nested): %s", timer_summary(timers, compile_timers()))
    if rows:
        _choose_row_step(model, report)
    return report


def _tune_kernels(model, report: CompileReport, cache_root: str, rows: bool,
                  ahead: Callable[[], None] | None) -> Callable[[], None] | None:
    """CUDA: probes PDL, starts compiling ``ahead``'s launches, tunes the kernels; returns the wait
    for the launches compiled ahead. The probe comes first: a launch passes PDL's switch to its
    kernel, so a kernel compiled ahead before the probe turned PDL on was not the one the warm-up
    launched, and compiled again there (11 of 12 on an H100, 2026-12-07)."""
    compiler_import.wait_for_key()  # the probe's kernel is the process's first: it needs Triton's key
    pdl.probe(model.tok_embeddings.weight.device)
    wait_ahead = compile_ahead.started("warm-up", ahead) if ahead is not None else None
    report.tuning = tuning.tune_model(model, cache_root, rows)
    tuning.adopt_first_ranks(model.tp)
    return wait_ahead


def _use_compile_cache(model, report: CompileReport, kernels: str, quantization: str, cache_root: str) -> None:
    """Keys the compile cache and points Inductor's and Triton's caches at its directory. The
    tuning summary stays out of the key (the linear op is opaque to Inductor), so this comes before
    tuning and the PDL probe, whose Triton kernels then load from the cache volume too instead of
    compiling into the container's home directory at every pod start."""
    device = model.tok_embeddings.weight.device
    capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    facts = cache_facts(model.config, model.tok_embeddings.weight.dtype, quantization, kernels, capability,
                        library_versions(), source_digest(step_modules()), torch.cuda.get_device_name(device))
    report.key = key_of(facts)
    try:
        report.cache_dir = use_cache_dir(cache_root, report.key, facts)
    except OSError as err:  # an unwritable cache volume costs this start its cache, not the start
        log.warning("compile cache %s unusable (%s): compiling into a temporary directory", cache_root, err)
        report.cache_dir = use_cache_dir(tempfile.mkdtemp(prefix="graphkeeper-compile-"), report.key, facts)


def _precompiled_dir(model, report: CompileReport) -> Path | None:
    """Where this step's pieces are precompiled (``model/precompiled.py``): the compile cache
    directory's, when this torch can and the model is on one rank (a rank's pieces have its
    shard's shapes, and the ranks share one directory)."""
    if not report.cache_dir or model.tp.enabled or not precompiled.available():
        return None
    return precompiled.pieces_dir(report.cache_dir)


def _choose_row_step(model, report: CompileReport) -> None:
    """Times a pass of every layer's middle piece at one token with the installed pieces and with
    the fused row pieces, as CUDA graphs, and keeps the row pieces if they are faster."""
    row = make_row_pieces(model.config, model.tp)
    with default_stance():
        mine, theirs = _one_token_pass_seconds(model, row), _one_token_pass_seconds(model, model.pieces)
    won = first_ranks(mine < theirs, model.tp)  # every rank runs rank 0's choice
    report.row_step = (f"{'fused row kernels' if won else 'the general step'} for one token: "
                       f"{mine * 1e3:.3f} ms against {theirs * 1e3:.3f} ms per pass of the layers")
    log.info("one-token step: %s", report.row_step)
    if won:
        model.use_pieces(model.pieces, f"{model.kernels}+row1", row)


def _one_token_pass_seconds(model, pieces: PieceFunctions, replays: int = 5) -> float:
    """GPU seconds of one token through every layer's ``middle`` piece (attention left out: both
    step variants share it), replayed from a CUDA graph."""
    config, weight = model.config, model.tok_embeddings.weight
    h = torch.randn(1, config.dim, device=weight.device, dtype=weight.dtype)
    attn = torch.randn(1, config.n_heads * config.head_dim, device=weight.device, dtype=weight.dtype)
    cos, sin = model.rope(torch.zeros(1, dtype=torch.long, device=weight.device))

    def run() -> None:
        x = h
        for layer in range(1, config.n_layers):
            x = pieces.middle(x, attn, cos, sin, *model.layers[layer - 1].tail_weights(),
                              *model.layers[layer].head_weights())[0]

    return replay_seconds(run, replays=replays)
