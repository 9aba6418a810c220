"""Known-wrong answers to exercise 10 (paged decode kernel): see tests/known_wrong/__init__.py.

Task 1's mutants are the bug classes of chapter 10, section 6 (they are also
minillm.grading.ex10.KNOWN_WRONG, written as kernels of their own); task 2's run fine as Python in
the simulator but are not GPU code; task 3's break the kernel inside the engine.
"""

from known_wrong import Mutant

NO_PARTIAL_MASK = (("for slot in range(min(block_size, n - j * block_size)):", "for slot in range(block_size):"),)
WRONG_GQA = (("kv_head = head // (q_heads // key_cache.shape[2])", "kv_head = head % key_cache.shape[2]"),)
DELEGATE = "from minillm.kernels.decode_attention import python_function as paged_decode_kernel\n"

KNOWN_WRONG = [
    # task 1: the kernel in the simulator
    Mutant(1, "no partial-block mask", edits=NO_PARTIAL_MASK, expect="NaN in"),
    Mutant(1, "wrong GQA head mapping", edits=WRONG_GQA, expect="max |error|"),
    Mutant(1, "softmax without the running max", edits=(("new_max = max(running_max, score)", "new_max = 0.0"),),
           expect="OverflowError"),
    Mutant(1, "max kept, sums never rescaled", edits=(("rescale = math.exp(running_max - new_max)", "rescale = 1.0"),),
           expect="max |error|"),
    Mutant(1, "reads the -1 padding, masks after the read", edits=(
        ("for j in range((n + block_size - 1) // block_size):", "for j in range(block_tables.shape[1]):"),
        ("for slot in range(min(block_size, n - j * block_size)):", "for slot in range(block_size):"),
        ("            score *= scale\n", "            score *= scale\n            if j * block_size + slot >= n:\n"
                                       "                score = -math.inf\n"),
    ), expect="NaN in"),
    Mutant(1, "no guard for the spare threads", edits=(("    if i >= num_seqs * q_heads:\n        return\n", ""),),
           expect="IndexError"),
    Mutant(1, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
    # task 2: Python the simulator runs but a GPU cannot
    Mutant(2, "a Python list as the accumulator", edits=(("acc = cuda.local.array(MAX_HEAD_DIM, float32)",
                                                          "acc = [0.0] * MAX_HEAD_DIM"),), expect="does not compile"),
    Mutant(2, "a generator expression for the dot product", edits=((
        "            score = 0.0\n            for d in range(head_dim):\n"
        "                score += query[seq, head, d] * key_cache[block, slot, kv_head, d]\n",
        "            score = sum(query[seq, head, d] * key_cache[block, slot, kv_head, d] for d in range(head_dim))\n"),),
        expect="does not compile"),
    Mutant(2, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
    # task 3: in the engine
    Mutant(3, "no partial-block mask", edits=NO_PARTIAL_MASK, expect="decode call"),
    Mutant(3, "wrong GQA head mapping", edits=WRONG_GQA, expect="decode call"),
    Mutant(3, "delegates to minillm's kernel", code=DELEGATE, expect="reference"),
]

# issue 18: minillm's kernel under another name (code object reused, source re-executed, __code__ swapped)
SOURCE_REEXEC = (
    "import inspect as _inspect\n"
    "from minillm.kernels import decode_attention as _lib\n"
    "exec(_inspect.getsource(_lib._kernel).replace('def _kernel(', 'def paged_decode_kernel(', 1))\n")

KNOWN_WRONG += [
    Mutant(1, "the library's answer under another name: decode_attention._kernel's code object reused", code=(
        "import types as _types\n"
        "from minillm.kernels import decode_attention as _lib\n"
        "paged_decode_kernel = _types.FunctionType(_lib._kernel.__code__, globals(), 'paged_decode_kernel')\n"),
        expect="bytecode"),
    Mutant(1, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(1, "the library's answer under another name: __code__ swapped in",
           code="from minillm.kernels import decode_attention as _lib\n"
                "paged_decode_kernel.__code__ = _lib._kernel.__code__\n", expect="bytecode"),
    Mutant(2, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(3, "the library's answer under another name: decode_attention._kernel's source re-executed",
           code=SOURCE_REEXEC, expect="bytecode"),
    Mutant(1, "a grader's kernel handed in (one of its known-wrong kernels)",
           code="paged_decode_kernel = grader.KNOWN_WRONG['wrong GQA head mapping']\n", expect="handed in"),
]
