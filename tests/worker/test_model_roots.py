"""Where a model reload may come from (engine/model_roots.py): a random preset only for a worker
that serves a random model, and only its own preset; a path only under one of the worker's model
roots (none configured: no path at all), judged after ``..`` and links resolve, every entry of the
directory inside a root too, and what loads is the path the check resolved."""

from __future__ import annotations

import pytest

from graphkeeper.worker.engine.model_roots import ReloadRefused, check_model_root
from graphkeeper.worker.model.loader import load_model, save_hf_directory


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


def test_without_a_model_root_every_path_is_refused(tmp_path):
    """No --model-root means no path reloads, not "the model's parent" (which for /model is /)."""
    model = str(tmp_path / "models" / "llama")
    for source in (str(tmp_path / "models" / "llama-2"), model, "/"):
        assert "no --model-root" in refusal(source, model, ())


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


def test_the_resolved_path_is_what_loads_even_when_the_link_is_swapped_after_the_check(tmp_path):
    """The check returns the real path; repointing the link the client named, after the check,
    cannot change which directory is loaded."""
    root, outside = tmp_path / "models", tmp_path / "outside"
    inside = root / "a"
    save_hf_directory(load_model("random:tiny@3", device="cpu", max_positions=64).model, inside)
    save_hf_directory(load_model("random:tiny@4", device="cpu", max_positions=64).model, outside)
    link = root / "current"
    link.symlink_to(inside)
    resolved = check_model_root(str(link), str(inside), (str(root),))
    assert resolved == str(inside.resolve())
    link.unlink()
    link.symlink_to(outside)  # the swap, between the check and the load
    loaded = load_model(resolved, device="cpu", max_positions=64)
    expected = load_model(str(inside), device="cpu", max_positions=64)
    assert loaded.revision == expected.revision != load_model(str(outside), device="cpu", max_positions=64).revision
    refusal(str(link), str(inside), (str(root),))  # judged again, the link now leads outside


def test_a_weight_file_linking_outside_the_roots_is_refused(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "outside"
    save_hf_directory(load_model("random:tiny@3", device="cpu", max_positions=64).model, outside)
    model = root / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_bytes((outside / "config.json").read_bytes())
    (model / "model.safetensors").symlink_to(outside / "model.safetensors")
    message = refusal(str(model), str(model), (str(root),))
    assert "'model.safetensors' links outside every --model-root" in message
    check_model_root(str(model), str(model), (str(root), str(outside)))  # inside another root: fine
