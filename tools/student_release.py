"""Write a student release of the course: a copy without the answers (`make student-release DIR=...`).

nbgrader's release step is the model: the teacher keeps the solved notebooks, the class gets the
exercises. The release is the working tree as git sees it (tracked files and untracked ones that
.gitignore does not exclude; the untracked ones are listed, so that a stray file is noticed), except:

- `solutions/`: the solved notebooks;
- `tests/known_wrong/`: near-solutions with one bug each (text edits of the solutions' code);
- the tests of the teacher's tools, which need solutions/ or carry demo solution regions:
  test_exercises.py, test_grading*.py (test_grading_lent_tools.py stays), test_student_release.py,
  test_answer_keys.py, test_chapters_hold_no_solution.py;
- `.ci/`: the project's CI, which runs those tests;
- `minillm/grading/private/`: the grader-private references and the graded cells' expected outputs
  (the solutions' PASS reports). A task whose check needs a private reference grades in the release
  with its answer key, `minillm/grading/keys/exNN_topic.json` (released: one salted digest of the
  expected output per pool case, no answer; see minillm/grading/answer_key.py); a task with a
  private reference and no key would report "not graded here".

In the release the chapters run, `make lab` opens them, and `make grade` grades: it reads the
non-learner cells from `minillm/grading/cells/` (see minillm/grading/runner.py), never solutions/.
Before anything is written, the exercises and their grading manifests must be in step with
solutions/ (`make exercises`). The copy is built beside DIR and moved into place only after it is
checked: no `solutions` path, nothing grader-private, no solution-region marker line in any file
(also inside notebook or JSON strings), a manifest for every exercise and an answer key for every
grader that declares one (in step with its sources: `make exercises` writes it).

Usage:
    python tools/student_release.py DIR     # DIR: a new or empty folder outside this repository

Exit status: 0 written, 2 refused (DIR, an out-of-step exercise, a leak; the message says which).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = ("solutions/", "tests/known_wrong/", "tests/test_exercises.py", "tests/test_grading.py",
            "tests/test_grading_framework.py", "tests/test_grading_known_wrong.py", "tests/test_grading_copies.py",
            "tests/test_chapters_hold_no_solution.py", "tests/test_student_release.py", "tests/test_answer_keys.py", ".ci/",
            "minillm/grading/private/")
PRIVATE = ("minillm", "grading", "private")  # grader-private: never in a release
# A solution-region marker on a line of its own: in plain text, or inside a JSON string (a notebook's
# source lines, a manifest's "\n"-joined sources). Mentions in prose (`# BEGIN SOLUTION` in backticks) pass.
MARKER = re.compile(r'(?:^|"|\\n)[ \t]*#[ \t]*(?:BEGIN|END) SOLUTION[ \t]*(?:\\n|"|$)', re.MULTILINE)


class ReleaseError(Exception):
    """The release cannot be written; the message says why and what to do."""


def _git_files(root: Path, *which: str) -> list[str]:
    try:
        listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *which], check=True,
                                 capture_output=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ReleaseError(f"{root} is not a git checkout (git ls-files failed: {error}); the release is "
                           "made of the files git sees") from error
    return [name for name in listing.decode("utf-8").split("\0") if name]


def course_files(root: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """(every file that goes into a release, the untracked ones among them)."""
    names = {name for name in _git_files(root, "--cached", "--others", "--exclude-standard")
             if (root / name).is_file()}  # a tracked file deleted in the working tree is not released
    untracked = set(_git_files(root, "--others", "--exclude-standard"))
    kept = released(sorted(names))
    return kept, [name for name in kept if name in untracked]


def released(names: list[str]) -> list[str]:
    """The tracked paths that go into a release (LEFT_OUT removed)."""
    return sorted(name for name in names if not name.startswith(LEFT_OUT))


def check_target(target: Path, root: Path = REPO_ROOT) -> Path:
    """DIR, resolved; refused if inside the repository or an existing non-empty folder."""
    target = Path(target).expanduser().resolve()
    if target == root or root in target.parents:
        raise ReleaseError(f"DIR={target} is inside the repository {root}: a release goes to a folder "
                           "outside it (e.g. DIR=../minillm-class)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ReleaseError(f"DIR={target} exists and is not an empty folder: give a new or empty folder "
                           "(nothing is overwritten)")
    return target


def check_exercises_in_step(root: Path = REPO_ROOT) -> None:
    """Exercises and grading manifests must be what solutions/ generates now (make exercises)."""
    if not (root / "solutions").is_dir():
        raise ReleaseError(f"no {root / 'solutions'}: this is already a student release (releases are made "
                           "from the teacher's copy of the course)")
    tools = str(Path(__file__).resolve().parent)
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import build_exercises  # noqa: PLC0415  (tools/ is not a package)

    try:
        stale = [item for item in build_exercises.plan(root / "solutions", root / "exercises")
                 if item.status != "in sync"]
    except build_exercises.ExerciseBuildError as error:
        raise ReleaseError(f"a solution notebook is malformed:\n{error}") from error
    if stale:
        listing = "\n".join(f"  {item.status}: {item.exercise.relative_to(root)}" for item in stale)
        raise ReleaseError(f"exercises or grading manifests are not in step with solutions/:\n{listing}\n"
                           "run `make exercises` (and commit what it writes) first")


def leaks(copy: Path) -> list[str]:
    """What in `copy` would hand out answers: a `solutions` path, a grader-private file, a
    solution-region marker line."""
    found = []
    for path in sorted(copy.rglob("*")):
        relative = path.relative_to(copy)
        if "solutions" in relative.parts:
            found.append(f"{relative}: a solutions path")
        if relative.parts[:len(PRIVATE)] == PRIVATE and path.is_file():
            found.append(f"{relative}: grader-private (minillm/grading/private/ is the teacher's)")
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (weights, images)
        text = data.decode("utf-8", errors="replace")
        for match in MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{relative}:{line}: solution-region marker {match.group(0).strip()!r}")
    return found


def missing_manifests(copy: Path) -> list[str]:
    """Each exercise's grading manifest, and the answer key of each grader that declares one."""
    exercises = sorted((copy / "exercises").glob("ex[0-9][0-9]_*.ipynb"))
    found = [f"{e.relative_to(copy)} has no minillm/grading/cells/{e.stem}.json (is it tracked by git?)"
             for e in exercises if not (copy / "minillm" / "grading" / "cells" / f"{e.stem}.json").exists()]
    for e in exercises:
        grader = copy / "minillm" / "grading" / f"{e.stem[:4]}.py"
        key = copy / "minillm" / "grading" / "keys" / f"{e.stem}.json"
        if grader.exists() and "AnswerKey(" in grader.read_text(encoding="utf-8") and not key.exists():
            found.append(f"{e.relative_to(copy)} has no answer key minillm/grading/keys/{e.stem}.json "
                         "(make exercises writes it; is it tracked by git?)")
    return found


