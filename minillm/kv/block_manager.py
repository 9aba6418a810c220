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

With `kv_offloading_size` GiB (chapter 14, hash chain only), a block the LRU reclaims is first
copied to a host tier (`minillm.kv.offload`), and a later hit on it is copied back in instead of
recomputed.

Either way only full blocks are cached and shared, so nobody ever appends into a block someone
else reads (no copy-on-write needed), and at least one prompt token is always computed (its
logits give the first output token). Unused cached blocks wait in the allocator's LRU queue; when
it reclaims one, the structure forgets it and every block cached below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.config import PREFIX_CACHES
from minillm.kv.base import CachedPrefix, KVCacheSpec, KVLayoutSnapshot, KVUsage, PrefixCacheStats
from minillm.kv.block_allocator import BlockAllocator
from minillm.kv.offload import HostPrefixTier, next_key, prefix_keys
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

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], start: int = 0,
               cursor: tuple[int, int] | None = None) -> tuple[tuple[int, int] | None | bool, list[int]]:
        """Cache `blocks[i]` as holding block `start + i` of `tokens`; where that prefix is cached
        already, the cached block is kept (the caller's copy stays uncached) and the chain
        continues from it.

        Incremental: `cursor` is what the previous call returned for blocks before `start` (the
        (hash, block) of block `start - 1`; None at the start), so a request that fills one more
        block hashes one block, not its whole prefix again. Returns (the new cursor — False once a
        hash collision makes the rest unverifiable —, the blocks newly registered).
        """
        bs = self.block_size
        parent_hash, parent = cursor if cursor else (None, None)
        if parent is not None and self.hash_of_block.get(parent) != parent_hash:
            return False, []  # the parent left the cache meanwhile: children could not be found anyway
        registered: list[int] = []
        for i, own in enumerate(blocks, start):
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
                registered.append(own)
            elif self.tokens_of_block[block] != chunk or self.parent_of_block[block] != parent:
                return False, registered  # a hash collision: the key is taken, nothing below can be verified
            parent_hash, parent = h, block
        return (parent_hash, parent), registered

    def touch(self, blocks: Sequence[int]) -> None:
        """Access times live in the allocator's LRU queue for the hash chain."""

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


@dataclass
class SwappedKV:
    """A preempted request's K/V in host memory (`preemption_mode="swap"`)."""

    num_tokens: int
    num_blocks: int  # host blocks charged to the swap space (the worker holds the copy)
    copied: bool = False  # the step that copies it out completed


