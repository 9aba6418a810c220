"""Known-wrong answers to exercise 12 (tensor parallelism): see tests/known_wrong/__init__.py.

Task 2's mutants run on forked gloo ranks (2, 4, 3 and 6 of them), as the grader runs every answer to task 2."""

from known_wrong import Mutant

REF = "from minillm.distributed import linear as _ref\n"


def _code_object_of(task: int, learner: str, reference: str) -> Mutant:
    # the library's function rebuilt from its code object, under the learner's name
    return Mutant(task, f"the library's answer under another name: {reference}'s code object reused, not delegating",
                  code=(f"import types as _types\n{REF}"
                        f"{learner} = _types.FunctionType(_ref.{reference}.__code__, vars(_ref), {learner!r})\n"))


KNOWN_WRONG = [
    # task 1: shard the MLP
    Mutant(1, "merged gate_up sliced as one block (rank 0 gets all of gate)",
           edits=(("gate_up=torch.cat([gate[mine], up[mine]])", "gate_up=weights.gate_up[2 * rank * n:2 * (rank + 1) * n].clone()"),),
           expect="gate_up differs"),
    Mutant(1, "gate_up bias sliced as one block",
           edits=(("gate_up_bias = torch.cat([bias_gate[mine], bias_up[mine]])",
                   "gate_up_bias = weights.gate_up_bias[2 * rank * n:2 * (rank + 1) * n].clone()"),),
           expect="gate_up_bias differs"),
    Mutant(1, "interleaved features (every world_size-th) instead of a consecutive slice",
           edits=(("mine = slice(rank * n, (rank + 1) * n)", "mine = slice(rank, intermediate, world_size)"),),
           expect="differs"),
    Mutant(1, "off by one feature", edits=(("mine = slice(rank * n, (rank + 1) * n)", "mine = slice(rank * n + 1, (rank + 1) * n + 1)"),)),
    Mutant(1, "down sliced by rows (output features) instead of columns",
           edits=(("down=weights.down[:, mine].contiguous()", "down=weights.down[mine].contiguous()"),), expect="down has shape"),
    Mutant(1, "down shard is a view that keeps the whole weight alive",
           edits=(("down=weights.down[:, mine].contiguous()", "down=weights.down[:, mine]"),), expect="view"),
    Mutant(1, "down bias split over the ranks", edits=(("down_bias=weights.down_bias)", "down_bias=weights.down_bias / world_size)"),),
           expect="down_bias differs"),
    Mutant(1, "a split that does not divide is not refused",
           edits=(("    if intermediate % world_size:\n        raise ValueError(f\"intermediate size {intermediate} does not "
                   "split over {world_size} ranks\")\n", ""),), expect="no error"),
    Mutant(1, "delegates to minillm.distributed.linear.shard_mlp", code=(
        REF + "def shard_mlp(weights, rank, world_size):\n    return _ref.shard_mlp(weights, rank, world_size)\n"),
        expect="reference"),
    Mutant(1, "delegates the slicing to linear.column_shard and row_shard", code=(
        REF + "def shard_mlp(weights, rank, world_size):\n"
        "    i = weights.down.shape[1]\n"
        "    bias = weights.gate_up_bias\n"
        "    return MLPWeights(_ref.column_shard(weights.gate_up, rank, world_size, [i, i]),\n"
        "                      None if bias is None else _ref.column_shard(bias, rank, world_size, [i, i]),\n"
        "                      _ref.row_shard(weights.down, rank, world_size), weights.down_bias)\n"), expect="reference"),
    Mutant(1, "hands in the library's shard_mlp (delegates)", code=REF + "shard_mlp = _ref.shard_mlp\n"),
    _code_object_of(1, "shard_mlp", "shard_mlp"),
    # task 2: the forward on one rank, run on 2 gloo ranks
    Mutant(2, "all-reduce after the column-parallel layer too",
           edits=(("    gate, up = gate_up.chunk(2, dim=-1)\n",
                   "    dist.all_reduce(gate_up, group=group)\n    gate, up = gate_up.chunk(2, dim=-1)\n"),),
           expect="differs from one process"),
    Mutant(2, "missing all-reduce (each rank returns its partial sum)",
           edits=(("    dist.all_reduce(partial, group=group)\n", ""),), expect="differs from one process"),
    Mutant(2, "down bias added on every rank, before the all-reduce",
           edits=(("    dist.all_reduce(partial, group=group)\n    if shard.down_bias is not None:\n"
                   "        partial = partial + shard.down_bias\n",
                   "    if shard.down_bias is not None:\n        partial = partial + shard.down_bias\n"
                   "    dist.all_reduce(partial, group=group)\n"),), expect="differs from one process"),
    Mutant(2, "averages instead of summing",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    dist.all_reduce(partial, group=group)\n    partial = partial / dist.get_world_size(group)\n"),),
           expect="differs from one process"),
    Mutant(2, "gate_up bias left out", edits=(("        gate_up = gate_up + shard.gate_up_bias\n", "        pass\n"),),
           expect="differs from one process"),
    Mutant(2, "an extra all-reduce that changes nothing (2 collectives per MLP)",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    dist.all_reduce(partial, group=group)\n    dist.all_reduce(torch.zeros(1, dtype=x.dtype), group=group)\n"),),
           expect="2 collective(s)"),
    Mutant(2, "the all-reduce on rank 0 only (rank 1 never joins)",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    if dist.get_rank(group) == 0:\n        dist.all_reduce(partial, group=group)\n"),),
           expect="same collectives"),
    Mutant(2, "all-gathers the partial sums and adds them on every rank (world_size times the data of an all-reduce)",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]\n"
                   "    dist.all_gather(parts, partial, group=group)\n    partial = sum(parts)\n"),),
           expect="allgather"),
    Mutant(2, "all-reduce bound before the ranks start (from torch.distributed import all_reduce), made twice",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    _all_reduce(partial, group=group)\n    _all_reduce(torch.zeros(1, dtype=x.dtype), group=group)\n"),),
           code="from torch.distributed import all_reduce as _all_reduce\n", expect="2 collective(s)"),
    Mutant(2, "delegates to minillm.distributed.linear.mlp_forward", code=(
        REF + "def tp_mlp(x, shard, group=None):\n    return _ref.mlp_forward(x, shard, _ref.ParallelState(0, 2, group))\n"),
        expect="reference"),
    Mutant(2, "delegates the all-reduce to linear.ParallelState.all_reduce", edits=(
        ("    dist.all_reduce(partial, group=group)\n",
         "    from minillm.distributed.linear import ParallelState\n    ParallelState(0, 2, group).all_reduce(partial)\n"),),
        expect="reference"),
    _code_object_of(2, "tp_mlp", "mlp_forward"),
    # task 3: attention by heads
    Mutant(3, "replicated KV head picked as rank % num_kv_heads",
           edits=(("    kv_first, kv_last = first // group, last // group\n",
                   "    kv_first, kv_last = first // group, last // group\n"
                   "    if num_kv_heads < world_size:\n        kv_first = kv_last = rank % num_kv_heads\n"),),
           expect="the k weight differs"),
    Mutant(3, "KV heads split like query heads, never replicated",
           edits=(("    kv_first, kv_last = first // group, last // group\n",
                   "    kv_per_rank = max(1, num_kv_heads // world_size)\n"
                   "    kv_first, kv_last = rank * kv_per_rank, (rank + 1) * kv_per_rank - 1\n"),)),
    Mutant(3, "o_proj sliced by rows instead of columns", edits=(("o=wo[:, q_rows].contiguous()", "o=wo[q_rows].contiguous()"),),
           expect="the o weight"),
    Mutant(3, "head rows counted in heads, not head_dim rows",
           edits=(("q_rows = slice(first * head_dim, (last + 1) * head_dim)", "q_rows = slice(first, last + 1)"),)),
    Mutant(3, "KV heads that neither split nor replicate are not refused",
           edits=(("    if num_kv_heads % world_size and world_size % num_kv_heads:\n        raise ValueError(f\"{num_kv_heads} KV "
                   "heads neither split over nor replicate onto {world_size} ranks\")\n", ""),), expect="no error"),
    Mutant(3, "local head counts are the model's", edits=(("num_heads=per_rank,", "num_heads=num_heads,"),), expect="num_heads is"),
    Mutant(3, "delegates to minillm.distributed.linear.shard_attention", code=(
        REF + "def shard_attention(wq, wk, wv, wo, num_heads, num_kv_heads, rank, world_size):\n"
        "    return _ref.shard_attention(wq, wk, wv, wo, num_heads, num_kv_heads, rank, world_size)\n"), expect="reference"),
    Mutant(3, "delegates the KV heads to linear.kv_heads_of_rank", edits=(
        ("    kv_first, kv_last = first // group, last // group\n",
         "    kv = _ref.kv_heads_of_rank(num_heads, num_kv_heads, rank, world_size)\n    kv_first, kv_last = kv.start, kv.stop - 1\n"),),
        code=REF, expect="reference"),
    _code_object_of(3, "shard_attention", "shard_attention"),
]


