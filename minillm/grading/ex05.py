"""Grader of exercise 05 (chapter 05: paged KV): a lowest-first allocator, ring block tables, the
engine, a padded matrix of slots computed with whole-tensor operations.

Tasks 1, 2 and 4 need no model: they replay seeded sequences of operations (and some drawn at grade
time) on the learner's code and on references of the variants chapter 05 does not show, which are
grader-private (`minillm.grading.private.ex05_reference`). minillm's `BlockAllocator` and
`BlockManager` are disabled (`forbid`) while the learner's code runs, and task 3 compares the
engine with minillm's own. Task 4 hands the learner's function tensors that refuse element-by-element
access (`NoLoops`), switches off every way out of torch (numpy, lists, storage) during the call, and
counts the torch operations it dispatches: a bound independent of the batch's size leaves no room for
a Python loop over rows or tokens. The C methods under torch.Tensor's (`torch._C.TensorBase.tolist`,
`.numpy`, `.data_ptr`, `.untyped_storage`, dlpack) are refused too, whichever way they are called, and
so is a tensor built from a list of Python numbers (`torch.tensor(rows)`): the way back into torch
after a Python loop.

Tasks 1 and 2 grade in a student release too, with answer keys (`minillm.grading.answer_key`): a case
is four operation sequences (task 1) or four traces (task 2), and its digest covers every operation's
result and the state after it. The sequences are driven by what the code under test returns (a
release block is one the allocator handed out), so the learner's and the reference's runs are the
same sequence exactly when every answer is right.
"""

from __future__ import annotations

import operator
import random
import sys
import threading
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm import LLM, SamplingParams
from minillm.grading import (
    _HITS,
    Fail,
    forbid,
    grade_time_seeds,
    private_reference,
    refuse_subclass,
    run_until_done,
    task,
)
from minillm.grading.answer_key import AnswerKey
from minillm.grading.plug_in import knobs_reach_the_engine
from minillm.kv.block_allocator import BlockAllocator
from minillm.kv.block_manager import BlockManager
from minillm.kv.block_table import BlockTableBuffer
from minillm.llm import BUNDLED_TARGET

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = ("NoLoops",)  # task 4 hands the tensors in as NoLoops
_TEACHERS = (private_reference("ex05_reference"),)  # the variants' references: withheld in a student release


def _private():
    """The grader-private references, loaded at import. Held in a tuple, not as a module global, so
    that looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]


# What the learner writes in task 1: disabled while learner code runs (the engine still builds a
# BlockAllocator before the factory replaces it, so __init__ stays allowed in task 3).
ALLOCATOR_METHODS = tuple((BlockAllocator, name) for name in ("allocate", "share", "release", "uncache"))


def _outcome(call, *args):
    # What an operation did: its result, or the kind of error it raised.
    try:
        return ("ok", call(*args))
    except NotImplementedError:
        raise  # a stub: the task is not written yet
    except Exception as error:  # minillm raises RuntimeError; anything else is a difference
        return (type(error).__name__, None)


def _allocator_state(allocator):
    return sorted(allocator.free_blocks), list(allocator.ref_counts), allocator.num_free


SEQUENCES = 4  # operation sequences (task 1) or traces (task 2) in one case: one digest covers them all


def _sequence_seeds(number):
    return [number * SEQUENCES + j for j in range(SEQUENCES)]


def _operations(make_allocator, seed, state):
    """Run operation sequence `seed` on a fresh allocator: [operation, outcome, state after] per step.
    Which block a share or release names comes from the blocks the allocator handed out (its own
    answers), so a right allocator sees the very sequence the reference sees."""
    rng = random.Random(seed)
    num_blocks = rng.randint(1, 12)
    allocator = make_allocator(num_blocks)
    readers: dict[int, int] = {}  # what the results said: block -> holders
    out = []
    for _ in range(rng.randint(1, 40)):
        in_use = sorted(b for b, n in readers.items() if n > 0)
        roll = rng.random()
        if roll < 0.45 or not in_use:
            op = ("allocate",)
        elif roll < 0.6:
            op = ("share", rng.choice(in_use))
        elif roll < 0.95:
            op = ("release", rng.choice(in_use))
        else:  # releasing a block nobody holds is a bug the allocator must refuse
            free = [b for b in range(num_blocks) if readers.get(b, 0) == 0]
            op = ("release", rng.choice(free)) if free else ("allocate",)
        args = (op[1], False) if op[0] == "release" else op[1:]  # release(block, keep_cached=False)
        outcome = _outcome(getattr(allocator, op[0]), *args)
        if outcome[0] == "ok":
            block = outcome[1] if op[0] == "allocate" else op[1]
            try:
                block = operator.index(block)
            except TypeError:  # not a block id: the transcript says so, the bookkeeping skips it
                block = None
            if block is not None:
                readers[block] = 1 if op[0] == "allocate" else readers.get(block, 0) + (1 if op[0] == "share" else -1)
        try:
            after = state(allocator)
        except Exception as error:  # noqa: BLE001
            after = f"{type(error).__name__}: {error}"
        out.append([list(op), list(outcome), list(after) if isinstance(after, tuple) else after])
    return [num_blocks, out]


def _lowest_first_state(allocator):
    return allocator.free_ids, list(allocator.ref_counts), len(allocator.free_ids)


def lowest_first_operations(number):
    """Task 1's expected output on case `number`: each of its sequences run on the lowest-first allocator."""
    return [_operations(_private().LowestFirstAllocator, seed, _lowest_first_state) for seed in _sequence_seeds(number)]


