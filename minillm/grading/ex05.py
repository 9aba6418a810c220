"""Grader of exercise 05 (chapter 05: paged KV): the allocator, block tables, the engine, vectorised slots.

Tasks 1 and 2 need no model: they replay seeded sequences of operations on the learner's code and
on minillm's (`BlockAllocator`, `BlockManager`) and compare the state after every operation. The
reference is disabled (`forbid`) while the learner's code runs. Task 4 hands the learner's function
tensors that refuse element-by-element access (`NoLoops`), so only a vectorised answer passes.
"""

from __future__ import annotations

import random

import torch

from minillm import LLM, SamplingParams
from minillm.grading import Fail, forbid, grade_time_seeds, refuse_subclass, run_until_done, task
from minillm.kv.block_allocator import BlockAllocator
from minillm.kv.block_manager import BlockManager
from minillm.kv.block_table import BlockTableBuffer
from minillm.llm import BUNDLED_TARGET
from minillm.request import Request

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = ("NoLoops",)  # task 4 hands the tensors in as NoLoops

# What the learner writes in task 1: disabled while learner code runs (the engine still builds a
# BlockAllocator before the factory replaces it, so __init__ stays allowed in task 3).
ALLOCATOR_METHODS = tuple((BlockAllocator, name) for name in ("allocate", "share", "release", "uncache"))


def _outcome(call, *args):
    # What an operation did: its result, or the kind of error it raised.
    try:
        return ("ok", call(*args))
    except Exception as error:  # minillm raises RuntimeError; anything else is a difference
        return (type(error).__name__, None)


def _allocator_state(allocator):
    return list(allocator.free_blocks), list(allocator.ref_counts), allocator.num_free


@task(1, "allocator")
def check_task_1(make_allocator, num_sequences: int = 200) -> str:
    if isinstance(make_allocator, type):
        refuse_subclass(make_allocator, BlockAllocator)
    for seed in [*range(num_sequences), *grade_time_seeds(FRESH_CASES)]:  # fresh ones cannot be memoised
        rng = random.Random(seed)
        num_blocks = rng.randint(1, 12)
        ref = BlockAllocator(num_blocks)
        with forbid(BlockAllocator):
            mine = make_allocator(num_blocks)
        history = []
        for _ in range(rng.randint(1, 40)):
            in_use = [b for b in range(num_blocks) if ref.ref_counts[b] > 0]
            roll = rng.random()
            if roll < 0.45 or not in_use:
                op = ("allocate",)
            elif roll < 0.6:
                op = ("share", rng.choice(in_use))
            elif roll < 0.95:
                op = ("release", rng.choice(in_use))
            else:  # releasing a block nobody holds is a bug the allocator must refuse
                free = [b for b in range(num_blocks) if ref.ref_counts[b] == 0]
                op = ("release", rng.choice(free)) if free else ("allocate",)
            history.append(op)
            args = (op[1], False) if op[0] == "release" else op[1:]  # release(block, keep_cached=False)
            expected = _outcome(getattr(ref, op[0]), *args)
            with forbid(BlockAllocator):
                got = _outcome(getattr(mine, op[0]), *args)
                try:
                    state = _allocator_state(mine)
                except Exception as error:  # noqa: BLE001
                    state = f"{type(error).__name__}: {error}"
            if got != expected or state != _allocator_state(ref):
                free, refs, num_free = _allocator_state(ref)
                raise Fail(f"seed {seed}, {num_blocks} blocks, after {history[-6:]} (last 6 operations): "
                           f"yours returned {got}, state {state}; BlockAllocator returned {expected}, "
                           f"free list {free}, ref counts {refs}, num_free {num_free}")
    return f"{num_sequences} seeded operation sequences: results, free lists and ref counts agree with BlockAllocator"


