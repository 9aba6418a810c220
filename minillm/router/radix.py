"""The router's approximate radix tree: which worker has seen which prefix of request text (chapter 13).

The router cannot see a worker's KV cache, so it keeps a guess: every request's text is inserted
under the worker it was sent to, and a worker that saw a prefix recently probably still holds its
KV blocks. One tree holds every worker ("tenant", SGLang's word); each node is an edge of
characters plus, per tenant, when that tenant last used it. A tenant's part of the tree is the
union of the paths of the texts sent to it, so its size (`tenant_chars`) is the number of distinct
prefixes it was sent: SGLang's router compares these sizes to find the worker with most room.

It works on characters, not tokens, as SGLang's HTTP router does: no tokenizer in the router, and
a shared prefix of text is a shared prefix of tokens up to the last token or so.

`evict(max_chars)` is LRU per tenant: while a tenant owns more than `max_chars` characters, the
tenant's least recently used leaf (a node it owns with no child it owns) loses that tenant; a
node no tenant owns is removed. A parent is used whenever a child is, so leaves go first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection


class _Node:
    __slots__ = ("text", "children", "tenants", "parent")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text  # the edge label from the parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[str, float] = {}  # tenant -> last access time
        self.parent = parent


class RadixTree:
    """Multi-tenant prefix tree over characters, with per-tenant LRU eviction."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.tenant_chars: dict[str, int] = {}
        self._clock = itertools.count()  # a logical clock: LRU order without wall time

    def size(self, tenant: str) -> int:
        """Characters of the tree owned by `tenant` (0 for one never seen)."""
        return self.tenant_chars.get(tenant, 0)

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, text: str, tenant: str) -> None:
        """Record that `tenant` saw `text`: every node on its path is (re)stamped for the tenant."""
        now = next(self._clock)
        self.tenant_chars.setdefault(tenant, 0)
        node, i = self.root, 0
        node.tenants[tenant] = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            else:
                common = _common_len(child.text, text, i)
                if common < len(child.text):
                    child = self._split(child, common)
            if tenant not in child.tenants:
                self.tenant_chars[tenant] += len(child.text)
            child.tenants[tenant] = now
            node, i = child, i + len(child.text)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; returns the new upper node (same owners)."""
        parent = child.parent
        upper = _Node(child.text[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    # ---- match ---------------------------------------------------------------------------------
    def prefix_match(self, text: str, tenants: Collection[str] | None = None) -> tuple[int, list[str]]:
        """The longest prefix of `text` some tenant has seen (among `tenants`, default all), in
        characters, and every tenant that has seen all of it (sorted; [] when nothing matches)."""
        node, i = self.root, 0
        best: list[str] = []
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            owners = [t for t in child.tenants if tenants is None or t in tenants]
            if not owners:
                break
            common = _common_len(child.text, text, i)
            i += common
            best = owners
            if common < len(child.text):
                break
            node = child
        return (i, sorted(best)) if best else (0, [])

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, max_chars: int) -> int:
        """Drop each tenant's least recently used leaves until it owns at most `max_chars`
        characters; returns how many characters were dropped in all."""
        dropped = 0
        for tenant, chars in list(self.tenant_chars.items()):
            if chars > max_chars:
                dropped += self._evict_tenant(tenant, max_chars)
        return dropped

    def _evict_tenant(self, tenant: str, max_chars: int) -> int:
        order = itertools.count()  # tie-breaker: nodes do not compare
        heap = [(n.tenants[tenant], next(order), n) for n in self._nodes_of(tenant) if self._is_leaf_of(n, tenant)]
        heapq.heapify(heap)
        dropped = 0
        while self.tenant_chars[tenant] > max_chars and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.tenant_chars[tenant] -= len(node.text)
            dropped += len(node.text)
            parent = node.parent
            if not node.tenants:
                del parent.children[node.text[0]]
            if parent is not self.root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), parent))
        return dropped

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything `tenant` saw (a worker that went away lost its cache)."""
        if tenant in self.tenant_chars:
            self._evict_tenant(tenant, 0)
            del self.tenant_chars[tenant]
        self.root.tenants.pop(tenant, None)

    def _nodes_of(self, tenant: str) -> list[_Node]:
        out, stack = [], [c for c in self.root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
        return out

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def recount(self, tenant: str) -> int:
        """Characters owned by `tenant`, counted by walking the tree (a check on `tenant_chars`)."""
        return sum(len(n.text) for n in self._nodes_of(tenant))


def _common_len(edge: str, text: str, start: int) -> int:
    """How many leading characters of `edge` equal text[start:]. Compared by `str.startswith` (in C, not a
    Python loop per character of every prompt): the whole edge first (a walk down a shared prefix), else a
    binary search for where the two part."""
    if text.startswith(edge, start):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - start)  # edge[:low] matches; edge[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low
