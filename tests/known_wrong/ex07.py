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
        "def chain_hashes(tokens, block_size, salt=None):\n"
        "    chain = _Ref(block_size); blocks = list(range(len(tokens) // block_size))\n"
        "    chain.insert(tokens, blocks)\n"
        "    return [chain.hash_of_block[b] for b in blocks]\n"), expect="reference HashChain"),
    # task 2: the lookup
    Mutant(2, "missing parent check", edits=(("if above == parent and tuple(held) == chunk)", "if tuple(held) == chunk)"),),
           expect="same tokens after another parent"),
    Mutant(2, "missing token check", edits=(("if above == parent and tuple(held) == chunk)", "if above == parent)"),),
           expect="other tokens"),
    Mutant(2, "reuses the whole prompt", edits=(("max_blocks = (len(tokens) - 1) // block_size", "max_blocks = len(tokens) // block_size"),),
           expect="fully cached prompt"),
    Mutant(2, "off-by-one: one block short of the limit", edits=(("max_blocks = (len(tokens) - 1) // block_size",
                                                                   "max_blocks = (len(tokens) - 2) // block_size"),),
           expect="all three full blocks cached"),
    Mutant(2, "delegates to BlockManager's lookup", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def lookup(cache, tokens, block_size, salt=None):\n"
        "    return _Ref._match(None, None)\n"), expect="reference BlockManager._match"),
    # task 3: predicting the engine
    Mutant(3, "caches only after all lookups", edits=(("        predicted.append(len(lookup(cache, prompt, block_size)) * block_size)\n",
                                                       "        predicted.append(len(lookup({}, prompt, block_size)) * block_size)\n"),)),
    Mutant(3, "registers a prompt's blocks before looking it up", edits=((
        "        predicted.append(len(lookup(cache, prompt, block_size)) * block_size)\n        parent = None\n",
        "        parent = None\n"), ("    return predicted\n", "        predicted.append(len(lookup(cache, prompt, block_size)) * block_size)\n    return predicted\n"))),
    Mutant(3, "parents named by hash, not by block", edits=(("            parent = known\n", "            parent = h\n"),)),
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

# issue 18: the grader's reference radix as the answer (now private to the grader)
KNOWN_WRONG += [
    Mutant(4, "the grader's reference handed in: RadixCache = the private ReferenceRadix", code=(
        "from minillm.grading.private.ex07_reference import ReferenceRadix as RadixCache\n"), expect="minillm"),
    Mutant(4, "the grader's reference inherited", code=(
        "from minillm.grading.private.ex07_reference import ReferenceRadix as _Ref\n"
        "class RadixCache(_Ref):\n    pass\n"), expect="minillm"),
    source_reexecuted(4, "RadixCache", "minillm.grading.private.ex07_reference", "ReferenceRadix", keyword="class"),
]

# issue 27: the chapter's code for the old tasks, and answers fitted to the seeded cases
KNOWN_WRONG += [
    Mutant(1, "the chapter's chain transcribed: no salt", edits=(("    hashes, parent = [], salt\n", "    hashes, parent = [], None\n"),),
           expect="salt"),
    Mutant(2, "the chapter's lookup transcribed: one entry per hash, a collision costs a miss", code=(
        "def lookup(cache, tokens, block_size, salt=None):\n"
        "    max_blocks = (len(tokens) - 1) // block_size\n"
        "    blocks, parent = [], None\n"
        "    for i, h in enumerate(chain_hashes(tokens[: max_blocks * block_size], block_size, salt)):\n"
        "        entry = (cache.get(h) or [None])[0]\n"
        "        if entry is None:\n            break\n"
        "        block, entry_parent, entry_tokens = entry\n"
        "        if tuple(entry_tokens) != tuple(tokens[i * block_size : (i + 1) * block_size]) or entry_parent != parent:\n"
        "            break\n"
        "        blocks.append(block)\n        parent = block\n"
        "    return blocks\n"), expect="then the right entry"),
    Mutant(2, "ignores the salt", edits=(("block_size], block_size, salt)):", "block_size], block_size)):"),),
           expect="all three full blocks cached (block_size 4, salt 12345)"),
    Mutant(3, "fitted to the seeded trace: its answer hard-coded", code=(
        "def predict_cached_tokens(prompts, block_size):\n"
        "    return [0, 0, 80, 0, 80, 80, 80, 80, 80, 80, 80, 80, 80, 80, 80, 80, 96, 96][:len(prompts)]\n"),
        expect="a trace drawn now"),
]
