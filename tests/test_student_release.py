"""`make student-release` (tools/student_release.py): a copy of the course without the answers that still grades.

One release is built, into a tmp dir, by the Makefile target, and checked by one test (split in two,
pytest-xdist would build it once per worker: xdist_group does not keep tests together here). In it:
no solutions/, no solution-region marker anywhere (grep), `make grade EX=03` fails the untouched exercise and passes
the same exercise with its learner cells filled from the solution (read here, from this repository),
importing the release's own minillm (the learner cell writes down where minillm came from). Both
grades use this test's venv (`make -o install ... VENV=`): nothing is installed. One small exercise
is graded, not all: test_exercises.py grades every exercise through the same manifests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))

import student_release  # noqa: E402

EXERCISE = "ex03_dynamic_batcher.ipynb"  # four tasks, the quickest solution to grade (~20 s)
# The solution-region marker on a line of its own, raw or inside a JSON string: grep's own reading,
# independent of the tool's regex.
GREP_MARKER = r'(^|"|\\n)[[:space:]]*#[[:space:]]*(BEGIN|END) SOLUTION[[:space:]]*(\\n|"|$)'


def _make(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    # -o install: use this venv as it is (sys.prefix), never pip-install the copy into it.
    command = ["make", "--no-print-directory", "-o", "install", f"VENV={sys.prefix}", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _release(target: Path) -> Path:
    made = _make("student-release", f"DIR={target}", cwd=REPO_ROOT, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "no solutions/" in made.stdout
    return target


def _assert_no_answers(release: Path) -> None:
    assert not (release / "solutions").exists()
    assert not (release / "tests" / "known_wrong").exists()
    assert not (release / "minillm" / "grading" / "private").exists()  # expected outputs, private references
    assert (REPO_ROOT / "minillm" / "grading" / "private" / "expected" / f"{Path(EXERCISE).stem}.json").exists()
    # The answer keys are released (digests only: tests/test_answer_keys.py), byte for byte the teacher's.
    keys = sorted(p.name for p in (REPO_ROOT / "minillm" / "grading" / "keys").glob("ex*.json"))
    assert f"{Path(EXERCISE).stem}.json" in keys
    assert sorted(p.name for p in (release / "minillm" / "grading" / "keys").glob("ex*.json")) == keys
    for name in keys:
        assert (release / "minillm" / "grading" / "keys" / name).read_bytes() == \
            (REPO_ROOT / "minillm" / "grading" / "keys" / name).read_bytes()
    notebooks = sorted((release / "exercises").glob("ex[0-9][0-9]_*.ipynb"))
    assert notebooks and not [p.name for p in notebooks
                              if any(c.get("outputs") for c in json.loads(p.read_text(encoding="utf-8"))["cells"])]
    assert not list(release.rglob("*solutions*"))
    grep = subprocess.run(["grep", "-rlE", GREP_MARKER, "."], cwd=release, capture_output=True, text=True,
                          timeout=120)
    assert grep.returncode == 1 and grep.stdout == "", f"marker lines in the release:\n{grep.stdout}{grep.stderr}"
    # The grep finds what it looks for: the same search over the source repository's solutions/.
    here = subprocess.run(["grep", "-rlE", GREP_MARKER, "solutions"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert f"solutions/{EXERCISE}" in here.stdout.split()
    # What a class needs is there.
    for path in ("Makefile", "README.md", "pyproject.toml", "requirements.lock", "tools/grade.py", "tools/lab.py",
                 f"exercises/{EXERCISE}", f"minillm/grading/cells/{Path(EXERCISE).stem}.json", "models"):
        assert (release / path).exists(), path
    chapters = sorted(p.name for p in (REPO_ROOT / "chapters").glob("*.ipynb"))
    assert chapters and sorted(p.name for p in (release / "chapters").glob("*.ipynb")) == chapters


def _filled(exercise: dict, solution: dict) -> dict:
    """The exercise with every learner cell holding the solution's code (markers and hints dropped),
    the first one also writing down where minillm and the grader were imported from."""
    solved = {c["id"]: "".join(c["source"]) for c in solution["cells"]
              if c["cell_type"] == "code" and "# BEGIN SOLUTION" in "".join(c["source"])}
    assert solved
    drop = re.compile(r"^\s*#\s*(BEGIN SOLUTION|END SOLUTION|HINT:.*)$")
    origin = ("\nimport pathlib as _pathlib\nimport minillm as _minillm\nimport minillm.grading.ex03 as _grader\n"
              "_pathlib.Path('imported_from.txt').write_text(_minillm.__file__ + '\\n' + _grader.__file__)\n")
    first = True
    for cell in exercise["cells"]:
        if cell.get("id") in solved:
            code = "\n".join(line for line in solved[cell["id"]].splitlines() if not drop.match(line))
            cell["source"] = code + (origin if first else "")
            first = False
    return exercise


@pytest.mark.slow
@pytest.mark.notebook
def test_release_has_no_answers_and_make_grade_there_fails_untouched_and_passes_a_correct_answer(
        tmp_path: Path) -> None:
    release = _release(tmp_path / "minillm-class")
    _assert_no_answers(release)

    untouched = _make("grade", "EX=03", cwd=release)
    assert untouched.returncode != 0, untouched.stdout + untouched.stderr  # make: 2 (tools/grade.py: 1)
    assert "0/4 task(s) pass" in untouched.stdout and "NotImplementedError" in untouched.stdout, untouched.stdout
    assert "NOT GRADED HERE" not in untouched.stdout, untouched.stdout  # task 3 too: a FAIL, "not written yet"

    notebook = release / "exercises" / EXERCISE
    solution = json.loads((REPO_ROOT / "solutions" / EXERCISE).read_text(encoding="utf-8"))
    exercise = json.loads(notebook.read_text(encoding="utf-8"))
    notebook.write_text(json.dumps(_filled(exercise, solution), indent=1), encoding="utf-8")
    correct = _make("grade", "EX=03", cwd=release)
    # Task 3's reference is grader-private (minillm/grading/private/, left out of a release): the release
    # grades it with its answer key (minillm/grading/keys/), so every task passes, and says how.
    assert correct.returncode == 0, correct.stdout + correct.stderr
    assert "4/4 task(s) pass" in correct.stdout and "NOT GRADED HERE" not in correct.stdout, correct.stdout
    assert "FAIL" not in correct.stdout and "graded with the answer key" in correct.stdout, correct.stdout
    imported = (release / "exercises" / "imported_from.txt").read_text(encoding="utf-8").split("\n")
    assert [Path(p).resolve() for p in imported] == [release.resolve() / "minillm" / "__init__.py",
                                                     release.resolve() / "minillm" / "grading" / "ex03.py"]


def test_release_refuses_a_dir_inside_the_repo_or_not_empty(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert student_release.main([str(REPO_ROOT / "exercises" / "class")]) == 2
    assert "is inside the repository" in capsys.readouterr().err
    (tmp_path / "old.txt").write_text("a teacher's file", encoding="utf-8")
    assert student_release.main([str(tmp_path)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]  # nothing written, nothing removed
    assert not (REPO_ROOT / "exercises" / "class").exists()


def test_release_refuses_a_stale_manifest_and_finds_leaks(tmp_path: Path) -> None:
    # A course of one exercise, in step; then its manifest edited by hand.
    course = tmp_path / "course"
    stem = Path(EXERCISE).stem
    for folder, name in (("solutions", EXERCISE), ("exercises", EXERCISE),
                         ("minillm/grading/cells", f"{stem}.json"), ("minillm/grading/private/expected", f"{stem}.json")):
        (course / folder).mkdir(parents=True)
        shutil.copy2(REPO_ROOT / folder / name, course / folder / name)
    student_release.check_exercises_in_step(course)
    manifest = course / "minillm" / "grading" / "cells" / f"{stem}.json"
    manifest.write_text(manifest.read_text(encoding="utf-8").replace("check_task_1", "check_task_2"),
                        encoding="utf-8")
    with pytest.raises(student_release.ReleaseError, match=f"out of sync: minillm/grading/cells/{stem}.json"):
        student_release.check_exercises_in_step(course)
    shutil.rmtree(course / "solutions")
    with pytest.raises(student_release.ReleaseError, match="already a student release"):
        student_release.check_exercises_in_step(course)

    # The tool's own scan: a marker line in a notebook's JSON, a manifest string, a .py file; prose passes.
    (tmp_path / "leaky").mkdir()
    (tmp_path / "leaky" / "a.ipynb").write_text('{"source": ["x = 1\\n", "    # BEGIN SOLUTION\\n"]}')
    (tmp_path / "leaky" / "b.json").write_text('{"source": "def f():\\n    # END SOLUTION\\n"}')
    (tmp_path / "leaky" / "c.py").write_text("def f():\n    # BEGIN SOLUTION\n    return 1\n")
    (tmp_path / "leaky" / "d.md").write_text("Learner code goes between `# BEGIN SOLUTION` and `# END SOLUTION`.\n")
    private = tmp_path / "leaky" / "minillm" / "grading" / "private" / "expected"
    private.mkdir(parents=True)
    (private / "ex03_dynamic_batcher.json").write_text('{"graded_outputs": {}}')
    found = student_release.leaks(tmp_path / "leaky")
    assert [line.split(":")[0] for line in found] == ["a.ipynb", "b.json", "c.py",
                                                      "minillm/grading/private/expected/ex03_dynamic_batcher.json"], found


# The tasks whose check reaches a grader-private reference (minillm/grading/private/, left out of a
# release) and no answer key (minillm/grading/answer_key.py): NOT GRADED HERE in a student release.
# docs/grading.md lists them; a task with a key grades in a release (tests/test_answer_keys.py grades
# each keyed exercise as a release does).
WITHHELD_IN_A_RELEASE = {"08": [1, 2, 3, 4], "09": [1, 2], "13": [1, 3]}
_PRIVATE_NAMES = {"_private", "private", "_TEACHERS"}  # how a grading module holds its private_reference()


def _tasks_reaching(path: Path) -> tuple[list[int], list[int]]:
    """(the tasks of a grading module whose check, or a module-level function or class it names, and so
    on, names the module's private reference; those among them that name an answer key, a module-level
    `NAME = AnswerKey(...)`)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    names, tasks, keys = {}, {}, set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            for decorator in getattr(node, "decorator_list", []):
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "task":
                    tasks[node.name] = decorator.args[0].value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", "") == "AnswerKey":  # a key reaches what its reference names
            for target in node.targets:
                if isinstance(target, ast.Name):
                    keys.add(target.id)
                    names[target.id] = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}

    def reaches(name: str, wanted: set[str], seen: set[str]) -> bool:
        seen.add(name)
        used = names.get(name, set())
        return bool(used & wanted) or any(reaches(n, wanted, seen) for n in used if n in names and n not in seen)

    private = sorted(number for name, number in tasks.items() if reaches(name, _PRIVATE_NAMES, set()))
    keyed = sorted(number for name, number in tasks.items() if number in private and reaches(name, keys, set()))
    return private, keyed


