"""Tests for tools/build_exercises.py: exercises generated from solutions, and nbval grading them.

The notebooks are made here, in tmp dirs: one tiny solved exercise with two tasks (a function body
with a hint, a method body without one) and two graded cells, executed by a real kernel so that its
stored outputs are real. Kernel start-ups are slow on a shared CPU, so it is executed once per module.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import load_build_exercises
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL = REPO_ROOT / "tools" / "build_exercises.py"




bx = load_build_exercises()

NAME = "ex99_demo.ipynb"
SETUP = """import warnings


def report(task, name, ok):
    print(f"task {task} ({name}): {'PASS' if ok else 'FAIL'}")"""
TASK1 = '''def add(a, b):
    """Task 1: the sum of a and b."""
    # BEGIN SOLUTION
    # HINT: return the sum of a and b
    return a + b
    # END SOLUTION'''
TASK1_STUB = '''def add(a, b):
    """Task 1: the sum of a and b."""
    raise NotImplementedError("TODO: return the sum of a and b")'''
TASK2 = """class Counter:
    def __init__(self):
        self.total = 0

    def bump(self, k):
        # BEGIN SOLUTION
        self.total += k
        return self.total
        # END SOLUTION"""
TASK2_STUB = """class Counter:
    def __init__(self):
        self.total = 0

    def bump(self, k):
        raise NotImplementedError("TODO: your code here")"""
GRADED = """# NBVAL_CHECK_OUTPUT
report(1, "add", add(2, 3) == 5 and add(-1, 1) == 0)
counter = Counter()
counter.bump(2)
report(2, "counter", counter.bump(3) == 5)"""
# Output that differs between kernels unless tools/nbval_sanitize.cfg cleans it up.
NOISY = """# NBVAL_CHECK_OUTPUT
print(object())
warnings.warn("graded cells may warn")"""
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def demo_solution() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell("# Exercise 99: a demo\nTask 1 adds, task 2 counts."),
        new_code_cell(SETUP),
        new_code_cell(TASK1),
        new_code_cell(TASK2),
        new_code_cell(GRADED),
        new_code_cell(NOISY),
    ]
    return new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC})


