"""The graders discriminate: every known-wrong implementation fails its task, the solution passes.

`tests/known_wrong/exNN.py` lists the mutants of exercise NN (see tests/known_wrong/__init__.py); this
file globs them, so a new exercise adds its file and nothing here. Each case runs the solution's
cells in this process with the mutant applied and calls the task's check function directly.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from known_wrong import Mutant, run_task, solution_path, tasks_in  # noqa: E402

NUMBERS = sorted(p.stem[2:] for p in (TESTS / "known_wrong").glob("ex[0-9][0-9].py"))
MUTANTS = [(number, mutant) for number in NUMBERS
           for mutant in importlib.import_module(f"known_wrong.ex{number}").KNOWN_WRONG]


def test_every_solution_has_known_wrong_implementations() -> None:
    solutions = sorted(p.name[2:4] for p in (TESTS.parent / "solutions").glob("ex[0-9][0-9]_*.ipynb"))
    missing = [n for n in solutions if n not in NUMBERS]
    assert not missing, f"no tests/known_wrong/exNN.py for exercise(s) {missing}"


@pytest.mark.parametrize("number", NUMBERS)
def test_every_task_has_two_mutants_and_one_delegates(number: str) -> None:
    mutants = importlib.import_module(f"known_wrong.ex{number}").KNOWN_WRONG
    for task in tasks_in(number):
        count = sum(m.task == task for m in mutants)
        assert count >= 2, f"ex{number} task {task} has {count} known-wrong implementation(s); at least 2"
    assert any("delegat" in m.name for m in mutants), f"ex{number}: no delegation mutant"


@pytest.mark.parametrize(("number", "mutant"), MUTANTS, ids=[f"ex{n}-t{m.task}-{m.name}" for n, m in MUTANTS])
def test_known_wrong_fails_its_task(number: str, mutant: Mutant) -> None:
    result = run_task(number, mutant.task, mutant)
    assert not result.passed, f"{solution_path(number).name}: '{mutant.name}' passes task {mutant.task}:\n{result}"
    if mutant.expect:
        assert mutant.expect in "\n".join(result.lines), f"'{mutant.name}' failed for another reason:\n{result}"


@pytest.mark.parametrize("number", NUMBERS)
def test_the_solution_passes_every_task_in_process(number: str) -> None:
    for task in tasks_in(number):
        result = run_task(number, task)
        assert result.passed, f"ex{number}'s solution fails task {task}:\n{result}"
