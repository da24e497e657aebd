"""Where a model comes from, checked without loading it: the source's kind (random preset,
``builtin:`` name, GGUF file, Hugging Face style directory), its config, and the one error type
for a source that cannot load.

Kept apart from ``loader`` (which builds the weights with torch) so that the worker's API
process, which refuses a bad ``--model`` before it spawns the engine core, never imports torch:
everything here is the standard library, numpy (through a GGUF file's header) and the config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.model import gguf_checkpoint as gguf_ckpt
from graphkeeper.worker.model.catalog import BuiltinModelError, resolve_builtin
from graphkeeper.worker.model.config import PRESETS, ModelConfig

DEFAULT_SEED = 0
INDEX_FILE = "model.safetensors.index.json"


class ModelSourceError(ValueError):
    """The model source cannot be loaded (missing files, unknown preset, bad config)."""


#: The longest path a loader error repeats; the tail is kept, since it names the model.
SHOWN_PATH_CHARS = 96


def shown(path: str | Path) -> str:
    """``path`` for an error message: a source comes from LoadModelRevision callers and may be
    4 KiB long; the message keeps its last characters, which name the model and the file."""
    text = str(path)
    return text if len(text) <= SHOWN_PATH_CHARS else "…" + text[-(SHOWN_PATH_CHARS - 1):]


def check_source(source: str) -> None:
    """Raises ModelSourceError when ``source`` cannot be loaded, without reading any weights.

    A random preset must exist and its seed parse; a directory must hold a readable, valid
    ``config.json`` and at least one ``*.safetensors`` file. Cheap, so the worker can refuse a
    bad ``--model`` before it starts serving anything.
    """
    source = resolve_source(source)
    if source.startswith("random:"):
        parse_random(source)
        return
    if gguf_ckpt.is_gguf(source):
        read_model_config(source)
        return
    with filesystem_errors(source):
        path = Path(source)
        if not path.is_dir():
            raise ModelSourceError(f"{shown(source)}: not a directory, and not random:<preset>[@seed]")
        read_hf_config(path)
        weight_files(path)


def resolve_source(source: str) -> str:
    """The path a ``builtin:`` source names (any other source unchanged), as a ModelSourceError."""
    try:
        return resolve_builtin(source)
    except BuiltinModelError as err:
        raise ModelSourceError(str(err)) from None


def read_model_config(source: str) -> ModelConfig:
    """The config of ``source`` without reading any weights (the worker sizes its KV cache by it)."""
    source = resolve_source(source)
    if source.startswith("random:"):
        return PRESETS[parse_random(source)[0]]
    with filesystem_errors(source):
        if gguf_ckpt.is_gguf(source):
            with gguf_errors(source):
                path = Path(source)
                if not path.is_file():
                    raise ModelSourceError(f"{shown(source)}: no such GGUF file")
                return gguf_ckpt.read_config(gguf_ckpt.open_gguf(path))
        return read_hf_config(Path(source))[0]



@contextmanager
def gguf_errors(source: str) -> Iterator[None]:
    """A GGUF file this decoder cannot serve is a ModelSourceError naming the file."""
    try:
        yield
    except gguf_ckpt.GGUFError as err:
        raise ModelSourceError(f"{shown(source)}: {err}") from None


@contextmanager
def filesystem_errors(source: str) -> Iterator[None]:
    """An OSError (name too long, permission denied, I/O error) or a path the OS refuses (a NUL
    byte) while reading ``source`` is a ModelSourceError naming the source, clipped."""
    try:
        yield
    except ModelSourceError:
        raise
    except OSError as err:
        raise ModelSourceError(f"{shown(source)}: {err.strerror or type(err).__name__}") from None
    except ValueError as err:
        raise ModelSourceError(f"{shown(source)}: {clipped_repr(str(err))}") from None


def parse_random(source: str) -> tuple[str, int]:
    spec = source.removeprefix("random:")
    preset, _, seed_text = spec.partition("@")
    if preset not in PRESETS:
        raise ModelSourceError(f"unknown preset {clipped_repr(preset)}; known: {', '.join(sorted(PRESETS))}")
    try:
        seed = int(seed_text) if seed_text else DEFAULT_SEED
    except ValueError:
        raise ModelSourceError(f"seed {clipped_repr(seed_text)} in {clipped_repr(source)} is not an integer") from None
    if not 0 <= seed < 2**64:  # what a torch generator takes
        raise ModelSourceError(f"seed {clipped_repr(seed_text)} in {clipped_repr(source)} is not in [0, 2**64)")
    return preset, seed


def _generation_eos(file: Path) -> tuple[int, ...]:
    """The EOS ids ``generation_config.json`` lists (Llama 3 Instruct ends turns on several)."""
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_bytes().decode("utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def read_hf_config(path: Path) -> tuple[ModelConfig, str | None]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{shown(path)}: no config.json (expected a Hugging Face style directory)")
    try:
        hf = json.loads(config_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelSourceError(f"{shown(config_file)}: not a readable JSON document: {err}") from None
    if not isinstance(hf, dict):
        raise ModelSourceError(f"{shown(config_file)}: not a JSON object")
    try:
        config = ModelConfig.from_hf(hf)
    except (KeyError, ValueError, TypeError) as err:
        raise ModelSourceError(f"{shown(config_file)}: {err!r}") from None
    extra = _generation_eos(path / "generation_config.json")
    if extra:
        config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys((*config.eos_token_ids, *extra))))
    return config, hf.get("torch_dtype") or hf.get("dtype")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's files: those ``model.safetensors.index.json`` names, else every ``*.safetensors``."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelSourceError(f"{shown(index)}: not a safetensors index: {err!r}") from None
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file() or f.parent != path]
        if missing:
            listed = ", ".join(clipped_repr(name) for name in missing[:4])
            raise ModelSourceError(f"{shown(index)}: names files that are not in {shown(path)}: {listed}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"{shown(path)}: no *.safetensors files")
    return files


