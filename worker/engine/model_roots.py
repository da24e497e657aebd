"""Where a model reload may come from: a LoadModelRevision source must lie under one of the
worker's ``--model-root`` directories (none configured: every path is refused), and a random
preset is only served by a worker that started with one.

The rule is judged on real paths, once: ``check_model_root`` resolves the source (``..`` and
every link) and returns that resolved path, which is what the engine loads, so repointing a link
after the check changes nothing. Every entry of the resolved directory must resolve inside a root
as well, so a weight file that is a link to a file outside the roots is refused, and each must be
a regular file or a directory: a FIFO or a device file is refused before anything opens it. Pure
but for reading the directory, so the rule tests without a worker.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from graphkeeper.proto.field_checks import FieldError, clipped_repr

#: Entries of a model directory looked at; a directory with more is refused (a checkpoint has tens).
MAX_ENTRIES = 4096


class ReloadRefused(FieldError):
    """A LoadModelRevision source outside the configured model roots."""


def check_model_root(source: str, model: str, roots: tuple[str, ...]) -> str:
    """What to load for ``source``: its resolved real path, or the random preset as given.

    Raises ReloadRefused unless ``source`` may be loaded by a worker serving ``model`` with
    ``roots``.
    """
    if source.startswith("random:"):
        if not model.startswith("random:"):
            raise ReloadRefused("source", "random presets are only served by workers started with one")
        if _preset(source) != _preset(model):
            raise ReloadRefused("source", "a random-model worker reloads only its own preset (another seed)")
        return source
    if not roots:
        raise ReloadRefused("source", "this worker has no --model-root: it loads no model from a path")
    real_roots = [_real(r) for r in roots]
    resolved = _real(source)
    if not _inside(resolved, real_roots):
        raise ReloadRefused("source", "not under any --model-root of this worker")
    _check_file_kind(resolved, "source")
    _check_entries(resolved, real_roots)
    return str(resolved)


def _check_file_kind(path: Path | str, what: str) -> None:
    """A directory or a regular file only: a FIFO or a device would block the read that loads it
    (a FIFO weight file held the step loop forever), so it is refused before anything opens it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # nothing to read: the loader reports it
    except OSError as err:
        raise ReloadRefused("source", f"cannot be read: {err.strerror or type(err).__name__}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise ReloadRefused("source", f"{what} is not a regular file or a directory (a FIFO, socket or device "
                            "would block the load)")


def _check_entries(directory: Path, roots: list[Path]) -> None:
    """Every file the loader may read from ``directory`` must resolve inside a root."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return  # nothing to read: the loader reports the missing directory
    except NotADirectoryError:
        return
    except OSError as err:
        raise ReloadRefused("source", f"cannot be read: {err.strerror or type(err).__name__}") from None
    if len(entries) > MAX_ENTRIES:
        raise ReloadRefused("source", f"holds more than {MAX_ENTRIES} entries")
    for entry in entries:
        if entry.is_symlink() and not _inside(_real(entry.path), roots):
            raise ReloadRefused("source", f"{clipped_repr(entry.name)} links outside every --model-root")
        _check_file_kind(entry.path, clipped_repr(entry.name))


def _real(path: str) -> Path:
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError):
        raise ReloadRefused("source", "not a usable path") from None


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _preset(source: str) -> str:
    """``random:<preset>[@seed]`` -> ``<preset>``: the shape, which decides the memory it takes."""
    return source.removeprefix("random:").split("@", 1)[0]