def _source_reexecuted(task: int, learner: str, reference: str) -> Mutant:
    # the library's function made again from its source text, under the learner's name
    return Mutant(task, f"the library's answer under another name: {reference}'s source re-executed, not delegating",
                  code=(f"import inspect as _inspect\n{REF}_ns = dict(vars(_ref))\n"
                        f"exec(_inspect.getsource(_ref.{reference}).replace('def {reference}', 'def {learner}', 1), _ns)\n"
                        f"{learner} = _ns[{learner!r}]\n"))


# Answers that are not the learner's: the library's source, and the check's expected output read from the
# check's frame, which a forked rank inherits with the rest of the grading process's memory.
KNOWN_WRONG += [
    _source_reexecuted(1, "shard_mlp", "shard_mlp"),
    _source_reexecuted(2, "tp_mlp", "mlp_forward"),
    _source_reexecuted(3, "shard_attention", "shard_attention"),
    Mutant(2, "reads the expected output from the check's frame, inherited by the forked rank", code=(
        "import sys as _sys\n"
        "def tp_mlp(x, shard, group=None):\n"
        "    frame = _sys._getframe(1)\n"
        "    while frame is not None and 'expected' not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        "    for want in frame.f_locals['expected']:\n"
        "        if want.shape[0] == x.shape[0] and want.shape[1] == shard.down.shape[0]:\n"
        "            return want.clone()\n"), expect="looked into the running program"),
]


