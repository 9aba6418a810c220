"""Fixed-size KV blocks and a free list (chapter 05).

The pool is cut into `num_blocks` blocks of `block_size` token slots. A block is either free, in
use (its reference count says by how many requests — more than one when a prefix is shared), or,
with prefix caching, *cached*: nobody uses it but its K/V are kept in case a later request has
the same prefix. Cached blocks are evicted oldest-first when the free list runs dry: this LRU
queue is the only eviction mechanism, whichever structure (hash chain or radix tree) finds the
cached blocks; `on_evict` tells that structure a block is being reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self.on_evict = None  # called with a block id when a cached block is reclaimed

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones plus cached ones that may be evicted."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise RuntimeError("no free KV block (check num_free before allocating)")
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more request reads this block (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]  # revived from the cache
        self.ref_counts[block] += 1

    def uncache(self, block: int) -> None:
        """The prefix cache dropped this block: if nobody uses it, it is simply free again."""
        if self.ref_counts[block] == 0 and block in self.evictable:
            del self.evictable[block]
            self.free_blocks.append(block)

    def release(self, block: int, keep_cached: bool) -> None:
        """One reader fewer; at zero the block is cached (if it holds a full, hashed block) or freed."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} released more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if keep_cached:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
