"""Build the learners' exercise notebooks from the solved ones: the course's grading pipeline.

`solutions/exNN_topic.ipynb` is the one source: a solved notebook, executed, outputs stored. Each
region of a code cell between a `# BEGIN SOLUTION` line and a `# END SOLUTION` line becomes
`raise NotImplementedError("TODO: <hint>")` at the indentation of the BEGIN line; the hint is taken
from `# HINT: ...` lines right after BEGIN (default: "your code here"). Every other cell and every
stored output stays: the graded cells (those with a `# NBVAL_CHECK_OUTPUT` line) show the learner
what a PASS looks like. Grading itself does not trust the notebook: `make grade` (tools/grade.py,
minillm/grading/runner.py) runs only the cells that hold a stub here, taken from the learner's
notebook, with every other cell from the exercise's manifest and the checks from
minillm/grading/exNN.py. This tool writes the manifests too, `minillm/grading/cells/exNN_topic.json`
(the ids and sources of every cell that is not the learner's; no solution region), so that grading
reads nothing from solutions/ and a student release (tools/student_release.py) can leave it out.

Usage:
    python tools/build_exercises.py            # regenerate exercises/ and the manifests (remove orphans)
    python tools/build_exercises.py --check    # write nothing; exit 1 listing what is out of sync
    python tools/build_exercises.py --only 05  # just exercise 05

Exit status: 0 in sync (or rebuilt), 1 out of sync (--check), 2 a malformed solution notebook.
The output is byte-deterministic (nbformat's sorted keys and indent, execution timestamps dropped),
so CI can regenerate and diff. `run_nbval()` runs nbval on one notebook (the chapter tests use it).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode

REPO_ROOT = Path(__file__).resolve().parent.parent
CELLS_SUBDIR = Path("minillm", "grading", "cells")  # the manifests, beside the graders
SANITIZE_CFG = Path(__file__).resolve().with_name("nbval_sanitize.cfg")
NOTEBOOK_GLOB = "ex[0-9][0-9]_*.ipynb"
DEFAULT_HINT = "your code here"
GRADED_MARKER = "NBVAL_CHECK_OUTPUT"
# Cell metadata that only records when a cell ran (nbclient, JupyterLab, nbextensions): it changes
# on every execution and would make every regeneration a diff.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime")

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN SOLUTION\s*$")
_END = re.compile(r"^[ \t]*#\s*END SOLUTION\s*$")
_HINT = re.compile(r"^[ \t]*#\s*HINT:\s*(?P<hint>.*?)\s*$")
# A comment that looks like a marker but is not exactly one would leak its region to learners.
_NEAR_MARKER = re.compile(r"^\s*#.*\b(BEGIN|END)\s+SOLUTION\b", re.IGNORECASE)


class ExerciseBuildError(ValueError):
    """A solution notebook cannot be turned into an exercise; the message names notebook and cell."""


def stub_source(source: str, where: str = "cell") -> tuple[str, int]:
    """Replace each solution region of one cell's source by a `raise NotImplementedError` stub.

    Returns the new source and the number of regions replaced. `where` prefixes error messages.
    """
    out: list[str] = []
    begin_line = 0  # 1-based line of the open BEGIN marker; 0 when outside a region
    indent, hint_parts, reading_hints, regions = "", [], False, 0
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        text = line.rstrip("\r\n")
        begin, end = _BEGIN.match(text), _END.match(text)
        if begin and begin_line:
            raise ExerciseBuildError(
                f"{where}: line {number}: BEGIN SOLUTION inside the region opened at line {begin_line} "
                "(regions cannot nest)"
            )
        if end and not begin_line:
            raise ExerciseBuildError(f"{where}: line {number}: END SOLUTION without a BEGIN SOLUTION")
        if not (begin or end) and _NEAR_MARKER.match(text):
            raise ExerciseBuildError(
                f"{where}: line {number}: malformed marker {text.strip()!r}; write exactly "
                "'# BEGIN SOLUTION' or '# END SOLUTION' on a line of its own"
            )
        if begin:
            begin_line, indent, hint_parts, reading_hints = number, begin["indent"], [], True
        elif end:
            hint = " ".join(part for part in hint_parts if part) or DEFAULT_HINT
            literal = json.dumps(f"TODO: {hint}", ensure_ascii=False)  # a valid Python str literal
            out.append(f"{indent}raise NotImplementedError({literal}){line[len(text) :]}")
            begin_line, regions = 0, regions + 1
        elif begin_line:
            hint = _HINT.match(text) if reading_hints else None
            reading_hints = hint is not None
            if hint:
                hint_parts.append(hint["hint"])
        else:
            out.append(line)
    if begin_line:
        raise ExerciseBuildError(f"{where}: line {begin_line}: BEGIN SOLUTION has no END SOLUTION")
    stubbed = "".join(out)
    if regions and _compiles(source) and not _compiles(stubbed):
        raise ExerciseBuildError(f"{where}: the stubbed cell is not valid Python:\n{stubbed}")
    return stubbed, regions


def _compiles(source: str) -> bool:
    # Cells with IPython magics do not compile as plain Python; those are not checked.
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, "<cell>", "exec", flags=flags, dont_inherit=True)
    except SyntaxError:
        return False
    return True


def is_graded(cell: NotebookNode) -> bool:
    """True for a code cell nbval compares in --nbval-lax mode (the comment or the tag)."""
    if cell.cell_type != "code":
        return False
    if "nbval-check-output" in cell.metadata.get("tags", []):
        return True
    return any(
        line.strip().startswith("#") and line.strip().lstrip("#").strip() == GRADED_MARKER
        for line in cell.source.splitlines()
    )


def load_notebook(path: Path) -> NotebookNode:
    """Read a notebook; cells without an id get one from their index (nbformat would pick at random)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ExerciseBuildError(f"{path}: cannot read the notebook: {error}") from error
    if data.get("nbformat") == 4 and data.get("nbformat_minor", 0) >= 5:
        for index, cell in enumerate(data.get("cells", [])):
            cell.setdefault("id", f"cell-{index}")
    return nbformat.reads(json.dumps(data), as_version=4)


