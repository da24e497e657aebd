"""The step's pieces precompiled (``model/precompiled.py``): the first start compiles a piece ahead
and saves it; a later one loads it without Dynamo tracing anything, and the loaded piece computes
what the compiled one did at every batch size; a file that does not load is compiled again. On a
CPU, with Inductor's C++ code (the same machinery the GPU's Triton code goes through)."""

from __future__ import annotations

import logging

import pytest
import torch

from graphkeeper.worker.model import precompiled
from graphkeeper.worker.model.config import PRESETS
from graphkeeper.worker.model.llama import make_pieces
from graphkeeper.worker.model.step import PIECES, CompileReport, compile_counters, compile_pieces

#: On the tests that compile ahead, save or load: a torch without AOT precompile (before 2.10: no
#: ``torch.compiler.load_compiled_function``) compiles the pieces jit, as ``_precompiled_dir`` then
#: says, and the rest of this file still runs. CI's torch (2.11, constraints.txt) has it.
needs_precompile = pytest.mark.skipif(not precompiled.available(),
                                      reason="this torch has no AOT precompile (torch.compiler.load_compiled_function, "
                                             "torch >= 2.10): the worker compiles its pieces jit here")


def test_precompile_is_found_on_every_torch_that_has_it():
    """The four ``needs_precompile`` tests skip only where torch lacks AOT precompile (before 2.10):
    on 2.10 and later (CI's pinned 2.11) ``available`` must say so, or a detection bug would skip
    them silently."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert precompiled.available() == ((major, minor) >= (2, 10))


def middle_args(rows: int) -> tuple:
    """``middle``'s arguments for ``random:tiny`` at ``rows`` rows (no fp8 scales)."""
    c = PRESETS["tiny"]
    g = torch.Generator().manual_seed(rows)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return (r(rows, c.dim), r(rows, c.n_heads * c.head_dim), r(rows, c.head_dim), r(rows, c.head_dim),
            r(c.dim, c.n_heads * c.head_dim), None, r(c.dim), r(2 * c.intermediate_size, c.dim), None,
            r(c.dim, c.intermediate_size), None, r(c.dim), r(qkv, c.dim), None)


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.compiler.reset()
    yield tmp_path
    torch.compiler.reset()


@needs_precompile
@torch.inference_mode()
def test_a_piece_compiled_ahead_is_loaded_by_the_next_start_without_tracing(inductor_cache):
    saved = inductor_cache / "precompiled"
    first = precompiled.Outcomes()
    piece = compile_pieces(make_pieces(PRESETS["tiny"]), saved=saved, outcomes=first).middle
    expected = {rows: piece(*middle_args(rows)) for rows in (16, 3, 40)}
    assert first.compiled == ["middle"] and first.loaded == [] and len(list(saved.glob("middle-*.bin"))) == 1

    torch.compiler.reset()  # a new start: nothing compiled in this process any more
    again = precompiled.Outcomes()
    loaded = compile_pieces(make_pieces(PRESETS["tiny"]), saved=saved, outcomes=again).middle
    before = compile_counters()
    for rows, out in expected.items():
        for got, want in zip(loaded(*middle_args(rows)), out, strict=True):
            assert torch.equal(got, want)
    assert again.loaded == ["middle"] and again.compiled == []
    assert compile_counters() == before  # Dynamo traced nothing, Inductor compiled nothing


@needs_precompile
@torch.inference_mode()
def test_a_file_that_does_not_load_is_compiled_again_and_replaced(inductor_cache, caplog):
    saved = inductor_cache / "precompiled"
    saved.mkdir()
    args = middle_args(5)
    call = (args[0], args[1], *args[4:11], args[11])
    garbage = saved / f"last-{precompiled.signature(call, 2)}.bin"
    garbage.write_bytes(b"not a precompiled function")
    outcomes = precompiled.Outcomes()
    last = compile_pieces(make_pieces(PRESETS["tiny"]), saved=saved, outcomes=outcomes).last
    with caplog.at_level(logging.WARNING, logger=precompiled.__name__):
        out = last(*call)
    assert out.shape == (5, PRESETS["tiny"].dim)
    assert "precompiled last" in caplog.text and "did not load" in caplog.text
    assert outcomes.compiled == ["last"] and garbage.read_bytes() != b"not a precompiled function"


