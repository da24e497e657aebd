"""Both engines satisfy ``EngineFace``, signature by signature: the in-process ``Engine`` and the
``EngineClient`` of the engine-core process, which is what production serves with. A
``runtime_checkable`` isinstance check alone looks only at names; this compares every method's
parameters (kind, name, default, type) and return type, every property's type, and every
attribute's value on an engine built but not started."""

from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Any

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineClient, EngineFace, EngineSettings
from graphkeeper.worker.engine.face import Handle, LifecycleView

SETTINGS = dict(model="random:tiny", max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=32)


def _members(protocol: type) -> tuple[list[str], list[str], dict[str, Any]]:
    """The protocol's methods, its properties and its attributes with their types."""
    own = {k: v for k, v in vars(protocol).items() if not k.startswith("_")}
    methods = [k for k, v in own.items() if inspect.isfunction(v)]
    properties = [k for k, v in own.items() if isinstance(v, property)]
    return methods, properties, typing.get_type_hints(protocol)


def _same_parameter(want: inspect.Parameter, have: inspect.Parameter, want_type: Any, have_type: Any) -> str:
    if want.kind is inspect.Parameter.POSITIONAL_ONLY:  # the caller passes it by position: any name does
        if have.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return f"{have.name} must take a positional argument"
    elif (have.name, have.kind) != (want.name, want.kind):
        return f"{have.name} ({have.kind.description}) where the face has {want.name} ({want.kind.description})"
    if have.default != want.default:
        return f"{have.name} defaults to {have.default!r}, the face to {want.default!r}"
    if have_type != want_type:
        return f"{have.name} is {have_type}, the face says {want_type}"
    return ""


def _method_mismatches(name: str, want_fn: Any, have_fn: Any, handle: Any) -> list[str]:
    if not callable(have_fn):
        return [f"{name}: missing"]
    want_sig, have_sig = inspect.signature(want_fn), inspect.signature(have_fn)
    want_hints, have_hints = typing.get_type_hints(want_fn), typing.get_type_hints(have_fn)

    def want_type(key: str) -> Any:  # the face's opaque handle is whatever this engine's submit returns
        hint = want_hints.get(key, inspect.Parameter.empty)
        return handle if hint is Handle else hint

    problems = []
    want_params, have_params = list(want_sig.parameters.values())[1:], list(have_sig.parameters.values())[1:]
    for i, want in enumerate(want_params):
        if i >= len(have_params):
            problems.append(f"{name}: no parameter for {want.name}")
            continue
        have = have_params[i]
        why = _same_parameter(want, have, want_type(want.name), have_hints.get(have.name, inspect.Parameter.empty))
        if why:
            problems.append(f"{name}: {why}")
    problems += [f"{name}: {p.name} is not in the face and has no default"
                 for p in have_params[len(want_params):] if p.default is inspect.Parameter.empty]
    if have_hints.get("return") != want_type("return"):
        problems.append(f"{name}: returns {have_hints.get('return')}, the face says {want_type('return')}")
    return problems


def _holds(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) is collections.abc.Callable:
        return callable(value)
    return isinstance(value, hint)


def face_mismatches(cls: type, instance: Any) -> list[str]:
    """How ``cls`` (and ``instance``, one of it) falls short of ``EngineFace``; empty when it satisfies it."""
    methods, properties, attributes = _members(EngineFace)
    submit = getattr(cls, "submit", None)
    handle = typing.get_type_hints(submit).get("return") if callable(submit) else None
    problems = []
    for name in methods:
        problems += _method_mismatches(name, getattr(EngineFace, name), getattr(cls, name, None), handle)
    for name in properties:
        have = getattr(cls, name, None)
        if not isinstance(have, property):
            problems.append(f"{name}: not a property")
        elif typing.get_type_hints(have.fget).get("return") != typing.get_type_hints(
                getattr(EngineFace, name).fget).get("return"):
            problems.append(f"{name}: its type differs from the face's")
    for name, hint in attributes.items():
        if not hasattr(instance, name):
            problems.append(f"{name}: no such attribute")
        elif not _holds(getattr(instance, name), hint):
            problems.append(f"{name}: {getattr(instance, name)!r} is not {hint}")
    return problems


@pytest.fixture(scope="module")
def engines():
    """Both engines, built (sizes decided, nothing allocated) and never started."""
    return {Engine: Engine(EngineSettings(**SETTINGS)), EngineClient: EngineClient(EngineSettings(**SETTINGS))}


@pytest.mark.parametrize("cls", [Engine, EngineClient], ids=lambda c: c.__name__)
def test_the_engine_satisfies_its_face(cls, engines):
    assert face_mismatches(cls, engines[cls]) == []
    assert isinstance(engines[cls], EngineFace)
    assert isinstance(engines[cls].lifecycle, LifecycleView)


def test_the_face_has_what_the_servers_use():
    methods, properties, attributes = _members(EngineFace)
    assert {"submit", "cancel", "limits", "model_info", "apply_policy", "load_revision", "status"} <= set(methods)
    assert properties == ["tokenizer"]
    assert {"settings", "metrics", "lifecycle", "failed", "publish"} <= set(attributes)


def test_each_engine_cancels_with_the_handle_its_submit_returns():
    for cls in (Engine, EngineClient):
        returned = typing.get_type_hints(cls.submit)["return"]
        taken = typing.get_type_hints(cls.cancel)[next(iter(list(inspect.signature(cls.cancel).parameters)[1:]))]
        assert returned is taken, cls.__name__


class _Drifted(EngineClient):
    """An engine whose surface drifted from the face in four ways the check must each name."""

    def submit(self, req: pb.GenerateRequest, stream: Any, priority: int) -> int:  # a required extra
        return 0

    def cancel(self, sid: str, reason: int = pb.FINISH_REASON_STOP) -> None:  # not the handle; another default
        pass

    def status(self, verbose: bool) -> pb.GraphStatus:  # a required parameter the servers do not pass
        return pb.GraphStatus()

    tokenizer = None  # no longer a property


def test_the_check_names_each_way_an_engine_drifts(engines):
    problems = face_mismatches(_Drifted, engines[EngineClient])
    assert any(p.startswith("submit: priority") for p in problems)
    assert any(p.startswith("cancel: sid is") for p in problems)
    assert any(p.startswith("cancel: reason defaults") for p in problems)
    assert any(p.startswith("status: verbose") for p in problems)
    assert "tokenizer: not a property" in problems


def test_the_check_names_a_missing_method_and_attribute():
    class Bare:
        pass

    problems = face_mismatches(Bare, Bare())
    assert "drain_and_stop: missing" in problems
    assert "lifecycle: no such attribute" in problems
