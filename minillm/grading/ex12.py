"""Grader of exercise 12 (chapter 12: tensor parallelism): an MLP and an attention block split over ranks.

Task 1 (shard the MLP) and task 3 (shard attention by heads) need no processes: the learner's
shards are compared exactly with `minillm.distributed.linear`'s for many shapes and rank counts.
Task 2 runs the learner's forward where it belongs: on 2, then 4, then 3 and 6 processes (these two on
weights drawn when the check runs; a forward written for one rank count fails) joined by torch.distributed
(gloo on loopback, `minillm.distributed.launch.run_ranks`: forked, bounded in time, every process
stopped), each rank with its shard, and compares every rank's output with one process computing
the whole MLP in float64. It also counts the collectives the forward makes. Task 3 then runs the
attention block on the learner's shards on 2 ranks and compares it with one process. Shards must hold
their own memory: a view into the whole weight (its storage larger than the shard, or inside the
weight's) fails tasks 1 and 3. Every task
adds cases whose weights are drawn when the check runs (`grade_time_seeds`), so answers memoised
from the reference beforehand fail.

The reference (`minillm.distributed.linear`) is disabled while learner code runs (`forbid`), in
the forked ranks too (they inherit it); a rank reports a call to it back to this process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.distributed import linear
from minillm.distributed.launch import RankError, run_ranks
from minillm.grading import DelegationError, Fail, forbid, grade_time_seeds, task

LEARNER_TOOLS = ()  # nothing here is lent to the learner

# Everything in minillm.distributed.linear that answers a task (its dataclasses stay usable: the
# learner returns MLPWeights and AttentionShard).
REFERENCE = (linear.divide, linear.column_shard, linear.row_shard, linear.shard_mlp, linear.mlp_forward,
             linear.kv_heads_of_rank, linear.shard_attention, linear.attention_forward,
             linear.all_reduce_bytes_per_token, linear.ColumnParallelLinear, linear.RowParallelLinear,
             linear.VocabParallelEmbedding, (linear.ParallelState, "of"), (linear.ParallelState, "all_reduce"))
WORLD_SIZE = 2
FRESH_CASES = 2  # per task, weights (and inputs) from seeds drawn when the check runs: not memoisable
RANKS_TIMEOUT_S = 60
# The ProcessGroup methods every torch.distributed collective ends in (counted in the forked ranks
# only): wrapping them counts a learner's `from torch.distributed import all_reduce` too.
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
               "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "alltoall",
               "alltoall_base", "all_to_all_single", "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base",
               "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
               "gather", "scatter", "send", "recv", "recv_anysource")


def _weights(hidden: int, intermediate: int, seed: int, bias: bool = True) -> linear.MLPWeights:
    g = torch.Generator().manual_seed(seed)
    def draw(*shape):  # noqa: E306
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    return linear.MLPWeights(gate_up=draw(2 * intermediate, hidden), gate_up_bias=draw(2 * intermediate) if bias else None,
                             down=draw(hidden, intermediate), down_bias=draw(hidden) if bias else None)


def _mlp_one_process(x: torch.Tensor, w: linear.MLPWeights) -> torch.Tensor:
    intermediate = w.down.shape[1]
    gate_up = x @ w.gate_up.T + (0 if w.gate_up_bias is None else w.gate_up_bias)
    hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    return hidden @ w.down.T + (0 if w.down_bias is None else w.down_bias)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # float64 sums in another order: rounding of a few ulps of the largest value, never more
    return bool(((got - want).abs() <= 1e-12 * max(1.0, want.abs().max().item())).all())


def _owns_its_memory(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _holds_only_its_share(shard: torch.Tensor, full: torch.Tensor) -> bool:
    """The shard's storage is its own size and lies outside the whole weight's memory (not a view of it)."""
    start, size = full.untyped_storage().data_ptr(), full.untyped_storage().nbytes()
    inside = start <= shard.untyped_storage().data_ptr() < start + size
    return _owns_its_memory(shard) and not inside


def _same(got, want, what: str, where: str) -> None:
    if want is None:
        if got is not None:
            raise Fail(f"{where}: {what} should be None (the layer has none), got a {type(got).__name__}")
        return
    if not isinstance(got, torch.Tensor):
        raise Fail(f"{where}: {what} is a {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Fail(f"{where}: {what} has shape {tuple(got.shape)} ({got.dtype}); expected {tuple(want.shape)} "
                   f"({want.dtype})")
    if not torch.equal(got, want):
        rows = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        raise Fail(f"{where}: {what} differs from this rank's slice in row(s) {rows[:8]} of {got.shape[0]}")


def _refuses(call, args: tuple, case: str) -> None:
    try:
        call(*args)
    except ValueError:
        return
    except Exception as error:  # noqa: BLE001
        raise Fail(f"{case}: raised {type(error).__name__}: {error}; expected a ValueError naming the numbers") from None
    raise Fail(f"{case}: no error; a split that does not divide must raise ValueError (it would drop features)")


# --- task 1: shard the MLP -------------------------------------------------------------------------

MLP_SHAPES = [(8, 12, 2), (8, 12, 3), (8, 12, 4), (6, 8, 1), (4, 6, 2), (10, 20, 5), (8, 12, 6)]


@task(1, "shard the MLP")
def check_task_1(shard_mlp) -> list[str]:
    checked = 0
    cases = [*zip(MLP_SHAPES, range(len(MLP_SHAPES))), *zip(MLP_SHAPES[:FRESH_CASES], grade_time_seeds(FRESH_CASES))]
    for case, ((hidden, intermediate, size), seed) in enumerate(cases):
        full = _weights(hidden, intermediate, seed=seed, bias=case != 3)
        expected = [linear.shard_mlp(full, rank, size) for rank in range(size)]
        for rank in range(size):
            where = f"H={hidden}, I={intermediate}, rank {rank} of {size}"
            with forbid(*REFERENCE):
                got = shard_mlp(full, rank, size)
            for field in ("gate_up", "gate_up_bias", "down", "down_bias"):
                if not hasattr(got, field):
                    raise Fail(f"{where}: the result has no .{field}: return an MLPWeights")
                _same(getattr(got, field), getattr(expected[rank], field), field, where)
            for field in ("gate_up", "down"):
                if size > 1 and not _holds_only_its_share(getattr(got, field), getattr(full, field)):
                    raise Fail(f"{where}: {field} is a view into the whole weight, which it keeps alive: each "
                               "rank should hold only its slice (copy it)")
            checked += 1
    full = _weights(8, 12, seed=99)
    for size in (5, 8):
        with forbid(*REFERENCE):
            _refuses(shard_mlp, (full, 0, size), f"I=12 over {size} ranks")
    return [f"{checked} (shape, rank) cases, 1 to 6 ranks: gate and up sliced alike, down by columns, "
            "biases as the layers need them, each shard its own memory (some weights drawn as the check ran)",
            "I=12 over 5 or 8 ranks refused with a ValueError"]


# --- task 2: the forward on one rank, under torch.distributed --------------------------------------

MLP_CASES = [(1, 8, 12, True), (5, 8, 12, True), (7, 16, 24, True), (3, 8, 4, False), (4, 6, 10, True),
             (2, 6, 24, False)]


def _count_collectives(log: list) -> None:
    """Wrap the process group's collectives with counting ones (in a forked rank only)."""
    process_group = torch._C._distributed_c10d.ProcessGroup
    for name in COLLECTIVES:
        original = getattr(process_group, name, None)
        if original is None:
            continue

        def counted(self, *args, _name=name, _original=original, **kwargs):
            log.append(_name)
            return _original(self, *args, **kwargs)

        setattr(process_group, name, counted)


