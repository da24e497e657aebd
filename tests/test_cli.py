"""The console script's shape: ``cli.py`` parses and dispatches, the commands import their rooms
only when they run, and ``cli.py`` and ``client.py`` share ``CommandError`` without importing
each other (under ``python -m graphkeeper.cli`` the entry point is ``__main__``, so an error
class defined there is not the one the commands raise)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from ports import free_port

SRC = Path(__file__).resolve().parents[1] / "src" / "graphkeeper"


def _imported_modules(path: Path, *, top_level: bool = False) -> set[str]:
    """The modules ``path`` imports: at module level only, or anywhere (function bodies too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_cli_and_client_do_not_import_each_other():
    assert "graphkeeper.client" not in _imported_modules(SRC / "cli.py", top_level=True)  # in _run_* only
    assert "graphkeeper.cli" not in _imported_modules(SRC / "client.py")
    for path in SRC.glob("*.py"):
        assert "__import__(" not in path.read_text(), f"{path.name}: import by name, not through a string"


def test_the_parser_loads_no_room():
    code = ("import sys; from graphkeeper.cli import build_parser; build_parser().parse_args(['status']); "
            "print(sorted(m for m in ('grpc', 'torch', 'kopf', 'graphkeeper.client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_command_error_is_one_line_and_exit_2_under_python_m():
    proc = subprocess.run([sys.executable, "-m", "graphkeeper.cli", "status", "--target", f"127.0.0.1:{free_port()}",
                           "--token-file", "/nonexistent/token"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: --token-file: ") and "/nonexistent/token" in line
