"""A radix tree of cached KV blocks, SGLang's RadixAttention at block granularity (chapter 07).

Prefix caching needs one question answered fast: *which cached blocks hold the longest prefix of
these tokens?* Two structures answer it, and `BlockManager(prefix_cache=...)` takes either:

- **Hash chain** (vLLM, `"hash"`, in `block_manager.py`): one flat dict from
  `hash(parent hash, block tokens)` to a block. Looking up block i costs one hash and one dict
  probe, but needs the hash of block i-1 first, so a lookup walks the prompt block by block; the
  prefix relation exists only implicitly, inside the hashes.
- **Radix tree** (SGLang, `"radix"`, here): the prefix relation *is* the structure. Each node holds
  a run of full blocks and their token ids; its children are keyed by the token ids of their first
  block. A shared prefix of many blocks is a single edge, compared in one go; no hashes are
  involved, so no collision can ever be mistaken for a match. Walking it also tells a scheduler
  how much of a waiting request is cached without touching anything (longest-prefix-match
  scheduling, `scheduling_policy="lpm"`), and a node knows its whole subtree.

Eviction stays with the block allocator's LRU queue (one mechanism for both structures). When it
reclaims a block, `remove_block` cuts the tree at that block: the block and everything below it
leave the tree, because a descendant's K/V are only reachable through its ancestors. SGLang evicts
leaves by their nodes' last-access time; `last_access` is kept here so a chapter can show the
tree ageing, but it does not drive eviction.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class RadixNode:
    __slots__ = ("tokens", "blocks", "children", "parent", "last_access")

    def __init__(self, tokens: tuple[int, ...], blocks: list[int], parent: RadixNode | None,
                 last_access: int = 0) -> None:
        self.tokens = tokens  # len(blocks) * block_size token ids: the edge from `parent` to here
        self.blocks = blocks
        self.children: dict[tuple[int, ...], RadixNode] = {}  # keyed by the first block's token ids
        self.parent = parent
        self.last_access = last_access  # a logical clock: larger is more recent

    def __repr__(self) -> str:
        return f"RadixNode(blocks={self.blocks}, children={len(self.children)}, last_access={self.last_access})"


class RadixTree:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self.node_of_block: dict[int, RadixNode] = {}
        # Each time a block id enters the tree it gets a new generation: a cursor (block, generation)
        # held by a request stays valid through splits, and is recognised as stale once that block
        # was evicted — even if the id was reused for another prefix since.
        self.generation_of: dict[int, int] = {}
        self._generations = itertools.count(1)
        self._clock = itertools.count(1)

    def __contains__(self, block: int) -> bool:
        return block in self.node_of_block

    def __len__(self) -> int:
        """Cached blocks in the tree."""
        return len(self.node_of_block)

    def match_prefix(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """The cached blocks holding the longest block-aligned prefix of `tokens`, in order.

        Only whole blocks match, so a partly filled block is never shared. `touch=False` makes
        this a pure query (the scheduler's LPM ranking must not age the tree).
        """
        bs = self.block_size
        tokens = tuple(tokens)
        now = next(self._clock) if touch else 0
        node, pos, matched = self.root, 0, []
        while True:
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            k = self._common_blocks(child, tokens, pos)
            matched.extend(child.blocks[:k])
            if touch:
                child.last_access = now
            if k < len(child.blocks):
                break
            node, pos = child, pos + len(child.tokens)
        return matched

    def cursor_at(self, block: int) -> tuple[int, int]:
        """The cursor that continues an insert after `block` (a block in the tree)."""
        return block, self.generation_of[block]

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], start: int = 0,
               cursor: tuple[int, int] | None = None) -> tuple[tuple[int, int] | None | bool, list[int]]:
        """Cache `blocks[i]` as holding block `start + i` of `tokens`, after the blocks before it.

        Where the tree already caches a prefix (another request computed the same blocks), its
        blocks are kept and the caller's duplicates stay uncached; the rest hang below as a new
        node — or extend a leaf, so a decoding request grows one edge instead of a chain of nodes.
        Incremental: `cursor` names the tree's block for block `start - 1` (what the previous call
        returned; None at the root), so no walk from the root each time a block fills. Returns
        (the new cursor — False if the given one is stale —, the blocks newly registered).
        """
        bs, n = self.block_size, len(blocks)
        if n == 0:
            return cursor, []
        tokens = tuple(tokens[start * bs : (start + n) * bs])
        if len(tokens) < n * bs:
            raise ValueError(f"{n} blocks of {bs} need {n * bs} token ids, got {len(tokens)}")
        now = next(self._clock)
        if cursor is None:
            if start != 0:
                return False, []
            node, k = self.root, 0
        else:
            block, generation = cursor
            node = self.node_of_block.get(block)
            if node is None or self.generation_of.get(block) != generation:
                return False, []  # the prefix left the tree meanwhile (evicted): nothing to hang below
            k = node.blocks.index(block) + 1
        registered: list[int] = []
        i = 0
        while i < n:
            key = tokens[i * bs : (i + 1) * bs]
            if k < len(node.blocks):  # inside an edge: continue along it, or split it here
                if node.tokens[k * bs : (k + 1) * bs] == key:
                    node.last_access = now
                    k, i = k + 1, i + 1
                    continue
                node = self._split(node, k)  # the upper part: exactly the k blocks matched so far
            child = node.children.get(key)
            if child is not None:
                node, k = child, 0
                continue
            rest = list(blocks[i:])
            for block in rest:
                if block in self.node_of_block:
                    raise RuntimeError(f"block {block} is already cached under another prefix")
            if node is not self.root and not node.children and k == len(node.blocks):
                node.tokens += tokens[i * bs :]  # extend the leaf's edge
                node.blocks.extend(rest)
                node.last_access = now
                target = node
            else:
                target = RadixNode(tokens[i * bs :], rest, node, now)
                node.children[key] = target
            for block in rest:
                self.node_of_block[block] = target
                self.generation_of[block] = next(self._generations)
            registered.extend(rest)
            return self.cursor_at(rest[-1]), registered
        return self.cursor_at(node.blocks[k - 1]), registered

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark the nodes holding `blocks` as just used (a request attached them)."""
        now = next(self._clock)
        for block in blocks:
            node = self.node_of_block.get(block)
            if node is not None:
                node.last_access = now

    def remove_block(self, block: int) -> list[int]:
        """Drop `block` and everything cached below it; returns the *other* blocks dropped.

        Called when the allocator reclaims a cached block: its descendants' prefixes pass through
        it, so leaving them would keep entries that nothing can reach (or, were the block id reused
        and cached again, entries under the wrong prefix).
        """
        node = self.node_of_block.get(block)
        if node is None:
            return []
        j = node.blocks.index(block)
        dropped = node.blocks[j:]
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            dropped.extend(below.blocks)
            stack.extend(below.children.values())
        for b in dropped:
            del self.node_of_block[b]
            del self.generation_of[b]
        if j == 0:
            del node.parent.children[node.tokens[: self.block_size]]
        else:
            node.tokens = node.tokens[: j * self.block_size]
            node.blocks = node.blocks[:j]
            node.children = {}
        return [b for b in dropped if b != block]

    # ---- helpers ---------------------------------------------------------------------------------
    def _common_blocks(self, node: RadixNode, tokens: tuple[int, ...], pos: int) -> int:
        """How many of `node`'s blocks `tokens[pos:]` matches (whole blocks only)."""
        edge = node.tokens
        if tokens[pos : pos + len(edge)] == edge:
            return len(node.blocks)
        bs, k = self.block_size, 0
        while k < len(node.blocks) and tokens[pos + k * bs : pos + (k + 1) * bs] == edge[k * bs : (k + 1) * bs]:
            k += 1
        return k

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first k blocks; returns the new upper part (the lower keeps `node`)."""
        bs = self.block_size
        upper = RadixNode(node.tokens[: k * bs], node.blocks[:k], node.parent, node.last_access)
        node.parent.children[node.tokens[:bs]] = upper
        node.tokens, node.blocks, node.parent = node.tokens[k * bs :], node.blocks[k:], upper
        upper.children[node.tokens[:bs]] = node
        for block in upper.blocks:
            self.node_of_block[block] = upper
        return upper