def _rank_task_2(rank: int, world_size: int, tp_mlp, cases: list) -> list:
    from minillm import grading

    log: list = []
    _count_collectives(log)
    answers = []
    for x, shards in cases:
        del log[:]
        try:
            out = tp_mlp(x.clone(), shards[rank], None)
            out = torch.Tensor.as_subclass(out, torch.Tensor).detach().clone() if isinstance(out, torch.Tensor) else out
            answer = ("ok", out if isinstance(out, torch.Tensor) else repr(out)[:200], list(log))
        except BaseException as error:  # noqa: BLE001  (reported to the check, in the parent)
            answer = ("error", type(error).__name__, str(error)[:500])
        if grading._HITS:
            answer = ("hit", grading._HITS[0], "")
        answers.append(answer)
        if answer[0] != "ok":
            break
    return answers


def _mlp_cases(shapes: list, seeds: list[int], world_size: int) -> tuple[list, list]:
    cases, expected = [], []
    for (tokens, hidden, intermediate, bias), seed in zip(shapes, seeds):
        full = _weights(hidden, intermediate, seed=seed, bias=bias)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        cases.append((x, [linear.shard_mlp(full, rank, world_size) for rank in range(world_size)]))
        expected.append(_mlp_one_process(x, full))
    return cases, expected