KEY_1 = AnswerKey("ex05_block_allocator", 1, size=256, seeded=50, reference=lowest_first_operations,
                  private=_TEACHERS[0])


def _operations_difference(number, mine, want):
    for seed, (num_blocks, steps), (_, ref_steps) in zip(_sequence_seeds(number), mine, want):
        for index, (step, ref) in enumerate(zip(steps + [None] * len(ref_steps), ref_steps)):
            if step != ref:
                history = [tuple(s[0]) for s in ref_steps[:index + 1]][-6:]
                got, state = (tuple(step[1]), step[2]) if step is not None else (None, None)
                return (f"seed {seed}, {num_blocks} blocks, after {history} (last 6 operations): yours returned "
                        f"{got}, state (free blocks sorted, ref counts, num_free) {state}; expected "
                        f"{tuple(ref[1])}, state {ref[2]} (allocate takes the lowest free block)")
    return f"seeds {_sequence_seeds(number)[0]}..{_sequence_seeds(number)[-1]}: your results differ"


def _judge_sequences(key, forbidden, run, what, detail, difference):
    """Tasks 1 and 2: each of `key`'s cases (seeded, and drawn now: fresh ones cannot be memoised) is
    SEQUENCES seeds; `run(seed)` is the learner's transcript of one, made with `forbidden` (minillm's
    own answer) disabled, and the case's transcripts are judged against the key; `difference(number,
    mine, want)` says where they first part."""
    for case in key.cases(fresh=FRESH_CASES // SEQUENCES):
        case.expected()
        seeds = _sequence_seeds(case.number)
        with forbid(*forbidden):
            mine = [run(seed) for seed in seeds]
        case.judge(mine, f"{what} {seeds[0]}..{seeds[-1]} ({detail})",
                   lambda mine, want, number=case.number: difference(number, mine, want))


@task(1, "allocator")
def check_task_1(make_allocator) -> str | list[str]:
    if isinstance(make_allocator, type):
        refuse_subclass(make_allocator, BlockAllocator)
    _judge_sequences(KEY_1, (BlockAllocator,), lambda seed: _operations(make_allocator, seed, _allocator_state),
                     "operation sequences", "every result and the state after it", _operations_difference)
    return KEY_1.report(f"{KEY_1.seeded * SEQUENCES} seeded operation sequences and {FRESH_CASES} drawn now: results, "
                        "free blocks and ref counts as the lowest-first rules say")


def _ring_grow(table, num_tokens, block_size, max_blocks, allocator):
    """The ring table's growth, as the reference does it: to ring_length blocks, all or nothing."""
    extra = max(0, _private().ring_length(num_tokens, block_size, max_blocks) - len(table))
    if extra > allocator.num_free:
        return False
    table.extend(allocator.allocate() for _ in range(extra))
    return True


def _ring_slots(table, start, n, block_size):
    return [_private().ring_slot(table, p, block_size) for p in range(start, start + n)]


def _tables(grow_table, slots_for, seed):
    """Run trace `seed`: requests grow their ring tables on one BlockAllocator, read their new tokens'
    and their window's slots, and finish (their blocks back). Per step: the request, where it was, how
    many tokens, what grow_table returned, the table after, the slots of the new tokens and the window's."""
    rng = random.Random(1000 + seed)
    block_size, num_blocks, max_blocks = rng.choice([1, 2, 4, 8]), rng.randint(1, 24), rng.randint(2, 6)
    window = (max_blocks - 1) * block_size  # the tokens a query reads: always held by the ring
    allocator = BlockAllocator(num_blocks)
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    out: list[list] = [[block_size, num_blocks, max_blocks]]
    for _ in range(rng.randint(1, 30)):
        rid = f"r{rng.randint(0, 4)}"
        start = computed.get(rid, 0)
        if start and rng.random() < 0.15:  # the request finishes (or is preempted): all its blocks go back
            try:
                for block in reversed(tables.pop(rid, [])):
                    allocator.release(block, keep_cached=False)
            except Exception as error:  # noqa: BLE001  (a table that holds what was never handed out)
                return [*out, ["finish", rid, f"{type(error).__name__}: {error}"]]
            computed.pop(rid)
            out.append(["finish", rid])
            continue
        n = rng.randint(1, window) if start == 0 else rng.choice([1, 1, 1, rng.randint(1, window)])
        table = tables.setdefault(rid, [])
        grown = grow_table(table, start + n, block_size, max_blocks, allocator)
        step = [rid, start, n, grown, list(table)]
        out.append(step)
        if not grown:
            if not table:
                del tables[rid]
            continue
        end = start + n
        first = max(0, end - window)
        step += [list(slots_for(table, start, n, block_size)), list(slots_for(table, first, end - first, block_size))]
        computed[rid] = end
    return out


def ring_tables(number):
    """Task 2's expected output on case `number`: each of its traces with the reference's ring tables."""
    return [_tables(_ring_grow, _ring_slots, seed) for seed in _sequence_seeds(number)]


KEY_2 = AnswerKey("ex05_block_allocator", 2, size=256, seeded=25, reference=ring_tables, private=_TEACHERS[0])


def _tables_difference(number, mine, want):
    for seed, trace, ref_trace in zip(_sequence_seeds(number), mine, want):
        block_size, num_blocks, max_blocks = ref_trace[0]
        for step, ref in zip(trace[1:] + [None] * len(ref_trace), ref_trace[1:]):
            if step == ref:
                continue
            if ref[0] == "finish" or step is None or step[0] == "finish":
                return f"seed {seed}: your tables differ from the ring tables' ({step} vs {ref})"
            rid, start, n, got, table, *slots = step
            _, _, _, grown, ref_table, *ref_slots = ref
            where = (f"seed {seed} (block_size {block_size}, {num_blocks} blocks, max_blocks {max_blocks}), "
                     f"request {rid} at {start} + {n} tokens")
            if (got, table) != (grown, ref_table):
                return (f"{where}: grow_table returned {got} and left the table {table}; expected {grown}, "
                        f"table {ref_table} (at most max_blocks blocks, or nothing changed)")
            if slots[:1] != ref_slots[:1]:
                return f"{where}: table {table}: your slots for the new tokens {slots[0]}, expected {ref_slots[0]}"
            end = start + n
            return (f"{where}: table {table}: your slots for the window, positions {max(0, end - block_size * (max_blocks - 1))}"
                    f"..{end - 1}, {slots[1] if len(slots) > 1 else None}, expected {ref_slots[1]}")
    return f"seeds {_sequence_seeds(number)[0]}..{_sequence_seeds(number)[-1]}: your tables differ"


@task(2, "block tables")
def check_task_2(grow_table, slots_for) -> str | list[str]:
    _judge_sequences(KEY_2, (BlockManager, BlockTableBuffer), lambda seed: _tables(grow_table, slots_for, seed),
                     "traces", "every table, its new tokens' slots and its window's", _tables_difference)
    return KEY_2.report(f"{KEY_2.seeded * SEQUENCES} seeded traces and {FRESH_CASES} drawn now: ring tables, new "
                        "tokens' slots and windows' slots")


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
        knobs_reach_the_engine(make_llm, ENGINE_KNOBS, lambda other: isinstance(other.engine.kv.allocator, allocator_class))
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

ELEMENT_WISE = ("__iter__", "tolist", "unbind", "numpy", "__array__", "as_subclass", "untyped_storage", "storage",
                "data_ptr", "__dlpack__", "__reduce_ex__", "__deepcopy__", "__repr__", "__str__", "__format__")
MAX_TORCH_OPS = 40  # torch operations one call may dispatch, whatever the batch's size (a vectorised answer: ~15)


def _escape(name):
    return Fail(f"your code takes a tensor apart element by element (Tensor.{name}): task 4 wants whole-tensor "
                "operations, no numpy, no Python loop over rows or tokens")


class NoLoops(torch.Tensor):
    """A tensor that refuses to be taken apart element by element: iterating it, indexing its first
    dimension with a Python int, `.tolist()`, `.numpy()`, leaving the subclass, or `.item()` / `int()`
    on more than one element raise. Whole-tensor operations (arithmetic, gather, broadcasting,
    indexing by tensors) work as usual, and their results are NoLoops too."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ELEMENT_WISE or (name in ("item", "__int__", "__index__", "__float__")
                                    and args and args[0].numel() > 1):
            raise _escape(name)
        if name == "__getitem__" and len(args) > 1:
            index = args[1]
            first = index[0] if isinstance(index, tuple) and index else index
            if isinstance(first, int) and not isinstance(first, bool):
                raise Fail("your code indexes a tensor row by row (tensor[i]): task 4 wants whole-tensor "
                           "operations, no Python loop over rows")
        return super().__torch_function__(func, types, args, kwargs)


# torch's own C methods and functions that read a tensor's data out of torch: torch.Tensor's are
# switched off by _no_way_out, and these are refused however they are reached (torch._C.TensorBase.tolist(t)
# skips torch.Tensor's attribute).
RAW_READS = ("tolist", "numpy", "data_ptr", "untyped_storage", "_to_dlpack", "_to_dlpack_versioned", "__dlpack__")
MAX_LIFTED = 8  # numbers a tensor built from Python data (torch.tensor(list)) may hold: a constant, not an answer


def _refused(message):
    """Record the refusal (so a learner's `except` cannot hide it: the task FAILs) and raise it."""
    _HITS.append(message)
    return Fail(message)


class _CountOps(TorchDispatchMode):
    """Counts the torch operations dispatched while active (a Python loop dispatches some per row), and
    refuses a tensor built from many Python numbers (`torch.tensor(rows)`, dispatched as lift_fresh):
    the way back into torch for an answer computed in a Python loop."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if func is torch.ops.aten.lift_fresh.default and args and args[0].numel() > MAX_LIFTED:
            raise _refused(f"your code built a tensor of {args[0].numel()} numbers from Python data "
                           "(torch.tensor of a list): task 4 wants the matrix computed by whole-tensor operations, "
                           "not by a Python loop and then turned into a tensor")
        return func(*args, **(kwargs or {}))


@contextmanager
def _no_raw_reads():
    """While active (in this thread and in threads it starts), a call of one of RAW_READS, from any code,
    raises and FAILs the task: the interpreter's profile hook sees C calls that no patch of torch.Tensor
    can (`torch._C.TensorBase.tolist(t)`, `torch._C._to_dlpack(t)`)."""

    def refuse(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) in RAW_READS:
            raise _refused(str(_escape(arg.__name__)))

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(refuse)
    threading.setprofile(refuse)
    try:
        yield
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


@contextmanager
def _no_way_out():
    """While active, no tensor (of any class) converts to numpy, a list or raw storage."""
    saved = {name: vars(torch.Tensor).get(name) for name in ELEMENT_WISE if name not in ("as_subclass",)}

    def refuse(name):
        def refused(*args, **kwargs):
            raise _escape(name)
        return refused

    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def _slots_case(rng: random.Random, rows: int | None = None):
    block_size = rng.choice([1, 2, 4, 8, 16])
    rows = rows or rng.randint(1, 12)
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


def _expected_matrix(tables, starts, counts, block_size):
    """Row i: the slots of positions starts[i] .. starts[i] + counts[i] - 1, then -1 up to max(counts).
    (Element by element: what task 4 must not do, so it is no answer; it runs in a release too.)"""
    width = max(counts, default=0)
    return [[(table[(start + j) // block_size] * block_size + (start + j) % block_size) if j < count else -1
             for j in range(width)] for table, start, count in zip(tables, starts, counts)]


@task(4, "padded slot matrix, vectorised")
def check_task_4(slot_matrix, num_cases: int = 300) -> str:
    rng = random.Random(55)
    cases = [([[3, 7, -1]], [0], [6], 4), ([[5, -1], [2, 9]], [3, 1], [1, 4], 4), ([[0, 1], [4, -1]], [0, 1], [0, 1], 2),
             ([[9, 8, 7, 6]], [1], [3], 1), ([[4, -1]], [0], [0], 4)]  # rows with nothing new; block_size 1
    cases += [_slots_case(rng) for _ in range(num_cases)]
    cases += [_slots_case(rng, rows=48) for _ in range(4)]  # big batches: a loop over rows costs too many ops
    cases += [_slots_case(random.Random(seed)) for seed in grade_time_seeds(FRESH_CASES)]  # cannot be memoised
    most = 0
    for number, (tables, starts, counts, block_size) in enumerate(cases):
        want = _expected_matrix(tables, starts, counts, block_size)
        args = [torch.tensor(x, dtype=torch.long).as_subclass(NoLoops) for x in (tables, starts, counts)]
        counter = _CountOps()
        with forbid(BlockManager, BlockTableBuffer), _no_way_out(), counter, _no_raw_reads():
            got = slot_matrix(*args, block_size)
        most = max(most, counter.count)
        where = f"case {number} ({len(tables)} rows, block_size {block_size})"
        if counter.count > MAX_TORCH_OPS:
            raise Fail(f"{where}: your code dispatched {counter.count} torch operations; a whole-tensor answer needs "
                       f"a few, the same for any batch (at most {MAX_TORCH_OPS}): is there a loop over rows or tokens?")
        if not isinstance(got, torch.Tensor):
            raise Fail(f"{where}: slot_matrix returned {type(got).__name__}, not a tensor")
        got = torch.Tensor.as_subclass(got, torch.Tensor)
        shape = (len(tables), max(counts))
        if got.dtype != torch.long or tuple(got.shape) != shape:
            raise Fail(f"{where}: returned dtype {got.dtype}, shape {tuple(got.shape)}; expected int64 of shape {shape}")
        if got.tolist() != want:
            raise Fail(f"{where}: tables {tables}, starts {starts}, counts {counts}: you returned {got.tolist()}, "
                       f"expected {want}")
    seeded = len(cases) - FRESH_CASES  # the PASS line counts the seeded cases (the fresh ones differ per run)
    return (f"{seeded} ragged batches (padded tables, empty rows, block_size 1..16, up to 48 rows) and {FRESH_CASES} "
            f"drawn now; whole-tensor operations only, at most {MAX_TORCH_OPS} per call")