@needs_precompile
@torch.inference_mode()
def test_a_file_whose_guards_do_not_take_the_arguments_is_compiled_again(inductor_cache, caplog):
    """A file that loads but was compiled for other arguments (here ``first``'s saved as
    ``middle``'s) is not run: the piece compiles ahead again and computes what the jit piece does."""
    saved = inductor_cache / "precompiled"
    c = PRESETS["tiny"]
    tokens = torch.arange(6)
    cos, sin = torch.ones(6, c.head_dim), torch.zeros(6, c.head_dim)
    embedding, norm = torch.randn(c.vocab_size, c.dim), torch.ones(c.dim)
    wqkv = torch.randn((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim)
    compile_pieces(make_pieces(c), saved=saved).first(tokens, cos, sin, embedding, norm, wqkv, None)
    (first_file,) = saved.glob("first-*.bin")
    (saved / f"middle-{precompiled.signature(middle_args(4), 4)}.bin").write_bytes(first_file.read_bytes())
    torch.compiler.reset()
    outcomes = precompiled.Outcomes()
    middle = compile_pieces(make_pieces(c), saved=saved, outcomes=outcomes).middle
    with caplog.at_level(logging.WARNING, logger=precompiled.__name__):
        got = middle(*middle_args(4))
    assert "precompiled middle" in caplog.text and outcomes.compiled == ["middle"] and outcomes.loaded == []
    for a, b in zip(got, make_pieces(c).middle(*middle_args(4)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)  # Inductor fuses: float32 rounding differs


def test_a_step_whose_every_piece_loaded_reports_a_cache_hit():
    report = CompileReport(enabled=True, cache="miss", graphs=0)  # the counters saw no compile at all
    outcomes = precompiled.Outcomes()
    outcomes.loaded = ["first", "middle", "last"]
    report.read_precompiled(outcomes)
    assert (report.cache, report.graphs) == ("hit", PIECES)
    assert report.precompiled == "loaded first, middle, last; compiled ahead none"
    partial = CompileReport(enabled=True, cache="partial", graphs=1)
    outcomes.loaded, outcomes.compiled = ["first", "middle"], ["last"]
    partial.read_precompiled(outcomes)
    assert (partial.cache, partial.graphs) == ("partial", 1)  # the counters' reading of the compile


def test_pieces_without_a_directory_are_compiled_as_before():
    pieces = compile_pieces(make_pieces(PRESETS["tiny"]), backend="aot_eager")
    assert not isinstance(pieces.middle, precompiled.PrecompiledPiece)


@needs_precompile
def test_pieces_are_precompiled_on_one_rank_with_a_cache_directory_only(tmp_path):
    """A rank of several has its shard's shapes and shares the directory: it compiles as before;
    so does a step with no cache directory."""
    from types import SimpleNamespace

    from graphkeeper.worker.model.step import _precompiled_dir

    one = SimpleNamespace(tp=SimpleNamespace(enabled=False))
    ranked = SimpleNamespace(tp=SimpleNamespace(enabled=True))
    assert _precompiled_dir(one, CompileReport(cache_dir=str(tmp_path))) == tmp_path / precompiled.SUBDIR
    assert _precompiled_dir(ranked, CompileReport(cache_dir=str(tmp_path))) is None
    assert _precompiled_dir(one, CompileReport(cache_dir="")) is None


def test_the_signature_leaves_out_the_batch_dimension_and_tells_other_arguments_apart():
    """Files are named for what the guards check of the first call: a start at another row count
    finds the same file; another grad mode or another buffer shape (a benchmark's runner sharing
    the cache) names a file of its own instead of replacing the worker's."""
    with torch.inference_mode():
        at_16, at_3 = precompiled.signature(middle_args(16), 4), precompiled.signature(middle_args(3), 4)
    assert at_16 == at_3
    assert precompiled.signature(middle_args(16), 4) != at_16  # grad mode on: other guards
    with torch.inference_mode():
        wider = (middle_args(16)[0][:, :-1],) + middle_args(16)[1:]
        assert precompiled.signature(wider, 4) != at_16
        assert precompiled.signature(middle_args(16), 0) != at_16  # the batch dimension counted: static
