"""Paged KV: per-request block tables over a shared pool, and prefix caching (chapters 05–07).

A request's K/V live in blocks scattered anywhere in the pool; its *block table* lists them in
order, so token position p sits at slot `table[p // block_size] · block_size + p % block_size`.
Blocks are added only when the last one is full, so a request wastes at most one partly filled
block — the fix for the slab's reservation of `max_model_len` slots per request.

Prefix caching (vLLM's automatic prefix caching): a *full* block is identified by a hash of its
parent block's hash and its own token ids, so equal hashes mean equal prefixes. A new request
first walks its prompt block by block through that hash chain and reuses every block already
computed; only the rest is prefilled. The token ids are compared on every hit, so a hash
collision can never hand out wrong K/V. Only full blocks are shared, so nobody ever appends into
a block someone else reads (no copy-on-write needed).
"""

from __future__ import annotations

import torch

from minillm.kv.base import KVUsage
from minillm.kv.block_allocator import BlockAllocator
from minillm.request import Request


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", enable_prefix_caching: bool = False,
                 allocate_pool: bool = True, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.allocator.on_evict = self._forget
        self.watermark_blocks = int(watermark * num_blocks)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device) if allocate_pool else None
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._tokens_of: dict[str, int] = {}  # tokens whose K/V are (or are about to be) in the table
        # Prefix cache: hash → block, and per block its hash and token ids (checked on every hit).
        self.cached_block_of: dict[int, int] = {}
        self.hash_of_block: dict[int, int] = {}
        self.tokens_of_block: dict[int, tuple[int, ...]] = {}
        self._hashes: dict[str, list[int]] = {}  # the hash chain of each request's full blocks
        self.swapped: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}  # host copies of preempted K/V
        self.num_swapped_out_tokens = 0
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # … of which were found

    # ---- prefix cache ------------------------------------------------------------------------
    def get_computed_tokens(self, request: Request) -> int:
        """Reuse the longest cached prefix of a new request's tokens; returns how many tokens hit.

        At least one token is always left to compute: the step needs its logits.
        """
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return 0
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        table: list[int] = []
        hashes: list[int] = []
        parent = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self.cached_block_of.get(h)
            if block is None or self.tokens_of_block[block] != chunk:
                break
            self.allocator.share(block)
            table.append(block)
            hashes.append(h)
            parent = h
        self.num_query_tokens += request.num_prompt_tokens
        hit = len(table) * bs
        self.num_hit_tokens += min(hit, request.num_prompt_tokens)
        if table:
            self.block_tables[request.request_id] = table
            self._hashes[request.request_id] = hashes
            self._tokens_of[request.request_id] = hit
        return hit

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash every block that `num_tokens` tokens fill, so later requests can reuse it."""
        rid, bs = request.request_id, self.block_size
        hashes = self._hashes.setdefault(rid, [])
        table = self.block_tables[rid]
        tokens = request.all_token_ids
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(hashes[-1] if hashes else None, chunk)
            hashes.append(h)
            block = table[i]
            if h not in self.cached_block_of and block not in self.hash_of_block:
                self.cached_block_of[h] = block
                self.hash_of_block[block] = h
                self.tokens_of_block[block] = chunk

    def _forget(self, block: int) -> None:
        """A cached block is being reused for something else: drop its hash entry."""
        h = self.hash_of_block.pop(block, None)
        if h is not None:
            del self.cached_block_of[h]
            del self.tokens_of_block[block]

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
        table = self.block_tables.setdefault(request.request_id, [])
        table.extend(self.allocator.allocate() for _ in range(needed))
        total = request.num_computed_tokens + num_new_tokens
        self._tokens_of[request.request_id] = total
        if self.enable_prefix_caching:
            self._register_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._tokens_of.pop(rid, None)
        self._hashes.pop(rid, None)
        if table is None:
            return
        # Release the tail first so that, as cached blocks, the deepest ones are evicted first.
        for block in reversed(table):
            self.allocator.release(block, keep_cached=block in self.hash_of_block)

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
            self._register_full_blocks(request, tokens + num_new_tokens)
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
