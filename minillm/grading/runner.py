"""Grade one learner notebook: what `make grade` runs (see minillm.grading).

`course_cells()` turns a solved notebook into the exercise's *manifest*: every code cell in order,
marked `learner` (it holds a `# BEGIN SOLUTION` region: the learner writes it), `graded` (a
`# NBVAL_CHECK_OUTPUT` call, kept as task number and argument names), `setup` (given code, with its
source) or `skip` (a `grading-skip` demo). `tools/build_exercises.py` writes it beside the graders,
`minillm/grading/cells/exNN_topic.json`, when it builds `exercises/`; it holds no learner cell's
source, so it ships in a student release (`make student-release`), which has no `solutions/`.

`compose()` rebuilds the notebook to run: the learner's cells (matched by cell id) from the
learner's notebook, every other cell from the manifest. `grade()` runs that plan in a fresh Python
process (`python -m minillm.grading.runner`), which imports the exercise's grading module before
any learner code runs, executes the cells with plain `exec`, and at each graded cell calls the
check it captured, on the objects the graded cell's call names. The verdicts come back as JSON,
never as printed text.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The markers of tools/build_exercises.py (the one tool that writes exercises).
_BEGIN = re.compile(r"^[ \t]*#\s*BEGIN SOLUTION\s*$", re.MULTILINE)
_GRADED = re.compile(r"^[ \t]*#\s*NBVAL_CHECK_OUTPUT\s*$", re.MULTILINE)
_NUMBER = re.compile(r"^ex(\d\d)_")
CELL_TIME_LIMIT_S = 300
WITHHELD = "NOT GRADED HERE"  # minillm.grading.WITHHELD (this module imports nothing of minillm in the parent)
SKIP_TAG = "grading-skip"  # on a solution's demo cell that no check needs
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
CELLS_DIR = Path(__file__).resolve().parent / "cells"  # the manifests, written by tools/build_exercises.py


class GradingSetupError(ValueError):
    """The solution or the learner notebook cannot be graded (not the learner's answer being wrong)."""


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _read(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise GradingSetupError(f"{path}: cannot read the notebook: {error}") from error


def grader_module_for(notebook: Path) -> str:
    match = _NUMBER.match(Path(notebook).name)
    if not match:
        raise GradingSetupError(f"{notebook}: an exercise is named exNN_topic.ipynb")
    return f"minillm.grading.ex{match[1]}"


def parse_graded_call(source: str, where: str) -> tuple[int, list[str]]:
    """`grader.check_task_N(a, b)` -> (N, ["a", "b"]): the task and the argument expressions."""
    try:
        body = ast.parse(source).body
    except SyntaxError as error:
        raise GradingSetupError(f"{where}: graded cell does not parse: {error}") from error
    calls = [node.value for node in body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    ok = (len(body) == 1 and len(calls) == 1 and isinstance(calls[0].func, ast.Attribute)
          and isinstance(calls[0].func.value, ast.Name) and calls[0].func.value.id == "grader"
          and re.fullmatch(r"check_task_\d+", calls[0].func.attr) and not calls[0].keywords)
    if not ok:
        raise GradingSetupError(f"{where}: a graded cell holds one call `grader.check_task_N(name, ...)`, "
                                f"not:\n{source}")
    call = calls[0]
    return int(call.func.attr.rsplit("_", 1)[1]), [ast.unparse(arg) for arg in call.args]


@dataclass
class Plan:
    grader: str
    cells: list[dict[str, Any]]  # {"kind": "setup" | "learner" | "graded", "source", "where", ...}
    notes: list[str] = field(default_factory=list)


def course_cells(solution: dict, name: str) -> dict[str, Any]:
    """The manifest of a solved notebook (parsed JSON) named `name`: what grading runs besides the
    learner's cells. Holds the source of setup and graded cells only, never a solution region."""
    cells = []
    for index, cell in enumerate(solution.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source, entry = _source(cell), {"index": index, "id": cell.get("id")}
        if SKIP_TAG in cell.get("metadata", {}).get("tags", []) and not _BEGIN.search(source):
            entry["kind"] = "skip"  # a demo the checks do not need: not run when grading
        elif _GRADED.search(source):
            entry.update(kind="graded", source=source)
        elif _BEGIN.search(source):
            entry.update(kind="learner", given=given_code(source))
        else:
            entry.update(kind="setup", source=source)
        cells.append(entry)
    return {"exercise": Path(name).name, "cells": cells}


_REGION = re.compile(r"^([ \t]*)#[ \t]*BEGIN SOLUTION[ \t]*$.*?^[ \t]*#[ \t]*END SOLUTION[ \t]*$", re.MULTILINE | re.DOTALL)


def given_code(source: str) -> str:
    """A learner cell as every learner gets it: each solution region a bare `raise NotImplementedError`
    (the exercise's stub without its hint). The copy detector leaves its functions out (provenance.set_given)."""
    return _REGION.sub(lambda match: f"{match[1]}raise NotImplementedError", source)


def given_sources(cells: list[dict[str, Any]]) -> list[str]:
    """The code of a plan (or a manifest's cells) that is the same for every learner: setup cells and the
    learner cells' given code."""
    return [cell["source"] if cell["kind"] == "setup" else cell.get("given", "") for cell in cells
            if cell["kind"] in ("setup", "learner")]


def manifest_for(learner_path: Path, cells_dir: Path | None = None) -> Path:
    """The manifest that grades a notebook named like `learner_path` (exNN_topic.ipynb)."""
    grader_module_for(learner_path)  # the name must be an exercise's
    manifest = Path(cells_dir or CELLS_DIR) / f"{Path(learner_path).stem}.json"
    if not manifest.exists():
        known = sorted(p.stem for p in Path(cells_dir or CELLS_DIR).glob("ex[0-9][0-9]_*.json"))
        raise GradingSetupError(f"{learner_path}: no exercise named {Path(learner_path).stem} in this course "
                                f"({manifest} is missing); the exercises are: {', '.join(known) or 'none'}")
    return manifest


def load_course(course: Path | dict) -> dict[str, Any]:
    """A manifest: given as one (dict or .json path), or made from a solved notebook (.ipynb path)."""
    if isinstance(course, dict):
        return course
    course = Path(course)
    if course.suffix == ".ipynb":
        return course_cells(_read(course), str(course))
    return _read(course)


def compose(course: Path | dict, learner_path: Path) -> Plan:
    """The cells to run: the learner's own cells, everything else from the course's manifest."""
    course, learner = load_course(course), _read(learner_path)
    learner_cells = {cell.get("id"): cell for cell in learner.get("cells", []) if cell.get("cell_type") == "code"}
    cells, notes, used = [], [], set()
    for entry in course["cells"]:
        kind, where, mine = entry["kind"], f"cell {entry['index']}", learner_cells.get(entry["id"])
        used.add(entry["id"])
        if kind == "skip":
            continue
        if kind == "graded":
            number, args = parse_graded_call("\n".join(line for line in entry["source"].splitlines()
                                                       if not _GRADED.match(line)), f"{course['exercise']}: {where}")
            cells.append({"kind": "graded", "task": number, "args": args, "where": where})
            if mine is not None and _source(mine) != entry["source"]:
                notes.append(f"{where} (graded) differs from the course's; the course's check was run")
        elif kind == "learner":
            if mine is None:
                notes.append(f"{where} (your code) is missing from your notebook (cell id {entry['id']})")
                cells.append({"kind": "learner", "source": "raise NotImplementedError('this cell is missing')",
                              "where": where})
            else:
                cells.append({"kind": "learner", "source": _source(mine), "where": where})
            cells[-1]["given"] = entry.get("given", "")
        else:
            if mine is not None and _source(mine) != entry["source"]:
                notes.append(f"{where} (given code) differs from the course's; the course's was run")
            cells.append({"kind": "setup", "source": entry["source"], "where": where})
    extra = [cid for cid in learner_cells if cid not in used]
    if extra:
        notes.append(f"{len(extra)} code cell(s) you added were not run: only the cells that held a stub are yours")
    if not any(cell["kind"] == "graded" for cell in cells):
        raise GradingSetupError(f"{course['exercise']}: no graded cell")
    return Plan(grader_module_for(course["exercise"]), cells, notes)


# --- the child process ---------------------------------------------------------------------------


def _run_plan(plan: dict, result_file) -> None:
    # Everything the loop needs is bound here, before any learner code runs.
    import importlib

    from minillm.grading import TaskResult, provenance, snapshot, tampered, tasks_of

    dumps, write, flush, monotonic = json.dumps, result_file.write, result_file.flush, time.monotonic
    provenance.set_given(given_sources(plan["cells"]))  # the exercise's given code is everyone's
    grader = importlib.import_module(plan["grader"])
    checks = tasks_of(grader)
    before = snapshot()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    results, notes = [], []
    for cell in plan["cells"]:
        where = cell["where"]
        if cell["kind"] == "graded":
            number = cell["task"]
            check = checks.get(number)
            started = monotonic()
            changed = tampered(before)
            if check is None:
                result = TaskResult(number, "?", False, [f"{plan['grader']} has no check for task {number}"])
            elif changed:
                shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                result = TaskResult(number, check.grading_task[1], False,
                                    [f"your code changed the grader or minillm ({shown}): graded as FAIL"])
            else:
                try:
                    args = [eval(expression, namespace) for expression in cell["args"]]  # noqa: S307
                except Exception as error:  # noqa: BLE001
                    why = [note for note in notes if "(your code) raised" in note]
                    result = TaskResult(number, check.grading_task[1], False,
                                        [f"the check needs {', '.join(cell['args'])}: {type(error).__name__}: {error}"]
                                        + ([f"because {why[-1]}"] if why else []))
                else:
                    result = check(*args)
                    changed = tampered(before)  # learner code runs inside the check too
                    if changed:
                        result = TaskResult(number, check.grading_task[1], False,
                                            [f"your code changed the grader or minillm ({', '.join(changed[:3])}) "
                                             "while it was checked: graded as FAIL"])
            entry = result.to_json()
            entry["seconds"] = round(monotonic() - started, 2)
            results.append(entry)
            continue
        previous = signal.signal(signal.SIGALRM, _cell_too_slow) if hasattr(signal, "SIGALRM") else None
        if previous is not None:
            signal.alarm(CELL_TIME_LIMIT_S)
        try:
            exec(compile(cell["source"], f"<{where}>", "exec"), namespace)  # noqa: S102
        except BaseException as error:  # noqa: BLE001  (SystemExit and friends too)
            owner = "your code" if cell["kind"] == "learner" else "given code"
            notes.append(f"{where} ({owner}) raised {type(error).__name__}: {str(error)[:300]}")
        finally:
            if previous is not None:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
    write(dumps({"results": results, "notes": notes}))
    flush()


def _cell_too_slow(*_):
    raise TimeoutError(f"the cell ran longer than {CELL_TIME_LIMIT_S} s")


def child_main(argv: list[str]) -> int:
    plan_path, result_path = argv
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    os.chdir(plan["cwd"])
    with open(result_path, "w", encoding="utf-8") as result_file:  # opened before learner code runs
        _run_plan(plan, result_file)
    return 0


# --- the parent ----------------------------------------------------------------------------------


@dataclass
class GradeReport:
    notebook: Path
    results: list[dict[str, Any]]
    notes: list[str]
    output: str  # the child's stdout and stderr (the learner's prints, tracebacks)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r["passed"] for r in self.results)

    def text(self) -> str:
        lines = [f"{self.notebook}"]
        for r in self.results:
            verdict = "PASS" if r["passed"] else WITHHELD if r.get("withheld") else "FAIL"
            lines.append(f"  task {r['task']} ({r['name']}): {verdict}")
            lines += [f"    {line}" for line in r["lines"]]
        lines += [f"  note: {note}" for note in self.notes]
        passed, withheld = sum(r["passed"] for r in self.results), sum(bool(r.get("withheld")) for r in self.results)
        lines.append(f"  {passed}/{len(self.results)} task(s) pass"
                     + (f"; {withheld} graded only in your teacher's copy (its reference is not in a student "
                        "release)" if withheld else ""))
        return "\n".join(lines)


def grade(learner_path: Path, course: Path | dict | None = None, timeout_s: int = 900) -> GradeReport:
    """Grade one notebook in a fresh process; the report lists every task's verdict.

    `course` defaults to the manifest in minillm/grading/cells/ named like the notebook; a solved
    notebook (.ipynb) or another manifest may be given instead (the tests of the tools do).
    """
    learner_path = Path(learner_path).resolve()
    course = load_course(course if course is not None else manifest_for(learner_path))
    plan = compose(course, learner_path)
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        plan_path, result_path = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan_path.write_text(json.dumps({"grader": plan.grader, "cells": plan.cells,
                                         "cwd": str(learner_path.parent)}), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("MPLBACKEND", "Agg")
        command = [sys.executable, "-m", "minillm.grading.runner", str(plan_path), str(result_path)]
        process = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            output += f"\ngrading timed out after {timeout_s} s"
        try:
            data = json.loads(result_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            data = {"results": [], "notes": [f"grading did not finish (exit status {process.returncode}); "
                                             f"last output:\n{output[-2000:]}"]}
    tasks = sorted({cell["task"] for cell in plan.cells if cell["kind"] == "graded"})
    got = {r["task"] for r in data["results"]}
    results = data["results"] + [{"task": t, "name": "?", "passed": False, "lines": ["not graded"]}
                                 for t in tasks if t not in got]
    return GradeReport(learner_path, results, plan.notes + data["notes"], output)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
