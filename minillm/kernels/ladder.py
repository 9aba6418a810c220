"""The warm-up ladder of GPU patterns as puzzles: a spec, a checker, a picture (chapter 10, exercise 10).

In GPU-Puzzles' manner (Sasha Rush), each rung is a small kernel the learner writes from a plain
spec. `check(rung, kernel)` runs it at once on numba's CUDA simulator with every access traced
(minillm.kernels.trace) and checks the properties that make it the pattern, not only its output:

1. map            `out[i, j] = a[i] + b[j]` on a 2-D grid larger than `out`: one thread per output,
                  each reads one number of `a` and one of `b`, spare threads touch nothing.
2. shared memory  `out[i] = a[i-2] + a[i-1] + a[i]` (missing terms are 0): each block loads its
                  numbers, and the two before them, into shared memory once; each number of `a`
                  is read from global memory at most twice; no race (a barrier between the loads
                  and the reads).
3. reduction      `out[b] = max(a[b·TPB : (b+1)·TPB])`, the last block partial: a tree in shared
                  memory, log2(TPB) rounds, no thread reads more than 2 shared numbers per round.
4. online softmax `out[r] = softmax(scores[r, :n_r]) · values[r, :n_r]`, ragged rows, logits in
                  the thousands, NaN past each row's end: one thread per row reads each of its
                  scores and values exactly once (one pass), nothing past its end.

The fifth rung, paged decode attention, is exercise 10's own (minillm.grading.ex10). A kernel is
handed in as its Python function (or a cuda.jit dispatcher); the checker launches it with the
rung's grid. `check` returns a `RungResult` whose `picture()` draws what the threads touched.
Needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TPB = 8  # threads per block of rungs 2 and 3 (a shared array's size must be a constant: TPB + 2, TPB)
HALO = 2  # rung 2's window reaches this many numbers before a block's first
# rung 2's shared array: TPB + HALO slots. A shared array's shape must be a constant the compiler sees:
# a module-level number, not an expression of two of them (the simulator accepts either; PTX does not)
WINDOW_SLOTS = TPB + HALO


# --- specs: plain numpy -------------------------------------------------------------------------

def broadcast_add_spec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a[:, None] + b[None, :]


def window_sum_spec(a: np.ndarray) -> np.ndarray:
    padded = np.concatenate([np.zeros(HALO, a.dtype), a])
    return padded[2:] + padded[1:-1] + padded[:-2]


def block_max_spec(a: np.ndarray) -> np.ndarray:
    return np.array([a[s: s + TPB].max() for s in range(0, len(a), TPB)], dtype=a.dtype)


def softmax_weighted_sum_spec(scores: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    out = np.empty(len(lengths), dtype=np.float64)
    for r, n in enumerate(lengths):
        s = scores[r, :n].astype(np.float64)
        p = np.exp(s - s.max())
        out[r] = (p / p.sum()) @ values[r, :n]
    return out.astype(scores.dtype)


SPECS = (broadcast_add_spec, window_sum_spec, block_max_spec, softmax_weighted_sum_spec)


# --- cases: inputs, launch, spec ---------------------------------------------------------------

@dataclass
class Case:
    label: str
    inputs: dict[str, np.ndarray]  # the kernel's arguments before `out`, by parameter name
    out_shape: tuple[int, ...]
    grid: tuple[int, ...] | int
    block: tuple[int, ...] | int
    spec: Callable

    def arguments(self) -> tuple[list, list[str]]:
        out = np.full(self.out_shape, np.nan, dtype=np.float32)  # an output nobody writes stays NaN
        return [*(v.copy() for v in self.inputs.values()), out], [*self.inputs, "out"]

    def want(self) -> np.ndarray:
        return self.spec(*self.inputs.values())


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def map_cases() -> list[Case]:
    out = []
    for (rows, cols), grid, seed in (((5, 7), (2, 2), 0), ((9, 3), (3, 1), 1)):
        g = _rng(seed)
        inputs = {"a": g.integers(-9, 10, rows).astype(np.float32), "b": g.integers(-9, 10, cols).astype(np.float32)}
        out.append(Case(f"a[{rows}] + b[{cols}] on {grid[0]}x{grid[1]} blocks of 4x4 threads", inputs, (rows, cols),
                        grid, (4, 4), broadcast_add_spec))
    return out


def shared_cases() -> list[Case]:
    out = []
    for n, seed in ((21, 2), (TPB, 3)):
        a = _rng(seed).integers(-9, 10, n).astype(np.float32)
        blocks = -(-n // TPB)
        out.append(Case(f"{n} numbers, {blocks} block{'s' * (blocks > 1)} of {TPB}", {"a": a}, (n,), blocks, TPB,
                        window_sum_spec))
    return out


def reduction_cases() -> list[Case]:
    out = []
    for n, seed in ((20, 4), (3 * TPB, 5)):
        a = -_rng(seed).integers(1, 100, n).astype(np.float32)  # all negative: a max padded with 0 is wrong
        blocks = -(-n // TPB)
        out.append(Case(f"{n} negative numbers, {blocks} blocks of {TPB}", {"a": a}, (blocks,), blocks, TPB,
                        block_max_spec))
    return out


def softmax_cases() -> list[Case]:
    g = _rng(6)
    lengths = np.array([5, 1, 12, 8, 3], dtype=np.int32)
    width = 12
    scores = np.full((len(lengths), width), np.nan, dtype=np.float32)
    values = np.full((len(lengths), width), np.nan, dtype=np.float32)
    for r, (n, scale) in enumerate(zip(lengths, (1.0, 1.0, 1000.0, 10.0, 1.0))):
        scores[r, :n] = (g.standard_normal(n) * scale).astype(np.float32)
        values[r, :n] = g.standard_normal(n).astype(np.float32)
    return [Case("5 rows of 5, 1, 12, 8, 3 scores (row 2: logits in the thousands), NaN past each end, 2 blocks of 4",
                 {"scores": scores, "values": values, "lengths": lengths}, (len(lengths),), 2, 4,
                 softmax_weighted_sum_spec)]


# --- the checks ---------------------------------------------------------------------------------

@dataclass
class RungResult:
    rung: str
    passed: bool
    lines: list[str]
    traces: list = field(default_factory=list)  # (case, trace, out) per case that ran

    def __repr__(self) -> str:
        return "\n".join([f"{self.rung}: {'PASS' if self.passed else 'FAIL'}", *(f"  {x}" for x in self.lines)])

    def picture(self, case: int = 0):
        """What the threads of one case touched: one panel per array, colored by thread block."""
        from minillm.kernels.pictures import plot_touches

        if not self.traces:
            raise ValueError(f"{self.rung}: no case ran, so there is nothing to draw ({self.lines[0]})")
        c, trace, _ = self.traces[case]
        return plot_touches(trace, [*c.inputs, "out"], title=f"{self.rung}: {c.label}")


_THREAD_ID = re.compile(r"tid=\[[^\]]*\] ctaid=\[[^\]]*\]:?\s*")


def _run(kernel, case: Case):
    from minillm.kernels.trace import trace_launch

    args, names = case.arguments()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        trace = trace_launch(kernel, case.grid, case.block, args, names)
    return trace, args[-1]


def _compare(got: np.ndarray, want: np.ndarray) -> str | None:
    if np.isnan(got).any():
        where = [list(map(int, i)) for i in np.argwhere(np.isnan(got))[:3]]
        return f"out is NaN at {where}: never written, or computed from a number past the end"
    if not np.allclose(got, want, atol=1e-4, rtol=1e-4):
        i = np.unravel_index(np.abs(got - want).argmax(), got.shape)
        return f"out{list(map(int, i))} = {got[i]:.6g}, the spec says {want[i]:.6g}"
    return None


def _most(trace, name: str, how: str = "r") -> tuple[int, tuple, tuple]:
    """(the most accesses of `name` by one thread, that thread, an element it touched)."""
    best = (0, (), ())
    for thread, elements in trace.accesses[name, how].items():
        total = sum(elements.values())
        if total > best[0]:
            best = (total, thread, next(iter(elements)))
    return best


def _map_properties(trace, case: Case) -> str | None:
    writes = trace.accesses["out", "w"]
    per_element: dict = {}
    for elements in writes.values():
        for element, count in elements.items():
            per_element[element] = per_element.get(element, 0) + count
    twice = [e for e, c in per_element.items() if c > 1]
    if twice:
        return f"out{list(twice[0])} is written more than once: one thread per output"
    for name in ("a", "b"):
        most, thread, _ = _most(trace, name)
        if most > 1:
            return f"thread {list(thread[1])} of block {list(thread[0])} reads {most} numbers of {name}: a map reads one"
    return None


def _shared_properties(trace, case: Case) -> str | None:
    if not any(kind == "shared" for kind in trace.kinds.values()):
        return "no cuda.shared.array: each block should load its numbers into shared memory once"
    most, thread, _ = _most(trace, "a")
    if most > 2:
        return (f"thread {list(thread[1])} of block {list(thread[0])} reads a from global memory {most} times: "
                "load into shared memory once, then read the window from there")
    per_block: dict = {}
    for (block, _), elements in trace.accesses["a", "r"].items():
        per_block[block] = per_block.get(block, 0) + sum(elements.values())
    block, count = max(per_block.items(), key=lambda kv: kv[1])
    if count > TPB + HALO:
        return f"block {list(block)} reads a from global memory {count} times: at most {TPB + HALO} (its {TPB} + {HALO})"
    return None


def _reduction_properties(trace, case: Case) -> str | None:
    shared = [n for n, kind in trace.kinds.items() if kind == "shared"]
    if not shared:
        return "no cuda.shared.array: the block's threads combine their numbers in shared memory"
    rounds = int(math.log2(TPB))
    for name in shared:
        most, thread, _ = _most(trace, name)
        if most > 2 * rounds + 1:
            return (f"thread {list(thread[1])} of block {list(thread[0])} reads {most} shared numbers: a tree reads "
                    f"at most 2 per round ({rounds} rounds for {TPB})")
    most, thread, _ = _most(trace, "a")
    if most > 1:
        return f"thread {list(thread[1])} of block {list(thread[0])} reads a {most} times: each thread loads one number"
    return None


def _softmax_properties(trace, case: Case) -> str | None:
    lengths = case.inputs["lengths"]
    for name in ("scores", "values"):
        for (block, thread), elements in trace.accesses[name, "r"].items():
            columns = [e[1] for e in trace.order[name, (block, thread)]]
            back = next((k for k in range(1, len(columns)) if columns[k] < columns[k - 1]), None)
            if back is not None:
                return (f"thread {list(thread)} of block {list(block)} reads {name} of its row in {columns.count(0)} "
                        f"passes (column {columns[back - 1]}, then back to {columns[back]}): one pass reads them in "
                        "order, once, updating the running max, sum and weighted sum as it goes")
            past = [e for e in elements if e[1] >= lengths[e[0]]]
            if past:
                return f"{name}{list(past[0])} lies past row {past[0][0]}'s end ({lengths[past[0][0]]} scores) and was read"
    return None


RUNGS: dict[str, tuple[Callable, Callable]] = {
    "map": (map_cases, _map_properties),
    "shared memory": (shared_cases, _shared_properties),
    "reduction": (reduction_cases, _reduction_properties),
    "online softmax": (softmax_cases, _softmax_properties),
}


def problems(rung: str, kernel, guard: Callable = contextlib.nullcontext) -> tuple[str | None, list[str], list]:
    """(the first problem or None, one line per case that passed, the traces) of `kernel` on `rung`.

    The specs' answers are computed first; the kernel runs inside `guard()` (a grader passes
    `lambda: forbid(*SPECS)`, so a kernel that calls a spec fails)."""
    if rung not in RUNGS:
        raise ValueError(f"rung must be one of {list(RUNGS)}, got {rung!r}")
    if not callable(kernel):
        return f"expected the kernel's Python function, got {type(kernel).__name__}", [], []
    from numba.core import config

    if not config.ENABLE_CUDASIM:
        return ("the ladder's checks watch every simulated thread: run with NUMBA_ENABLE_CUDASIM=1, set before "
                "numba is imported", [], [])
    make_cases, properties = RUNGS[rung]
    lines, traces = [], []
    for case, want in [(c, c.want()) for c in make_cases()]:
        try:
            with guard():
                trace, out = _run(kernel, case)
        except NotImplementedError:
            raise
        except Exception as error:  # the simulator raises what a GPU would silently get wrong
            message = _THREAD_ID.sub("", (str(error).splitlines() or [""])[0])[:160]
            return f"{case.label}: {type(error).__name__}: {message}", lines, traces
        traces.append((case, trace, out))
        problem = None
        if trace.races():  # before the output: a race makes it wrong only on some runs
            problem = f"a race: {trace.races()[0]}"
        if problem is None and trace.wrapped:
            name, element = trace.wrapped[0]
            problem = f"{name} read at a negative index (wrapped around to {list(element)}; on a GPU: out of bounds)"
        if problem is None:
            problem = _compare(out, want)
        if problem is None:
            problem = properties(trace, case)
        if problem is not None:
            return f"{case.label}: {problem}", lines, traces
        lines.append(f"{case.label}: matches the spec")
    return None, lines, traces


def check(rung: str, kernel) -> RungResult:
    """Run `kernel` on every case of `rung` in the simulator; PASS or the first problem, with traces."""
    problem, lines, traces = problems(rung, kernel)
    return RungResult(rung, problem is None, lines if problem is None else [problem], traces)
