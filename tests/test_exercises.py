"""The exercises as graded: every solution passes nbval, every untouched exercise fails it.

For each `solutions/exNN_*.ipynb` in the repository (picked up by glob, so a new exercise needs no
edit here):

- the solved notebook passes `pytest --nbval-lax` (its graded cells reproduce their stored
  `task N (...): PASS` lines);
- the exercise generated from it, left untouched, FAILS, and the report shows why: a stub's
  `NotImplementedError` or a `FAIL` line. A grader that passes an untouched stub grades nothing;
- the generated exercise is byte-identical to what `tools/build_exercises.py` makes from the
  solution now (a stale exercise would grade against stale outputs).

The nbval runs execute whole notebooks (tens of seconds each), hence the notebook and slow marks.
The tests of the build tool itself, on a synthetic notebook, are in test_grading.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_build_exercises

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((REPO_ROOT / "solutions").glob("ex[0-9][0-9]_*.ipynb"))
NBVAL_TIMEOUT_S = 900  # an exercise targets 60 s; CI machines are shared




bx = load_build_exercises()


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def test_there_are_exercises() -> None:
    assert SOLUTIONS, "no solutions/exNN_*.ipynb found"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_solution_passes_nbval(solution: Path) -> None:
    result = bx.run_nbval(solution, timeout_s=NBVAL_TIMEOUT_S)
    assert result.passed, f"nbval failed on {solution.name}:\n{result.output[-6000:]}"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_untouched_exercise_fails_nbval(solution: Path) -> None:
    exercise = REPO_ROOT / "exercises" / solution.name
    assert exercise.exists(), f"{exercise.name} is missing: run `python tools/build_exercises.py`"
    result = bx.run_nbval(exercise, timeout_s=NBVAL_TIMEOUT_S)
    assert not result.passed, f"the untouched {exercise.name} passes nbval: its graders check nothing"
    assert "timed out" not in result.output, (
        f"{exercise.name} timed out instead of failing:\n{result.output[-3000:]}"
    )
    assert "NotImplementedError" in result.output or "FAIL" in result.output, (
        f"{exercise.name} failed for another reason than its stubs:\n{result.output[-6000:]}"
    )


@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_exercise_is_in_sync_with_its_solution(solution: Path) -> None:
    number = solution.name[2:4]
    planned = bx.plan(REPO_ROOT / "solutions", REPO_ROOT / "exercises", only=number)
    stale = [f"{item.status}: {item.exercise.name}" for item in planned if item.status != "in sync"]
    assert not stale, f"{stale}; run `python tools/build_exercises.py --only {number}`"
