"""One launch that writes a step's keys and values into the KV cache.

Each token's heads are contiguous in ``k`` and ``v`` (views of the QKV projection's output), so
program (token, 0) copies the token's keys and (token, 1) its values to the token's cache row.
"""

from __future__ import annotations

from torch import Tensor

from graphkeeper.worker.kernels import pdl
from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import available, tl, triton

if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit
    def _write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, stride_k, stride_v,
                      ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        """Program (token, 0) stores the token's keys, (token, 1) its values, at its cache row."""
        await_inputs(USE_PDL)
        token = tl.program_id(0)
        which = tl.program_id(1)
        dest = tl.load(rows_ptr + token).to(tl.int64) * ROW
        cols = tl.arange(0, BLOCK)
        ok = cols < ROW
        if which == 0:
            tl.store(k_cache_ptr + dest + cols, tl.load(k_ptr + token * stride_k + cols, mask=ok), mask=ok)
        else:
            tl.store(v_cache_ptr + dest + cols, tl.load(v_ptr + token * stride_v + cols, mask=ok), mask=ok)

    _write = LaunchMemo(_write_kernel)


def fits(k: Tensor, v: Tensor) -> bool:
    """Whether the kernel can write ``k``/``v`` ``[T, n_kv, head_dim]`` (CUDA, heads contiguous)."""
    return available(k.device) and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]


def write(k: Tensor, v: Tensor, k_layer: Tensor, v_layer: Tensor, rows: Tensor) -> None:
    """Stores ``k``/``v`` at the flat cache ``rows`` of one layer's views; no host sync."""
    t, row = k.shape[0], k.shape[1] * k.shape[2]
    if t:
        _write.launch((t, 2), k, v, k_layer, v_layer, rows, k.stride(0), v.stride(0),
                      ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=1, **pdl.launch_options())
