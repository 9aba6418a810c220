"""Exercise 07's references (chapter 07: prefix caching), private to its grader (see the package docstring).

The token-granular radix cache with edge splits and LRU eviction (task 4), which the check compares
with. The salted hash chain (task 1) and the lookup through hash buckets (task 2) are no check's
reference any more: tasks 1 and 2 take their expected answers from minillm's HashChain (ex07.py says
how), which a student release has too. They stay here as answers the copy detector compares a
learner's chain and lookup with.
"""

from __future__ import annotations

from minillm.kv.block_manager import block_hash


def salted_hashes(tokens, block_size, salt):
    """The hashes of the full blocks of `tokens`; block 0's parent is `salt` (None: no salt)."""
    out, parent = [], salt
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(tokens[start : start + block_size]))
        out.append(parent)
    return out


def bucket_lookup(cache, tokens, block_size, salt):
    """The cached blocks a request reuses when `cache` maps a hash to a list of entries
    (block, parent block, token ids): per block, the first entry with this block's tokens and the
    block reused just before as parent; at least one token is left to compute."""
    names = salted_hashes(tokens, block_size, salt)[: (len(tokens) - 1) // block_size]
    chunks = [tuple(tokens[k : k + block_size]) for k in range(0, len(names) * block_size, block_size)]

    def walk(index, parent):
        if index == len(names):
            return []
        hits = [block for block, above, held in cache.get(names[index], ()) if (above, tuple(held)) == (parent, chunks[index])]
        return [hits[0], *walk(index + 1, hits[0])] if hits else []

    return walk(0, None)


class Edge:
    """A node of the reference tree: its edge tokens, parent, last use and children by first token."""

    __slots__ = ("tokens", "parent", "last_access", "children")

    def __init__(self, tokens, parent, last_access):
        self.tokens, self.parent, self.last_access, self.children = tuple(tokens), parent, last_access, {}


def _common(edge, tokens) -> int:
    limit = min(len(edge), len(tokens))
    return next((j for j in range(limit) if edge[j] != tokens[j]), limit)


def _descend(node, tokens, clock, split):
    child = node.children.get(tokens[0]) if tokens else None
    if child is None:
        return node, 0
    child.last_access = clock
    k = _common(child.tokens, tokens)
    if k == len(child.tokens):
        end, more = _descend(child, tokens[k:], clock, split)
        return end, k + more
    if not (split and k < len(tokens)):
        return child, k
    upper = Edge(child.tokens[:k], node, clock)
    node.children[upper.tokens[0]] = upper
    child.tokens, child.parent = child.tokens[k:], upper
    upper.children[child.tokens[0]] = child
    return upper, k


def _leaves(node):
    for child in node.children.values():
        if child.children:
            yield from _leaves(child)
        else:
            yield child


class ReferenceRadix:
    """Task 4's rules: edges split where an insert diverges (never merged), every call stamps the
    nodes its path enters with the next clock value, `evict` removes the least recently used leaf
    (ties: the smaller edge tokens) until enough tokens are gone."""

    def __init__(self):
        self.root, self.clock = Edge((), None, 0), 0

    def match(self, tokens):
        self.clock += 1
        return _descend(self.root, tuple(tokens), self.clock, split=False)[1]

    def insert(self, tokens):
        self.clock += 1
        tokens = tuple(tokens)
        end, matched = _descend(self.root, tokens, self.clock, split=True)
        if matched < len(tokens):
            end.children[tokens[matched]] = Edge(tokens[matched:], end, self.clock)
        return matched

    def evict(self, num_tokens):
        removed = 0
        while removed < num_tokens:
            victim = min(_leaves(self.root), key=lambda n: (n.last_access, n.tokens), default=None)
            if victim is None:
                break
            del victim.parent.children[victim.tokens[0]]
            removed += len(victim.tokens)
        return removed


