"""Grade exercise notebooks: `make grade` (all of exercises/) and `make grade EX=05` (one).

Usage:
    python tools/grade.py                      # every exercises/exNN_*.ipynb
    python tools/grade.py --only 05            # exercises/ex05_*.ipynb
    python tools/grade.py path/to/ex05_x.ipynb # any copy of an exercise, named as the course names it
    python tools/grade.py -v ...               # also show what the notebook printed

Each notebook is graded by `minillm.grading.runner`: only the learner's cells (those that hold a
stub in the exercise) are taken from the notebook, every other cell comes from the exercise's
manifest `minillm/grading/cells/exNN_topic.json` (written by `make exercises`; nothing is read from
solutions/, so a student release grades too), and the checks come from `minillm/grading/exNN.py`,
imported before any learner code runs (see the docstring of minillm/grading/__init__.py).
Exit status: 0 every task of every notebook passes, 1 some task fails, 2 a notebook could not be
graded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from minillm.grading.runner import GradingSetupError, grade  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: exercises/exNN_*.ipynb")
    parser.add_argument("--only", metavar="NN", help="only exercise NN (e.g. 05)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per notebook (default 900)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the notebook's own output")
    args = parser.parse_args(argv)
    if args.only is not None and not args.only.isdigit():
        parser.error(f"--only takes an exercise number such as 05, not {args.only!r}")
    notebooks = list(args.notebooks)
    if not notebooks:
        pattern = f"ex{int(args.only):02d}_*.ipynb" if args.only is not None else "ex[0-9][0-9]_*.ipynb"
        notebooks = sorted((REPO_ROOT / "exercises").glob(pattern))
        if not notebooks:
            print(f"error: no exercises/{pattern}", file=sys.stderr)
            return 2
    status = 0
    for notebook in notebooks:
        try:
            report = grade(notebook, timeout_s=args.timeout)
        except GradingSetupError as error:
            print(f"error: {error}", file=sys.stderr)
            status = 2
            continue
        if args.verbose:
            print(report.output)
        print(report.text())
        if not report.passed:
            status = max(status, 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
