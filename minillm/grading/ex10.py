"""Grader of exercise 10 (chapter 10): chapter 10's ladder of GPU patterns, then a paged decode
attention kernel, all written by the learner in numba.cuda.

Tasks 1-4, the ladder (minillm.kernels.ladder: spec, cases, checks, pictures): map, shared memory,
reduction, online softmax. Each kernel runs at once on the simulator with every access traced, and
must match the rung's numpy spec and show the pattern's properties (one thread per output; a block's
numbers loaded into shared memory once with no race between barriers; a tree reduction; one
in-order pass reading nothing past a row's end). The specs are disabled while the kernel runs.

Tasks 5-7, the paged decode kernel. Chapter 10 prints minillm's kernel, which reads a padded block
table [B, max_blocks] and the sequence lengths; the learner writes the same attention for another
layout of the page table, FlashInfer's compressed rows (CSR):

    def paged_decode_kernel(query, key_cache, value_cache, kv_indptr, kv_indices, kv_last_page_len, scale, out)

sequence b's pages are kv_indices[kv_indptr[b] : kv_indptr[b + 1]], in order, and its last page
holds kv_last_page_len[b] keys (1 … block_size). It is launched with one thread per (sequence,
query head): thread i = cuda.grid(1) serves sequence i // H_q and query head i % H_q. The
reference for the layout is built from the library: the same batch as a block table, through
`paged_attention_decode_reference`. The checks:

- task 5: in numba's CUDA simulator (on the GPU where there is one), on ragged GQA batches from
  `minillm.kernels.scenarios.paged_scenario` (scattered blocks, partial last blocks, lengths 1 and
  block_size ± 1, -1 padded tables, NaN in every slot no sequence owns, one batch with logits
  beyond exp()'s range), and batches drawn when the check runs, against the torch reference;
- task 6: the same function, and the four ladder kernels, compile to PTX for sm_90, in one subprocess
  without the simulator (which has no compiler): a kernel that only works as Python (lists, torch,
  numpy) fails here.
  The function travels as its code object (`marshal`), so a kernel defined by `exec` works too;
- task 7: plugged into the engine (`attention_backend="numba"`), it serves every decode row of the
  bundled model (the engine's block tables handed to it as CSR); each of its calls is compared with
  the reference afterwards, and the greedy tokens with the torch backend's.

While the learner's kernel runs, minillm's own kernel function and the torch reference are
disabled (`forbid`). `KNOWN_WRONG` holds minillm's block-table kernel with one bug each, the bug
classes of chapter 10, section 6 (which runs them); tests/known_wrong/ex10.py grades the learner's
kernel's versions of them.
The ladder's tasks need the simulator (they trace its threads); on a GPU they say so and fail.

numba reads NUMBA_ENABLE_CUDASIM when it is first imported and numba.cuda picks the simulator when it
is; the exercise's runner imports this module before any notebook cell, so it sets the variable here
when torch sees no GPU (and has numba re-read it if only its CPU compiler was imported before).
"""

from __future__ import annotations

import contextlib
import json
import marshal
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

if "numba.cuda" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if "numba" in sys.modules:  # numba's CPU compiler came first (the engine's CPU kernels): re-read the variable
        from numba.core import config as _numba_config

        _numba_config.reload_config()

from numba import cuda, float32  # noqa: E402

from minillm.grading import Fail, forbid, grade_time_seeds, task  # noqa: E402
from minillm.kernels import decode_attention, ladder  # noqa: E402
from minillm.kernels._launch import device_array, launch, simulator  # noqa: E402
from minillm.kernels.scenarios import PagedScenario, paged_scenario  # noqa: E402

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
LEARNER_TOOLS = ()

