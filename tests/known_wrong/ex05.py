"""Known-wrong answers to exercise 05 (block allocator): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, source_reexecuted

KNOWN_WRONG = [
    # task 1: free list and reference counts
    Mutant(1, "hands out from the back (pop for popleft)", edits=(("block = self.free_blocks.popleft()", "block = self.free_blocks.pop()"),)),
    Mutant(1, "returns a freed block to the front (appendleft for append)",
           edits=(("            self.free_blocks.append(block)", "            self.free_blocks.appendleft(block)"),)),
    Mutant(1, "frees a shared block at the first release", edits=(("        if self.ref_counts[block] == 0:\n            self.free_blocks.append(block)",
                                                                    "        self.ref_counts[block] = 0\n        self.free_blocks.append(block)"),)),
    Mutant(1, "no double-release check", edits=(("        if self.ref_counts[block] <= 0:\n            raise RuntimeError(f\"block {block} released more often than allocated\")\n", ""),)),
    Mutant(1, "delegates to BlockAllocator", code=(
        "from minillm.kv.block_allocator import BlockAllocator\n"
        "class LearnerAllocator(BlockAllocator):\n    pass\n"), expect="inherits from the reference BlockAllocator"),
    Mutant(1, "delegates by calling BlockAllocator.allocate", code=(
        "from minillm.kv.block_allocator import BlockAllocator as _Ref\n"
        "LearnerAllocator.allocate = lambda self: _Ref.allocate(self)\n"), expect="reference BlockAllocator.allocate"),
    # task 2: block tables and slots
    Mutant(2, "off-by-one block count (floor for ceil)", edits=(("needed = max(0, -(-num_tokens // block_size) - len(table))",
                                                                 "needed = max(0, num_tokens // block_size - len(table))"),)),
    Mutant(2, "one block too many", edits=(("needed = max(0, -(-num_tokens // block_size) - len(table))",
                                            "needed = max(0, num_tokens // block_size + 1 - len(table))"),)),
    Mutant(2, "allocates part of the table before refusing", edits=(("    if needed > allocator.num_free:\n        return False\n    table.extend(allocator.allocate() for _ in range(needed))",
                                                                     "    while needed and allocator.num_free:\n        table.append(allocator.allocate())\n        needed -= 1\n    if needed:\n        return False"),)),
    Mutant(2, "slot offset taken from the wrong end", edits=(("return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]",
                                                              "return [table[p // block_size] * block_size + (block_size - 1 - p % block_size) for p in range(start, start + n)]"),)),
    Mutant(2, "delegates to BlockManager", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def slots_for(table, start, n, block_size):\n"
        "    return _Ref.slot_mapping(None, [], [])\n"), expect="reference BlockManager.slot_mapping"),
    # task 3: the engine on your allocator
    Mutant(3, "the engine keeps minillm's allocator", edits=(("        kv.allocator = LearnerAllocator(kv.allocator.num_blocks)\n", ""),),
           expect="not your LearnerAllocator"),
    Mutant(3, "released blocks never come back", edits=(("        if self.ref_counts[block] == 0:\n            self.free_blocks.append(block)",
                                                         "        pass"),)),
    # task 4: vectorised slot mapping
    Mutant(4, "a Python loop over rows", code=(
        "def slot_mapping(block_tables, starts, counts, block_size):\n"
        "    out = []\n"
        "    for i in range(block_tables.shape[0]):\n"
        "        out += slots_for([int(b) for b in block_tables[i]], int(starts[i]), int(counts[i]), block_size)\n"
        "    return torch.tensor(out, dtype=torch.long)\n"), expect="row by row"),
    Mutant(4, "positions counted from 0, ignoring starts", edits=(("positions = torch.arange(rows.shape[0]) - row_start_in_output[rows] + starts[rows]",
                                                                   "positions = torch.arange(rows.shape[0]) - row_start_in_output[rows]"),)),
    Mutant(4, "inclusive cumulative sum (off by one row)", edits=(("row_start_in_output = torch.cumsum(counts, 0) - counts",
                                                                   "row_start_in_output = torch.cumsum(counts, 0)"),)),
    Mutant(4, "delegates to BlockManager.slot_mapping", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def slot_mapping(block_tables, starts, counts, block_size):\n"
        "    return _Ref.slot_mapping(None, [], [])\n"), expect="reference BlockManager.slot_mapping"),
]

# issue 18: the library's class re-executed, the grader's expected-slots helper as the answer
KNOWN_WRONG += [
    source_reexecuted(1, "LearnerAllocator", "minillm.kv.block_allocator", "BlockAllocator", keyword="class"),
    Mutant(2, "the grader's helper answers: slots_for calls grader._expected_slots", code=(
        "def slots_for(table, start, n, block_size):\n"
        "    return grader._expected_slots([table], [start], [n], block_size)\n"), expect="grader's"),
    Mutant(3, "the library's answer under another name: BlockAllocator's code in LearnerAllocator", code=(
        "import types as _types\n"
        "import minillm.kv.block_allocator as _lib\n"
        "LearnerAllocator.release = _types.FunctionType(_lib.BlockAllocator.release.__code__, vars(_lib), 'release')\n"),
        expect="bytecode"),
]
