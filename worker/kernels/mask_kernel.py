"""A step's grammar masks applied to its logits in one launch.

A grammar's mask arrives as llguidance's bitmask, ``[n, ceil(vocab / 32)]`` int32 (bit ``j`` of
word ``w`` allows token ``32 w + j``). With PyTorch operations, unpacking it and setting the
disallowed tokens to ``-inf`` takes about ten launches from Python (the bit arithmetic, a gather of
the rows, the fill and a scatter back), and the engine thread is what limits a step on the H200
(the penalties' profile, ``bench/results/sampling-h200.md``). Here one kernel reads the words and
writes ``-inf`` where a bit is clear, in the rows named; it writes nothing else, so an allowed
token keeps its value bit for bit. vLLM applies xgrammar's and llguidance's masks the same way.
"""

from __future__ import annotations

from torch import Tensor

from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import tl, triton

#: Vocabulary entries one program covers (32 mask words).
BLOCK = 1024

if triton is not None:

    @triton.jit
    def _mask_kernel(logits_ptr, stride_l, masks_ptr, words, rows_ptr, V, BLOCK: tl.constexpr):
        k = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        row = tl.load(rows_ptr + k).to(tl.int64)
        word = tl.load(masks_ptr + k * words + cols // 32, mask=ok, other=-1)
        allowed = ((word >> (cols % 32)) & 1) != 0
        tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=ok & ~allowed)

    _mask = LaunchMemo(_mask_kernel)


def apply(logits: Tensor, masks: Tensor, rows: Tensor) -> None:
    """Sets to ``-inf``, in place, every token of ``logits`` ``[N, V]`` (float32, rows contiguous)
    row ``rows[k]`` that bitmask ``masks[k]`` (``[n, words]`` int32, contiguous) does not allow."""
    vocab, n = logits.shape[1], masks.shape[0]
    _mask.launch((n, triton.cdiv(vocab, BLOCK)), logits, logits.stride(0), masks, masks.shape[1], rows, vocab,
                 BLOCK=BLOCK, num_warps=4)
