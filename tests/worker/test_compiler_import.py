"""torch's compiler imported on a thread during a start (``model/compiler_import.py``): in a fresh
interpreter the modules are absent, then present once the join returns; an import that fails there
is logged and left to the start's own import, never raised on the start's path."""

from __future__ import annotations

import logging
import subprocess
import sys

from graphkeeper.worker.model import compiler_import

FRESH = """
import sys
from graphkeeper.worker.model import compiler_import
before = [m in sys.modules for m in compiler_import.MODULES]
join = compiler_import.ahead()
join()
print(before, [m in sys.modules for m in compiler_import.MODULES])
"""


def test_the_compiler_is_imported_by_the_time_the_join_returns():
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[False,", "False,", "False]", "[True,", "True,", "True]"]


def test_an_import_that_fails_ahead_is_logged_and_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(compiler_import, "MODULES", ("graphkeeper_no_such_module",))
    monkeypatch.setattr(compiler_import, "_thread", None)
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
    done = subprocess.run([sys.executable, "-c", STARTED_TWICE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