MAX_HEAD_DIM = 64  # the size of a thread's accumulator: cuda.local.array(MAX_HEAD_DIM, float32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Name, arguments of paged_scenario. Ragged lengths around the block size, GQA 2:1, MQA 4:1 with a
# wide table, 3:1 with logits in the thousands (exp() of them overflows without the running max).
CASES: tuple[tuple[str, dict], ...] = (
    ("lengths 1, bs-1, bs, bs+1, 13; GQA 4:2", dict(seq_lens=[1, 3, 4, 5, 13], block_size=4, num_blocks=16,
                                                    kv_heads=2, q_heads=4, head_dim=8, seed=10)),
    ("block_size 8, MQA 4:1, -1 padded width", dict(seq_lens=[7, 2, 16, 9], block_size=8, num_blocks=10,
                                                    kv_heads=1, q_heads=4, head_dim=4, seed=11,
                                                    extra_table_width=2)),
    ("large logits, GQA 6:2", dict(seq_lens=[5, 12, 3], block_size=4, num_blocks=10, kv_heads=2, q_heads=6,
                                   head_dim=8, seed=12, logit_scale=1000.0)),
)
DRAWN_BATCHES = 3  # task 5's batches drawn when the check runs
DRAWN_RUNG_CASES = 2  # each ladder task's cases drawn when the check runs
ATOL = RTOL = 1e-4
_THREAD_ID = re.compile(r"tid=\[[^\]]*\] ctaid=\[[^\]]*\]:\s*")  # which thread failed first varies
PORTABLE_MODULES = {"math": math, "cuda": cuda}  # what a kernel's globals may name, besides numbers
PORTABLE_TYPES = ("float32", "float64", "int32", "int64")


def _numba_ready() -> None:
    if not simulator() and not torch.cuda.is_available():
        raise Fail("numba was imported before NUMBA_ENABLE_CUDASIM=1 was set and there is no GPU: restart the "
                   "kernel and run the notebook from the top")


def _references():
    return (decode_attention.paged_attention_decode_reference, decode_attention._kernel)


