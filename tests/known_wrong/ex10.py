"""Known-wrong answers to exercise 10 (the ladder, then the paged decode kernel): see
tests/known_wrong/__init__.py.

Tasks 1-4 (the ladder): the bug each rung is about: a missing guard, a missing barrier (a race,
caught by the trace on every run), no shared memory, no halo, a serial "reduction", a max padded
with 0, no running max, two passes, reading past a row's end, calling the spec. Task 5's mutants
are the bug classes of chapter 10, section 6 (minillm.grading.ex10.KNOWN_WRONG has them in the
chapter's block-table layout), in the exercise's CSR layout, and the chapter's printed kernel
transcribed under the new argument names; task 6's run fine as Python in the simulator but are not GPU
code; task 7's break the kernel inside the engine.
"""

from known_wrong import Mutant

NO_PARTIAL_MASK = (("                filled = kv_last_page_len[seq]  # the last page only up to the end\n",
                    "                filled = block_size\n"),)
WRONG_GQA = (("        kv_head = head // group\n", "        kv_head = head % key_cache.shape[2]\n"),)
DELEGATE = "from minillm.kernels.decode_attention import python_function as paged_decode_kernel\n"

KNOWN_WRONG = [
    # task 1: the kernel in the simulator
    Mutant(5, "no partial-block mask", edits=NO_PARTIAL_MASK, expect="NaN in"),
    Mutant(5, "wrong GQA head mapping", edits=WRONG_GQA, expect="max |error|"),
    Mutant(5, "softmax without the running max", edits=(("                if score > running_max:", "                if False:"),
                                                         ("running_max = -math.inf  # the largest", "running_max = 0.0  # the largest")),
           expect="OverflowError"),
    Mutant(5, "max kept, sums never rescaled", edits=(("rescale = math.exp(running_max - score)", "rescale = 1.0"),),
           expect="max |error|"),
    Mutant(5, "reads on past its own pages, into the next sequence's and the -1 padding", edits=(
        ("last_page = kv_indptr[seq + 1] - 1", "last_page = kv_indices.shape[0] - 1"),), expect="NaN in"),
    Mutant(5, "the last page read in full, masked after the read", edits=(
        NO_PARTIAL_MASK[0],
        ("                score = dot * scale\n", "                score = dot * scale\n"
         "                if page == last_page and slot >= kv_last_page_len[seq]:\n"
         "                    score = -math.inf\n"),
    ), expect="NaN in"),
    Mutant(5, "sequence b's pages taken from the next sequence's entries of kv_indptr", edits=(
        ("page = kv_indptr[seq]\n", "page = kv_indptr[min(seq + 1, query.shape[0] - 1)]\n"),)),
    Mutant(5, "transcribes the chapter's printed kernel: the block-table layout under the new names", code=(
        "def paged_decode_kernel(query, key_cache, value_cache, kv_indptr, kv_indices, kv_last_page_len, scale, out):\n"
        "    i = cuda.grid(1)\n"
        "    num_seqs, q_heads, dim = query.shape\n"
        "    if i >= num_seqs * q_heads:\n"
        "        return\n"
        "    b, h = i // q_heads, i % q_heads\n"
        "    kv_head = h // (q_heads // key_cache.shape[2])\n"
        "    bs = key_cache.shape[1]\n"
        "    acc = cuda.local.array(MAX_HEAD_DIM, float32)\n"
        "    for d in range(dim):\n"
        "        acc[d] = 0.0\n"
        "    m, total = -math.inf, 0.0\n"
        "    for p in range(kv_last_page_len[b]):  # the chapter's seq_lens[b]\n"
        "        block, off = kv_indices[b * kv_indices.shape[0] // num_seqs + p // bs], p % bs  # its table row\n"
        "        s = 0.0\n"
        "        for d in range(dim):\n"
        "            s += query[b, h, d] * key_cache[block, off, kv_head, d]\n"
        "        s *= scale\n"
        "        m_new = max(m, s)\n"
        "        correction, weight = math.exp(m - m_new), math.exp(s - m_new)\n"
        "        total = total * correction + weight\n"
        "        for d in range(dim):\n"
        "            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]\n"
        "        m = m_new\n"
        "    for d in range(dim):\n"
        "        out[b, h, d] = acc[d] / total\n")),
    Mutant(5, "no guard for the spare threads", edits=(("    if i < query.shape[0] * q_heads:\n", "    if True:\n"),),
           expect="IndexError"),
    Mutant(5, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
    # task 2: Python the simulator runs but a GPU cannot
    Mutant(6, "a Python list as the accumulator", edits=(("acc = cuda.local.array(MAX_HEAD_DIM, float32)",
                                                          "acc = [0.0] * MAX_HEAD_DIM"),), expect="does not compile"),
    Mutant(6, "a generator expression for the dot product", edits=((
        "                dot = 0.0\n                for d in range(head_dim):\n"
        "                    dot += query[seq, head, d] * key_cache[block, slot, kv_head, d]\n",
        "                dot = sum(query[seq, head, d] * key_cache[block, slot, kv_head, d] for d in range(head_dim))\n"),),
        expect="does not compile"),
    Mutant(6, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
    # task 3: in the engine
    Mutant(7, "no partial-block mask", edits=NO_PARTIAL_MASK, expect="decode call"),
    Mutant(7, "wrong GQA head mapping", edits=WRONG_GQA, expect="decode call"),
    Mutant(7, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
]

# issue 18: minillm's kernel under another name (code object reused, source re-executed, __code__ swapped)
SOURCE_REEXEC = (
    "import inspect as _inspect\n"
    "from minillm.kernels import decode_attention as _lib\n"
    "exec(_inspect.getsource(_lib._kernel).replace('def _kernel(', 'def paged_decode_kernel(', 1))\n")

KNOWN_WRONG += [
    Mutant(5, "the library's answer under another name: decode_attention._kernel's code object reused", code=(
        "import types as _types\n"
        "from minillm.kernels import decode_attention as _lib\n"
        "paged_decode_kernel = _types.FunctionType(_lib._kernel.__code__, globals(), 'paged_decode_kernel')\n"),
        expect="bytecode"),
    Mutant(5, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(5, "the library's answer under another name: __code__ swapped in",
           code="from minillm.kernels import decode_attention as _lib\n"
                "paged_decode_kernel.__code__ = _lib._kernel.__code__\n", expect="bytecode"),
    Mutant(6, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(7, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(5, "a grader's kernel handed in (one of its known-wrong kernels)",
           code="paged_decode_kernel = grader.KNOWN_WRONG['wrong GQA head mapping']\n", expect="handed in"),
]

# the ladder (tasks 1-4)
KNOWN_WRONG += [
    Mutant(1, "no guard: the spare threads index past the end", edits=((
        "    if row < out.shape[0] and col < out.shape[1]:  # the grid is larger than out in both directions\n"
        "        out[row, col] = a[row] + b[col]\n", "    out[row, col] = a[row] + b[col]\n"),), expect="IndexError"),
    Mutant(1, "guards the rows only", edits=(("if row < out.shape[0] and col < out.shape[1]:", "if row < out.shape[0]:"),),
           expect="IndexError"),
    Mutant(1, "rows and columns swapped", edits=(("out[row, col] = a[row] + b[col]", "out[row, col] = a[col] + b[row]"),),
           expect="IndexError"),
    Mutant(1, "delegates to the rung's spec", edits=(("out[row, col] = a[row] + b[col]",
                                                      "out[row, col] = ladder.broadcast_add_spec(a, b)[row, col]"),),
           expect="reference"),
    Mutant(2, "no barrier between the loads and the reads", edits=((
        "    cuda.syncthreads()  # every slot of the tile is loaded before anyone reads a neighbour's\n", ""),),
        expect="a race"),
    Mutant(2, "reads the window from global memory, no shared tile", edits=((
        "out[i] = tile[local] + tile[local + 1] + tile[local + 2]",
        "out[i] = a[i] + (a[i - 1] if i >= 1 else 0.0) + (a[i - 2] if i >= 2 else 0.0)"),),
        expect="global memory"),
    Mutant(2, "no halo: the two numbers before the block are never loaded", edits=((
        "    if local < HALO:  # the halo: the numbers just before this block's first\n"
        "        before = i - HALO\n        tile[local] = a[before] if before >= 0 else 0.0\n", ""),),
        expect="the spec says"),
    Mutant(3, "thread 0 reads the whole tile: not a tree", edits=((
        "    half = TPB >> 1\n    while half >= 1:  # log2(TPB) rounds, half as many threads active in each\n"
        "        if local < half:\n            other = tile[local + half]\n            if other > tile[local]:\n"
        "                tile[local] = other\n"
        "        cuda.syncthreads()  # this round's maxima are written before the next round reads them\n"
        "        half >>= 1\n    if local == 0:\n        out[cuda.blockIdx.x] = tile[0]\n",
        "    if local == 0:\n        best = tile[0]\n        for k in range(1, TPB):\n"
        "            best = max(best, tile[k])\n        out[cuda.blockIdx.x] = best\n"),), expect="a tree reads at most 2 per round"),
    Mutant(3, "pads the last block with 0, which wins over negative numbers", edits=((
        "tile[local] = a[i] if i < a.size else -math.inf", "tile[local] = a[i] if i < a.size else 0.0"),),
        expect="the spec says"),
    Mutant(3, "no barrier between rounds", edits=((
        "        cuda.syncthreads()  # this round's maxima are written before the next round reads them\n", ""),),
        expect="a race"),
    Mutant(4, "no running max: exp overflows on row 2", edits=(
        ("if score > best:  # a new maximum", "if False:  # a new maximum"),
        ("best, total, weighted = -math.inf, 0.0, 0.0", "best, total, weighted = 0.0, 0.0, 0.0")), expect="OverflowError"),
    Mutant(4, "max kept, sums never rescaled", edits=((
        "shrink = math.exp(best - score)", "shrink = 1.0"),), expect="the spec says"),
    Mutant(4, "two passes: the max first, then the sums", edits=((
        "        best, total, weighted = -math.inf, 0.0, 0.0\n",
        "        best, total, weighted = -math.inf, 0.0, 0.0\n        for j in range(lengths[r]):\n"
        "            if scores[r, j] > best:\n                best = scores[r, j]\n"),), expect="passes (column"),
    Mutant(6, "a ladder kernel that only runs as Python: a list in the map", edits=((
        "out[row, col] = a[row] + b[col]", "pair = [a[row], b[col]]\n        out[row, col] = pair[0] + pair[1]"),),
        expect="your map kernel does not compile"),
    Mutant(6, "a ladder kernel that only runs as Python: a list as the reduction's scratch", edits=((
        "tile[local] = a[i] if i < a.size else -math.inf",
        "tile[local] = [a[i] if i < a.size else -math.inf][0]"),), expect="your reduction kernel does not compile"),
    Mutant(4, "reads the whole row width, past the row's end", edits=((
        "for j in range(lengths[r]):", "for j in range(scores.shape[1]):"),), expect="NaN"),
]

# issue 27: a ladder kernel that fits only the seeded case (5 rows) fails on the cases drawn at grade time
KNOWN_WRONG += [
    Mutant(4, "fits the seeded case only: five rows assumed", edits=((
        "    if r < lengths.size:\n", "    if r < 5:\n"),), expect="drawn as the check ran"),
]

# issue 27: task 5 used three fixed batches only; a kernel that knows their answers fails on the batches drawn
# at grade time (the reference's outputs for grader.CASES memoised at cell time, before the check disables it)
KNOWN_WRONG += [
    Mutant(5, "memoised: the seeded batches' outputs looked up by their first query value", code=(
        "from minillm.kernels.decode_attention import paged_attention_decode_reference as _ref\n"
        "from minillm.kernels.scenarios import paged_scenario as _scenario\n"
        "_MEMO = {}\n"
        "for _name, _kwargs in grader.CASES:\n"
        "    _case = _scenario(**_kwargs)\n"
        "    _MEMO[float(_case.query[0, 0, 0])] = _ref(*_case.args()).numpy()\n"
        "def paged_decode_kernel(query, key_cache, value_cache, kv_indptr, kv_indices, kv_last_page_len, scale, out):\n"
        "    i = cuda.grid(1)\n"
        "    q_heads = query.shape[1]\n"
        "    if i < query.shape[0] * q_heads:\n"
        "        seq, head = i // q_heads, i % q_heads\n"
        "        known = _MEMO.get(float(query[0, 0, 0]))\n"
        "        for d in range(query.shape[2]):\n"
        "            out[seq, head, d] = known[seq, head, d] if known is not None else 0.0\n"),
        expect="drawn as the check ran"),
]
