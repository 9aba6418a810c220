"""The prefix cache's host tier: evicted blocks wait in host memory instead of vanishing (chapter 14).

Without it, a cached block the device pool reclaims is gone: the next request with that prefix
computes it again. With an offload tier (vLLM's CPU offloading, `--kv-offloading-size` GiB), the
block is first copied to a host block, and a later prefix hit that the device no longer holds is
copied back over the host link before the step's forward — a transfer instead of a recompute.
The host pool has `capacity_blocks` blocks and evicts least recently used ones when full.

Host blocks are found by a SHA-256 chain over the token ids (block i's key digests block i-1's key
and its own tokens), so a key names a whole prefix, independent of which device block held it;
the block's own token ids are compared on every hit as well. (The device chain uses Python's
`hash` and checks its parent block instead; a host block has no parent block to check.)

This module only keeps the books — which key sits in which host block, in LRU order. The copies
travel in the plan's swap fields under a pseudo request id per host block (`host_block_id`), so
the worker (and the simulator, which charges them to its PCIe link) moves them like swap copies.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

# The plan's swap fields name copies by request id; a host block of the tier goes by this one.
HOST_BLOCK_PREFIX = "kv-offload/"


def host_block_id(slot: int) -> str:
    """The pseudo request id the plan's swap fields use for host block `slot`."""
    return f"{HOST_BLOCK_PREFIX}{slot}"


def next_key(parent_key: bytes, block_tokens: Sequence[int]) -> bytes:
    """The host key of a block: its parent's key (b"" for the first block) and its token ids, digested."""
    return hashlib.sha256(parent_key + ",".join(map(str, block_tokens)).encode()).digest()


def prefix_keys(tokens: Sequence[int], num_blocks: int, block_size: int) -> list[bytes]:
    """The host keys of the first `num_blocks` full blocks of `tokens`."""
    keys, key = [], b""
    for i in range(num_blocks):
        key = next_key(key, tokens[i * block_size : (i + 1) * block_size])
        keys.append(key)
    return keys


class HostPrefixTier:
    """Host blocks holding evicted prefix-cache blocks, found by prefix key, evicted LRU."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the offload tier needs at least 1 host block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.num_slots_used = 0  # host blocks handed out at least once: 0 … num_slots_used - 1 (a big tier fills lazily)
        self.free_slots: list[int] = []  # of those, the ones given back
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # key → host block; oldest use first
        self.tokens_of: dict[bytes, tuple[int, ...]] = {}
        self.pinned: set[bytes] = set()  # read by this step's copies in: not evicted before them

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def num_free(self) -> int:
        return self.capacity_blocks - len(self.slot_of)

    def find(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        """The host block holding this prefix block, or None. Changes nothing."""
        slot = self.slot_of.get(key)
        return slot if slot is not None and self.tokens_of[key] == tokens else None

    def pin(self, key: bytes) -> int:
        """Keep `key` until the step's copy in has read it (`unpin_all`); marks it recently used."""
        self.slot_of.move_to_end(key)
        self.pinned.add(key)
        return self.slot_of[key]

    def unpin_all(self) -> None:
        self.pinned.clear()

    def store(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        """Make room for a block leaving the device: the host block to copy it into, or None when
        no copy is needed (already held: only marked recently used) or possible (all pinned)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return None
        if not self.num_free:
            victim = next((k for k in self.slot_of if k not in self.pinned), None)
            if victim is None:
                return None
            self.drop(victim)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot, self.num_slots_used = self.num_slots_used, self.num_slots_used + 1
        self.slot_of[key] = slot
        self.tokens_of[key] = tokens
        return slot

    def drop(self, key: bytes) -> None:
        """Forget `key` (LRU eviction, or a copy out that never happened); its host block is free."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            del self.tokens_of[key]
            self.pinned.discard(key)
            self.free_slots.append(slot)
