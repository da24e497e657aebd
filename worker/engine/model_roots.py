"""Where a model reload may come from: a LoadModelRevision source must lie under one of the
worker's model roots (by default the directory holding its own model), and a random preset is
only served by a worker that started with one. Pure, so the rule tests without a worker."""

from __future__ import annotations

from pathlib import Path

from graphkeeper.proto.policy import FieldError


class ReloadRefused(FieldError):
    """A LoadModelRevision source outside the configured model roots."""


def check_model_root(source: str, model: str, roots: tuple[str, ...]) -> None:
    """Raises ReloadRefused unless ``source`` may be loaded by a worker serving ``model``."""
    if source.startswith("random:"):
        if not model.startswith("random:"):
            raise ReloadRefused("source", "random presets are only served by workers started with one")
        if _preset(source) != _preset(model):
            raise ReloadRefused("source", "a random-model worker reloads only its own preset (another seed)")
        return
    if not roots and not model.startswith("random:"):
        roots = (str(Path(model).resolve().parent),)
    try:
        resolved = Path(source).resolve()
    except (OSError, ValueError):
        raise ReloadRefused("source", "not a usable path") from None
    if not any(resolved.is_relative_to(Path(r).resolve()) for r in roots):
        raise ReloadRefused("source", "not under any --model-root of this worker")


def _preset(source: str) -> str:
    """``random:<preset>[@seed]`` -> ``<preset>``: the shape, which decides the memory it takes."""
    return source.removeprefix("random:").split("@", 1)[0]
