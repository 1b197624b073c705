"""A prefix cache for a hybrid model: the next turn of a conversation reads only its new tokens.

Prompts are cut into blocks of `block_tokens`. Block i is named by a hash chain (its digest
hashes its parent's digest and its own tokens), so a prompt's cached prefix is found
block by block from its start, as in vLLM. LFM2 is hybrid, so a block holds everything a
lane needs to resume at its end:

- the target's attention K/V rows for its positions (any prefix could reuse those),
- the conv states at its end (a short conv's state is known only at the position it was
  computed for, so lanes record them as they cross block boundaries),
- where the lane drafted, the drafter's context K/V rows for its positions.

A resuming lane gets copies of its blocks in its own slots and prefills only the rest,
so a block serves any number of lanes at once and a hit changes no neighbour. Lanes pin
the blocks they resumed from until they finish, and offer their own blocks when they
finish (or are cancelled). Eviction takes the least recently used unpinned block; every
use touches a chain from its leaf to its root, so a parent is never older than its
children, eviction takes leaves first, and no cached block is ever orphaned.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .lane import Lane
from .protocols import Drafter, Target

BLOCK_TOKENS = 64


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a block: its parent's name and its own tokens, hashed."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def default_budget_bytes() -> int:
    """A quarter of the memory left once the model is loaded: device memory where MLX
    reports it (Apple silicon, CUDA), else the RAM the OS says is available."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    total = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if total:
        free = int(total) - mx.get_active_memory()
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/meminfo") as meminfo:
                free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            pass
    return max(free, 0) // 4


@dataclass(eq=False)
class Block:
    digest: bytes
    tokens: tuple[int, ...]
    target: tuple[mx.array, ...]  # the target's `prefix_rows` for the block
    drafter: tuple[mx.array, ...] | None  # the drafter's `context_rows`, where the lane drafted
    pins: int = 0  # lanes that resumed from this block and are still running

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.target, *(self.drafter or ())))


class PrefixCache:
    def __init__(self, target: Target, drafter: Drafter | None, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes < 1 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs a positive budget and block size, got {budget_bytes} bytes, {block_tokens} tokens")
        self.target, self.drafter = target, drafter
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        target.boundary_every = block_tokens
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, tokens read from the cache

    # ---- a lane starts ----------------------------------------------------------------

    def attach(self, lane: Lane) -> int:
        """Resume a freshly admitted lane from the longest cached prefix of its prompt:
        restore its caches, pin the blocks, and return the tokens it need not read. At
        least the prompt's last token is left to read, for the first token's logits."""
        prompt, drafting = lane.request.prompt, lane.drafter_slot is not None
        chain = self._walk(prompt[: len(prompt) - 1], lambda block: not drafting or block.drafter is not None)
        self.queried_tokens += len(prompt)
        if not chain:
            return 0
        cached = len(chain) * self.block_tokens
        keys, values = (mx.concatenate([b.target[i] for b in chain], axis=2) for i in range(2))
        self.target.restore_prefix(lane.target_slot, keys, values, chain[-1].target[2])
        if drafting:
            rows = (mx.concatenate([b.drafter[i] for b in chain], axis=2) for i in range(2))
            self.drafter.restore_context(lane.drafter_slot, prompt[:cached], *rows)
        for block in chain:
            block.pins += 1
        lane.cached_blocks = chain
        self._touch(chain)
        self.hit_tokens += cached
        return cached

    # ---- a lane ends ------------------------------------------------------------------

    def offer(self, lane: Lane) -> None:
        """Keep the blocks a finished lane has read (prompt and reply) that the cache lacks
        or holds without drafter rows, as far as the budget allows; call before its
        slots close."""
        tokens = lane.request.prompt + lane.generated
        slot = lane.target_slot
        # Committed rows past the emitted tokens (a kept draft after an eos) are not offered.
        known = min(slot.length, len(tokens))
        drafted = lane.drafter_slot.length if lane.drafter_slot is not None else 0
        chain, added, parent, size = [], [], b"", self.block_tokens
        for start in range(0, known - size + 1, size):
            end = start + size
            digest = block_digest(parent, tokens[start:end])
            block = self._blocks.get(digest)
            if block is not None and block.tokens != tuple(tokens[start:end]):
                break
            if block is None and end not in slot.conv_at:
                break  # no conv state recorded there: nothing from here on can be resumed
            with_drafter = drafted >= end and (block is None or block.drafter is None)
            if with_drafter or block is None:
                target_rows = self.target.prefix_rows(slot, start, end) if block is None else ()
                drafter_rows = self.drafter.context_rows(lane.drafter_slot, start, end) if with_drafter else None
                grow = sum(a.nbytes for a in (*target_rows, *(drafter_rows or ())))  # lazy: only shapes are read
                if not self._make_room(grow, keep=chain):
                    break
                if block is None:
                    block = Block(digest, tuple(tokens[start:end]), target_rows, drafter_rows)
                    self._blocks[digest] = block
                else:
                    block.drafter = drafter_rows
                self._bytes += grow
                added.append(block)
            chain.append(block)
            parent = digest
        # Launched, not awaited: evaluating the copies releases the pools they were read from.
        mx.async_eval([a for block in added for a in (*block.target, *(block.drafter or ()))])
        self._touch(chain)

    def release(self, lane: Lane) -> None:
        """Unpin the blocks a lane resumed from."""
        for block in lane.cached_blocks:
            block.pins -= 1
        lane.cached_blocks = []

    def clear(self) -> None:
        """Drop every unpinned block and reset the counters (after the warm-up's traffic)."""
        for digest in [d for d, b in self._blocks.items() if not b.pins]:
            self._drop(digest)
        self.queried_tokens = self.hit_tokens = 0

    def stats(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "bytes": self._bytes,
            "blocks": len(self._blocks),
            "block_tokens": self.block_tokens,
            "queried_tokens_total": self.queried_tokens,
            "hit_tokens_total": self.hit_tokens,
        }

    # ---- blocks -----------------------------------------------------------------------

    def _walk(self, tokens: list[int], usable) -> list[Block]:
        """The cached, usable blocks that begin `tokens`, root first."""
        chain, parent, size = [], b"", self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            part = tokens[start : start + size]
            block = self._blocks.get(block_digest(parent, part))
            if block is None or block.tokens != tuple(part) or not usable(block):
                break
            chain.append(block)
            parent = block.digest
        return chain

    def _touch(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # leaf first, root last: the root is the most recent
            self._blocks.move_to_end(block.digest)

    def _make_room(self, nbytes: int, keep: list[Block]) -> bool:
        """Evict least recently used unpinned blocks (none of `keep`) until `nbytes` more fit."""
        if self._bytes + nbytes <= self.budget_bytes:
            return True
        kept = {block.digest for block in keep}
        for digest in [d for d, b in self._blocks.items() if not b.pins and d not in kept]:
            self._drop(digest)
            if self._bytes + nbytes <= self.budget_bytes:
                return True
        return False

    def _drop(self, digest: bytes) -> None:
        self._bytes -= self._blocks.pop(digest).nbytes
