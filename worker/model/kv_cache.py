"""A static, preallocated KV cache: one slot per running sequence, a fixed maximum length.

Shapes and addresses never change between steps, which is what lets a recorded graph read and
write it. Scratch slots after the real ones belong to the capture phase: the first, the *dummy slot*,
absorbs the writes of padded rows so that padding never touches a real sequence's state, and
validation probes write distinct positions across all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.kernels import kv_write_kernel
from graphkeeper.worker.model.config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_slots: int, max_seq_len: int, *,
        device: torch.device, dtype: torch.dtype, scratch_slots: int = 1,
    ) -> None:
        self.num_slots = num_slots
        self.scratch_slots = max(1, scratch_slots)
        self.max_seq_len = max_seq_len
        total = num_slots + self.scratch_slots
        # [layer, slot, position, kv_head, head_dim]: one (slot, position) is one contiguous row,
        # so a step's keys land with a single index_copy_ per layer at slot * max_seq_len + position.
        shape = (config.n_layers, total, max_seq_len, config.n_kv_heads, config.head_dim)
        # Zeros, not empty: the dummy slot is read by padded rows and must hold finite values.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Each layer's view, made once: a step indexes them per layer on the host's hot path.
        self.k_layers, self.v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))

    @property
    def dummy_slot(self) -> int:
        return self.num_slots

    def probe_slot_position(self, row: int) -> tuple[int, int]:
        """A distinct scratch (slot, position) for probe row ``row``."""
        return self.num_slots + row // self.max_seq_len, row % self.max_seq_len

    def row_index(self, slot, position):
        """Where ``(slot, position)`` lives in a layer's flat view (ints or numpy arrays)."""
        return slot * self.max_seq_len + position

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Stores ``k``/``v`` ``[T, n_kv, head_dim]`` at flat ``rows`` (see row_index); no host sync.

        On CUDA one launch of ``kv_write_kernel`` writes both; elsewhere two ``index_copy_``.
        """
        t = k.shape[0]
        row = k.shape[1] * k.shape[2]
        if kv_write_kernel.fits(k, v):
            kv_write_kernel.write(k, v, self.k_layers[layer], self.v_layers[layer], rows)
            return
        self.k_layers[layer].view(-1, row).index_copy_(0, rows, k.reshape(t, -1))
        self.v_layers[layer].view(-1, row).index_copy_(0, rows, v.reshape(t, -1))

    def nbytes(self) -> int:
        """Bytes the keys and values take (every slot, the scratch ones included)."""
        return self.k.nbytes + self.v.nbytes

    def addresses(self) -> tuple[int, int]:
        """The buffers' device addresses; graphs recorded against others are stale."""
        return self.k.data_ptr(), self.v.data_ptr()