# Answers memoised before the check: the reference's outputs for the grader's seeded cases, computed in the
# learner's cell (where the reference is not disabled); the cases drawn at grade time are not in the memo.
KNOWN_WRONG += [
    Mutant(2, "memoises the reference's outputs for the seeded cases (delegates ahead of time)", code=(
        REF + "_memo = {}\n"
        "for _n, (_t, _h, _i, _b) in enumerate(grader.MLP_CASES):\n"
        "    _w = grader._weights(_h, _i, seed=200 + _n, bias=_b)\n"
        "    _x = torch.randn(_t, _h, generator=torch.Generator().manual_seed(201 + _n), dtype=torch.float64)\n"
        "    _memo[_x.numpy().tobytes()] = _ref.mlp_forward(_x, _w, _ref.ParallelState())\n"
        "def tp_mlp(x, shard, group=None):\n"
        "    dist.all_reduce(torch.zeros(1, dtype=x.dtype), group=group)\n"
        "    return _memo[x.numpy().tobytes()].clone()\n"), expect="KeyError"),
]


# Issue 27: a forward written for 2 ranks only, and shards that are views into the whole weight.
KNOWN_WRONG += [
    Mutant(2, "hard-coded for 2 ranks: half the down bias added on every rank before the all-reduce",
           edits=(("    dist.all_reduce(partial, group=group)\n    if shard.down_bias is not None:\n"
                   "        partial = partial + shard.down_bias\n",
                   "    if shard.down_bias is not None:\n        partial = partial + shard.down_bias / 2\n"
                   "    dist.all_reduce(partial, group=group)\n"),), expect="4 ranks"),
    Mutant(2, "hard-coded for 2 ranks: averages the partial sums, then doubles them",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    dist.all_reduce(partial, group=group)\n    partial = partial / dist.get_world_size(group) * 2\n"),),
           expect="4 ranks"),
    Mutant(3, "shards are views into the whole weights (no copy)",
           edits=(("q=wq[q_rows].clone(), k=wk[kv_rows].clone(), v=wv[kv_rows].clone()",
                   "q=wq[q_rows], k=wk[kv_rows], v=wv[kv_rows]"),), expect="view into the whole weight"),
    Mutant(3, "o shard is a column view of o_proj (strided, keeps all of it)",
           edits=(("o=wo[:, q_rows].contiguous()", "o=wo[:, q_rows]"),), expect="the o shard is a view"),
    Mutant(3, "shards are views into one copy of the whole weight",
           edits=(("q=wq[q_rows].clone(),", "q=wq.clone()[q_rows],"),), expect="the q shard is a view"),
]


# A forward that is right on 2, 3 and 4 ranks only: while task 2 drew one of 3 and 6 ranks per grade, it passed
# half the grades; both run in every grade now.
KNOWN_WRONG += [
    Mutant(2, "tried on up to 4 ranks only: ranks 4 and up leave their partial sum out",
           edits=(("    dist.all_reduce(partial, group=group)\n",
                   "    if dist.get_rank(group) >= 4:\n        partial = torch.zeros_like(partial)\n"
                   "    dist.all_reduce(partial, group=group)\n"),), expect="6 ranks"),
]
