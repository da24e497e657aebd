"""The KV cache's blocks, as bookkeeping: which are free, who holds each, and which hold a cached
prefix. Pure Python (no torch): the scheduler asks it for blocks and the step plan carries the
resulting block tables to the runner as plain data.

- **Reference counts.** A block is held by every running sequence whose table lists it; a prefix
  block shared by many requests has one count per holder. A block whose count falls to zero is
  free again.
- **Prefix caching.** A *full* block of a sequence (prompt or generated tokens) is identified by
  a hash chained over its token ids, its parent block's hash and the model revision, so equal
  hashes mean equal keys and values. A block whose tokens are final and whose keys and values were
  computed (by a prefill, or by decode steps once its last generated token was fed back) is
  registered under its hash; a later request looks up its prompt's block hashes in order and
  reuses the blocks of its longest cached prefix, so a chat's next turn (prompt + answer + a new
  user turn) reuses the answer's blocks too. A cached block that no sequence holds stays cached,
  in least-recently-used order, until an allocation needs its memory (then it is evicted:
  forgotten and reused). A new model revision drops them all.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

import numpy as np


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free or evictable (the caller checks first)."""


def block_hashes(tokens: Seq[int], block_size: int, revision: str) -> list[bytes]:
    """The chained hash of every full block of ``tokens`` (pure): block ``i``'s hash covers its own
    token ids, block ``i - 1``'s hash and the model revision."""
    out: list[bytes] = []
    parent = revision.encode()
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def chain_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """One block's hash: its token ids chained after ``parent`` (the previous block's hash, or the
    model revision for the first block). Used for prompt blocks and, one at a time, for blocks
    filled by decode, so both chains are equal for equal tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class BlockManager:
    """Allocates, shares and frees the ``num_blocks`` blocks of one KV cache."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, revision: str = "") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.revision = revision
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by no one; oldest first
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found there

    def resize(self, num_blocks: int) -> None:
        """Manages ``num_blocks`` blocks from now on (a new KV cache); only while none is held."""
        if self.used:
            raise RuntimeError(f"cannot resize the KV cache while {self.used} blocks are held")
        prefix, revision = self.prefix_caching, self.revision
        queries, hits = self.query_tokens, self.hit_tokens
        self.__init__(num_blocks, self.block_size, prefix_caching=prefix, revision=revision)
        self.query_tokens, self.hit_tokens = queries, hits

    # --- counts ---------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks an allocation may take now: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks some sequence holds (never below 0: another thread's read may fall between
        the two lists' updates while the prefix cache is reset)."""
        return max(self.num_blocks - self.available, 0)

    def status(self) -> tuple[int, int, int, int, int]:
        """(total, used, cached, prefix query tokens, prefix hit tokens), for status and metrics."""
        return self.num_blocks, self.used, self.cached, self.query_tokens, self.hit_tokens

    @property
    def cached(self) -> int:
        """Blocks no sequence holds that still hold a cached prefix (reusable until needed)."""
        return len(self._evictable)

    # --- allocation -------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one holder; free ones first, then the least recently used cached ones."""
        if n > self.available:
            raise NoFreeBlocks(f"{n} blocks asked for, {self.available} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Seq[int]) -> None:
        """Drops one holder's reference to each block; a cached block nobody holds stays cached.

        ``blocks`` is a block table, in order; it is freed tail first, so that its last block is
        the least recently used: a lookup stops at the first missing block, and evicting a
        chain's first block would make every cached block after it unreachable."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # --- prefix cache -----------------------------------------------------------------------

    def peek(self, hashes: Seq[bytes]) -> list[int]:
        """The blocks of the longest cached prefix among ``hashes``; nothing is taken."""
        found = []
        if self.prefix_caching:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def idle(self, blocks: Seq[int]) -> int:
        """How many of ``blocks`` no sequence holds (taking them lowers ``available``)."""
        return sum(1 for b in blocks if self.refs[b] == 0)

    def acquire(self, blocks: Seq[int], query_tokens: int) -> None:
        """Holds the cached ``blocks`` (from ``peek``) once more, for a prompt of ``query_tokens``
        tokens; counts the query and the hit in tokens (0: a preempted sequence's recompute, whose
        prompt was counted when it was first admitted)."""
        if self.prefix_caching and query_tokens:
            self.query_tokens += query_tokens
            self.hit_tokens += len(blocks) * self.block_size
        for block in blocks:
            if self.refs[block] == 0:
                del self._evictable[block]
            self.refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Records that ``block`` holds the keys of the full block ``block_hash`` (written by a
        launched step); a hash already cached keeps its first block."""
        if not self.prefix_caching or block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash

    def forget(self, blocks: Seq[int]) -> None:
        """Drops ``blocks`` from the prefix cache (a failed step may have left them half written)."""
        for block in blocks:
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._block_of[h]
                if block in self._evictable:
                    del self._evictable[block]
                    self._free.append(block)

    def reset_prefix_cache(self, revision: str) -> None:
        """Forgets every cached block (a new model revision computes other keys)."""
        self.revision = revision
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