@task(2, "block tables")
def check_task_2(grow_table, slots_for, num_traces: int = 100) -> str:
    for seed in range(num_traces):
        rng = random.Random(1000 + seed)
        block_size, num_blocks = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 24)
        ref = BlockManager(1, 1, 8, num_blocks=num_blocks, block_size=block_size, allocate_pool=False, watermark=0.0)
        allocator = BlockAllocator(num_blocks)  # minillm's allocator under your tables: task 2 checks only them
        tables: dict[str, list[int]] = {}
        requests = [Request(f"r{i}", [5] * rng.randint(1, 40), SamplingParams(max_tokens=64), 0.0)
                    for i in range(rng.randint(1, 6))]
        for _ in range(rng.randint(1, 30)):
            req = rng.choice(requests)
            rid, start = req.request_id, req.num_computed_tokens
            if start and rng.random() < 0.15:  # the request finishes (or is preempted): all its blocks go back
                ref.free(req)
                for block in reversed(tables.pop(rid)):
                    allocator.release(block, keep_cached=False)
                req.num_computed_tokens = 0
                continue
            n = req.num_prompt_tokens if start == 0 else rng.choice([1, 1, 1, rng.randint(1, 20)])
            expected = ref.allocate(req, n)
            ref.commit_step()  # what the engine does once the step has run
            table = tables.setdefault(rid, [])
            where = f"seed {seed} (block_size {block_size}, {num_blocks} blocks), request {rid} at {start} + {n} tokens"
            with forbid(BlockManager, BlockTableBuffer):
                got = grow_table(table, start + n, block_size, allocator)
            if got != expected or table != ref.block_tables.get(rid, []):
                raise Fail(f"{where}: grow_table returned {got} and left the table {table}; BlockManager.allocate "
                           f"returned {expected}, table {ref.block_tables.get(rid, [])}")
            if not table:
                del tables[rid]
            if not expected:
                continue
            ref_slots = ref.slot_mapping([req], [n]).tolist()
            ref_keys = ref.key_index([req], [start + n])[0].tolist()
            with forbid(BlockManager, BlockTableBuffer):
                slots = list(slots_for(table, start, n, block_size))
                keys = list(slots_for(table, 0, start + n, block_size))
            if slots != ref_slots:
                raise Fail(f"{where}: your slots for the new tokens {slots}, BlockManager.slot_mapping {ref_slots}")
            if keys != ref_keys:
                raise Fail(f"{where}: your slots for positions 0..{start + n - 1} {keys}, "
                           f"BlockManager.key_index {ref_keys}")
            req.num_computed_tokens = start + n
    return f"{num_traces} seeded traces: tables, slot mappings and key indices agree with BlockManager"


PROMPTS = ["Once upon a time", "The little robot", "In the morning the market", "She opened the door and",
           "A long time ago", "The rain fell on", "He looked at the map", "Every evening the old man",
           "The train was late", "Under the bridge", "They walked to the river", "The garden was quiet"]
OUTPUT_LENS = [40, 6, 52, 18, 33, 4, 47, 25, 12, 38, 9, 44]
# A small pool (24 blocks of 8 slots for up to 8 requests): blocks are reused, and requests are preempted.
ENGINE_KNOBS = dict(batching="continuous", kv_layout="paged", block_size=8, num_kv_blocks=24, max_num_seqs=8,
                    max_model_len=128)


def _engine_run(llm, max_iterations=2_000):
    # llm.generate's loop with a cap: an allocator that never frees a block would stall it forever.
    engine = llm.engine
    requests = [engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for prompt, n in zip(PROMPTS, OUTPUT_LENS)]  # all requests waiting at t = 0
    engine.expect_more_requests = False
    run_until_done(engine, max_iterations, "the engine stalled: {unfinished} requests unfinished after "
                   f"{max_iterations} iterations (are released blocks returned to the free list?)")
    allocator = engine.kv.allocator
    in_use = sum(1 for count in allocator.ref_counts if count > 0)
    return ([list(r.output_token_ids) for r in requests], len(engine.metrics.steps),
            engine.scheduler.num_preemptions, in_use)


@task(3, "real engine")
def check_task_3(make_llm, allocator_class) -> list[str]:
    if isinstance(allocator_class, type):
        refuse_subclass(allocator_class, BlockAllocator)
    with forbid(*ALLOCATOR_METHODS):
        llm = make_llm(**ENGINE_KNOBS)
        used = type(llm.engine.kv.allocator).__name__
        if not isinstance(llm.engine.kv.allocator, allocator_class):
            raise Fail(f"the engine's BlockManager uses {used}, not your {allocator_class.__name__}")
    ref_tokens, ref_steps, ref_preemptions, _ = _engine_run(LLM(BUNDLED_TARGET, **ENGINE_KNOBS))
    with forbid(*ALLOCATOR_METHODS):
        tokens, steps, preemptions, in_use = _engine_run(llm)
    lines = [f"allocator in the engine: {used}",
             f"outputs identical to minillm's own paged engine: {tokens == ref_tokens}",
             f"engine steps: yours {steps}, minillm {ref_steps}",
             f"preemptions: yours {preemptions}, minillm {ref_preemptions}",
             f"blocks in use at the end: {in_use}"]
    if (tokens, steps, preemptions, in_use) != (ref_tokens, ref_steps, ref_preemptions, 0):
        raise Fail("your engine run differs from minillm's: " + "; ".join(lines[1:]))
    return lines


