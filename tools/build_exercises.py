"""Build the learners' exercise notebooks from the solved ones: the course's grading pipeline.

`solutions/exNN_topic.ipynb` is the one source: a solved notebook, executed, outputs stored. Each
region of a code cell between a `# BEGIN SOLUTION` line and a `# END SOLUTION` line becomes
`raise NotImplementedError("TODO: <hint>")` at the indentation of the BEGIN line; the hint is taken
from `# HINT: ...` lines right after BEGIN (default: "your code here"). Every other cell stays, but
the exercise opens clean, as nbgrader's release writes it: no code cell keeps a stored output or an
execution count (a solution's output would show its answer: a PASS line that prints the knobs, the
cached tokens, a demo run of the solution). Every code cell from the first learner cell on carries
Jupyter's `raises-exception` tag, so that Run All on an untouched exercise goes on past a demo that
calls a stub and shows every task's "not written yet" verdict, not only the first.

What a graded cell should print lives with the grader, not in the learner's notebook: this tool
writes, per exercise,
- `minillm/grading/cells/exNN_topic.json`, the manifest: the ids and sources of every cell that is
  not the learner's (no solution region), which `make grade` (tools/grade.py,
  minillm/grading/runner.py) runs around the learner's cells; it ships in a student release;
- `minillm/grading/private/expected/exNN_topic.json`: the graded cells' stored outputs (the
  solution's PASS reports, which may name an answer), what nbval compares a learner's graded cells
  with (`run_nbval(..., expected=...)` puts them back into a copy first). Like everything under
  `minillm/grading/private/`, it is the teacher's: a student release leaves it out;
- `minillm/grading/keys/exNN_topic.json`, for an exercise whose grader declares an `AnswerKey`
  (minillm/grading/answer_key.py): one salted digest of the grader-private reference's output per
  pool case, which a student release ships and grades with. Writing one runs the references
  (`python -m minillm.grading.answer_key exNN_topic`, in a subprocess: this tool imports no minillm);
  a key is stale when its fingerprint (the key format, the grading module, its private modules)
  is not the sources' now, and `--check` says so without running anything.
Grading itself does not trust the notebook: only the cells that hold a stub here are taken from the
learner's notebook, every other cell from the manifest, the checks from minillm/grading/exNN.py.

Usage:
    python tools/build_exercises.py            # regenerate exercises/, manifests, expected outputs (remove orphans)
    python tools/build_exercises.py --check    # write nothing; exit 1 listing what is out of sync or not clean
    python tools/build_exercises.py --only 05  # just exercise 05

Exit status: 0 in sync (or rebuilt), 1 out of sync or a stored output in exercises/ (--check), 2 a
malformed solution notebook (or an answer key that could not be written). The output is
byte-deterministic (nbformat's sorted keys and indent, execution timestamps dropped), so CI can
regenerate and diff. `run_nbval()` runs nbval on one
notebook (the chapter tests use it).
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
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode

REPO_ROOT = Path(__file__).resolve().parent.parent
CELLS_SUBDIR = Path("minillm", "grading", "cells")  # the manifests, beside the graders
# The graded cells' expected outputs: grader-private (minillm/grading/private/ is not released).
EXPECTED_SUBDIR = Path("minillm", "grading", "private", "expected")
RUN_ALL_TAG = "raises-exception"  # Jupyter (and nbclient, nbval): an error in this cell does not stop Run All
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
    """The exercise made from a solved notebook; raises ExerciseBuildError naming `name` and the cell.

    No code cell keeps an output or an execution count; every code cell from the first learner cell
    on is tagged `raises-exception` (RUN_ALL_TAG)."""
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
        regions += count
        # Open clean: a stored output would show the solution's answer or its PASS (nbgrader's release
        # clears them too); what a graded cell should print is kept by the grader (render_expected).
        cell.source, cell.outputs, cell.execution_count = source, [], None
        if regions:  # from the first learner cell on: a stub that raises does not stop Run All
            tags = list(cell.metadata.get("tags", []))
            if RUN_ALL_TAG not in tags:
                cell.metadata["tags"] = [*tags, RUN_ALL_TAG]
    if not graded:
        raise ExerciseBuildError(f"{name}: no graded cell (a code cell with a '# {GRADED_MARKER}' line)")
    if not regions:
        raise ExerciseBuildError(f"{name}: no solution region ('# BEGIN SOLUTION' ... '# END SOLUTION')")
    return exercise


def stored_outputs(notebook: NotebookNode | dict) -> list[str]:
    """'cell N' for every code cell of `notebook` that holds a stored output or an execution count
    (an exercise must hold none)."""
    cells = notebook["cells"]
    return [f"cell {index}" for index, cell in enumerate(cells) if cell.get("cell_type") == "code"
            and (cell.get("outputs") or cell.get("execution_count") is not None)]


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


def _answer_key():
    # minillm/grading/answer_key.py: loaded by path, as the runner is (its top imports only the standard library).
    name = "_minillm_grading_answer_key"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "minillm" / "grading" / "answer_key.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def keys_status(root: Path, stem: str) -> str | None:
    """Whether `stem`'s answer key is "in sync", "out of sync" or "missing"; None when its grading
    module (in `root`) declares no AnswerKey. Compares the key's fingerprint, runs nothing."""
    keys = _answer_key()
    grader = Path(root) / "minillm" / "grading" / f"{stem[:4]}.py"
    if not grader.exists() or not keys.declares_keys(grader.read_text(encoding="utf-8")):
        return None
    path = keys.key_path(stem, root)
    if not path.exists():
        return "missing"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "out of sync"
    current = document.get("format") == keys.FORMAT and document.get("fingerprint") == keys.fingerprint(stem, root)
    return "in sync" if current else "out of sync"


