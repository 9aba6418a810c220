"""Paged KV: per-request block tables over a shared pool, and prefix caching (chapters 05–07).

A request's K/V live in blocks scattered anywhere in the pool; its *block table* lists them in
order, so token position p sits at slot `table[p // block_size] · block_size + p % block_size`.
Blocks are added only when the last one is full, so a request wastes at most one partly filled
block — the fix for the slab's reservation of `max_model_len` slots per request.

Prefix caching: a new request first looks up the longest prefix of its tokens whose K/V some
earlier request already computed, attaches those blocks (reference count + 1) and prefills only
the rest. Two lookup structures, chosen by `prefix_cache` (chapter 07 compares them):

- `"hash"` (vLLM's automatic prefix caching, `HashChain` below): a *full* block is identified by a
  hash of its parent block's hash and its own token ids, so equal hashes mean equal prefixes —
  almost. The token ids are compared on every hit, and so is the parent block, so a hash
  collision can never hand out wrong K/V.
- `"radix"` (SGLang's RadixAttention, `minillm.kv.radix.RadixTree`): a tree of token runs.

Either way only full blocks are cached and shared, so nobody ever appends into a block someone
else reads (no copy-on-write needed), and at least one prompt token is always computed (its
logits give the first output token). Unused cached blocks wait in the allocator's LRU queue; when
it reclaims one, the structure forgets it and every block cached below it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.config import PREFIX_CACHES
from minillm.kv.base import KVUsage
from minillm.kv.block_allocator import BlockAllocator
from minillm.kv.radix import RadixTree
from minillm.request import Request


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class HashChain:
    """vLLM-style prefix cache: `block_hash(parent hash, tokens)` → block, one dict probe per block.

    A hit is trusted only if the cached block's token ids *and* its parent block equal what the
    walk has matched so far; checking the tokens alone would not do, since two different prefixes
    whose hashes collide could each end in a block of equal tokens. The parent check in turn is
    exact because evicting a block also forgets every block cached below it (`remove_block`): a
    child never outlives the block it was registered under, so a reused block id cannot adopt it.
    (vLLM trusts the hash instead, and keeps such orphans for when their parent is recomputed.
    They are rare here: a request releases its tail first, so children are evicted before parents.)
    Access times live in the allocator's LRU queue, not here; `touch` exists for the radix tree.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cached_block_of: dict[int, int] = {}  # hash → block
        self.hash_of_block: dict[int, int] = {}
        self.tokens_of_block: dict[int, tuple[int, ...]] = {}
        self.parent_of_block: dict[int, int | None] = {}
        self.children_of_block: dict[int, set[int]] = {}

    def __contains__(self, block: int) -> bool:
        return block in self.hash_of_block

    def __len__(self) -> int:
        return len(self.hash_of_block)

    def match_prefix(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """The cached blocks holding the longest block-aligned prefix of `tokens`, in order."""
        bs = self.block_size
        matched: list[int] = []
        parent_hash = parent = None
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent_hash, chunk)
            block = self.cached_block_of.get(h)
            if block is None or self.tokens_of_block[block] != chunk or self.parent_of_block[block] != parent:
                break
            matched.append(block)
            parent_hash, parent = h, block
        return matched

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Cache `blocks[i]` as holding `tokens[i*bs:(i+1)*bs]`; where that prefix is cached already,
        the cached block is kept (the caller's copy stays uncached) and the chain continues from it."""
        bs = self.block_size
        parent_hash = parent = None
        for i, own in enumerate(blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent_hash, chunk)
            block = self.cached_block_of.get(h)
            if block is None:
                if own in self.hash_of_block:
                    raise RuntimeError(f"block {own} is already cached under another prefix")
                block = own
                self.cached_block_of[h] = own
                self.hash_of_block[own] = h
                self.tokens_of_block[own] = chunk
                self.parent_of_block[own] = parent
                if parent is not None:
                    self.children_of_block.setdefault(parent, set()).add(own)
            elif self.tokens_of_block[block] != chunk or self.parent_of_block[block] != parent:
                return  # a hash collision: the key is taken, and nothing below can be verified
            parent_hash, parent = h, block

    def remove_block(self, block: int) -> list[int]:
        """Forget `block` and every block cached below it; returns the *other* blocks forgotten."""
        if block not in self.hash_of_block:
            return []
        parent = self.parent_of_block[block]
        if parent is not None:
            self.children_of_block[parent].discard(block)
        dropped, stack = [], [block]
        while stack:
            b = stack.pop()
            del self.cached_block_of[self.hash_of_block.pop(b)]
            del self.tokens_of_block[b], self.parent_of_block[b]
            stack.extend(self.children_of_block.pop(b, ()))
            dropped.append(b)
        return dropped[1:]


class BlockManager:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", enable_prefix_caching: bool = False,
                 allocate_pool: bool = True, watermark: float = 0.01, prefix_cache: str = "hash") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache={prefix_cache!r}; choose one of {PREFIX_CACHES}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.allocator.on_evict = self._forget
        self.watermark_blocks = int(watermark * num_blocks)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_kind = prefix_cache
        self.prefix_cache: HashChain | RadixTree = (HashChain if prefix_cache == "hash" else RadixTree)(block_size)
        self.block_tables: dict[str, list[int]] = {}
        self._tokens_of: dict[str, int] = {}  # tokens whose K/V are (or are about to be) in the table
        self._num_offered: dict[str, int] = {}  # full blocks of each request already offered to the cache
        self._lookups: dict[str, tuple[int, int]] = {}  # (query, hit) tokens, counted once admitted
        self.swapped: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}  # host copies of preempted K/V
        self.num_swapped_out_tokens = 0
        # vLLM's prefix-cache counters: tokens of admitted requests looked up, and of those, found.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # ---- prefix cache ------------------------------------------------------------------------
    @property
    def cached_block_of(self) -> dict[int, int]:
        """hash → cached block (hash chain only)."""
        return self.prefix_cache.cached_block_of

    @property
    def hash_of_block(self) -> dict[int, int]:
        return self.prefix_cache.hash_of_block

    def is_cached(self, block: int) -> bool:
        return block in self.prefix_cache

    def _match(self, request: Request, touch: bool) -> list[int]:
        """Cached blocks for the longest prefix of the request's tokens, leaving >= 1 token to compute."""
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size  # the last token must run: its logits are needed
        return self.prefix_cache.match_prefix(tokens[: max_blocks * self.block_size], touch=touch)

    def cached_prefix_tokens(self, request: Request) -> int:
        """How many of a waiting request's tokens `get_computed_tokens` would find cached. Changes
        nothing (no reference counts, no metrics, no access times): a scheduler may ask freely."""
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return 0
        return len(self._match(request, touch=False)) * self.block_size

    def get_computed_tokens(self, request: Request) -> int:
        """Attach the longest cached prefix of a new request's tokens; returns how many tokens hit.

        At least one token is always left to compute: the step needs its logits. The lookup is
        counted in `num_query_tokens`/`num_hit_tokens` once the request is allocated (admitted), so a
        request turned away and retried is not counted twice.
        """
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return 0
        table = self._match(request, touch=True)
        for block in table:
            self.allocator.share(block)
        hit = len(table) * self.block_size
        self._lookups[request.request_id] = (request.num_tokens, hit)
        if table:
            self.block_tables[request.request_id] = table
            self._tokens_of[request.request_id] = hit
            self._num_offered[request.request_id] = len(table)
        return hit

    def _offer_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer every block that `num_tokens` tokens fill to the prefix cache, for later requests.

        Called when the blocks are allocated, before the step computes them: a request admitted
        later in the same step may share them, since each layer writes all new K/V before reading.
        """
        rid = request.request_id
        num_full = num_tokens // self.block_size
        if num_full > self._num_offered.get(rid, 0):
            self.prefix_cache.insert(request.all_token_ids, self.block_tables[rid][:num_full])
            self._num_offered[rid] = num_full

    def _forget(self, block: int) -> None:
        """The allocator reclaims a cached block: it and the blocks cached below it leave the cache;
        those of them nobody uses go straight to the free list (nothing can find them any more)."""
        for dropped in self.prefix_cache.remove_block(block):
            self.allocator.uncache(dropped)

    # ---- allocation ------------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        have = len(self.block_tables.get(request.request_id, ()))
        return max(0, -(-total // self.block_size) - have)

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Room for a *new* request, keeping `watermark_blocks` free so running ones can still grow
        (admitting up to the last block would force a preemption at the very next step)."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        return needed + self.watermark_blocks <= self.allocator.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.allocator.num_free:
            return False
        rid = request.request_id
        table = self.block_tables.setdefault(rid, [])
        table.extend(self.allocator.allocate() for _ in range(needed))
        total = request.num_computed_tokens + num_new_tokens
        self._tokens_of[rid] = total
        if self.enable_prefix_caching:
            if rid in self._lookups:
                query, hit = self._lookups.pop(rid)
                self.num_query_tokens += query
                self.num_hit_tokens += hit
            self._offer_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._tokens_of.pop(rid, None)
        self._num_offered.pop(rid, None)
        self._lookups.pop(rid, None)
        if table is None:
            return
        # Release the tail first so that, as cached blocks, the deepest ones are evicted first.
        for block in reversed(table):
            self.allocator.release(block, keep_cached=block in self.prefix_cache)

    # ---- swapping (preemption_mode="swap") -------------------------------------------------------
    def swap_out(self, request: Request) -> None:
        """Copy the request's K/V to a host-memory pool and free its blocks; it resumes later
        without recomputing anything (vLLM's swap preemption)."""
        rid = request.request_id
        tokens = request.num_computed_tokens
        if self.k_pool is not None:
            slots = self.key_index([request], [tokens])[0] if tokens else torch.zeros(0, dtype=torch.long)
            host = "cpu"
            self.swapped[rid] = (self.k_pool[:, slots].to(host), self.v_pool[:, slots].to(host))
        else:
            self.swapped[rid] = None
        self.num_swapped_out_tokens += tokens
        self.free(request)

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.swapped

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back: fresh blocks, its K/V copied in, room for new tokens."""
        rid = request.request_id
        tokens = request.num_computed_tokens
        needed = -(-(tokens + num_new_tokens) // self.block_size)
        if needed + self.watermark_blocks > self.allocator.num_free:
            return False
        saved = self.swapped.pop(rid)
        self.block_tables[rid] = [self.allocator.allocate() for _ in range(needed)]
        self._tokens_of[rid] = tokens + num_new_tokens
        if saved is not None and tokens:
            slots = self.key_index([request], [tokens])[0].to(self.k_pool.device)
            self.k_pool[:, slots] = saved[0].to(self.k_pool.device)
            self.v_pool[:, slots] = saved[1].to(self.v_pool.device)
        if self.enable_prefix_caching:
            self._offer_full_blocks(request, tokens + num_new_tokens)
        return True

    def drop_swapped(self, request: Request) -> None:
        self.swapped.pop(request.request_id, None)

    # ---- addressing for the runner ---------------------------------------------------------------
    def slot_mapping(self, requests: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        bs = self.block_size
        slots: list[int] = []
        for req, n in zip(requests, num_new_tokens):
            table = self.block_tables[req.request_id]
            start = req.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        return torch.tensor(slots, dtype=torch.long)

    def key_index(self, requests: list[Request], context_lens: list[int]) -> torch.Tensor:
        bs = self.block_size
        k_max = max(context_lens)
        num_table_blocks = -(-k_max // bs)
        tables = torch.zeros(len(requests), num_table_blocks, dtype=torch.long)
        for i, (req, ctx) in enumerate(zip(requests, context_lens)):
            blocks = self.block_tables[req.request_id][: -(-ctx // bs)]
            tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(k_max)
        return tables[:, pos // bs] * bs + pos % bs

    def usage(self) -> KVUsage:
        """Slots holding real tokens (a shared block counted once), slots in allocated blocks, capacity."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            tokens = self._tokens_of[rid]
            for i, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(bs, tokens - i * bs))
        in_use = self.allocator.num_blocks - len(self.allocator.free_blocks) - len(self.allocator.evictable)
        return KVUsage(used_tokens=sum(filled.values()), reserved_tokens=in_use * bs,
                       total_tokens=self.allocator.num_blocks * bs)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free