def csr_pages(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              padding: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded block table as FlashInfer's CSR page table: (kv_indptr [B+1], kv_indices, kv_last_page_len [B]),
    int32; `padding` -1 entries after the last sequence's pages (never to be read)."""
    tables, lens = block_tables.cpu().tolist(), seq_lens.cpu().tolist()
    indptr, indices, last = [0], [], []
    for row, n in zip(tables, lens):
        pages = -(-int(n) // block_size)
        indices += row[:pages]
        indptr.append(len(indices))
        last.append(int(n) - (pages - 1) * block_size)
    indices += [-1] * padding
    return tuple(torch.tensor(v, dtype=torch.int32, device=block_tables.device) for v in (indptr, indices, last))


def run_decode_kernel(python_function: Callable, query, key_cache, value_cache, block_tables, seq_lens,
                      scale: float) -> torch.Tensor:
    """Launch `python_function` as a numba.cuda kernel on the batch's CSR page table, one thread per
    (sequence, query head); on CPU. The batch comes as a block table (the reference's layout)."""
    if not callable(python_function):
        raise Fail(f"expected the kernel's Python function, got {type(python_function).__name__}")
    out = torch.full_like(query, float("nan"))  # a thread that writes nothing leaves NaN
    indptr, indices, last = csr_pages(block_tables, seq_lens, key_cache.shape[1], padding=2)
    with warnings.catch_warnings():  # numpy's overflow warnings, from the simulator's threads
        warnings.simplefilter("ignore", RuntimeWarning)
        launch(cuda.jit(python_function), query.shape[0] * query.shape[1], device_array(query),
               device_array(key_cache), device_array(value_cache), device_array(indptr), device_array(indices),
               device_array(last), float(scale), device_array(out))
    return out.cpu()


def drawn_case(seed: int) -> tuple[str, dict]:
    """A ragged batch drawn from `seed` (a seed drawn when the check runs): 1 to 5 sequences of 1 to 20
    keys, block size 2, 4 or 8, MHA, GQA or MQA, now and then logits in the thousands."""
    rng = random.Random(seed)
    block_size = rng.choice((2, 4, 8))
    seq_lens = [rng.randint(1, 20) for _ in range(rng.randint(1, 5))]
    kv_heads, group = rng.choice(((1, 1), (1, 4), (2, 1), (2, 2), (2, 3)))
    pages = sum(-(-n // block_size) for n in seq_lens)
    kwargs = dict(seq_lens=seq_lens, block_size=block_size, num_blocks=pages + 1 + rng.randint(0, 4),
                  kv_heads=kv_heads, q_heads=kv_heads * group, head_dim=rng.choice((4, 8)), seed=seed,
                  logit_scale=rng.choice((1.0, 1.0, 1000.0)))
    return f"a batch drawn as the check ran (seed {seed}: {kwargs})", kwargs


def scenarios(device: str = DEVICE, drawn: tuple[int, ...] = ()) -> list[tuple[str, PagedScenario]]:
    cases = list(CASES) + [drawn_case(seed) for seed in drawn]
    return [(name, paged_scenario(**kwargs).to(device)) for name, kwargs in cases]


def compare_decode(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when equal within tolerance, else what differs."""
    if got.isnan().any():
        return (f"NaN in {int(got.isnan().any(-1).sum())} of {got.shape[0] * got.shape[1]} (sequence, head) outputs: "
                "a slot past a sequence's end or a -1 block was read")
    if not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
        err = (got - want).abs()
        b, h = divmod(int(err.amax(-1).argmax()), got.shape[1])
        return f"max |error| {err.max():.3g} (first at sequence {b}, query head {h})"
    return None


def decode_problems(python_function: Callable, drawn: tuple[int, ...] = ()) -> list[tuple[str, str | None]]:
    """(case, problem or None) for every case of task 5 (and those drawn from `drawn` seeds); the reference
    is disabled while the kernel runs."""
    expected = [(name, case, decode_attention.paged_attention_decode_reference(*case.to("cpu").args()))
                for name, case in scenarios(drawn=drawn)]
    results = []
    for name, case, want in expected:
        try:
            with forbid(*_references()):
                got = run_decode_kernel(python_function, *case.args())
            results.append((name, compare_decode(got, want)))
        except Fail:
            raise
        except NotImplementedError as error:  # the stub: say so, without which simulated thread hit it first
            raise NotImplementedError(_THREAD_ID.sub("", str(error))) from None
        except Exception as error:  # the simulator raises on what a GPU would get silently wrong
            message = _THREAD_ID.sub("", (str(error).splitlines() or [""])[0])[:120]
            results.append((name, f"{type(error).__name__}: {message}"))
    return results


# ---- tasks 1-4: the ladder -----------------------------------------------------------------------

def drawn_rung_case(rung: str, seed: int) -> ladder.Case:
    """One case of `rung` drawn from `seed` (a seed drawn when the check runs): other sizes than the seeded
    ones, so a kernel written for those (a grid, a length, a block count) fails."""
    g = np.random.default_rng(seed)
    tpb = ladder.TPB
    if rung == "map":
        rows, cols = (int(v) for v in g.integers(1, 13, 2))
        grid = (-(-rows // 4) + int(g.integers(0, 2)), -(-cols // 4) + int(g.integers(0, 2)))  # spare threads
        inputs = {"a": g.integers(-9, 10, rows).astype(np.float32), "b": g.integers(-9, 10, cols).astype(np.float32)}
        return ladder.Case(f"a[{rows}] + b[{cols}] on {grid[0]}x{grid[1]} blocks of 4x4 threads", inputs, (rows, cols),
                           grid, (4, 4), ladder.broadcast_add_spec)
    if rung == "shared memory":
        n = int(g.integers(1, 5 * tpb))
        a = g.integers(-9, 10, n).astype(np.float32)
        return ladder.Case(f"{n} numbers, blocks of {tpb}", {"a": a}, (n,), -(-n // tpb), tpb, ladder.window_sum_spec)
    if rung == "reduction":
        n = int(g.integers(1, 5 * tpb))
        a = -g.integers(1, 100, n).astype(np.float32)
        blocks = -(-n // tpb)
        return ladder.Case(f"{n} negative numbers, {blocks} blocks of {tpb}", {"a": a}, (blocks,), blocks, tpb,
                           ladder.block_max_spec)
    # never the seeded case's 5 rows, nor 4 (one whole block of 4 threads: a kernel assuming 5 rows is right there)
    rows, width = int(g.choice([1, 2, 3, 6, 7])), 12
    lengths = g.integers(1, width + 1, rows).astype(np.int32)
    scores = np.full((rows, width), np.nan, dtype=np.float32)
    values = np.full((rows, width), np.nan, dtype=np.float32)
    for r, n in enumerate(lengths):
        scores[r, :n] = (g.standard_normal(n) * g.choice([1.0, 10.0, 1000.0])).astype(np.float32)
        values[r, :n] = g.standard_normal(n).astype(np.float32)
    return ladder.Case(f"{rows} rows of {', '.join(map(str, lengths.tolist()))} scores", {"scores": scores,
                       "values": values, "lengths": lengths}, (rows,), -(-rows // 4), 4, ladder.softmax_weighted_sum_spec)


def _drawn_rung_problem(rung: str, kernel, seeds: list[int]) -> str | None:
    """The first problem of `kernel` on cases of `rung` drawn from `seeds`, judged as ladder.problems judges
    the seeded ones (the spec, races, wrapped indices, the rung's properties), or None."""
    properties = ladder.RUNGS[rung][1]
    for seed in seeds:
        case = drawn_rung_case(rung, seed)
        want = case.want()
        where = f"{case.label} (drawn as the check ran, seed {seed})"
        try:
            with forbid(*ladder.SPECS):
                trace, out = ladder._run(kernel, case)
        except NotImplementedError:
            raise
        except Exception as error:  # the simulator raises what a GPU would silently get wrong
            message = _THREAD_ID.sub("", (str(error).splitlines() or [""])[0])[:160]
            return f"{where}: {type(error).__name__}: {message}"
        problem = f"a race: {trace.races()[0]}" if trace.races() else None
        if problem is None and trace.wrapped:
            name, element = trace.wrapped[0]
            problem = f"{name} read at a negative index (wrapped around to {list(element)}; on a GPU: out of bounds)"
        problem = problem or ladder._compare(out, want) or properties(trace, case)
        if problem is not None:
            return f"{where}: {problem}"
    return None


def _rung(rung: str, kernel) -> list[str]:
    _numba_ready()
    try:
        problem, lines, _ = ladder.problems(rung, kernel, guard=lambda: forbid(*ladder.SPECS))
        if problem is None:
            problem = _drawn_rung_problem(rung, kernel, grade_time_seeds(DRAWN_RUNG_CASES))
    except NotImplementedError as error:  # the stub: say so, without which simulated thread hit it first
        raise NotImplementedError(_THREAD_ID.sub("", str(error))) from None
    if problem is not None:
        raise Fail(problem)
    return lines + [f"{DRAWN_RUNG_CASES} case(s) drawn as the check ran: match the spec"]


@task(1, "map", check_time_limit_s=60)
def check_task_1(broadcast_add) -> list[str]:
    return _rung("map", broadcast_add)


@task(2, "shared memory", check_time_limit_s=60)
def check_task_2(window_sum) -> list[str]:
    return _rung("shared memory", window_sum)


@task(3, "reduction", check_time_limit_s=60)
def check_task_3(block_max) -> list[str]:
    return _rung("reduction", block_max)


@task(4, "online softmax", check_time_limit_s=60)
def check_task_4(softmax_weighted_sum) -> list[str]:
    return _rung("online softmax", softmax_weighted_sum)


# ---- task 5: the paged decode kernel in the simulator ---------------------------------------------

@task(5, "paged decode kernel", check_time_limit_s=120)
def check_task_5(paged_decode_kernel) -> list[str]:
    _numba_ready()
    drawn = tuple(grade_time_seeds(DRAWN_BATCHES))
    results = decode_problems(paged_decode_kernel, drawn)
    bad = [(name, problem) for name, problem in results if problem is not None]
    if bad:
        more = f" (and {len(bad) - 1} more of the {len(results)} batches)" if len(bad) > 1 else ""
        raise Fail(f"{bad[0][0]}: {bad[0][1]}{more}")
    return [f"{len(CASES)} ragged batches, read through their CSR page tables, match "
            "paged_attention_decode_reference on the same batches as block tables:",
            *(f"  {name}" for name, _ in CASES),
            f"  and {DRAWN_BATCHES} batches drawn as the check ran"]


# ---- task 6: the same function compiled for a real GPU --------------------------------------------

def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def portable_globals(python_function: Callable) -> tuple[dict[str, float], dict[str, str]]:
    """The globals a kernel uses, as (numbers by value, module or numba type by name)."""
    if getattr(python_function, "__closure__", None):
        raise Fail("your kernel reads variables of an enclosing function: a kernel sees only its arguments, "
                   "module-level numbers, math, cuda and numba's types")
    numbers, named = {}, {}
    for name in _code_names(python_function.__code__):
        if name not in python_function.__globals__:
            continue
        value = python_function.__globals__[name]
        if isinstance(value, bool | int | float):
            numbers[name] = value
        elif any(value is m for m in PORTABLE_MODULES.values()) or getattr(value, "__name__", "") == "numba.cuda":
            named[name] = "cuda" if value is not math else "math"
        elif name in PORTABLE_TYPES or repr(value) in PORTABLE_TYPES:
            named[name] = repr(value)
    return numbers, named


COMPILE_SCRIPT = """
import json, marshal, math, sys, types
from numba import cuda, types as nt
import numba
folder, cc = sys.argv[1], int(sys.argv[2])
f32 = {n: nt.Array(nt.float32, n, "C") for n in (1, 2, 3, 4)}
i32 = {n: nt.Array(nt.int32, n, "C") for n in (1, 2)}
SIGNATURES = {
    "paged decode": (f32[3], f32[4], f32[4], i32[1], i32[1], i32[1], nt.float32, f32[3]),
    "map": (f32[1], f32[1], f32[2]),
    "shared memory": (f32[1], f32[1]),
    "reduction": (f32[1], f32[1]),
    "online softmax": (f32[2], f32[2], i32[1], f32[1]),
}
for k, spec in enumerate(json.load(open(folder + "/kernels.json"))):
    namespace = dict(spec["numbers"])
    for name, what in spec["named"].items():
        namespace[name] = {"math": math, "cuda": cuda}.get(what) or getattr(numba, what)
    code = marshal.loads(open(f"{folder}/kernel{k}.marshal", "rb").read())
    function = types.FunctionType(code, namespace, code.co_name)
    print("compiling", spec["label"], file=sys.stderr, flush=True)
    ptx, _ = cuda.compile_ptx(function, SIGNATURES[spec["label"]], cc=(cc // 10, cc % 10))
    print(spec["label"], ptx.count(".entry"), len(ptx.splitlines()), flush=True)
"""


def compile_to_ptx(python_function: Callable, cc: int = 90, timeout_s: float = 120,
                   more: tuple[tuple[str, Callable], ...] = ()) -> tuple[bool, str]:
    """Compile the paged decode kernel (and the ladder's kernels in `more`, (rung, function) pairs) for
    sm_<cc> in one fresh process without the simulator: (ok, what happened)."""
    kernels = [("paged decode", python_function), *more]
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        for k, (label, function) in enumerate(kernels):
            numbers, named = portable_globals(function)
            (Path(tmp) / f"kernel{k}.marshal").write_bytes(marshal.dumps(function.__code__))
            specs.append({"label": label, "numbers": numbers, "named": named})
        (Path(tmp) / "kernels.json").write_text(json.dumps(specs))
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, tmp, str(cc)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        which = [line.split(" ", 1)[1] for line in lines if line.startswith("compiling ")]
        errors = [k for k, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception): ", line)]
        why = " ".join(lines[errors[0]: errors[0] + 2]) if errors else (lines[-1] if lines else "(no message)")
        kernel = f"your {which[-1]} kernel " if which and more else ""
        return False, f"{kernel}does not compile for sm_{cc}: {why[:300]}"
    rows = [line.rsplit(" ", 2) for line in proc.stdout.splitlines()]
    entries = [int(row[1]) for row in rows]
    if not more:
        return entries == [1], f"compiles for sm_{cc}: {entries[0]} kernel entry, {rows[0][2]} lines of PTX"
    return (entries == [1] * len(kernels),
            f"compiles for sm_{cc}: {len(rows)} kernels ({', '.join(row[0] for row in rows)}), one entry each")


LADDER = (("map", 1), ("shared memory", 2), ("reduction", 3), ("online softmax", 4))


@task(6, "compiles for the GPU", check_time_limit_s=150)
def check_task_6(paged_decode_kernel, broadcast_add, window_sum, block_max, softmax_weighted_sum) -> str:
    rungs = (broadcast_add, window_sum, block_max, softmax_weighted_sum)
    for kernel in (paged_decode_kernel, *rungs):
        if not isinstance(kernel, types.FunctionType):
            raise Fail(f"expected each kernel's Python function (a def), got {type(kernel).__name__}")
    _numba_ready()
    wrong = [name for name, problem in decode_problems(paged_decode_kernel) if problem is not None]
    if wrong:  # compiling a kernel that is wrong (or a stub) would prove nothing
        raise Fail(f"task 5 does not pass yet ({wrong[0]}): make the kernel right in the simulator first")
    for (rung, number), kernel in zip(LADDER, rungs):
        try:
            problem = ladder.problems(rung, kernel, guard=lambda: forbid(*ladder.SPECS))[0]
        except NotImplementedError:
            problem = "not written yet"
        if problem is not None:
            raise Fail(f"task {number} does not pass yet ({problem[:80]}): make it right in the simulator first")
    ok, message = compile_to_ptx(paged_decode_kernel, cc=90, more=tuple(zip((r for r, _ in LADDER), rungs)))
    if not ok:
        raise Fail(message + " (the simulator runs any Python; a GPU kernel may use only its arguments, "
                   "numbers, math, cuda.local.array, cuda.shared.array and numba types)")
    return message + " (PTX, numba-cuda via NVRTC; no GPU needed)"


# ---- task 7: in the engine ------------------------------------------------------------------------

def _host(a):
    return torch.as_tensor(a.copy_to_host() if hasattr(a, "copy_to_host") else a.copy()) if hasattr(a, "shape") else a


class RecordingKernel:
    """Stands in for minillm's decode kernel: hands the learner's the engine's block tables as a CSR page
    table, launches it, and keeps a copy of each call (in the block-table layout, for the reference)."""

    def __init__(self, python_function: Callable) -> None:
        self.kernel = cuda.jit(python_function)
        self.calls: list[tuple] = []

    def __getitem__(self, launch_config):
        launch_kernel = self.kernel[launch_config]

        def run(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
            pages = [p.to(DEVICE) for p in csr_pages(_host(block_tables), _host(seq_lens), key_cache.shape[1])]
            launch_kernel(query, key_cache, value_cache, *(device_array(p) for p in pages), scale, out)
            self.calls.append(tuple(_host(a) for a in (query, key_cache, value_cache, block_tables, seq_lens,
                                                        scale, out)))

        return run


@contextlib.contextmanager
def engine_decode_kernel(stand_in):
    """Inside the block, minillm's paged_attention_decode launches `stand_in` instead of its own kernel."""
    own = decode_attention.kernel
    decode_attention.kernel = stand_in
    try:
        yield
    finally:
        decode_attention.kernel = own


PROMPTS = ("In the beginning", "And God said", "Blessed")
ENGINE_KNOBS = dict(max_num_seqs=3, block_size=4, num_kv_blocks=24, max_model_len=32)


@task(7, "in the engine", check_time_limit_s=150)
def check_task_7(paged_decode_kernel) -> list[str]:
    from minillm import LLM, SamplingParams

    _numba_ready()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    knobs = dict(ENGINE_KNOBS, device=DEVICE)
    want = [o.outputs[0].token_ids for o in LLM(attention_backend="torch", **knobs).generate(list(PROMPTS), greedy,
                                                                                             use_tqdm=False)]
    stand_in = RecordingKernel(paged_decode_kernel)
    with engine_decode_kernel(stand_in), forbid(*_references()), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            llm = LLM(attention_backend="numba", **knobs)  # its start-up warm-up launches the kernel too
            at_start_up = len(stand_in.calls)
            got = [o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), greedy, use_tqdm=False)]
        except NotImplementedError as error:
            raise NotImplementedError(_THREAD_ID.sub("", str(error))) from None
    if not stand_in.calls:
        raise Fail("the engine never launched your kernel")
    for number, (query, key_cache, value_cache, tables, lens, scale, out) in enumerate(stand_in.calls):
        problem = compare_decode(out, decode_attention.paged_attention_decode_reference(
            query, key_cache, value_cache, tables, lens, scale))
        if problem is not None:
            raise Fail(f"decode call {number} of {len(stand_in.calls)} (batch {query.shape[0]}, context lengths "
                       f"{lens.tolist()}): {problem}")
    if got != want:
        raise Fail(f"greedy tokens differ from the torch backend's: yours {got}, torch {want}")
    # every call is checked; the count said is generate's (the warm-up's depends on what this process built before)
    return [f"{len(stand_in.calls) - at_start_up} decode calls of the bundled model ran on your kernel, "
            "each equal to the reference", f"greedy tokens equal the torch backend's: {got}"]


# ---- known-wrong kernels: minillm's kernel with one bug each (all compile; task 5 must catch them) ----

def _no_partial_block_mask(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range((seq_lens[b] + bs - 1) // bs * bs):  # BUG: every slot of the last block, past the end too
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _wrong_gqa_mapping(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h % key_cache.shape[2]  # BUG: interleaves query heads over KV heads; HF groups neighbours
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _no_running_max(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    total = 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        weight = math.exp(s * scale)  # BUG: no max subtracted: overflows past ~88 (float32), ~709 (float64)
        total += weight
        for d in range(dim):
            acc[d] += weight * value_cache[block, off, kv_head, d]
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _max_without_rescale(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m = max(m, s)
        weight = math.exp(s - m)  # BUG: the sums so far were taken against a smaller max and are not rescaled
        total += weight
        for d in range(dim):
            acc[d] += weight * value_cache[block, off, kv_head, d]
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _reads_padding(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(block_tables.shape[1] * bs):  # BUG: the whole table width, -1 entries included ...
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        if p >= seq_lens[b]:
            s = -math.inf  # ... masked after the read; the value is read anyway (0 · NaN = NaN)
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


KNOWN_WRONG: dict[str, Callable] = {
    "no partial-block mask": _no_partial_block_mask,
    "wrong GQA head mapping": _wrong_gqa_mapping,
    "softmax without a max": _no_running_max,
    "max kept, never rescaled": _max_without_rescale,
    "reads the -1 padding": _reads_padding,
}