def render_keys(root: Path, stem: str) -> str:
    """The text of `stem`'s answer key, computed by the grading module in `root` in a fresh process
    (it imports minillm and runs the grader-private references on every pool case)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(root).resolve()), env.get("PYTHONPATH")) if p)
    env.pop(_answer_key().AS_RELEASE_ENV, None)  # the keys are written from the references
    done = subprocess.run([sys.executable, "-m", "minillm.grading.answer_key", stem], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise ExerciseBuildError(f"{stem}: the answer key could not be written:\n{done.stderr[-4000:]}")
    return done.stdout


def render_manifest(solution_path: Path) -> str:
    """The exact text of the grading manifest of `solution_path`: every code cell's id and kind, the
    source of every cell that is not the learner's (setup and graded cells), never a solution region."""
    notebook = json.loads(nbformat.writes(load_notebook(solution_path), version=nbformat.NO_CONVERT))
    manifest = _runner().course_cells(notebook, Path(solution_path).name)
    manifest = {"about": f"Generated by tools/build_exercises.py from solutions/{Path(solution_path).name} "
                         "(make exercises): the cells make grade runs besides the learner's. Do not edit.",
                **manifest}
    return json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def render_expected(solution_path: Path) -> str:
    """The exact text of `solution_path`'s expected outputs: each graded cell's stored outputs, by cell
    id (grader-private: they may name an answer; see the module docstring)."""
    node = load_notebook(solution_path)
    written = json.loads(nbformat.writes(node, version=nbformat.NO_CONVERT))["cells"]  # outputs as Jupyter saves them
    graded = {cell["id"]: {"execution_count": cell["execution_count"], "outputs": cell["outputs"]}
              for cell, source in zip(written, node.cells) if is_graded(source)}
    expected = {"about": f"Generated by tools/build_exercises.py from solutions/{Path(solution_path).name} "
                         "(make exercises): what each graded cell prints when every task passes, for nbval. "
                         "Grader-private: a student release leaves minillm/grading/private/ out. Do not edit.",
                "exercise": Path(solution_path).name, "graded_outputs": graded}
    return json.dumps(expected, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def with_expected_outputs(notebook: dict, expected: dict) -> dict:
    """A copy of a learner's notebook (parsed JSON) whose graded cells hold the outputs `expected` (a
    parsed private/expected file) says they print when every task passes: what nbval compares with."""
    restored = copy.deepcopy(notebook)
    for cell in restored["cells"]:
        stored = expected["graded_outputs"].get(cell.get("id"))
        if stored is not None and cell.get("cell_type") == "code":
            cell["outputs"] = copy.deepcopy(stored["outputs"])
            cell["execution_count"] = stored["execution_count"]
    return restored


def expected_path(notebook_path: Path, root: Path = REPO_ROOT) -> Path:
    """The expected-outputs file of an exercise notebook named exNN_topic.ipynb."""
    return Path(root) / EXPECTED_SUBDIR / f"{Path(notebook_path).stem}.json"


@dataclass(frozen=True)
class Planned:
    """One generated file (an exercise or its grading manifest) and what regenerating it would do."""

    exercise: Path  # the generated file: exercises/exNN_topic.ipynb, or its manifest, expected outputs, answer key
    status: str  # "in sync" | "out of sync" | "missing" | "orphaned"
    text: str | None  # the generated text; None for an orphan and for an answer key (written by apply)
    kind: str = "exercise"  # or "manifest", "expected", "keys"


def plan(solutions_dir: Path, exercises_dir: Path, only: str | None = None,
         cells_dir: Path | None = None, expected_dir: Path | None = None) -> list[Planned]:
    """Compare every exercise, grading manifest and expected-outputs file with what its solution
    generates, and every answer key's fingerprint with its sources'. Raises ExerciseBuildError
    listing every malformed solution (all of them, so one run shows every problem). `cells_dir` and
    `expected_dir` default to minillm/grading/cells and minillm/grading/private/expected beside
    `exercises_dir` (the course's root, where the graders and minillm/grading/keys are)."""
    if not Path(solutions_dir).is_dir():
        raise ExerciseBuildError(
            f"no {solutions_dir} here: exercises and grading manifests are built from the solved notebooks, "
            "which only the teacher's copy of the course has (a student release has none and needs no build)")
    root = Path(exercises_dir).parent
    cells_dir = Path(cells_dir) if cells_dir is not None else Path(exercises_dir).parent / CELLS_SUBDIR
    expected_dir = Path(expected_dir) if expected_dir is not None else Path(exercises_dir).parent / EXPECTED_SUBDIR
    pattern = f"ex{only}_*" if only else NOTEBOOK_GLOB.removesuffix(".ipynb")
    solutions = sorted(Path(solutions_dir).glob(f"{pattern}.ipynb"))
    planned, errors = [], []
    for solution in solutions:
        try:
            texts = [(Path(exercises_dir) / solution.name, render_exercise(solution), "exercise"),
                     (cells_dir / f"{solution.stem}.json", render_manifest(solution), "manifest"),
                     (expected_dir / f"{solution.stem}.json", render_expected(solution), "expected")]
        except ExerciseBuildError as error:
            errors.append(str(error))
            continue
        for path, text, kind in texts:
            if not path.exists():
                status = "missing"
            else:
                status = "in sync" if path.read_bytes() == text.encode("utf-8") else "out of sync"
            planned.append(Planned(path, status, text, kind))
        keyed = keys_status(root, solution.stem)
        if keyed is not None:
            planned.append(Planned(_answer_key().key_path(solution.stem, root), keyed, None, "keys"))
    if errors:
        raise ExerciseBuildError("\n".join(errors))
    stems = {solution.stem for solution in solutions}
    keyed_stems = {item.exercise.stem for item in planned if item.kind == "keys"}
    for folder, suffix, kind, wanted in ((Path(exercises_dir), ".ipynb", "exercise", stems),
                                         (cells_dir, ".json", "manifest", stems),
                                         (expected_dir, ".json", "expected", stems),
                                         (root / "minillm" / "grading" / "keys", ".json", "keys", keyed_stems)):
        for path in sorted(folder.glob(f"{pattern}{suffix}")):
            if path.stem not in wanted:
                planned.append(Planned(path, "orphaned", None, kind))
    return planned


def apply(planned: list[Planned]) -> None:
    """Write missing and stale exercises (answer keys: by running their references); remove orphans
    (exercises/ is generated, never hand-edited)."""
    for item in planned:
        if item.status == "orphaned":
            item.exercise.unlink()
        elif item.status != "in sync" and item.kind == "keys":
            text = render_keys(item.exercise.parent.parent.parent.parent, item.exercise.stem)
            item.exercise.parent.mkdir(parents=True, exist_ok=True)
            item.exercise.write_bytes(text.encode("utf-8"))
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
    parser.add_argument("--expected", type=Path, help="where the graded cells' expected outputs go "
                        "(default: minillm/grading/private/expected beside the exercises folder)")
    args = parser.parse_args(argv)
    if args.only is not None and not args.only.isdigit():
        parser.error(f"--only takes an exercise number such as 05, not {args.only!r}")
    only = f"{int(args.only):02d}" if args.only is not None else None
    try:
        planned = plan(args.solutions, args.exercises, only, args.cells, args.expected)
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
        dirty = _not_clean(args.exercises, only)
        for path, cells in dirty:
            print(f"stored output: {_show(path)}: {', '.join(cells)} (an exercise opens clean)")
        if stale or dirty:
            print(f"run `python tools/build_exercises.py` to regenerate {len(stale) + len(dirty)} file(s)")
            return 1
        print(f"{exercises} exercise(s) in sync and clean, with their grading manifests, expected outputs and answer keys")
        return 0
    try:
        apply(planned)
    except ExerciseBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for item in stale:
        action = "removed orphan" if item.status == "orphaned" else "wrote"
        print(f"{action}: {_show(item.exercise)}")
    print(f"{len(planned) - len(stale)} file(s) already in sync, {len(stale)} updated "
          f"({exercises} exercise(s), their grading manifests, expected outputs and answer keys)")
    return 0


def _not_clean(exercises_dir: Path, only: str | None) -> list[tuple[Path, list[str]]]:
    """Every exercise notebook on disk that holds a stored output (whatever generated it): the check
    looks at the files themselves, not only at whether they equal what this tool writes."""
    pattern = f"ex{only}_*.ipynb" if only else NOTEBOOK_GLOB
    found = []
    for path in sorted(Path(exercises_dir).glob(pattern)):
        try:
            cells = stored_outputs(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            cells = ["cannot read the notebook"]
        if cells:
            found.append((path, cells))
    return found


@dataclass(frozen=True)
class NbvalResult:
    """The verdict of nbval on one notebook, with pytest's report for failure messages."""

    passed: bool
    output: str  # without the colour codes of IPython's tracebacks


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_nbval(notebook_path: Path, timeout_s: int = 300, lax: bool = True,
              cell_timeout_s: int | None = None, expected: Path | dict | None = None) -> NbvalResult:
    """Run `pytest --nbval-lax --nbval-current-env` (with the sanitize file) on one notebook.

    `lax=False` runs strict `--nbval` (every untagged cell compared), as the chapter tests do.
    `expected` (an expected-outputs file, `expected_path(notebook)`, or its parsed JSON): a learner's
    exercise holds no stored output, so nbval would compare nothing; the graded cells' expected outputs
    are put back into a hidden copy beside the notebook (the kernel runs in the notebook's folder),
    which nbval runs and which is removed afterwards.
    """
    notebook_path = Path(notebook_path).resolve()
    if expected is not None:
        if not isinstance(expected, dict):
            expected = json.loads(Path(expected).read_text(encoding="utf-8"))
        restored = with_expected_outputs(json.loads(notebook_path.read_text(encoding="utf-8")), expected)
        handle, name = tempfile.mkstemp(prefix=f".{notebook_path.stem}.expected-", suffix=".ipynb",
                                        dir=notebook_path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(restored, out, indent=1)
        try:
            return run_nbval(Path(name), timeout_s, lax, cell_timeout_s)
        finally:
            Path(name).unlink(missing_ok=True)
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
