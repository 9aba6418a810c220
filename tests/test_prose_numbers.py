"""Prose that cannot drift (issue 18): every number typed into a chapter's markdown is printed above it.

Reads the saved notebooks only (no kernel, well under a second for all chapters). The rules live in
tools/check_prose.py; the unit tests below pin the normalisation so the check can fail for the
right reasons.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from decimal import Decimal
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
_spec = importlib.util.spec_from_file_location("check_prose", REPO_ROOT / "tools" / "check_prose.py")
check_prose = importlib.util.module_from_spec(_spec)
sys.modules["check_prose"] = check_prose  # dataclasses look their module up
_spec.loader.exec_module(check_prose)


@pytest.mark.parametrize("notebook", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_prose_number_is_printed_above_it(notebook: Path) -> None:
    findings = check_prose.check_notebook(notebook)
    assert not findings, "\n".join(str(f) for f in findings)


def test_allowlist_entries_cite_a_source_and_are_used() -> None:
    for chapter, entries in check_prose.CHAPTER_ALLOW.items():
        notebook = next(p for p in CHAPTERS if p.name.startswith(chapter))
        prose = " ".join(
            "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "markdown"
        )
        typed = {check_prose._decimal(n) for n, _ in check_prose.numbers_in(prose)}
        for number, source in entries.items():
            assert len(source) > 10, f"chapter {chapter}: allowlisted {number} needs its source"
            assert Decimal(number) in typed, f"chapter {chapter}: allowlisted {number} no longer appears"


def _notebook(tmp_path: Path, cells: list[dict]) -> Path:
    path = tmp_path / "99_test.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def _code(source: str, output: str, ignored: bool = False) -> dict:
    tags = ["nbval-ignore-output"] if ignored else []
    return {"cell_type": "code", "source": source, "metadata": {"tags": tags},
            "outputs": [{"output_type": "stream", "name": "stdout", "text": output}]}


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "source": text, "metadata": {}}


def _flagged(tmp_path: Path, cells: list[dict]) -> list[str]:
    return [f.number for f in check_prose.check_notebook(_notebook(tmp_path, cells), allow={})]


def test_normalisation_accepts_separators_rounding_percent_and_ranges(tmp_path: Path) -> None:
    cells = [_code("run()", "max prompt 1793 tokens; speedup 46.0x; ratio 0.8977; 1.12 and 1.41"),
             _md("Prompts up to 1,800 tokens, a 46× speedup, 0.90 or 90 %, a 1.1–1.4× range.")]
    assert _flagged(tmp_path, cells) == []


def test_a_number_no_output_above_contains_is_flagged(tmp_path: Path) -> None:
    cells = [_code("run()", "max prompt 917 tokens"), _md("A few prompts up to 1,800 tokens.")]
    assert _flagged(tmp_path, cells) == ["1,800"]
    # A number printed only further down does not support the prose above it.
    assert _flagged(tmp_path, [_md("Speedup 0.90×."), _code("run()", "speedup 0.90x")]) == ["0.90"]


def test_fold_and_tens_words_count_as_numbers(tmp_path: Path) -> None:
    cells = [_code("run()", "p99 ratio 46.2; scrapes 14"), _md("A hundredfold gap; twenty times a second.")]
    assert _flagged(tmp_path, cells) == ["100", "20"]


def test_a_measurement_of_this_machine_is_not_support(tmp_path: Path) -> None:
    cells = [_code("time_it()", "decode 13.9 ms", ignored=True), _md("A decode step takes 13.9 ms.")]
    findings = check_prose.check_notebook(_notebook(tmp_path, cells), allow={})
    assert [(f.number, f.machine_dependent) for f in findings] == [("13.9", True)]


def test_global_patterns_and_allowlist(tmp_path: Path) -> None:
    cells = [_md("## 3. Llama-2-7B on an A100 in 2023 (chapter 05, section 4.2); 2 × 64 = 128 bytes; "
                 "`max_num_batched_tokens=8192`; vLLM measured 20.4 % used.")]
    assert _flagged(tmp_path, cells) == ["20.4"]
    path = _notebook(tmp_path, cells)
    assert check_prose.check_notebook(path, allow={"20.4": "Kwon et al. 2023, section 2.3"}) == []


def test_measured_comparisons_are_printed_as_sentences() -> None:
    from minillm.viz.sentences import change, ratio, speedup

    assert [ratio(1495.2, 111.1), ratio(3.0, 2.0), ratio(0.9, 1.0)] == ["13×", "1.5×", "0.90×"]
    assert change("the longest gap", 1495.2, 111.1) == "the longest gap fell from 1495.2 ms to 111.1 ms (13× lower)"
    assert change("TTFT", 10.0, 25.0, unit="s", digits=0) == "TTFT rose from 10 s to 25 s (2.5× higher)"
    assert speedup("n-gram", 1.0, 1.0 / 0.9, "plain decoding") == "n-gram: 0.90× plain decoding's speed (a slowdown)"
    assert speedup("x", 1.0, 1.0).endswith("(no clear difference)")
    with pytest.raises(ValueError, match="denominator"):
        ratio(1.0, 0.0)
    with pytest.raises(ValueError, match="positive"):
        change("gap", 0.0, 1.0)