def _run_mlp_on_ranks(tp_mlp, world_size: int, shapes: list, seeds: list[int]) -> None:
    cases, expected = _mlp_cases(shapes, seeds, world_size)
    with forbid(*REFERENCE):
        try:
            answers = run_ranks(_rank_task_2, world_size, (tp_mlp, cases), timeout_s=RANKS_TIMEOUT_S)
        except RankError as error:
            raise Fail(f"the {world_size} ranks did not finish: {str(error).splitlines()[0]}") from None
    for rank, rank_answers in enumerate(answers):
        for number, answer in enumerate(rank_answers):
            tokens, hidden, intermediate, bias = shapes[number]
            where = (f"{world_size} ranks, rank {rank}, case {number} (T={tokens}, H={hidden}, I={intermediate}, "
                     f"bias {bias})")
            if answer[0] == "hit":
                raise DelegationError(answer[1])
            if answer[0] == "error":
                if answer[1] == "NotImplementedError":
                    raise NotImplementedError(answer[2])
                # a peer that never joined shows as a hang (timeout) or, once it has exited, a closed or reset link
                stuck = any(word in answer[2] for word in ("Connection closed", "Connection reset", "Broken pipe",
                                                           "imed out", "timeout"))
                hint = " (do all ranks make the same collectives, in the same order?)" if stuck else ""
                raise Fail(f"{where}: your tp_mlp raised {answer[1]}: {answer[2]}{hint}")
            out, log = answer[1], answer[2]
            want = expected[number]
            if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                shown = tuple(out.shape) if isinstance(out, torch.Tensor) else out
                raise Fail(f"{where}: returned {shown}; every rank returns the whole output, shape {tuple(want.shape)}")
            if not _close(out, want):
                error = (out - want).abs().max().item()
                raise Fail(f"{where}: differs from one process by up to {error:.3g} (first row: yours "
                           f"{[round(v, 4) for v in out[0, :4].tolist()]}, one process "
                           f"{[round(v, 4) for v in want[0, :4].tolist()]}): which outputs are partial sums, "
                           "and where is each bias added?")
            if log != ["allreduce"]:
                raise Fail(f"{where}: your forward made {len(log)} collective(s) through torch.distributed's process "
                           f"group ({', '.join(log) or 'none'}); column then row parallel needs exactly one "
                           "all-reduce (dist.all_reduce), after the row-parallel layer")


SEEDED_WORLD_SIZES = (2, 4)  # task 2's runs on the seeded weights
DRAWN_WORLD_SIZES = (3, 6)  # then on weights drawn as the check runs (a run of 3 or 6 ranks is a tenth of a second)


@task(2, "forward on 2 and more ranks")
def check_task_2(tp_mlp) -> list[str]:
    # Every rank count in every grade: a forward written for one count (a bias divided by 2) cannot pass, nor one
    # that handles 3 ranks and not 6 (when one of the two was drawn per grade, it passed half the grades).
    seeds = grade_time_seeds(FRESH_CASES * len(DRAWN_WORLD_SIZES))
    runs = [(size, [s for s in MLP_CASES if s[2] % size == 0], None) for size in SEEDED_WORLD_SIZES]
    runs += [(size, [s for s in MLP_CASES if s[2] % size == 0][:FRESH_CASES],
              seeds[FRESH_CASES * i:FRESH_CASES * (i + 1)]) for i, size in enumerate(DRAWN_WORLD_SIZES)]
    count = 0
    for number, (size, shapes, drawn) in enumerate(runs):
        fixed = [200 + 10 * number + index for index in range(len(shapes))]
        _run_mlp_on_ranks(tp_mlp, size, shapes, drawn if drawn is not None else fixed)
        count += len(shapes)
    hidden, tokens = MLP_CASES[1][1], MLP_CASES[1][0]
    return [f"{count} cases (1 to 7 tokens, with and without biases) on 2, 4, 3 and 6 gloo ranks (on 3 and 6, weights "
            "drawn as the check ran): every rank's output equals one process's MLP in float64 (1e-12)",
            f"collectives per forward: one all-reduce; for T={tokens}, H={hidden} it sums {tokens * hidden * 8} "
            "bytes of float64 per rank"]


# --- task 3: attention, split by heads -------------------------------------------------------------

HEAD_DIM = 2
HEAD_CASES = [(4, 4, 2), (4, 2, 2), (4, 1, 2), (6, 2, 2), (8, 8, 4), (8, 2, 4), (8, 1, 4), (4, 2, 4), (8, 2, 8),
              (6, 3, 3), (6, 6, 1)]
BAD_HEAD_CASES = [(6, 6, 4), (6, 3, 2), (8, 2, 3), (12, 3, 2), (6, 2, 3)]
RUN_CASES = [(4, 4), (4, 2), (4, 1)]  # (heads, kv heads) run on 2 ranks


