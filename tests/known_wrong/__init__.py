"""Known-wrong implementations of every exercise task, one file per exercise (`exNN.py`).

Each file defines `KNOWN_WRONG: list[Mutant]`. A mutant is the solution with a bug a learner could
make, written either as text edits of the solution's learner cells (each `old` must occur exactly
once in them) or as an extra cell run after them (`code=`, e.g. a class that delegates to the
reference). `tests/test_grading_known_wrong.py` globs these files, runs the solution's cells with
the mutant applied in-process (no notebook kernel), calls the mutant's task check directly and
asserts it FAILS, and, with `expect=`, that its message contains that text.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minillm.grading import LIBRARIES, TaskResult, provenance, snapshot, tampered, tasks_of
from minillm.grading.runner import compose, given_sources, grader_module_for

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Mutant:
    task: int
    name: str  # the bug class, e.g. "admission overtakes"
    edits: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    code: str | None = None  # a cell run after the learner's cells
    expect: str | None = None  # text the failure message must contain


def _seed_everything(seed: int = 0) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def solution_path(number: str) -> Path:
    found = sorted((REPO_ROOT / "solutions").glob(f"ex{number}_*.ipynb"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one solutions/ex{number}_*.ipynb, found {found}")
    return found[0]


def apply_edits(sources: list[str], edits) -> list[str]:
    sources = list(sources)
    for old, new in edits:
        hits = [(i, s.count(old)) for i, s in enumerate(sources) if old in s]
        total = sum(count for _, count in hits)
        if total != 1:
            raise AssertionError(f"edit {old!r} must occur exactly once in the learner cells, found {total}")
        index = hits[0][0]
        sources[index] = sources[index].replace(old, new)
    return sources


def _library_values() -> list[tuple[Any, str, Any]]:
    """(owner, name, value) of what the tamper snapshot watches outside minillm, to put back after a
    mutant that patched it (the mutants run in this process)."""
    import sys

    out = []
    for owner_name, names in LIBRARIES.items():
        module_name, _, class_name = owner_name.partition(".")
        owner = sys.modules.get(module_name)
        if owner is not None and class_name:
            owner = getattr(owner, class_name, None)
        if owner is None:
            continue
        for name in (names if names is not None else [n for n, v in vars(owner).items() if callable(v)]):
            if name in vars(owner):
                out.append((owner, name, vars(owner)[name]))
    return out


def run_task(number: str, task: int, mutant: Mutant | None = None) -> TaskResult:
    """The solution of exercise `number` with `mutant` applied, graded on `task`, in this process, as
    `make grade` grades it: a learner cell that patched the grader, minillm or the libraries the
    checks use FAILs the task (and is undone afterwards)."""
    saved = _library_values()
    try:
        return _run_task(number, task, mutant)
    finally:
        provenance.set_given(())
        for owner, name, value in saved:
            if vars(owner).get(name) is not value:
                setattr(owner, name, value)


def _run_task(number: str, task: int, mutant: Mutant | None) -> TaskResult:
    solution = solution_path(number)
    _seed_everything()  # a mutant that draws unseeded random numbers behaves the same in any test order
    plan = compose(solution, solution)
    learner = [i for i, cell in enumerate(plan.cells) if cell["kind"] == "learner"]
    sources = apply_edits([plan.cells[i]["source"] for i in learner], mutant.edits if mutant else ())
    namespace: dict[str, Any] = {"__name__": "__main__"}
    provenance.set_given(given_sources(plan.cells))  # as the runner does: the exercise's given code is everyone's
    grader = importlib.import_module(grader_module_for(solution))
    before = snapshot()
    target = None
    for cell in plan.cells:
        if cell["kind"] == "graded":
            if cell["task"] == task:
                target = cell
                break
            continue
        source = sources[learner.index(plan.cells.index(cell))] if cell["kind"] == "learner" else cell["source"]
        exec(compile(source, f"<{solution.name} {cell['where']}>", "exec"), namespace)  # noqa: S102
        if cell["kind"] == "learner" and plan.cells.index(cell) == learner[-1] and mutant and mutant.code:
            exec(compile(mutant.code, "<mutant>", "exec"), namespace)  # noqa: S102
    if target is None:
        raise AssertionError(f"{solution.name} has no graded cell for task {task}")
    if mutant and mutant.code and plan.cells.index(target) < learner[-1]:
        exec(compile(mutant.code, "<mutant>", "exec"), namespace)  # noqa: S102
    check = tasks_of(grader)[task]
    changed = tampered(before)
    if changed:
        return TaskResult(task, check.grading_task[1], False,
                          [f"your code changed the grader or minillm ({', '.join(changed[:3])}): graded as FAIL"])
    return check(*[eval(arg, namespace) for arg in target["args"]])  # noqa: S307


def tasks_in(number: str) -> list[int]:
    """The task numbers of exercise `number`'s graded cells, in notebook order."""
    plan = compose(solution_path(number), solution_path(number))
    return [cell["task"] for cell in plan.cells if cell["kind"] == "graded"]


# --- issue 18: the classes of answers that pass a check of outputs alone (minillm.grading.provenance) ---


def code_reused(task: int, learner: str, module: str, reference: str) -> Mutant:
    """`learner` made from the reference's code object (`types.FunctionType(ref.__code__, ...)`)."""
    return Mutant(task, f"the library's answer under another name: {reference}'s code object reused", code=(
        f"import types as _types\nimport {module} as _lib\n"
        f"{learner} = _types.FunctionType(_lib.{reference}.__code__, vars(_lib), {learner!r})\n"), expect="bytecode")


def source_reexecuted(task: int, learner: str, module: str, reference: str, keyword: str = "def") -> Mutant:
    """`learner` made by re-executing the reference's source under the learner's name."""
    leaf = reference.rsplit(".", 1)[-1]
    return Mutant(task, f"the library's answer under another name: {reference}'s source re-executed", code=(
        f"import inspect as _inspect\nimport textwrap as _textwrap\nimport {module} as _lib\n_ns = dict(vars(_lib))\n"
        f"exec(_textwrap.dedent(_inspect.getsource(_lib.{reference})).replace({keyword + ' ' + leaf!r}, "
        f"{keyword + ' ' + learner!r}, 1), _ns)\n{learner} = _ns[{learner!r}]\n"), expect="bytecode")


def reads_the_checks_frame(task: int, definition: str, var: str = "expected") -> Mutant:
    """A learner function that takes the expected answer from the check's frame (`definition` uses
    `_expected()`, which returns the calling check's local variable `var`)."""
    return Mutant(task, "reads the expected answer from the grader's frame", code=(
        "import sys as _sys\n"
        "def _expected():\n"
        "    frame = _sys._getframe(2)\n"
        f"    while frame is not None and {var!r} not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        f"    return frame.f_locals[{var!r}]\n" + definition), expect="looked into the running program")


def reads_a_traceback_frame(task: int, definition: str, var: str = "expected") -> Mutant:
    """The same, reaching the check's frame through a traceback instead of sys._getframe."""
    return Mutant(task, "reads the expected answer through a traceback's frames", code=(
        "def _expected():\n"
        "    try:\n"
        "        raise RuntimeError\n"
        "    except RuntimeError as error:\n"
        "        frame = error.__traceback__.tb_frame\n"
        f"    while frame is not None and {var!r} not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        f"    return frame.f_locals[{var!r}]\n" + definition), expect="looked into the running program")
