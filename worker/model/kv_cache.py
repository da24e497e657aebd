"""A paged KV cache: fixed-size blocks of ``block_size`` tokens and a block table per slot.

A running sequence holds a *slot* (its row in the block table and in the runner's per-slot
buffers) and a list of blocks; token ``p`` of the sequence lives in block
``table[slot, p // block_size]`` at offset ``p % block_size``, so its flat row in a layer's view
is ``block * block_size + offset`` (its *slot mapping*). The engine decides which blocks a
sequence holds (``engine/blocks.py``); the step plan carries the table's changes as plain data
and the runner applies them to ``block_table`` before the step runs.

Shapes and addresses never change between steps, which is what lets a recorded graph read and
write it: the block table is one static ``[slots, max_blocks_per_seq]`` tensor whose entries
change in place. Scratch slots after the real ones belong to the capture phase and to padding:
each has its own scratch blocks (a whole context's worth), fixed at construction. The first, the
*dummy slot*, absorbs the writes of padded rows so that padding never touches a real sequence's
state, and validation probes write distinct positions across all of them.

Built without ``num_blocks`` the cache is the static one: each slot owns ``max_blocks_per_seq``
blocks of its own from the start (benchmarks and tests that address slots directly).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.kernels import kv_write_kernel
from graphkeeper.worker.model.config import ModelConfig
from graphkeeper.worker.model.sleep_memory import ALIGNMENT, SleepableRegion
from graphkeeper.worker.settings import DEFAULT_BLOCK_SIZE, check_block_size


class KVCache:
    def __init__(
        self, config: ModelConfig, num_slots: int, max_seq_len: int, *,
        device: torch.device, dtype: torch.dtype, scratch_slots: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None, sleepable: bool = False,
    ) -> None:
        """``sleepable``: keys and values in a sleepable region (sleep mode on CUDA), whose memory
        Sleep gives back at unchanged addresses."""
        self.num_slots = num_slots
        self.scratch_slots = max(1, scratch_slots)
        self.max_seq_len = max_seq_len
        self.block_size = check_block_size(block_size)
        self.max_blocks_per_seq = math.ceil(max_seq_len / block_size)
        #: Blocks sequences may hold (ids 0 .. num_blocks - 1); scratch blocks come after them.
        self.static = num_blocks is None
        self.num_blocks = num_slots * self.max_blocks_per_seq if num_blocks is None else num_blocks
        slots = num_slots + self.scratch_slots
        scratch_blocks = self.scratch_slots * self.max_blocks_per_seq
        total = self.num_blocks + scratch_blocks
        # [layer, block, offset, kv_head, head_dim]: one (block, offset) is one contiguous row,
        # so a step's keys land with a single write per layer at block * block_size + offset.
        shape = (config.n_layers, total, block_size, config.n_kv_heads, config.head_dim)
        # Zeros, not empty: the dummy slot's blocks are read by padded rows and must hold finite values.
        self.region: SleepableRegion | None = None
        if sleepable and torch.device(device).type == "cuda":
            half = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.region = SleepableRegion(2 * half + 2 * ALIGNMENT, "kv-cache", torch.device(device))
            self.k, self.v = (self.region.take(shape, dtype).zero_() for _ in range(2))
        else:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Each layer's view, made once: a step indexes them per layer on the host's hot path.
        self.k_layers, self.v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))
        # The table, on the host (the runner computes slot mappings from it) and on the device
        # (the attention kernels read it). Sequence slots start on block 0 (never read before
        # they are written: a row reads only up to its length); scratch slots own their blocks.
        self.table_host = np.zeros((slots, self.max_blocks_per_seq), dtype=np.int64)
        per_slot = np.arange(self.max_blocks_per_seq, dtype=np.int64)
        if self.static:
            self.table_host[:num_slots] = np.arange(num_slots)[:, None] * self.max_blocks_per_seq + per_slot
        self.table_host[num_slots:] = (self.num_blocks + np.arange(self.scratch_slots)[:, None]
                                       * self.max_blocks_per_seq + per_slot)
        self.block_table = torch.from_numpy(self.table_host.copy()).to(device)

    @property
    def dummy_slot(self) -> int:
        return self.num_slots

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in every layer, keys and values."""
        return self.k[:, 0].nbytes * 2

    def probe_slot_position(self, row: int) -> tuple[int, int]:
        """A distinct scratch (slot, position) for probe row ``row``."""
        return self.num_slots + row // self.max_seq_len, row % self.max_seq_len

    def row_index(self, slot, position):
        """Where ``(slot, position)`` lives in a layer's flat view (ints or numpy arrays), through
        the host copy of the block table: its slot mapping."""
        bs = self.block_size
        return self.table_host[slot, position // bs] * bs + position % bs

    def update_host(self, updates: np.ndarray) -> None:
        """Applies block-table changes ``[3, k]`` (slot, index, block) to the host copy."""
        self.table_host[updates[0], updates[1]] = updates[2]

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
        """Bytes the keys and values take (every block, the scratch ones included)."""
        return self.k.nbytes + self.v.nbytes

    def addresses(self) -> tuple[int, ...]:
        """The buffers' device addresses; graphs recorded against others are stale."""
        return self.k.data_ptr(), self.v.data_ptr(), self.block_table.data_ptr()