def write_release(target: Path, root: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """Write the release into `target` (checked first); returns the relative paths written and
    the untracked ones among them."""
    target = check_target(target, root)
    check_exercises_in_step(root)
    names, untracked = course_files(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        for name in names:
            destination = partial / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, destination)
        problems = leaks(partial) + missing_manifests(partial)
        if not any(partial.glob("exercises/ex[0-9][0-9]_*.ipynb")):
            problems.append("no exercises/exNN_*.ipynb in the release")
        if problems:
            raise ReleaseError("the release would be wrong; nothing was written:\n  " + "\n  ".join(problems))
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(partial, target)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return names, untracked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a new or empty folder outside this repository")
    args = parser.parse_args(argv)
    try:
        names, untracked = write_release(args.dir)
    except ReleaseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    target = Path(args.dir).expanduser().resolve()
    exercises = sum(name.startswith("exercises/") for name in names)
    print(f"wrote {len(names)} files to {target}: {exercises} exercises, no solutions/ "
          f"(left out: {', '.join(LEFT_OUT)})")
    if untracked:
        shown = ", ".join(untracked[:10]) + (f" and {len(untracked) - 10} more" if len(untracked) > 10 else "")
        print(f"note: {len(untracked)} of them are not tracked by git: {shown}")
    print(f"next: cd {target} && git init && git add -A && git commit -m 'Course release', push it to the "
          "class; grade a learner's notebook with `make grade` (or tools/grade.py path/to/exNN_topic.ipynb)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
