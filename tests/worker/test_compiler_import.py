"""torch's compiler imported, and Triton's key hashed, on a thread during a start
(``model/compiler_import.py``): in a fresh interpreter the modules are absent, then present once
the join returns; an import that fails there is logged and left to the start's own import, never
raised on the start's path."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from graphkeeper.worker.model import compiler_import


def printed_by_a_fresh_interpreter(code: str) -> list[str]:
    """What ``code`` prints, run in a new interpreter (nothing imported yet), split on whitespace."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()

FRESH = """
import sys
from graphkeeper.worker.model import compiler_import
before = [m in sys.modules for m in compiler_import.MODULES]
join = compiler_import.ahead()
join()
print(before, [m in sys.modules for m in compiler_import.MODULES])
"""


def test_the_compiler_is_imported_by_the_time_the_join_returns():
    assert printed_by_a_fresh_interpreter(FRESH) == ["[False,", "False,", "False]", "[True,", "True,", "True]"]


def test_an_import_that_fails_ahead_is_logged_and_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(compiler_import, "MODULES", ("graphkeeper_no_such_module",))
    monkeypatch.setattr(compiler_import, "_thread", None)
    monkeypatch.setattr(compiler_import, "_key_thread", None)
    with caplog.at_level(logging.INFO, logger=compiler_import.__name__):
        compiler_import.ahead()()
    assert "importing graphkeeper_no_such_module ahead failed" in caplog.text
    assert "waited for it" in caplog.text


STARTED_TWICE = """
from graphkeeper.worker.model import compiler_import
compiler_import.start()
first = compiler_import._thread
compiler_import.start()
join = compiler_import.ahead()
print(first is not None and compiler_import._thread is first)
join()
"""


def test_the_import_starts_once_however_many_times_it_is_asked_for():
    """The engine core starts it while it waits for its settings; the start's ``ahead`` then joins
    that same thread instead of importing again beside it."""
    assert printed_by_a_fresh_interpreter(STARTED_TWICE) == ["True"]


KEYED = """
from triton.runtime.cache import triton_key
from graphkeeper.worker.model import compiler_import
compiler_import.wait_for_key()  # nothing started: returns at once
before = triton_key.cache_info().currsize
compiler_import.start()
compiler_import.wait_for_key()
print(before, triton_key.cache_info().currsize)
compiler_import.ahead()()
"""


def test_the_thread_hashes_triton_s_key_first_and_the_probe_can_wait_for_it():
    """Triton's key (a hash of its compiler and its library, cached for the process) is what the
    start's first Triton kernel waits for: the thread has it before the PDL probe asks."""
    pytest.importorskip("triton")
    assert printed_by_a_fresh_interpreter(KEYED) == ["0", "1"]