def _attention_weights(num_heads: int, num_kv_heads: int, hidden: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(num_heads * HEAD_DIM, hidden), (num_kv_heads * HEAD_DIM, hidden), (num_kv_heads * HEAD_DIM, hidden),
              (hidden, num_heads * HEAD_DIM)]
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def _attention_one_process(x, wq, wk, wv, wo, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    tokens = x.shape[0]
    q = (x @ wq.T).view(tokens, num_heads, HEAD_DIM).transpose(0, 1)
    k = (x @ wk.T).view(tokens, num_kv_heads, HEAD_DIM).transpose(0, 1)
    v = (x @ wv.T).view(tokens, num_kv_heads, HEAD_DIM).transpose(0, 1)
    scores = q @ k.repeat_interleave(num_heads // num_kv_heads, dim=0).transpose(1, 2) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    heads = scores.softmax(dim=-1) @ v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    return heads.transpose(0, 1).reshape(tokens, -1) @ wo.T


def _rank_task_3(rank: int, world_size: int, runs: list) -> list:
    return [linear.attention_forward(x, shards[rank], linear.ParallelState.of()) for x, shards in runs]


@task(3, "attention by heads")
def check_task_3(shard_attention) -> list[str]:
    checked, runs, expected = 0, [], []
    seeds = [400 + number for number in range(len(HEAD_CASES))] + grade_time_seeds(FRESH_CASES)
    for (heads, kv_heads, size), seed in zip(HEAD_CASES + HEAD_CASES[5:5 + FRESH_CASES], seeds):
        weights = _attention_weights(heads, kv_heads, hidden=6, seed=seed)
        for rank in range(size):
            want = linear.shard_attention(*weights, heads, kv_heads, rank, size)
            where = f"{heads} query heads, {kv_heads} KV heads (head_dim {HEAD_DIM}), rank {rank} of {size}"
            with forbid(*REFERENCE):
                got = shard_attention(*weights, heads, kv_heads, rank, size)
            for field in ("q", "k", "v", "o"):
                if not hasattr(got, field):
                    raise Fail(f"{where}: the result has no .{field}: return an AttentionShard")
                _same(getattr(got, field), getattr(want, field), f"the {field} weight", where)
            for field, full in zip(("q", "k", "v", "o"), weights):
                if size > 1 and not _holds_only_its_share(getattr(got, field), full):
                    raise Fail(f"{where}: the {field} shard is a view into the whole weight, which it keeps alive: "
                               "each rank should hold only its heads (copy them)")
            for field in ("num_heads", "num_kv_heads"):
                if getattr(got, field, None) != getattr(want, field):
                    raise Fail(f"{where}: {field} is {getattr(got, field, None)!r}, this rank holds "
                               f"{getattr(want, field)}")
            checked += 1
    for heads, kv_heads, size in BAD_HEAD_CASES:
        weights = _attention_weights(heads, kv_heads, hidden=6, seed=1)
        with forbid(*REFERENCE):
            _refuses(shard_attention, (*weights, heads, kv_heads, 0, size),
                     f"{heads} query heads, {kv_heads} KV heads over {size} ranks")
    for (heads, kv_heads), seed in zip(RUN_CASES, grade_time_seeds(len(RUN_CASES))):
        weights = _attention_weights(heads, kv_heads, hidden=6, seed=seed)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        with forbid(*REFERENCE):
            shards = [shard_attention(*weights, heads, kv_heads, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
        runs.append((x, shards))
        expected.append(_attention_one_process(x, *weights, heads, kv_heads))
    try:
        outputs = run_ranks(_rank_task_3, WORLD_SIZE, (runs,), timeout_s=RANKS_TIMEOUT_S)
    except RankError as error:
        raise Fail(f"the attention block did not run on your shards: {str(error).splitlines()[0]}") from None
    for rank, rank_outputs in enumerate(outputs):
        for (heads, kv_heads), out, want in zip(RUN_CASES, rank_outputs, expected):
            if not _close(out, want):
                raise Fail(f"{heads} query heads, {kv_heads} KV heads on {WORLD_SIZE} ranks: rank {rank}'s attention "
                           f"output differs from one process by {(out - want).abs().max().item():.3g}")
    return [f"{checked} (heads, KV heads, rank) cases, 1 to 8 ranks, KV heads replicated when fewer than ranks, "
            "each shard its own memory",
            f"{len(BAD_HEAD_CASES)} splits that do not divide refused with a ValueError",
            f"the attention block on your shards, {WORLD_SIZE} gloo ranks, 1 to 4 KV heads: equal to one process (1e-12)"]
