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

from minillm.grading import TaskResult, tasks_of
from minillm.grading.runner import compose, grader_module_for

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


def run_task(number: str, task: int, mutant: Mutant | None = None) -> TaskResult:
    """The solution of exercise `number` with `mutant` applied, graded on `task`, in this process."""
    solution = solution_path(number)
    _seed_everything()  # a mutant that draws unseeded random numbers behaves the same in any test order
    plan = compose(solution, solution)
    learner = [i for i, cell in enumerate(plan.cells) if cell["kind"] == "learner"]
    sources = apply_edits([plan.cells[i]["source"] for i in learner], mutant.edits if mutant else ())
    namespace: dict[str, Any] = {"__name__": "__main__"}
    grader = importlib.import_module(grader_module_for(solution))
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
    return check(*[eval(arg, namespace) for arg in target["args"]])  # noqa: S307


def tasks_in(number: str) -> list[int]:
    """The task numbers of exercise `number`'s graded cells, in notebook order."""
    plan = compose(solution_path(number), solution_path(number))
    return [cell["task"] for cell in plan.cells if cell["kind"] == "graded"]