class BlockManager:
    """Block tables, reference counts, the prefix cache and the swap space, for one KV pool.

    The pool has `num_blocks` blocks plus one *null block* (id `num_blocks`) that is never handed
    out and stays zero: padding entries of a block table (-1) read it, so a padded key slot never
    brings uninitialised memory into attention (NaN x 0 is NaN). A freshly handed-out block is
    zeroed by the runner before the step that first writes it, for the same reason.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", enable_prefix_caching: bool = False,
                 allocate_pool: bool = True, watermark: float = 0.01, prefix_cache: str = "hash",
                 max_model_len: int | None = None, swap_space_gib: float = 4.0, kv_cache_dtype: str = "auto",
                 kv_offloading_size: float = 0.0) -> None:
        """`kv_cache_dtype`: how the worker's pool stores K/V (minillm.kv.quant): the bytes per block, and so
        how many blocks the swap space and the offload tier hold, follow it. `kv_offloading_size`: GiB of
        host memory for the prefix cache's offload tier (vLLM's `--kv-offloading-size`; 0: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache={prefix_cache!r}; choose one of {PREFIX_CACHES}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.allocator.on_evict = self._forget
        self.watermark_blocks = int(watermark * num_blocks)
        self.null_block = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_kind = prefix_cache
        self.prefix_cache: HashChain | RadixTree = (HashChain if prefix_cache == "hash" else RadixTree)(block_size)
        max_blocks = -(-max_model_len // block_size) if max_model_len else num_blocks
        self.max_blocks_per_seq = max(1, min(max_blocks, num_blocks))
        # The pool itself is the worker's (minillm.worker): this manager only says which blocks are whose.
        self.cache_spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, (num_blocks + 1) * block_size, block_size,
                                      self.null_block, self.max_blocks_per_seq, dtype, device, allocate_pool,
                                      kv_cache_dtype)
        self.block_tables: dict[str, list[int]] = {}  # the same tables as Python lists
        self._tokens_of: dict[str, int] = {}  # tokens whose K/V are (or are about to be) in the table
        self._offered: dict[str, tuple[int, object]] = {}  # full blocks offered to the cache, and the cursor
        self._pending_prefix: dict[str, CachedPrefix] = {}  # looked up, attached when allocate succeeds
        self._used_tokens = 0  # slots holding a real token, a shared block once: kept as blocks change
        # What this step did, kept until commit_step() (or undone by rollback_step()).
        self._step_registered: list[int] = []
        self._registered_by: dict[str, list[int]] = {}  # this step's registrations, per request
        self._step_offers: list[tuple[str, tuple[int, object] | None]] = []
        self._step_lookups: list[tuple[int, int]] = []
        self._step_swapped_in: list[str] = []
        self.fresh_blocks: list[int] = []  # handed out since the last plan: the worker zeroes them
        # Swap space: host memory for preempted requests' K/V (vLLM's swap_space, GiB).
        bytes_per_block = self.cache_spec.block_bytes  # K and V, every layer, scales included
        self.swap_capacity_blocks = int(swap_space_gib * 2**30 // bytes_per_block)
        self.bytes_per_block = bytes_per_block
        self.swap_used_blocks = 0
        self.swapped: dict[str, SwappedKV] = {}
        self._swapped_tokens = 0
        self.num_swapped_out_tokens = 0
        self.num_swapped_in_tokens = 0
        # vLLM's prefix-cache counters: tokens of admitted requests looked up, and of those, found.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0  # (host hits included: tokens not recomputed)
        self._stats = (0, 0)  # the totals at the last make_prefix_cache_stats()
        # The offload tier (chapter 14): evicted cached blocks spill to host blocks, hits come back in.
        self.offload: HostPrefixTier | None = None
        if kv_offloading_size:
            if prefix_cache != "hash" or not enable_prefix_caching:
                raise ValueError("kv_offloading_size needs enable_prefix_caching=True with prefix_cache='hash' "
                                 f"(the radix tree has no offload tier), got prefix_cache={prefix_cache!r}, "
                                 f"enable_prefix_caching={enable_prefix_caching}")
            self.offload = HostPrefixTier(max(1, int(kv_offloading_size * 2**30 // bytes_per_block)))
        self._offload_out: list[tuple[int, int, bytes]] = []  # (device block, host block, key), not yet planned
        self._offload_in: list[tuple[int, int]] = []  # (host block, device block), not yet planned
        self._step_spilled: list[bytes] = []  # host keys stored this step (dropped if it fails)
        self._step_copies = (0, 0)  # this step's copies out and in, counted when it completes
        self.num_host_hit_tokens = 0  # of num_hit_tokens, those copied back from the host tier
        self.num_offloaded_blocks = 0  # copies device → host tier
        self.num_onloaded_blocks = 0  # copies host tier → device

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

    def _match(self, request: Request, touch: bool = False) -> list[int]:
        """Cached blocks for the longest prefix of the request's tokens, leaving >= 1 token to compute."""
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size  # the last token must run: its logits are needed
        return self.prefix_cache.match_prefix(tokens[: max_blocks * self.block_size], touch=touch)

    def _match_host(self, request: Request, start: int) -> tuple[bytes, ...]:
        """Keys of the host blocks continuing a device match of `start` blocks (the offload tier)."""
        if self.offload is None or not len(self.offload):
            return ()
        tokens, bs = request.all_token_ids, self.block_size
        max_blocks = (len(tokens) - 1) // bs
        if start >= max_blocks:
            return ()
        keys = prefix_keys(tokens, max_blocks, bs)
        found = []
        for i in range(start, max_blocks):
            if self.offload.find(keys[i], tuple(tokens[i * bs : (i + 1) * bs])) is None:
                break
            found.append(keys[i])
        return tuple(found)

    def cached_prefix_tokens(self, request: Request) -> int:
        """How many of a waiting request's tokens are cached. Changes nothing (no reference counts,
        no metrics, no access times): a scheduler may ask freely (LPM does, every step)."""
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return 0
        blocks = len(self._match(request))
        return (blocks + len(self._match_host(request, blocks))) * self.block_size

    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """Look up a new request's cached prefix without taking anything: pass the result to
        `allocate(..., cached=...)`, which attaches it only if the whole allocation succeeds."""
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return CachedPrefix((), 0, request.num_tokens)
        blocks = tuple(self._match(request))
        host = self._match_host(request, len(blocks))
        return CachedPrefix(blocks, (len(blocks) + len(host)) * self.block_size, request.num_tokens, host)

    def get_computed_tokens(self, request: Request) -> int:
        """The cached prefix of a new request, in tokens; the next `allocate` for it attaches those
        blocks (and `free` forgets the lookup if it never comes). At least one token is always left
        to compute: the step needs its logits. Lookups are counted (num_query_tokens, num_hit_tokens)
        when the step that admitted the request completes, so a request turned away is not counted."""
        cached = self.get_computed_blocks(request)
        if self.enable_prefix_caching:
            self._pending_prefix[request.request_id] = cached  # a miss is a lookup too (counted)
        return cached.num_tokens

    def _offer_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer every block that `num_tokens` known tokens fill to the prefix cache, for later requests.

        Called when the blocks are allocated, before the step computes them: a request admitted
        later in the same step may share them, since each layer writes all new K/V before reading.
        If the step fails, `rollback_step` takes them back out. Incremental: only blocks filled
        since the last offer are hashed or inserted.
        """
        rid = request.request_id
        num_full = num_tokens // self.block_size
        done, cursor = self._offered.get(rid, (0, None))
        if num_full <= done or cursor is False:
            return
        table = self.block_tables[rid]
        new_cursor, registered = self.prefix_cache.insert(request.all_token_ids, table[done:num_full], done, cursor)
        self._step_offers.append((rid, self._offered.get(rid)))
        self._offered[rid] = (num_full, new_cursor)
        self._step_registered.extend(registered)
        self._registered_by.setdefault(rid, []).extend(registered)

    def _unregister(self, blocks: Sequence[int]) -> None:
        """Take blocks whose K/V will not be computed back out of the prefix cache (with what hangs below)."""
        for block in reversed(blocks):
            for dropped in [block, *self.prefix_cache.remove_block(block)]:
                self.allocator.uncache(dropped)

    def _forget(self, block: int) -> None:
        """The allocator reclaims a cached block: it and the blocks cached below it leave the cache;
        those of them nobody uses go straight to the free list (nothing can find them any more).
        With an offload tier they are copied to host blocks first."""
        if self.offload is not None:
            self._spill(block)
        for dropped in self.prefix_cache.remove_block(block):
            self.allocator.uncache(dropped)

    def _spill(self, block: int) -> None:
        """Plan copying `block` and the cached blocks below it to the host tier (parents first).
        Blocks registered this step are left out: their K/V are not computed yet."""
        chain = self.prefix_cache
        path, b = [], block
        while b is not None:  # the host key names the whole prefix: walk up to the first block
            path.append(b)
            b = chain.parent_of_block[b]
        key = b""
        for b in reversed(path):
            key = next_key(key, chain.tokens_of_block[b])
        uncomputed = set(self._step_registered)
        stack = [(block, key)]
        while stack:
            b, key = stack.pop()
            if b not in uncomputed:
                slot = self.offload.store(key, chain.tokens_of_block[b])
                if slot is not None:
                    self._offload_out.append((b, slot, key))
                    self._step_spilled.append(key)
            stack.extend((c, next_key(key, chain.tokens_of_block[c])) for c in chain.children_of_block.get(b, ()))

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offload tier's copies planned since the last call, for the plan's swap fields: (device
        block, host block) out — before this step's blocks are zeroed or rewritten —, then (host
        block, device block) in, before the forward (`minillm.kv.offload.host_block_id` names them)."""
        if not self._offload_out and not self._offload_in:  # (most steps, and every step without the tier)
            return [], []
        out = [(b, slot) for b, slot, _ in self._offload_out]
        copies_in = self._offload_in
        self._step_copies = (self._step_copies[0] + len(out), self._step_copies[1] + len(copies_in))
        self._offload_out, self._offload_in = [], []
        return out, copies_in

    def discard_offload_copies(self) -> None:
        """No plan will carry the pending copies out: what they would have stored is forgotten."""
        for _, _, key in self._offload_out:
            self.offload.drop(key)
            self._step_spilled.remove(key)
        self._offload_out = []

    # ---- allocation ------------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        have = len(self.block_tables.get(request.request_id, ()))
        return max(0, -(-total // self.block_size) - have)

    def _blocks_to_take(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None) -> int:
        """Free blocks an allocation would consume: new blocks, plus cached ones it revives from the LRU."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if cached is not None and cached.blocks and request.request_id not in self.block_tables:
            needed -= len(cached.blocks)  # those are attached, not allocated ...
            needed += sum(1 for b in cached.blocks if self.allocator.ref_counts[b] == 0)  # ... but revived
        return needed

    def can_admit(self, request: Request, num_new_tokens: int, keep_headroom: bool = True,
                  cached: CachedPrefix | None = None) -> bool:
        """Room for a *new* request, keeping `watermark_blocks` free so running ones can still grow
        (admitting up to the last block would force a preemption at the very next step). With nothing
        running (`keep_headroom=False`) the headroom protects nobody, so it is not kept. Cached blocks
        it would revive from the LRU count against the room like new ones."""
        if cached is None:
            cached = self._pending_prefix.get(request.request_id)
        needed = self._blocks_to_take(request, num_new_tokens, cached)
        return needed + (self.watermark_blocks if keep_headroom else 0) <= self.allocator.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None,
                 num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more K/V (plus `num_lookahead_tokens` unverified
        speculative ones, whose blocks are never offered to the prefix cache); attach a looked-up
        cached prefix first. False, and nothing changed, if the pool cannot hold it all."""
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is not None:  # a running request grows (every decode row, every step): the short path
            total = request.num_computed_tokens + num_new_tokens
            end = total + num_lookahead_tokens
            need = -(-end // self.block_size) - len(table)
            if need > 0:
                if need > self.allocator.num_free:
                    return False
                new = [self.allocator.allocate() for _ in range(need)]
                self.fresh_blocks.extend(new)
                table.extend(new)
            if self._pending_prefix:
                self._pending_prefix.pop(rid, None)
            self._used_tokens += end - self._tokens_of[rid]
            self._tokens_of[rid] = end
            if self.enable_prefix_caching:
                self._offer_full_blocks(request, total)
            return True
        if cached is None:
            cached = self._pending_prefix.get(rid)
        fresh = rid not in self.block_tables
        if fresh and cached is not None and request.num_computed_tokens < cached.num_tokens:
            raise ValueError(f"request {rid}: set num_computed_tokens to the cached prefix "
                             f"({cached.num_tokens} tokens) before allocating the tokens after it")
        total = request.num_computed_tokens + num_new_tokens
        if self._blocks_to_take(request, num_new_tokens + num_lookahead_tokens, cached) > self.allocator.num_free:
            return False
        self._pending_prefix.pop(rid, None)
        table = self.block_tables.get(rid)
        if table is None:
            table = self.block_tables[rid] = []
            self._tokens_of[rid] = 0
            host_slots = []
            if cached is not None:
                host_tokens = len(cached.host_keys) * self.block_size
                self._step_lookups.append((cached.num_query_tokens, cached.num_tokens, host_tokens))
                if cached.blocks:
                    self._attach(rid, table, cached)
                if cached.host_keys:  # pinned before allocating: spills must not take their host blocks
                    if any(k not in self.offload.slot_of for k in cached.host_keys):
                        raise RuntimeError(f"request {rid}: its cached prefix left the host tier since the lookup; "
                                           "allocate right after get_computed_blocks")
                    host_slots = [self.offload.pin(k) for k in cached.host_keys]
        need = max(0, -(-(total + num_lookahead_tokens) // self.block_size) - len(table))
        if need:
            new = [self.allocator.allocate() for _ in range(need)]
            self.fresh_blocks.extend(new)
            table.extend(new)
            self._offload_in.extend(zip(host_slots, new))  # the host blocks come back into the first ones
        self._used_tokens += total + num_lookahead_tokens - self._tokens_of[rid]
        self._tokens_of[rid] = total + num_lookahead_tokens
        if self.enable_prefix_caching:
            self._offer_full_blocks(request, total)
        return True

    def _attach(self, rid: str, table: list[int], cached: CachedPrefix) -> None:
        for block in cached.blocks:
            if self.allocator.ref_counts[block] == 0:
                self._used_tokens += self.block_size  # revived from the cache: in use again
            self.allocator.share(block)
        table.extend(cached.blocks)
        self._tokens_of[rid] = len(cached.blocks) * self.block_size  # (host blocks come as new ones)
        self._offered[rid] = (len(cached.blocks), self._cursor_after(cached.blocks))
        self.prefix_cache.touch(cached.blocks)

    def _cursor_after(self, blocks: Sequence[int]) -> object:
        """The prefix cache's cursor after a matched run of cached blocks."""
        if isinstance(self.prefix_cache, RadixTree):
            return self.prefix_cache.cursor_at(blocks[-1])
        return self.prefix_cache.hash_of_block[blocks[-1]], blocks[-1]

    def _release_tail(self, rid: str, keep_blocks: int) -> None:
        """Release the request's blocks after the first `keep_blocks`, tail first (so that, as cached
        blocks, the deepest are evicted first); keeps the used-slot count in step."""
        table, bs = self.block_tables[rid], self.block_size
        tokens = self._tokens_of[rid]
        for i in range(len(table) - 1, keep_blocks - 1, -1):
            block = table[i]
            self.allocator.release(block, keep_cached=block in self.prefix_cache)
            if self.allocator.ref_counts[block] == 0:
                self._used_tokens -= max(0, min(bs, tokens - i * bs))
        del table[keep_blocks:]

    def free(self, request: Request) -> None:
        """Give back every block the request holds (its host copy, if swapped, stays: `drop_swapped`).

        Freed during planning (a preemption), the request will not run this step: blocks it
        registered in the prefix cache this step would never hold computed K/V, so they leave the
        cache first."""
        rid = request.request_id
        self._pending_prefix.pop(rid, None)
        registered = self._registered_by.pop(rid, None)
        if registered:
            self._unregister(registered)
        self._offered.pop(rid, None)
        if rid not in self.block_tables:
            return
        self._release_tail(rid, 0)
        del self.block_tables[rid]
        self._tokens_of.pop(rid, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Roll the request's KV back to its first `num_tokens` tokens: tail blocks are freed
        (speculative decoding's rejected tokens; a failed step's reservation)."""
        rid = request.request_id
        old = self._tokens_of.get(rid)
        if old is None or num_tokens >= old:
            return
        bs = self.block_size
        keep = -(-num_tokens // bs)
        offered = self._offered.get(rid)
        if offered is not None and offered[0] > num_tokens // bs:
            raise RuntimeError(f"trim({rid}, {num_tokens}) would cut blocks already in the prefix cache")
        self._release_tail(rid, keep)
        if keep:  # the last kept block now holds fewer tokens
            self._used_tokens -= min(bs, old - (keep - 1) * bs) - (num_tokens - (keep - 1) * bs)
        self._tokens_of[rid] = num_tokens

    # ---- one step: keep it, or take it back ------------------------------------------------------
    def commit_step(self) -> None:
        """The step completed: its cache entries hold computed K/V now; count its lookups."""
        if not (self._step_lookups or self._step_copies[0] or self._step_copies[1] or self._step_spilled
                or self.offload is not None or self.swapped or self._step_swapped_in or self._step_registered
                or self._registered_by or self._step_offers):
            return  # (a step that looked nothing up, registered, offered or moved nothing: most decode steps)
        for query, hit, host_hit in self._step_lookups:
            self.num_query_tokens += query
            self.num_hit_tokens += hit
            self.num_host_hit_tokens += host_hit
        self.num_offloaded_blocks += self._step_copies[0]
        self.num_onloaded_blocks += self._step_copies[1]
        self._step_copies = (0, 0)
        self._step_spilled.clear()
        if self.offload is not None:
            self.offload.unpin_all()
        for saved in self.swapped.values():
            saved.copied = True  # this step's swap-outs were copied by the worker before its forward
        for rid in self._step_swapped_in:
            self._release_swapped(rid)
        self._step_lookups.clear()
        self._step_registered.clear()
        self._registered_by.clear()
        self._step_offers.clear()
        self._step_swapped_in.clear()

    def rollback_step(self) -> list[str]:
        """The step failed before its K/V were computed: take every block it registered back out
        of the prefix cache (the scheduler then frees or trims what it allocated). Returns the
        requests whose swap-out copy never happened (they must recompute instead)."""
        self._unregister(self._step_registered)
        self._registered_by.clear()
        for rid, before in reversed(self._step_offers):
            if rid in self._offered:
                if before is None:
                    del self._offered[rid]
                else:
                    self._offered[rid] = before
        if self.offload is not None:  # copies out that never ran: those host blocks hold nothing
            for key in self._step_spilled:
                self.offload.drop(key)
            self.offload.unpin_all()
        self._step_spilled.clear()
        self._offload_out, self._offload_in, self._step_copies = [], [], (0, 0)
        lost = [rid for rid, saved in self.swapped.items() if not saved.copied]
        for rid in lost:
            self._release_swapped(rid)
        self._step_registered.clear()
        self._step_offers.clear()
        self._step_lookups.clear()
        self._step_swapped_in.clear()
        return lost

    # ---- swapping (preemption_mode="swap") -------------------------------------------------------
    def swap_out(self, request: Request) -> list[int] | None:
        """Plan moving the request's K/V to host memory and free its blocks; it resumes later without
        recomputing anything (vLLM's swap preemption). Returns the device blocks the executor must
        copy out before this step's forward (`copy_out`), or None if the swap space is full."""
        rid = request.request_id
        tokens = request.num_computed_tokens
        blocks = list(self.block_tables.get(rid, ()))[: -(-tokens // self.block_size)]
        if self.swap_used_blocks + len(blocks) > self.swap_capacity_blocks:
            return None
        self.swap_used_blocks += len(blocks)
        self.swapped[rid] = SwappedKV(tokens, len(blocks), copied=not blocks)  # copied once the step completes
        self._swapped_tokens += tokens
        self.num_swapped_out_tokens += tokens
        self.free(request)
        return blocks

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.swapped

    def swap_in(self, request: Request, num_new_tokens: int, keep_headroom: bool = True) -> list[int] | None:
        """Bring a swapped-out request back: its cached prefix re-attached if still cached, fresh
        blocks for the rest, room for new tokens. Returns the blocks the executor copies in (`copy_in`),
        or None (nothing changed) if the pool has no room."""
        rid = request.request_id
        saved = self.swapped[rid]
        cached = self.get_computed_blocks(request) if self.enable_prefix_caching else None
        if cached is not None:
            k = min(len(cached.blocks), saved.num_tokens // self.block_size)
            cached = CachedPrefix(cached.blocks[:k], k * self.block_size, 0)
        needed = self._blocks_to_take(request, num_new_tokens, cached)
        if needed + (self.watermark_blocks if keep_headroom else 0) > self.allocator.num_free:
            return None
        if not self.allocate(request, num_new_tokens, cached=cached):
            return None
        if cached is not None:
            self._step_lookups.pop()  # a swap-in is not a new request's lookup
        self._step_swapped_in.append(rid)
        skip = len(cached.blocks) if cached is not None else 0
        self.num_swapped_in_tokens += saved.num_tokens - skip * self.block_size
        return self.block_tables[rid][skip : saved.num_blocks]

    def _release_swapped(self, request_id: str) -> None:
        saved = self.swapped.pop(request_id, None)
        if saved is not None:
            self.swap_used_blocks -= saved.num_blocks
            self._swapped_tokens -= saved.num_tokens

    def drop_swapped(self, request: Request) -> None:
        self._release_swapped(request.request_id)

    # ---- what the plan reads ---------------------------------------------------------------------
    def block_ids_of(self, request_id: str) -> list[int]:
        """The request's block table (the plan sends the worker its changes)."""
        return self.block_tables.get(request_id, [])

    def take_fresh_blocks(self) -> list[int]:
        """Blocks handed out since the last plan, which the worker zeroes before they are written."""
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    # ---- addressing, position by position (chapter 05; the worker does it for whole batches) -----------------------------------------------------------
    def slot_mapping(self, requests: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        bs = self.block_size
        slots: list[int] = []
        for req, n in zip(requests, num_new_tokens):
            table = self.block_tables[req.request_id]
            start = req.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        return torch.tensor(slots, dtype=torch.long)

    def key_index(self, requests: list[Request], context_lens: list[int]) -> torch.Tensor:
        """[B, max(context_lens)] slots of each request's keys in order; padding reads the null block."""
        bs = self.block_size
        k_max = max(context_lens)
        num_table_blocks = -(-k_max // bs)
        tables = torch.full((len(requests), num_table_blocks), self.null_block, dtype=torch.long)
        for i, (req, ctx) in enumerate(zip(requests, context_lens)):
            blocks = self.block_tables[req.request_id][: -(-ctx // bs)]
            tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(k_max)
        return tables[:, pos // bs] * bs + pos % bs

    def usage(self) -> KVUsage:
        """Slots holding real tokens (a shared block counted once), slots in allocated blocks, capacity,
        and tokens swapped out to host memory. O(1): every count is kept as blocks change."""
        in_use = self.allocator.num_in_use
        bs = self.block_size
        return KVUsage(used_tokens=self._used_tokens, reserved_tokens=in_use * bs,
                       total_tokens=self.allocator.num_blocks * bs,
                       swapped_tokens=self._swapped_tokens)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups counted since the last call (vLLM's `make_prefix_cache_stats`)."""
        queries, hits = self._stats
        self._stats = (self.num_query_tokens, self.num_hit_tokens)
        return PrefixCacheStats(self.num_query_tokens - queries, self.num_hit_tokens - hits)

    def layout_snapshot(self) -> KVLayoutSnapshot:
        allocator = self.allocator
        return KVLayoutSnapshot("blocks", allocator.num_blocks, self.block_size,
                                {rid: tuple(t) for rid, t in self.block_tables.items()}, dict(self._tokens_of),
                                self.usage(), tuple(allocator.ref_counts), tuple(allocator.evictable),
                                self.cache_spec.bytes_per_token, self.cache_spec.kv_cache_dtype)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free