def _tasks_reaching_private(path: Path) -> list[int]:
    """The tasks a release cannot grade: they reach the private reference and no answer key."""
    private, keyed = _tasks_reaching(path)
    return [number for number in private if number not in keyed]


def _described(withheld: dict[str, list[int]]) -> str:
    if not withheld:
        return "every task grades in a student release"
    def numbers(tasks: list[int]) -> str:
        if len(tasks) == 1:
            return f"task {tasks[0]}"
        if len(tasks) > 1 and tasks == list(range(tasks[0], tasks[-1] + 1)):
            return f"tasks {tasks[0]}-{tasks[-1]}"
        return "tasks " + ", ".join(map(str, tasks[:-1])) + f" and {tasks[-1]}"

    parts = [f"ex{number} {numbers(tasks)}" for number, tasks in sorted(withheld.items())]
    return ", ".join(parts[:-1]) + f" and {parts[-1]}"


def test_the_tasks_a_release_does_not_grade_are_the_documented_ones() -> None:
    found = {path.stem[2:]: tasks for path in sorted((REPO_ROOT / "minillm" / "grading").glob("ex[0-9][0-9].py"))
             if (tasks := _tasks_reaching_private(path))}
    assert found == WITHHELD_IN_A_RELEASE
    assert _tasks_reaching_private(REPO_ROOT / "minillm" / "grading" / "ex02.py") == []
    # The analysis finds what it looks for: ex04 reaches its private reference in tasks 1-3, and has keys for them.
    assert _tasks_reaching(REPO_ROOT / "minillm" / "grading" / "ex04.py") == ([1, 2, 3], [1, 2, 3])
    docs = " ".join((REPO_ROOT / "docs" / "grading.md").read_text(encoding="utf-8").split())
    assert _described(found) in docs, _described(found)
