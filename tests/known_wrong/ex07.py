"""Known-wrong answers to exercise 07 (prefix lookup and radix cache): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, source_reexecuted

KNOWN_WRONG = [
    # task 1: the hash chain
    Mutant(1, "no parent in the hash", edits=(("parent = block_hash(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))",
                                               "parent = block_hash(None, tuple(tokens[i * block_size : (i + 1) * block_size]))"),)),
    Mutant(1, "hashes the trailing partial block", edits=(("for i in range(len(tokens) // block_size):",
                                                           "for i in range(-(-len(tokens) // block_size)):"),),
           expect="one per full block"),
    Mutant(1, "delegates to HashChain", code=(
        "from minillm.kv.block_manager import HashChain as _Ref\n"
        "def chain_hashes(tokens, block_size):\n"
        "    chain = _Ref(block_size); blocks = list(range(len(tokens) // block_size))\n"
        "    chain.insert(tokens, blocks)\n"
        "    return [chain.hash_of_block[b] for b in blocks]\n"), expect="reference HashChain"),
    # task 2: the lookup
    Mutant(2, "missing parent check", edits=(("or entry_parent != parent:", ":"),),
           expect="same tokens, another parent"),
    Mutant(2, "missing token check", edits=(("if tuple(entry_tokens) != tuple(tokens[i * block_size : (i + 1) * block_size]) or entry_parent != parent:",
                                             "if entry_parent != parent:"),), expect="other tokens"),
    Mutant(2, "reuses the whole prompt", edits=(("max_blocks = (len(tokens) - 1) // block_size", "max_blocks = len(tokens) // block_size"),),
           expect="fully cached prompt"),
    Mutant(2, "off-by-one: one block short of the limit", edits=(("max_blocks = (len(tokens) - 1) // block_size",
                                                                   "max_blocks = (len(tokens) - 2) // block_size"),),
           expect="all three full blocks cached"),
    Mutant(2, "delegates to BlockManager's lookup", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def lookup(cache, tokens, block_size):\n"
        "    return _Ref._match(None, None)\n"), expect="reference BlockManager._match"),
    # task 3: predicting the engine
    Mutant(3, "caches only after all lookups", edits=(("        predicted.append(len(lookup(cache, prompt, block_size)) * block_size)\n",
                                                       "        predicted.append(len(lookup({}, prompt, block_size)) * block_size)\n"),)),
    Mutant(3, "a re-registered hash overwrites its entry", edits=(("            if h not in cache:\n                cache[h]", "            if True:\n                cache[h]"),)),
    # task 4: the radix cache
    Mutant(4, "no split: a diverging insert adds a duplicate edge", edits=(("                if split and i < len(tokens):", "                if False:"),)),
    Mutant(4, "split one token too late", edits=(("                    upper = RadixNode(child.tokens[:k], node, self.clock)",
                                                  "                    k += 1\n                    upper = RadixNode(child.tokens[:k], node, self.clock)"),)),
    Mutant(4, "evicts the most recently used leaf", edits=(("victim = min(leaves, key=lambda n: (n.last_access, n.tokens))",
                                                            "victim = max(leaves, key=lambda n: (n.last_access, n.tokens))"),)),
    Mutant(4, "match does not refresh last_access", edits=(("        return self._walk(list(tokens), split=False)[1]",
                                                            "        clock = self.clock\n        stamps = {id(n): n.last_access for n in self._nodes()}\n"
                                                            "        matched = self._walk(list(tokens), split=False)[1]\n"
                                                            "        for n in self._nodes():\n            n.last_access = stamps.get(id(n), n.last_access)\n"
                                                            "        return matched\n\n    def _nodes(self):\n"
                                                            "        out, stack = [], [self.root]\n        while stack:\n"
                                                            "            n = stack.pop(); out.append(n); stack.extend(n.children.values())\n"
                                                            "        return out"),)),
    Mutant(4, "delegates to minillm's RadixTree", code=(
        "from minillm.kv.radix import RadixTree as _Ref\n"
        "class RadixCache(RadixCache):\n"
        "    def match(self, tokens):\n        return _Ref.match_prefix(self, tokens)\n"), expect="reference RadixTree"),
]

# issue 18: the grader's own reference radix as the answer
KNOWN_WRONG += [
    Mutant(4, "the grader's reference handed in: RadixCache = grader._ReferenceRadix",
           code="RadixCache = grader._ReferenceRadix\n", expect="handed in"),
    Mutant(4, "the grader's reference inherited", code="class RadixCache(grader._ReferenceRadix):\n    pass\n",
           expect="inherits from the grader's"),
    source_reexecuted(4, "RadixCache", "minillm.grading.ex07", "_ReferenceRadix", keyword="class"),
]