def build_exercise(solution: NotebookNode, name: str = "notebook") -> NotebookNode:
    """The exercise made from a solved notebook; raises ExerciseBuildError naming `name` and the cell."""
    exercise = copy.deepcopy(solution)
    regions = graded = 0
    for index, cell in enumerate(exercise.cells):
        where = f"{name}: cell {index}"
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            if any(_BEGIN.match(line) or _END.match(line) for line in cell.source.splitlines()):
                raise ExerciseBuildError(f"{where}: solution markers only work in code cells")
            continue
        source, count = stub_source(cell.source, where)
        if is_graded(cell):
            graded += 1
            if count:
                raise ExerciseBuildError(f"{where}: a graded cell must not contain a solution region")
            if cell.execution_count is None or not cell.outputs:
                raise ExerciseBuildError(
                    f"{where}: graded cell has no stored output, so nbval would compare nothing; "
                    "execute the solution and save it with outputs"
                )
        if count:
            # The solution's outputs would show its answer and do not belong to the stub.
            cell.source, cell.outputs, cell.execution_count = source, [], None
            regions += count
    if not graded:
        raise ExerciseBuildError(f"{name}: no graded cell (a code cell with a '# {GRADED_MARKER}' line)")
    if not regions:
        raise ExerciseBuildError(f"{name}: no solution region ('# BEGIN SOLUTION' ... '# END SOLUTION')")
    return exercise


def render_exercise(solution_path: Path) -> str:
    """The exact text of the exercise generated from `solution_path`."""
    exercise = build_exercise(load_notebook(solution_path), _show(solution_path))
    text = nbformat.writes(exercise, version=nbformat.NO_CONVERT)  # sorted keys, indent=1
    return text if text.endswith("\n") else text + "\n"


def _runner():
    # minillm/grading/runner.py decides what grading runs; loaded by path (it needs only the
    # standard library) so that this tool does not import minillm, and with it torch.
    name = "_minillm_grading_runner"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "minillm" / "grading" / "runner.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


def render_manifest(solution_path: Path) -> str:
    """The exact text of the grading manifest of `solution_path`: every code cell's id and kind, the
    source of every cell that is not the learner's (setup and graded cells), never a solution region."""
    notebook = json.loads(nbformat.writes(load_notebook(solution_path), version=nbformat.NO_CONVERT))
    manifest = _runner().course_cells(notebook, Path(solution_path).name)
    manifest = {"about": f"Generated by tools/build_exercises.py from solutions/{Path(solution_path).name} "
                         "(make exercises): the cells make grade runs besides the learner's. Do not edit.",
                **manifest}
    return json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


@dataclass(frozen=True)
class Planned:
    """One generated file (an exercise or its grading manifest) and what regenerating it would do."""

    exercise: Path  # the generated file: exercises/exNN_topic.ipynb or minillm/grading/cells/exNN_topic.json
    status: str  # "in sync" | "out of sync" | "missing" | "orphaned"
    text: str | None  # the generated text; None for an orphan
    kind: str = "exercise"  # or "manifest"


