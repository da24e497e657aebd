"""The launch memo's hook check on the installed Triton, without a GPU: Triton 3.6 keeps an empty
``HookChain`` in its knobs when no profiler is installed, and the memo must read that as no hook,
or every launch goes through Triton's binding (the GPU tests' miss counts found exactly that)."""

from __future__ import annotations

from triton import knobs

from graphkeeper.worker.kernels.launch_memo import hooked


def test_triton_s_default_launch_hooks_count_as_none():
    assert not hooked(knobs.runtime.launch_enter_hook)
    assert not hooked(knobs.runtime.launch_exit_hook)
    assert not hooked(None)


def test_an_installed_launch_hook_counts_whether_chained_or_plain():
    chain = knobs.runtime.launch_enter_hook

    def profiler(metadata):
        return None

    if hasattr(chain, "add"):
        chain.add(profiler)
        try:
            assert hooked(knobs.runtime.launch_enter_hook)
        finally:
            chain.remove(profiler)
        assert not hooked(knobs.runtime.launch_enter_hook)
    assert hooked(profiler)  # an older Triton's knob holds the callable itself
