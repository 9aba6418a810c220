"""The chapter notebooks: each runs top to bottom and reproduces its stored outputs.

Chapters are checked with strict nbval (`--nbval`, not `--nbval-lax`): every code cell's fresh
output is compared with the output saved in the notebook, except in cells tagged
`nbval-ignore-output` (timings, measured hardware, plots of measurements, library source shown with
`inspect.getsource`). So token ids, greedy text of the bundled model, KV byte counts and cost-model
tables are checked on every run, and a chapter whose stored outputs went stale fails.

The cheap checks below read the saved notebooks without a kernel: each chapter was saved after one
clean top-to-bottom run, and no stored output prints a path of the machine that ran it.
Every notebook in chapters/ matching NN_*.ipynb is picked up, so later chapters need no edit here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import load_build_exercises

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
SANITIZE_CFG = REPO_ROOT / "tools" / "nbval_sanitize.cfg"
IGNORE_TAG = "nbval-ignore-output"
CELL_TIMEOUT_S = 300
NOTEBOOK_TIMEOUT_S = 900  # generous: a chapter targets 90 s, but CI machines are shared
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Absolute paths that would tie a stored output to one machine (checkout, temp dir, home, venv).
_MACHINE_PATH = re.compile(r"(/home/|/Users/|/tmp/|/work/|/root/|site-packages|[A-Z]:\\)")


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def _code_cells(path: Path) -> list[dict]:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _output_texts(cell: dict) -> list[str]:
    texts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            texts.append("".join(output["text"]))
        elif "data" in output:
            plain = output["data"].get("text/plain", "")
            texts.append("".join(plain) if isinstance(plain, list) else plain)
        elif output["output_type"] == "error":
            texts.append(f"{output['ename']}: {output['evalue']}")
    return texts


def test_there_are_chapters() -> None:
    assert CHAPTERS, "no chapters/NN_*.ipynb found"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_is_saved_after_one_clean_run(notebook: Path) -> None:
    cells = _code_cells(notebook)
    counts = [cell.get("execution_count") for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{notebook.name}: execution counts {counts}; re-run it from a fresh kernel and save it, e.g. "
        "`jupyter nbconvert --to notebook --execute --inplace`"
    )
    errors = [
        i for i, cell in enumerate(cells) if any(o["output_type"] == "error" for o in cell.get("outputs", []))
    ]
    assert not errors, f"{notebook.name}: code cells {errors} stored an error"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_outputs_print_no_machine_paths(notebook: Path) -> None:
    leaks = [
        (index, match.group(0))
        for index, cell in enumerate(_code_cells(notebook))
        for text in _output_texts(cell)
        for match in [_MACHINE_PATH.search(text)]
        if match
    ]
    assert not leaks, f"{notebook.name}: outputs of code cells print machine paths: {leaks}"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_compares_some_outputs(notebook: Path) -> None:
    """A chapter whose every cell is tagged ignore-output would pass nbval without checking anything."""
    compared = [
        cell
        for cell in _code_cells(notebook)
        if IGNORE_TAG not in cell.get("metadata", {}).get("tags", []) and _output_texts(cell)
    ]
    assert len(compared) >= 3, f"{notebook.name}: only {len(compared)} code cells with outputs are compared"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("notebook", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_passes_strict_nbval(notebook: Path) -> None:
    result = load_build_exercises().run_nbval(notebook, timeout_s=NOTEBOOK_TIMEOUT_S, lax=False,
                                              cell_timeout_s=CELL_TIMEOUT_S)
    passed, report = result.passed, result.output
    assert passed, f"nbval failed on {notebook.name}:\n{report[-6000:]}"
