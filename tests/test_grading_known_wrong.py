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
# Near copies of minillm across exercises (tests/known_wrong/copies.py): the copy detector's every size.
MUTANTS += [(number, mutant) for number, mutant in importlib.import_module("known_wrong.copies").COPIES
            if number in NUMBERS]


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


CLASSES = ("under another name", "grader", "frame", "never reads q", "memoised")


@pytest.mark.parametrize("number", NUMBERS)
def test_every_exercise_has_mutants_of_issue_18s_classes(number: str) -> None:
    """The library's answer under another name or a grader's helper as the answer (every exercise),
    and the check's data read from its frames or memoised (where a check could be fooled so)."""
    names = [m.name for m in importlib.import_module(f"known_wrong.ex{number}").KNOWN_WRONG]
    assert any("under another name" in n or "grader" in n for n in names), f"ex{number}: {names}"


def test_issue_18s_classes_are_covered() -> None:
    names = [m.name for _, m in MUTANTS]
    for kind in CLASSES:
        assert sum(kind in n for n in names) >= 2, f"fewer than two mutants of the class '{kind}'"


# make grade itself (a fresh process, the runner, the course's cells): one mutant of each class
GRADED = [("10", "def paged_decode_kernel(", "the library's answer under another name: decode_attention._kernel's "
           "source re-executed", 5),
          ("09", "def verify(", "never reads q: draws from p and keeps the guess only if the draw equals it", 2),
          ("03", "def should_fire(now", "the grader's helper answers: calls grader._reference_should_fire", 1),
          ("03", "def should_fire(now", "reads the expected answer from the grader's frame", 1)]


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize(("number", "cell", "name", "task"), GRADED, ids=[f"ex{g[0]}-{g[2][:40]}" for g in GRADED])
def test_make_grade_fails_each_class(number: str, cell: str, name: str, task: int, tmp_path: Path) -> None:
    import json

    from minillm.grading.runner import grade

    mutant = next(m for m in importlib.import_module(f"known_wrong.ex{number}").KNOWN_WRONG
                  if m.name == name and m.task == task)
    solution = solution_path(number)
    notebook = json.loads(solution.read_text(encoding="utf-8"))
    mine = [c for c in notebook["cells"] if c["cell_type"] == "code" and cell in "".join(c["source"])]
    assert len(mine) == 1, f"{solution.name}: {len(mine)} cells define {cell}"
    mine[0]["source"] = "".join(mine[0]["source"]) + "\n" + mutant.code  # as a learner would write it in that cell
    learner = tmp_path / solution.name
    learner.write_text(json.dumps(notebook), encoding="utf-8")
    report = grade(learner, timeout_s=900)
    verdict = next(r for r in report.results if r["task"] == task)
    assert not verdict["passed"], report.text()
    assert mutant.expect in " ".join(verdict["lines"]), report.text()
