"""Where a model reload may come from (engine/model_roots.py, pure): a random preset only for a worker
that serves a random model, and only its own preset; a path only under one of the worker's model
roots, by default the served model's parent directory, judged after ``..`` and links resolve."""

from __future__ import annotations

import pytest

from graphkeeper.worker.engine.model_roots import ReloadRefused, check_model_root


def refusal(source: str, model: str, roots: tuple[str, ...] = ()) -> str:
    with pytest.raises(ReloadRefused) as err:
        check_model_root(source, model, roots)
    assert err.value.field == "source"
    return str(err.value)


def test_a_random_model_worker_reloads_its_own_preset_with_another_seed():
    check_model_root("random:tiny@7", "random:tiny", ())
    check_model_root("random:tiny", "random:tiny@3", ("/models",))


def test_a_random_model_worker_refuses_another_preset():
    assert "only its own preset" in refusal("random:small@7", "random:tiny@7")


def test_a_worker_serving_a_directory_refuses_every_random_preset(tmp_path):
    model = str(tmp_path / "llama")
    message = refusal("random:tiny", model, (str(tmp_path),))
    assert message.startswith("source: ") and "random presets" in message


def test_a_path_outside_the_model_roots_is_refused_naming_source(tmp_path):
    roots = (str(tmp_path / "models"), str(tmp_path / "more"))
    check_model_root(str(tmp_path / "models" / "llama-2"), str(tmp_path / "models" / "llama"), roots)
    check_model_root(str(tmp_path / "more" / "a" / "b"), str(tmp_path / "models" / "llama"), roots)
    message = refusal(str(tmp_path / "elsewhere" / "llama-2"), str(tmp_path / "models" / "llama"), roots)
    assert message == "source: not under any --model-root of this worker"


def test_the_default_root_is_the_served_models_parent_directory(tmp_path):
    model = str(tmp_path / "models" / "llama")
    check_model_root(str(tmp_path / "models" / "llama-2"), model, ())
    check_model_root(model, model, ())
    refusal(str(tmp_path / "llama-3"), model, ())
    refusal(str(tmp_path / "models-2" / "llama"), model, ())  # a sibling that shares a prefix is not under it


def test_a_path_with_dot_dot_is_judged_where_it_resolves(tmp_path):
    roots = (str(tmp_path / "models"),)
    model = str(tmp_path / "models" / "llama")
    check_model_root(str(tmp_path / "models" / "llama" / ".." / "llama-2"), model, roots)
    refusal(str(tmp_path / "models" / ".." / "secrets"), model, roots)
    refusal(str(tmp_path / "models" / "llama" / ".." / ".." / ".." / "etc"), model, roots)


def test_a_link_under_a_root_to_a_directory_outside_is_refused(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "models" / "link").symlink_to(tmp_path / "outside")
    refusal(str(tmp_path / "models" / "link"), str(tmp_path / "models" / "llama"), (str(tmp_path / "models"),))


def test_a_random_model_worker_without_model_roots_reloads_no_path(tmp_path):
    refusal(str(tmp_path / "llama"), "random:tiny", ())
    check_model_root(str(tmp_path / "llama"), "random:tiny", (str(tmp_path),))
