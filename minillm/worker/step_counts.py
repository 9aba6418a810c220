"""What one engine step does, counted per piece: Python calls and torch ops (chapter 04).

On a tiny model the step's time is mostly framework work — Python between the ops, tensor
creation, the dispatch of small ops — and wall-clock time on a shared machine swings with the
neighbours. Counts do not: the same step of the same engine makes the same calls, every time. So
the batch-1 step is measured (and its gains kept, tests/test_step_counts.py) as

- **Python calls**: every function call the interpreter makes during the piece, Python functions
  and built-ins alike (`sys.setprofile`'s "call" and "c_call" events; a numba function counts as
  one call, however much it computes);
- **torch ops**: ops the dispatcher runs (`torch.profiler` events named `aten::…` or `mkldnn::…`),
  both those called from Python (`from_python`) and all of them, those they call inside included.

The pieces are the engine's own methods, entered in this order each step; a piece's counts
include everything it calls, and "step glue" is the step's own work between them:

    schedule            scheduler.schedule
    plan → data         executor.plans.build (the `SchedulerOutput` a worker reads)
    apply plan          worker.update_state (input batch diffs, KV moves)
    inputs, metadata    worker.prepare (the flat layout, attention metadata; the compiled decode has none)
    forward, lm_head    model.forward + compute_logits, or the compiled decode call
    sample              minillm.worker.model_runner.sample
    update requests     scheduler.update_from_output
    outputs, metrics    engine._on_update (text, streams) + engine._record (step metrics)
    propose             engine._propose (speculative decoding: the proposer's guesses for the next step)

`count_steps(engine, n)` runs n steps of whatever the engine holds and returns the counts per step;
`count_generate_decode_step(llm, prompt)` counts one decode step as `LLM.generate` runs it, its
loop around `engine.step()` included (the piece "generate loop"); `timed_pieces(engine)` times the
same pieces (wall clock, for bench/step_profile.py; never for tests).
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile, record_function

GLUE = "step glue"
PIECES = ("schedule", "plan → data", "apply plan", "inputs, metadata", "forward, lm_head", "sample",
          "update requests", "outputs, metrics", "propose", GLUE)
GENERATE_LOOP = "generate loop"  # LLM.generate's own work between steps (run_until_done, its progress bar)
_OP_PREFIXES = ("aten::", "mkldnn::")


@dataclass
class PieceCounts:
    """Per step, averaged over the steps counted."""

    python_calls: float = 0.0
    torch_ops_from_python: float = 0.0
    torch_ops: float = 0.0


def _targets(engine, step: bool = False) -> list[tuple[object, str, str]]:
    """(object, method name, piece) for every piece's entry point in this engine (and, with `step`,
    `engine.step` itself as the step's glue: what runs outside it is then someone else's)."""
    from minillm.worker import model_runner

    executor = engine.executor
    worker = executor.worker
    targets = [(engine.scheduler, "schedule", "schedule"), (executor.plans, "build", "plan → data"),
               (worker, "update_state", "apply plan"), (worker, "prepare", "inputs, metadata"),
               (worker.model, "forward", "forward, lm_head"), (worker.model, "compute_logits", "forward, lm_head"),
               (model_runner, "sample", "sample"), (engine.scheduler, "update_from_output", "update requests"),
               (engine, "_on_update", "outputs, metrics"), (engine, "_record", "outputs, metrics"),
               (engine, "_propose", "propose")]
    if getattr(worker, "compiled_decode", None) is not None:
        targets.append((worker.compiled_decode, "run", "forward, lm_head"))
    if step:
        targets.append((engine, "step", GLUE))
    return targets


@contextmanager
def _pieces_marked(engine, current: list[str], wrapper_codes: set, ranges: bool, step: bool = False):
    """Each piece's method wrapped: while it runs, `current[-1]` names it (and, with `ranges`, a
    profiler range "piece::NAME" is open)."""
    def wrap(function, piece):
        def in_piece(*args, **kwargs):
            current.append(piece)
            try:
                return function(*args, **kwargs)
            finally:
                current.pop()

        def in_range(*args, **kwargs):
            with record_function(f"piece::{piece}"):
                return function(*args, **kwargs)
        wrapper_codes.add(in_piece.__code__)
        return in_range if ranges else in_piece

    saved = []
    for obj, name, piece in _targets(engine, step):
        saved.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, wrap(getattr(obj, name), piece))
    try:
        yield
    finally:
        for obj, name, original in reversed(saved):
            if original is None:
                delattr(obj, name)  # a method wrapped on the instance: the class's is back
            else:
                setattr(obj, name, original)


def _python_calls(engine, run: Callable[[], object], outside: str = GLUE) -> Counter:
    """Calls made while `run()` runs, by piece; calls outside every piece count as `outside`."""
    current: list[str] = [outside]
    wrapper_codes: set = set()
    calls: Counter = Counter()

    def count(frame, event, arg):
        if event == "c_call" or (event == "call" and frame.f_code not in wrapper_codes):
            calls[current[-1]] += 1

    with _pieces_marked(engine, current, wrapper_codes, ranges=False, step=outside != GLUE):
        sys.setprofile(count)
        try:
            run()
        finally:
            sys.setprofile(None)
    return calls


def _steps(engine, num_steps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(num_steps):
            engine.step()
    return run


def _torch_ops(engine, num_steps: int) -> tuple[Counter, Counter]:
    from_python: Counter = Counter()
    total: Counter = Counter()
    with ExitStack() as stack:
        stack.enter_context(_pieces_marked(engine, [GLUE], set(), ranges=True))
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        for _ in range(num_steps):
            engine.step()
    for event in prof.events():
        if not event.name.startswith(_OP_PREFIXES):
            continue
        parent, piece, nested = event.cpu_parent, GLUE, False
        while parent is not None:
            if parent.name.startswith(_OP_PREFIXES):
                nested = True
            elif parent.name.startswith("piece::"):
                piece = parent.name.removeprefix("piece::")
                break
            parent = parent.cpu_parent
        total[piece] += 1
        if not nested:
            from_python[piece] += 1
    return from_python, total


def count_steps(engine, num_steps: int) -> dict[str, PieceCounts]:
    """Counts per step and piece over the engine's next `num_steps` steps (twice `num_steps` are run:
    once for Python calls, once under the profiler); the engine must hold enough work for them."""
    calls = _python_calls(engine, _steps(engine, num_steps))
    from_python, total = _torch_ops(engine, num_steps)
    return {piece: PieceCounts(calls[piece] / num_steps, from_python[piece] / num_steps, total[piece] / num_steps)
            for piece in PIECES}


def count_generate_decode_step(llm, prompt: list[int], num_tokens: tuple[int, int] = (9, 41)) -> dict[str, float]:
    """Python calls of one steady decode step inside `LLM.generate`, by piece (`GENERATE_LOOP` among
    them): two greedy generates of `prompt` that differ only in how many tokens they emit are counted
    whole, and their difference, divided by the extra tokens, is what one more decode step costs there
    — the request's arrival, prefill and finish cancel out. (A block is allocated every `block_size`
    tokens: the extra steps hold the average of that too.)"""
    from minillm.request import SamplingParams

    def generate(n: int) -> Callable[[], None]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return lambda: llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)

    short, long = num_tokens
    generate(short)()  # the first generate may import or compile what later ones reuse
    few = _python_calls(llm.engine, generate(short), GENERATE_LOOP)
    many = _python_calls(llm.engine, generate(long), GENERATE_LOOP)
    return {piece: (many[piece] - few[piece]) / (long - short) for piece in (*PIECES, GENERATE_LOOP)}


def total(counts: dict[str, PieceCounts]) -> PieceCounts:
    """The whole step's counts."""
    return PieceCounts(sum(c.python_calls for c in counts.values()),
                       sum(c.torch_ops_from_python for c in counts.values()),
                       sum(c.torch_ops for c in counts.values()))


@contextmanager
def timed_pieces(engine):
    """While open, each piece's wall time is added to the yielded dict (seconds, by piece; a step's
    own time outside them is not: take the step's time and subtract)."""
    seconds: dict[str, float] = defaultdict(float)
    saved = []
    def timed(function, piece):
        def in_piece(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[piece] += time.perf_counter() - start
        return in_piece

    for obj, name, piece in _targets(engine):
        saved.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, timed(getattr(obj, name), piece))
    try:
        yield seconds
    finally:
        for obj, name, original in reversed(saved):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
