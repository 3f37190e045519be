"""Fixed-size KV blocks shared by reference count, with prefix caching and copy-on-write.

The pool holds `num_blocks` blocks of `block_size` token slots each (the tensors live in
`paged_attention.KVPool`; this module only does the accounting). A sequence owns a block table,
the ids of the blocks that hold its tokens in order. Blocks are shared, never copied, where the
tokens (and so the keys and values) are the same:
- the samples of one request fork the prompt's table: every block gains a reference;
- a request whose prompt starts with the same full blocks as an earlier one (same model, same
  adapter: the keys depend on the LoRA factors) finds them by the hash chain of their tokens and
  skips their prefill (prefix caching, as in vLLM and nano-vllm).
A sequence that is about to write into a block another sequence also references (the samples'
shared, partly filled last prompt block) gets a private copy first: copy-on-write.

Free blocks that still hold a full, hashed block stay findable until they are reused, oldest
freed first, so a prompt sent again soon after skips its prefill too; a new block is one
holding nothing findable, the most recently freed, wherever there is one. So a cached prefix
lives as long as the pool allows, and the blocks in use keep landing on the same memory: on a
CPU a new pool's first calls no longer cycle through all of it, writing each step's new keys
to never-touched pages (128 rows into such blocks took 190 us against 15 us; in steady state,
once every page was touched, the two orders measured the same: docs/benchmarks.md).

Admission reserves a request's worst case (its prompt plus every sample's `max_tokens`) up
front, so a running sequence never finds the pool empty: no preemption, no recompute.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockManager", "KVUsage", "blocks_for", "worst_case_blocks"]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def worst_case_blocks(
    prompt: int, num_samples: int, max_tokens: int, block_size: int, cached: int = 0
) -> int:
    """Blocks a request may take: its prompt blocks but the `cached` ones found, each sample's
    growth (the last sampled token is never written), and a copy of the shared last prompt
    block for all samples but one."""
    grow = blocks_for(prompt + max_tokens - 1, block_size) - blocks_for(prompt, block_size)
    copies = (num_samples - 1) if prompt % block_size else 0
    return blocks_for(prompt, block_size) - cached + num_samples * grow + copies


@dataclass(frozen=True)
class KVUsage:
    """A read-only view of one pool's blocks, for metrics and admission decisions."""

    block_size: int
    blocks_total: int
    blocks_used: int  # referenced by a live sequence
    blocks_reserved: int  # promised to admitted sequences, not yet written
    blocks_cached: int  # free but still holding a findable prefix block
    prefix_hits: int  # blocks found in the prefix cache since the pool was made
    prefix_queries: int  # full prompt blocks looked up

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used


@dataclass
class _Block:
    ref_count: int = 0
    digest: bytes | None = None  # set once the block is full and its prefix hash is known
    tokens: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Free blocks holding nothing findable, most recently freed last (taken first); block
        # 0 first in a new pool.
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks still findable by digest, oldest freed first (an OrderedDict: a prefix
        # hit takes one out of the middle in O(1)).
        self._findable: OrderedDict[int, None] = OrderedDict()
        self._by_digest: dict[bytes, int] = {}
        self.reserved = 0
        self.prefix_hits = 0
        self.prefix_queries = 0

    # ---- hashing ------------------------------------------------------------------------------

    @staticmethod
    def chain(namespace: str, tokens: Sequence[int], block_size: int) -> list[bytes]:
        """Digests of the full blocks of `tokens`, each over its tokens and all before it."""
        digests: list[bytes] = []
        previous = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        for start in range(0, len(tokens) - block_size + 1, block_size):
            h = hashlib.blake2b(previous, digest_size=16)
            h.update(np.asarray(tokens[start : start + block_size], dtype=np.int64).tobytes())
            previous = h.digest()
            digests.append(previous)
        return digests

    # ---- accounting ---------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks a new request may still reserve."""
        return len(self._plain) + len(self._findable) - self.reserved

    def used(self) -> int:
        """Blocks referenced by a sequence; plain reads, safe from another thread."""
        return self.num_blocks - len(self._plain) - len(self._findable)

    def usage(self) -> KVUsage:
        """Counters only (no iteration), so another thread may read it while a step runs."""
        return KVUsage(
            self.block_size,
            self.num_blocks,
            self.used(),
            self.reserved,
            len(self._findable),
            self.prefix_hits,
            self.prefix_queries,
        )

    def reserve(self, blocks: int) -> bool:
        if blocks > self.available():
            return False
        self.reserved += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        assert 0 <= blocks <= self.reserved, (blocks, self.reserved)
        self.reserved -= blocks

    # ---- blocks ---------------------------------------------------------------------------------

    def cached_prefix(self, digests: Sequence[bytes], tokens: Sequence[int]) -> list[int]:
        """The blocks already holding the first full blocks of `tokens` (a prefix cache hit)."""
        found: list[int] = []
        for index, digest in enumerate(digests):
            block_id = self._by_digest.get(digest)
            start = index * self.block_size
            chunk = tuple(int(t) for t in tokens[start : start + self.block_size])
            if block_id is None or self._blocks[block_id].tokens != chunk:
                break
            found.append(block_id)
        return found

    def cost(self, found: Sequence[int]) -> int:
        """Of the cached blocks `found`, how many are free now (reusing one takes it)."""
        return sum(1 for b in found if self._blocks[b].ref_count == 0)

    def take_cached(self, found: Sequence[int], wanted: int) -> None:
        """Reference the cached blocks `found` (of `wanted` looked up) for a new sequence; a
        free one leaves the free list, out of the caller's reservation."""
        self.prefix_queries += wanted
        self.prefix_hits += len(found)
        for block_id in found:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._findable[block_id]
                self.unreserve(1)
            block.ref_count += 1

    def allocate(self) -> int:
        """A fresh block out of a reservation: the most recently freed of those holding nothing
        findable, else the oldest freed cached one (its prefix is lost)."""
        if self._plain:
            block_id = self._plain.pop()
        else:
            block_id, _ = self._findable.popitem(last=False)
        self.unreserve(1)
        block = self._blocks[block_id]
        if block.digest is not None and self._by_digest.get(block.digest) == block_id:
            del self._by_digest[block.digest]
        block.digest, block.tokens, block.ref_count = None, (), 1
        return block_id

    def fork(self, table: Sequence[int]) -> list[int]:
        """Another reference to every block of `table` (a sample sharing its prompt)."""
        for block_id in table:
            self._blocks[block_id].ref_count += 1
        return list(table)

    def shared(self, block_id: int) -> bool:
        return self._blocks[block_id].ref_count > 1

    def copy_on_write(self, table: list[int], index: int) -> tuple[int, int]:
        """Give `table` a private copy of its block `index` (out of a reservation); returns
        (source, copy) for the caller to copy the slots."""
        source = table[index]
        self._blocks[source].ref_count -= 1
        copy = self.allocate()
        table[index] = copy
        return source, copy

    def seal(self, block_id: int, digest: bytes, tokens: Sequence[int]) -> None:
        """Make a full block findable by its prefix digest."""
        block = self._blocks[block_id]
        if block.digest is not None:
            return
        block.digest, block.tokens = digest, tuple(int(t) for t in tokens)
        self._by_digest.setdefault(digest, block_id)

    def free(self, table: Sequence[int]) -> None:
        """Drop a sequence's references; blocks nobody references return to the pool."""
        for block_id in reversed(table):
            block = self._blocks[block_id]
            assert block.ref_count > 0, block_id
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.digest is None:
                    self._plain.append(block_id)
                else:
                    self._findable[block_id] = None
