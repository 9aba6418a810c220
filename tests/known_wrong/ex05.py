"""Known-wrong answers to exercise 05 (block allocator): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, source_reexecuted

KNOWN_WRONG = [
    # task 1: lowest free block first, reference counts
    Mutant(1, "the chapter's allocator transcribed: a FIFO free list", edits=(
        ("block = heapq.heappop(self.free_blocks)", "block = self.free_blocks.pop(0)"),
        ("            heapq.heappush(self.free_blocks, block)", "            self.free_blocks.append(block)")),
        expect="the lowest free block"),
    Mutant(1, "a freed block goes to the end of a sorted list (not kept in heap order)",
           edits=(("            heapq.heappush(self.free_blocks, block)", "            self.free_blocks.append(block)"),)),
    Mutant(1, "hands out the highest free block", edits=(("block = heapq.heappop(self.free_blocks)",
                                                         "block = max(self.free_blocks)\n        self.free_blocks.remove(block)"),)),
    Mutant(1, "frees a shared block at the first release", edits=(("        if readers == 1:", "        if True:"),)),
    Mutant(1, "no double-release check", edits=(("        if readers == 0:\n            raise RuntimeError(f\"block {block} released more often than allocated\")\n", ""),)),
    Mutant(1, "delegates to BlockAllocator", code=(
        "from minillm.kv.block_allocator import BlockAllocator\n"
        "class LearnerAllocator(BlockAllocator):\n    pass\n"), expect="inherits from the reference BlockAllocator"),
    Mutant(1, "delegates by calling BlockAllocator.allocate", code=(
        "from minillm.kv.block_allocator import BlockAllocator as _Ref\n"
        "LearnerAllocator.allocate = lambda self: _Ref.allocate(self)\n"), expect="reference BlockAllocator.allocate"),
    # task 2: ring block tables and slots
    Mutant(2, "the chapter's table transcribed: it grows past max_blocks", edits=((
        "needed = max(0, min(-(-num_tokens // block_size), max_blocks) - len(table))",
        "needed = max(0, -(-num_tokens // block_size) - len(table))"),), expect="at most max_blocks"),
    Mutant(2, "the chapter's slots transcribed: no ring", edits=((
        "table[(p // block_size) % ring]", "table[min(p // block_size, ring - 1)]"),), expect="expected"),
    Mutant(2, "off-by-one block count (floor for ceil)", edits=(("min(-(-num_tokens // block_size), max_blocks)",
                                                                 "min(num_tokens // block_size, max_blocks)"),)),
    Mutant(2, "allocates part of the table before refusing", edits=(("    if needed > allocator.num_free:\n        return False\n    table.extend(allocator.allocate() for _ in range(needed))",
                                                                     "    while needed and allocator.num_free:\n        table.append(allocator.allocate())\n        needed -= 1\n    if needed:\n        return False"),)),
    Mutant(2, "slot offset taken from the wrong end", edits=(("* block_size + p % block_size for p in range(start, start + n)]",
                                                              "* block_size + (block_size - 1 - p % block_size) for p in range(start, start + n)]"),)),
    Mutant(2, "delegates to BlockManager", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def slots_for(table, start, n, block_size):\n"
        "    return _Ref.slot_mapping(None, [], [])\n"), expect="reference BlockManager.slot_mapping"),
    # task 3: the engine on your allocator
    Mutant(3, "the engine keeps minillm's allocator", edits=(("        kv.allocator = LearnerAllocator(kv.allocator.num_blocks)\n", ""),),
           expect="not your LearnerAllocator"),
    Mutant(3, "drops the knobs", edits=(("    return LLM(MODEL, scheduler_factory=factory, **knobs)", "    return LLM(MODEL, scheduler_factory=factory)"),),
           expect="a size drawn now"),
    Mutant(3, "released blocks never come back", edits=(("            heapq.heappush(self.free_blocks, block)", "            pass"),)),
    # task 4: the padded slot matrix, vectorised
    Mutant(4, "a Python loop over rows", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    width = int(counts.max().item())\n"
        "    rows = []\n"
        "    for i in range(block_tables.shape[0]):\n"
        "        row = slots_for([int(b) for b in block_tables[i]], int(starts[i]), int(counts[i]), block_size)\n"
        "        rows.append(row + [-1] * (width - len(row)))\n"
        "    return torch.tensor(rows, dtype=torch.long)\n"), expect="row by row"),
    Mutant(4, "numpy, then a Python loop", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    tables, s, c = block_tables.numpy(), starts.numpy(), counts.numpy()\n"
        "    width = int(c.max()) if len(c) else 0\n"
        "    rows = [[int(tables[i][(s[i] + j) // block_size]) * block_size + int((s[i] + j) % block_size) if j < c[i] else -1\n"
        "             for j in range(width)] for i in range(len(c))]\n"
        "    return torch.tensor(rows, dtype=torch.long).reshape(len(c), width)\n"), expect="element by element"),
    Mutant(4, "np.asarray, then a Python loop", code=(
        "import numpy as _np\n"
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    tables, s, c = (_np.asarray(t) for t in (block_tables, starts, counts))\n"
        "    width = int(c.max()) if len(c) else 0\n"
        "    rows = [[int(tables[i][(s[i] + j) // block_size]) * block_size + int((s[i] + j) % block_size) if j < c[i] else -1\n"
        "             for j in range(width)] for i in range(len(c))]\n"
        "    return torch.tensor(rows, dtype=torch.long).reshape(len(c), width)\n"), expect="element by element"),
    Mutant(4, "a loop over rows on plain tensors (leaving the subclass through a copy)", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    width = int(counts.max().item())\n"
        "    plain = [torch.Tensor._make_subclass(torch.Tensor, t) for t in (block_tables, starts, counts)]\n"
        "    out = torch.full((block_tables.shape[0], width), -1, dtype=torch.long)\n"
        "    for i in range(block_tables.shape[0]):\n"
        "        cols = torch.arange(width)\n"
        "        pos = plain[1][i] + cols\n"
        "        row = plain[0][i][(pos // block_size).clamp(max=block_tables.shape[1] - 1)] * block_size + pos % block_size\n"
        "        out[i] = torch.where(cols < plain[2][i], row, -1)\n"
        "    return out\n"), expect="torch operations"),
    Mutant(4, "torch's C tolist under the patched one (torch._C.TensorBase.tolist), then a Python loop", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    read = torch._C.TensorBase.tolist\n"
        "    tables, s, c = (read(torch.Tensor._make_subclass(torch.Tensor, t)) for t in (block_tables, starts, counts))\n"
        "    width = max(c, default=0)\n"
        "    rows = [[tables[i][(s[i] + j) // block_size] * block_size + (s[i] + j) % block_size if j < c[i] else -1\n"
        "             for j in range(width)] for i in range(len(c))]\n"
        "    return torch.tensor(rows, dtype=torch.long).reshape(len(c), width)\n"), expect="element by element"),
    Mutant(4, "the C tolist called by map (no Python call to see), a Python loop, then torch.tensor(rows)", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    plain = [torch.Tensor._make_subclass(torch.Tensor, t) for t in (block_tables, starts, counts)]\n"
        "    tables, s, c = map(torch._C.TensorBase.tolist, plain)\n"
        "    width = max(c, default=0)\n"
        "    rows = [[tables[i][(s[i] + j) // block_size] * block_size + (s[i] + j) % block_size if j < c[i] else -1\n"
        "             for j in range(width)] for i in range(len(c))]\n"
        "    return torch.tensor(rows, dtype=torch.long).reshape(len(c), width)\n"), expect="from Python data"),
    Mutant(4, "the chapter's flat layout transcribed (repeat_interleave and cumsum)", code=(
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    rows = torch.repeat_interleave(torch.arange(block_tables.shape[0]), counts)\n"
        "    row_start = torch.cumsum(counts, 0) - counts\n"
        "    positions = torch.arange(rows.shape[0]) - row_start[rows] + starts[rows]\n"
        "    return block_tables[rows, positions // block_size] * block_size + positions % block_size\n"), expect="shape"),
    Mutant(4, "positions counted from 0, ignoring starts", edits=(("    positions = starts[:, None] + columns\n", "    positions = columns + 0 * starts[:, None]\n"),)),
    Mutant(4, "padding left as slots (no -1)", edits=(("    return torch.where(real, slots, torch.full_like(slots, -1))", "    return slots"),)),
    Mutant(4, "delegates to BlockManager.slot_mapping", code=(
        "from minillm.kv.block_manager import BlockManager as _Ref\n"
        "def slot_matrix(block_tables, starts, counts, block_size):\n"
        "    return _Ref.slot_mapping(None, [], [])\n"), expect="reference BlockManager.slot_mapping"),
]

# issue 18: the library's class re-executed, the grader's reference as the answer
KNOWN_WRONG += [
    source_reexecuted(1, "LearnerAllocator", "minillm.kv.block_allocator", "BlockAllocator", keyword="class"),
    Mutant(2, "the grader's helper answers: slots_for calls the private ring_slot", code=(
        "from minillm.grading.private.ex05_reference import ring_slot as _slot\n"
        "def slots_for(table, start, n, block_size):\n"
        "    return [_slot(table, p, block_size) for p in range(start, start + n)]\n"), expect="grader's"),
    Mutant(3, "the library's answer under another name: BlockAllocator's code in LearnerAllocator", code=(
        "import types as _types\n"
        "import minillm.kv.block_allocator as _lib\n"
        "LearnerAllocator.release = _types.FunctionType(_lib.BlockAllocator.release.__code__, vars(_lib), 'release')\n"),
        expect="bytecode"),
]