# --- task 4: vectorised -------------------------------------------------------------------------


class NoLoops(torch.Tensor):
    """A tensor that refuses to be taken apart element by element: iterating it, indexing its first
    dimension with a Python int, or `.tolist()` / `.item()` / `int()` on more than one element raise.
    Whole-tensor operations (arithmetic, gather, repeat_interleave, cumsum, indexing by tensors)
    work as usual, and their results are NoLoops too."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__iter__", "tolist", "unbind") or (name in ("item", "__int__", "__index__", "__float__")
                                                        and args and args[0].numel() > 1):
            raise Fail(f"your code takes a tensor apart element by element (Tensor.{name}): "
                       "task 4 wants whole-tensor operations, no Python loop over rows or tokens")
        if name == "__getitem__" and len(args) > 1:
            index = args[1]
            first = index[0] if isinstance(index, tuple) and index else index
            if isinstance(first, int) and not isinstance(first, bool):
                raise Fail("your code indexes a tensor row by row (tensor[i]): task 4 wants whole-tensor "
                           "operations, no Python loop over rows")
        return super().__torch_function__(func, types, args, kwargs)


def _slots_case(rng: random.Random):
    block_size = rng.choice([1, 2, 4, 8, 16])
    rows = rng.randint(1, 12)
    width = rng.randint(1, 10)
    tables, starts, counts = [], [], []
    for _ in range(rows):
        used = rng.randint(1, width)
        blocks = rng.sample(range(200), used) + [-1] * (width - used)  # padded with -1
        capacity = used * block_size
        start = rng.randint(0, capacity - 1)
        count = rng.randint(0, capacity - start)
        tables.append(blocks)
        starts.append(start)
        counts.append(count)
    return tables, starts, counts, block_size


def _expected_slots(tables, starts, counts, block_size):
    return [tables[r][p // block_size] * block_size + p % block_size
            for r in range(len(tables)) for p in range(starts[r], starts[r] + counts[r])]


@task(4, "vectorised slot mapping")
def check_task_4(slot_mapping, num_cases: int = 300) -> str:
    rng = random.Random(55)
    cases = [([[3, 7, -1]], [0], [6], 4), ([[5, -1], [2, 9]], [3, 1], [1, 4], 4), ([[0, 1], [4, -1]], [0, 1], [0, 1], 2),
             ([[9, 8, 7, 6]], [1], [3], 1)]  # a row with nothing new; block_size 1
    cases += [_slots_case(rng) for _ in range(num_cases)]
    cases += [_slots_case(random.Random(seed)) for seed in grade_time_seeds(FRESH_CASES)]  # cannot be memoised
    for number, (tables, starts, counts, block_size) in enumerate(cases):
        want = _expected_slots(tables, starts, counts, block_size)
        args = [torch.tensor(x, dtype=torch.long).as_subclass(NoLoops) for x in (tables, starts, counts)]
        with forbid(BlockManager, BlockTableBuffer):
            got = slot_mapping(*args, block_size)
        if not isinstance(got, torch.Tensor):
            raise Fail(f"case {number}: slot_mapping returned {type(got).__name__}, not a tensor")
        got = torch.Tensor.as_subclass(got, torch.Tensor)
        if got.dtype != torch.long or got.dim() != 1:
            raise Fail(f"case {number}: returned dtype {got.dtype}, shape {tuple(got.shape)}; expected a 1-D int64 tensor")
        if got.tolist() != want:
            raise Fail(f"case {number}: block_size {block_size}, tables {tables}, starts {starts}, counts {counts}: "
                       f"you returned {got.tolist()}, expected {want}")
    seeded = len(cases) - FRESH_CASES  # the PASS line counts the seeded cases (the fresh ones differ per run)
    return f"{seeded} ragged batches (padded tables, empty rows, block_size 1..16), whole-tensor operations only"
