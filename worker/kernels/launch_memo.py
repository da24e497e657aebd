"""A Triton kernel launched again without Triton's per-call binding, once its specialization is known.

Why: a PIECEWISE step launches the KV write and the varlen attention from Python for every layer,
between the captured pieces, and the sampler launches its kernels every step. Triton's launch path
binds every argument, specializes it, builds and hashes a cache key and looks the compiled kernel up
on each call: on the H200 that was 15% of the engine thread under long prompts, beside 9% for the
launch itself (``bench/results/profile-long-h200.txt``), and the engine thread sets the step's pace.

``LaunchMemo`` keys a call on everything Triton's specialization reads, by value: every scalar
argument, every tensor's dtype and 16-byte alignment, every keyword (constexprs and launch options)
and the device. The first call with a key goes through Triton, which compiles or finds the kernel and
launches it; later calls with the same key hand the same arguments, in the order Triton passes them,
straight to the compiled kernel's launcher. Two calls with one key get the same specialization from
Triton, so they get the same compiled kernel either way.

The launcher's calling convention is Triton's own and not a public API, so the direct path is taken
only on the Triton versions it was checked on (``CHECKED_VERSIONS``) and never while a launch hook
(a profiler) is installed; everywhere else every call goes through Triton as before.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from graphkeeper.worker.kernels import compile_ahead
from graphkeeper.worker.kernels.triton_support import triton

#: Triton versions (major.minor) whose compiled-kernel launcher takes
#: ``(grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook, *args)``
#: with ``args`` every parameter in signature order, constexprs included.
CHECKED_VERSIONS = ("3.6",)


def _direct_supported() -> bool:
    """Whether this Triton launches compiled kernels the way the direct path calls them."""
    return triton is not None and ".".join(triton.__version__.split(".")[:2]) in CHECKED_VERSIONS


def hooked(hook: Any) -> bool:
    """Whether a launch hook is installed. Triton 3.6's knobs hold an empty ``HookChain``, not
    None, when nothing is installed: that counts as no hook (else no launch would ever be direct)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class LaunchMemo:
    """One Triton kernel's launches: ``memo.launch(grid, *args, **kwargs)`` does what
    ``kernel[grid](*args, **kwargs)`` does, skipping Triton's binding for a call it has seen."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        #: key -> (the compiled kernel, the parameters the call named by keyword, in signature order)
        self._compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
        self._direct = _direct_supported() and type(kernel).__name__ == "JITFunction"
        self._params = tuple(getattr(kernel, "arg_names", ()))
        self._knobs: Any = None  # Triton's runtime knobs and driver, bound at the first launch: a
        self._device: Any = None  # machine without a GPU has no active driver to ask at import
        self._stream: Any = None

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self._direct or compile_ahead.dry():
            compile_ahead.launcher(self.kernel, grid)(*args, **kwargs)
            return
        if self._knobs is None:
            self._bind()
        if hooked(self._knobs.launch_enter_hook) or hooked(self._knobs.launch_exit_hook):
            self.kernel[grid](*args, **kwargs)
            return
        device = self._device()
        key = (device, *kwargs.items(), *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else a
                                          for a in args])
        seen = self._compiled.get(key)
        if seen is None:
            compiled = self.kernel[grid](*args, **kwargs)
            named = self._params[len(args):]
            # Only a call that named every later parameter by keyword: one left to its default
            # could not be listed in order.
            if all(name in kwargs for name in named):
                self._compiled[key] = (compiled, named)
            return
        compiled, named = seen
        x, y, z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        compiled.run(x, y, z, self._stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *[kwargs[name] for name in named])

    def _bind(self) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        self._knobs = knobs.runtime
        self._device = driver.active.get_current_device
        self._stream = driver.active.get_current_stream

    def __len__(self) -> int:
        """Specializations seen (for tests)."""
        return len(self._compiled)