@pytest.fixture(scope="module")
def solution_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The demo solution, executed by a real kernel and saved the way Jupyter saves it."""
    from nbclient import NotebookClient

    workdir = tmp_path_factory.mktemp("executed")
    notebook = demo_solution()
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    return nbformat.writes(notebook).encode("utf-8")


@pytest.fixture
def dirs(tmp_path: Path, solution_bytes: bytes) -> tuple[Path, Path]:
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    (solutions / NAME).write_bytes(solution_bytes)
    return solutions, exercises


def build(solutions: Path, exercises: Path, *extra: str) -> int:
    return bx.main(["--solutions", str(solutions), "--exercises", str(exercises), *extra])


def code_cell(source: str, output: str | None = None) -> nbformat.NotebookNode:
    """A code cell as if executed, without a kernel: `output` becomes its stored stdout."""
    cell = new_code_cell(source)
    if output is not None:
        cell.execution_count = 1
        cell.outputs = [new_output("stream", name="stdout", text=output)]
    return cell


# --- one cell's source ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected", "regions"),
    [
        (
            "# BEGIN SOLUTION\nx = 1\n# END SOLUTION\nprint(x)\n",
            'raise NotImplementedError("TODO: your code here")\nprint(x)\n',
            1,
        ),
        (TASK1, TASK1_STUB, 1),
        (TASK2, TASK2_STUB, 1),
        # The hint may span lines and hold quotes; the stub keeps the BEGIN line's tab indentation.
        (
            'if True:\n\t# BEGIN SOLUTION\n\t# HINT: use "sum"\n\t# HINT: and \\ no loop\n\ty = 2\n\t# END SOLUTION',
            'if True:\n\traise NotImplementedError("TODO: use \\"sum\\" and \\\\ no loop")',
            1,
        ),
        (
            "a = 0\n# BEGIN SOLUTION\na = 1\n# END SOLUTION\nfor i in range(2):\n    # BEGIN SOLUTION\n    a += i\n    # END SOLUTION\n",
            'a = 0\nraise NotImplementedError("TODO: your code here")\nfor i in range(2):\n    raise NotImplementedError("TODO: your code here")\n',
            2,
        ),
        ("print('no region')", "print('no region')", 0),
    ],
)
def test_stub_source(source: str, expected: str, regions: int) -> None:
    assert bx.stub_source(source) == (expected, regions)


def test_stub_hint_is_the_learners_message() -> None:
    stub, _ = bx.stub_source('# BEGIN SOLUTION\n# HINT: use "sum" \\o/\nx = 1\n# END SOLUTION')
    with pytest.raises(NotImplementedError, match=re.escape('TODO: use "sum" \\o/')):
        exec(stub, {})


# --- building notebooks --------------------------------------------------------------------------


def test_build_replaces_solutions_opens_clean_and_keeps_the_expected_outputs_private(
        dirs: tuple[Path, Path]) -> None:
    solutions, exercises = dirs
    assert build(solutions, exercises) == 0
    solution = nbformat.read(solutions / NAME, as_version=4)
    exercise = nbformat.read(exercises / NAME, as_version=4)
    assert [cell.source for cell in exercise.cells] == [
        solution.cells[0].source, SETUP, TASK1_STUB, TASK2_STUB, GRADED, NOISY,
    ]  # fmt: skip
    # The exercise opens clean (nbgrader's release does the same): no stored output anywhere, the
    # graded cells' included; the setup cell ran in the solution and its output is dropped as well.
    assert solution.cells[1].execution_count is not None and solution.cells[4].outputs
    for cell in exercise.cells[1:]:
        assert cell.outputs == [] and cell.execution_count is None
    assert bx.stored_outputs(exercise) == [] and bx.stored_outputs(solution) == [f"cell {i}" for i in range(1, 6)]
    # What the graded cells print when every task passes is the grader's, in the private folder.
    expected = json.loads((exercises.parent / bx.EXPECTED_SUBDIR / NAME.replace(".ipynb", ".json")).read_text())
    assert sorted(expected["graded_outputs"]) == sorted([solution.cells[4].id, solution.cells[5].id])
    stored = expected["graded_outputs"][solution.cells[4].id]["outputs"]
    assert "".join(stored[0]["text"]) == "task 1 (add): PASS\ntask 2 (counter): PASS\n"
    restored = bx.with_expected_outputs(json.loads((exercises / NAME).read_text()), expected)
    assert restored["cells"][4]["outputs"] == stored and restored["cells"][1]["outputs"] == []
    # Run All goes on past a stub that raises: every code cell from the first learner cell is tagged.
    assert [bx.RUN_ALL_TAG in cell.metadata.get("tags", []) for cell in exercise.cells] == [
        False, False, True, True, True, True]
    for index in (0, 1, 4, 5):
        assert exercise.cells[index].id == solution.cells[index].id
    # Execution timestamps make noise in diffs; the kernelspec is what Jupyter opens it with.
    assert "execution" in solution.cells[4].metadata
    assert all("execution" not in cell.metadata for cell in exercise.cells)
    assert exercise.metadata.kernelspec == KERNELSPEC
    assert exercise.metadata.language_info.name == "python"


def test_check_fails_on_a_stored_output_planted_in_a_copy_of_the_course(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make check-exercises` (`--check`) on a copy of this repository's exercises: in step and clean,
    then one output planted into an exercise's code cell: it fails, naming the notebook and the cell."""
    course = tmp_path / "course"
    for folder in ("solutions", "exercises", str(bx.CELLS_SUBDIR), str(bx.EXPECTED_SUBDIR)):
        shutil.copytree(REPO_ROOT / folder, course / folder)
    args = ["--solutions", str(course / "solutions"), "--exercises", str(course / "exercises"), "--check"]
    assert bx.main(args) == 0, capsys.readouterr().out
    assert "in sync and clean" in capsys.readouterr().out
    target = sorted((course / "exercises").glob(bx.NOTEBOOK_GLOB))[0]
    notebook = json.loads(target.read_text(encoding="utf-8"))
    index, cell = next((i, c) for i, c in enumerate(notebook["cells"]) if c["cell_type"] == "code")
    cell["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["an answer\n"]}]
    target.write_text(json.dumps(notebook, indent=1), encoding="utf-8")
    assert bx.main(args) == 1
    out = capsys.readouterr().out
    assert f"stored output: {target}: cell {index}" in out, out
    # The same through make's command line, as CI runs it.
    check = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    assert check.returncode == 1 and "stored output" in check.stdout, check.stdout + check.stderr


def test_rebuild_is_byte_identical_and_check_passes(dirs: tuple[Path, Path]) -> None:
    solutions, exercises = dirs
    assert build(solutions, exercises) == 0
    first = (exercises / NAME).read_bytes()
    assert build(solutions, exercises) == 0
    assert (exercises / NAME).read_bytes() == first
    # As CI runs it: the script itself, in a fresh process.
    check = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--solutions", str(solutions), "--exercises", str(exercises)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "1 exercise(s) in sync and clean" in check.stdout


def test_check_reports_an_edited_solution(
    dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    solutions, exercises = dirs
    assert build(solutions, exercises) == 0
    before = (exercises / NAME).read_bytes()
    text = (solutions / NAME).read_text(encoding="utf-8")
    (solutions / NAME).write_text(text.replace("return the sum of a and b", "add them"), encoding="utf-8")
    capsys.readouterr()
    assert build(solutions, exercises, "--check") == 1
    assert f"out of sync: {exercises / NAME}" in capsys.readouterr().out
    assert (exercises / NAME).read_bytes() == before  # --check writes nothing
    assert build(solutions, exercises) == 0
    assert 'raise NotImplementedError(\\"TODO: add them\\")' in (exercises / NAME).read_text(encoding="utf-8")
    assert build(solutions, exercises, "--check") == 0


def test_check_reports_missing_and_orphaned(
    dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    solutions, exercises = dirs
    assert build(solutions, exercises, "--check") == 1
    assert f"missing: {exercises / NAME}" in capsys.readouterr().out
    assert not exercises.exists()
    assert build(solutions, exercises) == 0
    orphan = exercises / "ex42_gone.ipynb"
    orphan.write_bytes((exercises / NAME).read_bytes())
    capsys.readouterr()
    assert build(solutions, exercises, "--check") == 1
    assert f"orphaned: {orphan}" in capsys.readouterr().out
    assert build(solutions, exercises, "--only", "99", "--check") == 0  # --only looks at one exercise
    assert build(solutions, exercises) == 0
    assert not orphan.exists() and (exercises / NAME).exists()


def test_only_builds_one_exercise(dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    solutions, exercises = dirs
    (solutions / "ex07_other.ipynb").write_bytes((solutions / NAME).read_bytes())
    assert build(solutions, exercises, "--only", "07") == 0
    assert sorted(p.name for p in exercises.iterdir()) == ["ex07_other.ipynb"]
    assert build(solutions, exercises, "--only", "5") == 2
    assert "no solution or exercise ex05_*.ipynb" in capsys.readouterr().err


# --- malformed solutions -------------------------------------------------------------------------

GOOD_GRADED = code_cell("# NBVAL_CHECK_OUTPUT\nreport()", "task 1 (x): PASS\n")


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        (
            [code_cell("def f():\n    # BEGIN SOLUTION\n    return 1"), GOOD_GRADED],
            "ex98_bad.ipynb: cell 0: line 2: BEGIN SOLUTION has no END SOLUTION",
        ),
        (
            [
                code_cell("# BEGIN SOLUTION\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n# END SOLUTION"),
                GOOD_GRADED,
            ],
            "ex98_bad.ipynb: cell 0: line 2: BEGIN SOLUTION inside the region opened at line 1 (regions cannot nest)",
        ),
        (
            [code_cell("x = 1\n# END SOLUTION"), GOOD_GRADED],
            "ex98_bad.ipynb: cell 0: line 2: END SOLUTION without a BEGIN SOLUTION",
        ),
        (
            [code_cell("# BEGIN SOLUTION (task 1)\nx = 1\n# END SOLUTION"), GOOD_GRADED],
            "ex98_bad.ipynb: cell 0: line 1: malformed marker '# BEGIN SOLUTION (task 1)'",
        ),
        ([code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION")], "ex98_bad.ipynb: no graded cell"),
        ([code_cell("x = 1"), GOOD_GRADED], "ex98_bad.ipynb: no solution region"),
        (
            [
                code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION"),
                code_cell("# NBVAL_CHECK_OUTPUT\nreport()"),
            ],
            "ex98_bad.ipynb: cell 1: graded cell has no stored output",
        ),
        (
            [code_cell("# NBVAL_CHECK_OUTPUT\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION", "1\n")],
            "ex98_bad.ipynb: cell 0: a graded cell must not contain a solution region",
        ),
        (
            [new_markdown_cell("# BEGIN SOLUTION\nanswer\n# END SOLUTION"), GOOD_GRADED],
            "ex98_bad.ipynb: cell 0: solution markers only work in code cells",
        ),
        (
            [code_cell("if x:\n# BEGIN SOLUTION\n    y = 1\n# END SOLUTION\nz = 1"), GOOD_GRADED],
            "ex98_bad.ipynb: cell 0: the stubbed cell is not valid Python",
        ),
    ],
)
def test_malformed_solutions_are_clear_errors(cells: list[nbformat.NotebookNode], message: str) -> None:
    with pytest.raises(bx.ExerciseBuildError) as error:
        bx.build_exercise(new_notebook(cells=cells), "ex98_bad.ipynb")
    assert message in str(error.value)


def test_cli_reports_every_malformed_solution_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nbformat.write(
        new_notebook(cells=[code_cell("# BEGIN SOLUTION\nx = 1"), GOOD_GRADED]), solutions / "ex01_a.ipynb"
    )
    nbformat.write(new_notebook(cells=[code_cell("x = 1"), GOOD_GRADED]), solutions / "ex02_b.ipynb")
    nbformat.write(
        new_notebook(cells=[code_cell("# BEGIN SOLUTION\n# END SOLUTION"), GOOD_GRADED]),
        solutions / "ex03_c.ipynb",
    )
    assert build(solutions, exercises) == 2
    err = capsys.readouterr().err
    assert "ex01_a.ipynb: cell 0: line 1: BEGIN SOLUTION has no END SOLUTION" in err
    assert "ex02_b.ipynb: no solution region" in err
    assert not exercises.exists()


# --- grading with nbval --------------------------------------------------------------------------


def test_sanitize_file_cleans_addresses_and_kernel_paths() -> None:
    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns(bx.SANITIZE_CFG.read_text(encoding="utf-8"))

    def clean(text: str) -> str:
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text

    assert clean("<object object at 0x7f3a2c1b9d80>") == clean("<object object at 0x55d0aa11>")
    assert clean("/tmp/ipykernel_4242/1234567.py:3: UserWarning: w") == clean(
        "/var/folders/x1/T/ipykernel_77/1234567.py:3: UserWarning: w"
    )
    assert clean("task 1 (add): PASS, mask 0x1f, id 0xabc") == "task 1 (add): PASS, mask 0x1f, id 0xabc"
    assert clean("task 1 (add): PASS") != clean("task 1 (add): FAIL")


@pytest.mark.slow
@pytest.mark.notebook
def test_nbval_passes_the_solution_and_fails_the_untouched_exercise(dirs: tuple[Path, Path]) -> None:
    solutions, exercises = dirs
    assert build(solutions, exercises) == 0
    expected = bx.expected_path(NAME, exercises.parent)
    solved = bx.run_nbval(solutions / NAME, timeout_s=180)
    assert solved.passed, solved.output
    assert "5 passed" in solved.output  # one item per code cell, the two graded ones compared

    # The exercise holds no output: nbval compares its graded cells with the grader's expected outputs.
    untouched = bx.run_nbval(exercises / NAME, timeout_s=180, expected=expected)
    assert not untouched.passed, untouched.output
    # The graded cell calls the stubs: it raises (tagged raises-exception, so Run All goes on) and
    # its output is not the PASS the grader expects.
    assert "Cell 3: Cell outputs differ" in untouched.output and "Missing output fields" in untouched.output
    assert "1 failed, 4 passed" in untouched.output
    assert not list(exercises.glob(".*")), "the restored copy was not removed"

    # A wrong answer runs without error but prints FAIL: the expected PASS output catches it.
    wrong = exercises / "ex99_wrong.ipynb"
    text = (exercises / NAME).read_text(encoding="utf-8")
    wrong.write_text(
        text.replace(
            'raise NotImplementedError(\\"TODO: return the sum of a and b\\")', "return a - b"
        ).replace(
            'raise NotImplementedError(\\"TODO: your code here\\")',
            "self.total += k\\n        return self.total",
        ),
        encoding="utf-8",
    )
    answered = bx.run_nbval(wrong, timeout_s=180, expected=expected)
    assert not answered.passed, answered.output
    assert "Cell outputs differ" in answered.output and "task 1 (add): FAIL" in answered.output
    assert "1 failed, 4 passed" in answered.output
    # Without the expected outputs nbval has nothing to compare: the same wrong answer would pass.
    assert bx.run_nbval(wrong, timeout_s=180).passed
    # And the right answer, in the learner's notebook, passes against the expected outputs.
    right = exercises / "ex99_right.ipynb"
    right.write_text(text.replace('raise NotImplementedError(\\"TODO: return the sum of a and b\\")', "return a + b")
                     .replace('raise NotImplementedError(\\"TODO: your code here\\")',
                              "self.total += k\\n        return self.total"), encoding="utf-8")
    assert bx.run_nbval(right, timeout_s=180, expected=expected).passed

    # The helper the per-exercise tests call: a run past its time limit is a failure, not a hang.
    assert bx.nbval_passes(solutions / NAME, timeout_s=1) is False


def test_repo_exercises_are_in_sync_with_their_solutions() -> None:
    solutions = sorted((REPO_ROOT / "solutions").glob(bx.NOTEBOOK_GLOB))
    if not solutions:
        pytest.skip("no solutions/exNN_*.ipynb in the repository yet")
    check = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stdout + check.stderr