def plan(solutions_dir: Path, exercises_dir: Path, only: str | None = None,
         cells_dir: Path | None = None) -> list[Planned]:
    """Compare every exercise and grading manifest with what its solution generates. Raises
    ExerciseBuildError listing every malformed solution (all of them, so one run shows every problem).
    `cells_dir` defaults to minillm/grading/cells beside `exercises_dir` (the course's root)."""
    if not Path(solutions_dir).is_dir():
        raise ExerciseBuildError(
            f"no {solutions_dir} here: exercises and grading manifests are built from the solved notebooks, "
            "which only the teacher's copy of the course has (a student release has none and needs no build)")
    cells_dir = Path(cells_dir) if cells_dir is not None else Path(exercises_dir).parent / CELLS_SUBDIR
    pattern = f"ex{only}_*" if only else NOTEBOOK_GLOB.removesuffix(".ipynb")
    solutions = sorted(Path(solutions_dir).glob(f"{pattern}.ipynb"))
    planned, errors = [], []
    for solution in solutions:
        try:
            texts = [(Path(exercises_dir) / solution.name, render_exercise(solution), "exercise"),
                     (cells_dir / f"{solution.stem}.json", render_manifest(solution), "manifest")]
        except ExerciseBuildError as error:
            errors.append(str(error))
            continue
        for path, text, kind in texts:
            if not path.exists():
                status = "missing"
            else:
                status = "in sync" if path.read_bytes() == text.encode("utf-8") else "out of sync"
            planned.append(Planned(path, status, text, kind))
    if errors:
        raise ExerciseBuildError("\n".join(errors))
    stems = {solution.stem for solution in solutions}
    for folder, suffix, kind in ((Path(exercises_dir), ".ipynb", "exercise"), (cells_dir, ".json", "manifest")):
        for path in sorted(folder.glob(f"{pattern}{suffix}")):
            if path.stem not in stems:
                planned.append(Planned(path, "orphaned", None, kind))
    return planned


def apply(planned: list[Planned]) -> None:
    """Write missing and stale exercises; remove orphans (exercises/ is generated, never hand-edited)."""
    for item in planned:
        if item.status == "orphaned":
            item.exercise.unlink()
        elif item.status != "in sync" and item.text is not None:
            item.exercise.parent.mkdir(parents=True, exist_ok=True)
            item.exercise.write_bytes(item.text.encode("utf-8"))


def _show(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if out of sync")
    parser.add_argument("--only", metavar="NN", help="only exercise NN (e.g. 05)")
    parser.add_argument("--solutions", type=Path, default=REPO_ROOT / "solutions", help="default: solutions/")
    parser.add_argument("--exercises", type=Path, default=REPO_ROOT / "exercises", help="default: exercises/")
    parser.add_argument("--cells", type=Path, help="where the grading manifests go "
                        "(default: minillm/grading/cells beside the exercises folder)")
    args = parser.parse_args(argv)
    if args.only is not None and not args.only.isdigit():
        parser.error(f"--only takes an exercise number such as 05, not {args.only!r}")
    only = f"{int(args.only):02d}" if args.only is not None else None
    try:
        planned = plan(args.solutions, args.exercises, only, args.cells)
    except ExerciseBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if only and not planned:
        print(f"error: no solution or exercise ex{only}_*.ipynb", file=sys.stderr)
        return 2
    stale = [item for item in planned if item.status != "in sync"]
    exercises = sum(item.kind == "exercise" for item in planned)
    if args.check:
        for item in stale:
            print(f"{item.status}: {_show(item.exercise)}")
        if stale:
            print(f"run `python tools/build_exercises.py` to regenerate {len(stale)} file(s)")
            return 1
        print(f"{exercises} exercise(s) in sync, with their grading manifests")
        return 0
    apply(planned)
    for item in stale:
        action = "removed orphan" if item.status == "orphaned" else "wrote"
        print(f"{action}: {_show(item.exercise)}")
    print(f"{len(planned) - len(stale)} file(s) already in sync, {len(stale)} updated "
          f"({exercises} exercise(s) and their grading manifests)")
    return 0


@dataclass(frozen=True)
class NbvalResult:
    """The verdict of nbval on one notebook, with pytest's report for failure messages."""

    passed: bool
    output: str  # without the colour codes of IPython's tracebacks


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_nbval(notebook_path: Path, timeout_s: int = 300, lax: bool = True,
              cell_timeout_s: int | None = None) -> NbvalResult:
    """Run `pytest --nbval-lax --nbval-current-env` (with the sanitize file) on one notebook.

    `lax=False` runs strict `--nbval` (every untagged cell compared), as the chapter tests do.
    """
    notebook_path = Path(notebook_path).resolve()
    command = [
        sys.executable, "-m", "pytest", "--nbval-lax" if lax else "--nbval", "--nbval-current-env",
        "--nbval-sanitize-with", str(SANITIZE_CFG), f"--nbval-cell-timeout={cell_timeout_s or timeout_s}",
        "-p", "no:cacheprovider", "--color=no", str(notebook_path),
    ]  # fmt: skip
    # The kernel inherits this environment: let it import minillm from the checkout.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(
        command, cwd=notebook_path.parent, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        output, _ = process.communicate()
        return NbvalResult(False, f"{_ANSI.sub('', output)}\nnbval timed out after {timeout_s} s")
    return NbvalResult(process.returncode == 0, _ANSI.sub("", output))


def nbval_passes(notebook_path: Path, timeout_s: int = 300) -> bool:
    """True when the notebook passes `pytest --nbval-lax --nbval-current-env` within timeout_s."""
    return run_nbval(notebook_path, timeout_s).passed


if __name__ == "__main__":
    sys.exit(main())
