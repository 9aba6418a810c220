"""Claims that hold (issue 26): a directional claim about a measured quantity has something behind it.

The rules live in tools/check_claims.py (its docstring says how an author satisfies it). Reads the
saved notebooks only. The unit tests below plant claims with and without backing so the check is
known to fail for the right reasons.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_prose_numbers import _code, _md, _notebook

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
_spec = importlib.util.spec_from_file_location("check_claims", REPO_ROOT / "tools" / "check_claims.py")
check_claims = importlib.util.module_from_spec(_spec)
sys.modules["check_claims"] = check_claims  # dataclasses look their module up
_spec.loader.exec_module(check_claims)


@pytest.mark.parametrize("notebook", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_directional_claim_is_backed(notebook: Path) -> None:
    findings = check_claims.check_notebook(notebook)
    assert not findings, "\n".join(str(f) for f in findings)


def test_allowlist_entries_cite_a_source_and_are_used() -> None:
    for chapter, entries in check_claims.CHAPTER_ALLOW.items():
        notebook = next(p for p in CHAPTERS if p.name.startswith(chapter))
        prose = " ".join(
            " ".join("".join(c["source"]).split()) for c in json.loads(notebook.read_text())["cells"]
            if c["cell_type"] == "markdown"
        ).lower()
        for fragment, source in entries.items():
            assert len(source) > 10, f"chapter {chapter}: allowlisted {fragment!r} needs its source"
            assert fragment.lower() in prose, f"chapter {chapter}: allowlisted {fragment!r} no longer appears"


def _flagged(tmp_path: Path, cells: list[dict]) -> list[str]:
    return [f.sentence for f in check_claims.check_notebook(_notebook(tmp_path, cells), allow={})]


def test_a_planted_claim_with_nothing_behind_it_fails_with_file_cell_and_sentence(tmp_path: Path) -> None:
    cells = [_code("rows = run()", "batch  ttft_ms\n1  10.2\n8  3.1"),
             _md("## 2. Results\n\nThe table shows the batch sizes. Continuous batching makes TTFT fall "
                 "several times.")]
    findings = check_claims.check_notebook(_notebook(tmp_path, cells), allow={})
    assert [(f.cell, f.sentence) for f in findings] == [(1, "Continuous batching makes TTFT fall several times.")]
    assert "99_test.ipynb cell 1: 'Continuous batching makes TTFT fall several times.'" in str(findings[0])
    assert "TTFT" in findings[0].why and "<!-- claim:" in findings[0].why


@pytest.mark.parametrize("notebook", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_question_has_a_folded_answer(notebook: Path) -> None:
    findings = check_claims.check_questions(notebook)
    assert not findings, "\n".join(str(f) for f in findings)


QUESTIONS = ("## 9 · Check your understanding\n\n1. Why does TTFT fall with the delay?\n"
             "2. What would a\n   second replica buy?\n3. Name two costs.\n\n")


@pytest.mark.parametrize("answers, problem", [
    ("<details><summary>Answers</summary>\n\n1. Because...\n2. Nothing,\n   as...\n3. A and B.\n</details>", None),
    ("", "no folded answers"),
    ("<details><summary>Answers</summary>\n\n1. Because...\n3. A and B.\n</details>", "question(s) 2 have no"),
    ("<details><summary>Answers</summary>\n\n1. a\n2. b\n3. c\n", "never closed"),
    ("<details><summary>Hint</summary>\n\n1. a\n2. b\n3. c\n</details>", "not the answers"),
])
def test_a_question_without_a_folded_answer_fails(tmp_path: Path, answers: str, problem: str | None) -> None:
    """Planted: the answers fold missing, one answer left out, a fold never closed, a hint fold."""
    cells = [_md("# 99 · Test"), _md(QUESTIONS + answers), _md("## Exercise\n\n1. Not a question of the section.")]
    findings = check_claims.check_questions(_notebook(tmp_path, cells))
    if problem is None:
        assert findings == []
    else:
        assert len(findings) == 1 and problem in findings[0].why and findings[0].cell == 1
    assert "no 'Check your understanding'" in check_claims.unanswered_questions([_md("# 99 · Test")])


def test_the_command_line_exits_1_on_a_planted_claim_and_0_on_a_chapter(tmp_path: Path, capsys) -> None:
    planted = _notebook(tmp_path, [_md("Chunked prefill makes p99 ITL fall several times.")])
    assert check_claims.main([str(planted)]) == 1
    assert "Chunked prefill makes p99 ITL fall several times." in capsys.readouterr().out
    assert check_claims.main([str(CHAPTERS[0])]) == 0


@pytest.mark.parametrize("claim", [
    "The step time barely moves from batch 1 to 32.",
    "Dynamic batching is not much better than static on throughput.",
    "Goodput is 3.5× higher with continuous batching.",
    "The measured curve flattened sooner than the formula's step time.",
    "TTFT falls by an order of magnitude.",
    "Prefix caching improves TTFT on the chat trace.",
    "Throughput increases with the batch until the seats are full.",
    "The p99 ITL jumps once the budget is exceeded.",
    "The encode time grows roughly in proportion to the prompt.",
    "The step time is roughly proportional to the batch.",
])
def test_the_directional_words_of_issue_26_are_claims(tmp_path: Path, claim: str) -> None:
    assert _flagged(tmp_path, [_md(claim)]) == [claim]


def test_an_assert_or_printed_sentence_next_to_it_backs_the_same_quantity(tmp_path: Path) -> None:
    claim = _md("TTFT falls several times with continuous batching.")
    asserted = _code('assert cb.ttft_ms * 3 < static.ttft_ms, "continuous batching should cut TTFT 3x"', "")
    assert _flagged(tmp_path, [claim, asserted]) == []
    assert _flagged(tmp_path, [asserted, claim]) == []
    printed = _code("print(change('mean TTFT', a, b))", "mean TTFT fell from 1759.0 ms to 10.3 ms (172× lower)")
    assert _flagged(tmp_path, [printed, claim]) == []
    # An assert about another quantity, or one two markdown cells away, backs nothing.
    other = _code('assert cb.throughput > static.throughput, "more tokens per second"', "")
    assert _flagged(tmp_path, [claim, other]) == ["TTFT falls several times with continuous batching."]
    assert _flagged(tmp_path, [asserted, _md("Next."), claim]) == [
        "TTFT falls several times with continuous batching."]


def test_a_marker_must_name_an_assert_or_output_that_exists(tmp_path: Path) -> None:
    check = _code('assert ratio > 5, "continuous batching cuts mean TTFT at least 5x"', "")
    question = _md("**Q2.** Why does TTFT fall so much? <!-- claim: cuts mean TTFT at least 5x -->\n\n"
                   "<details><summary>Answer</summary>\n\nTTFT falls because requests join at the next step."
                   " <!-- claim: cuts mean TTFT at least 5x -->\n</details>")
    assert _flagged(tmp_path, [check, _md("Section."), question]) == []
    stale = _md("TTFT falls a lot. <!-- claim: cuts mean TTFT at least 9x -->")
    assert _flagged(tmp_path, [check, _md("Section."), stale]) == [
        "<!-- claim: cuts mean TTFT at least 9x -->", "TTFT falls a lot."]


def test_citations_arithmetic_open_questions_goals_and_allowlist(tmp_path: Path) -> None:
    cells = [
        _md("# Chapter\n\n- explain why TP made this CPU slower;\n- measure it.\n\n"
            "Orca (Yu et al., OSDI 2022) reports 36.9× higher throughput than FasterTransformer. "
            "At batch 256 the KV read is 0.5 MiB × 512 × 256 ≈ 69 GB, five times the weights' memory. "
            "Which requests' TTFT suffers most, and what would shrink it? "
            "Why does the step time grow with the batch? "
            "Other programs can only make a timing slower."),
    ]
    assert _flagged(tmp_path, cells) == ["Why does the step time grow with the batch?",
                                         "Other programs can only make a timing slower."]
    path = _notebook(tmp_path, cells)
    allow = {"can only make a timing slower": "a measurement principle: interference only adds time"}
    assert [f.sentence for f in check_claims.check_notebook(path, allow=allow)] == [
        "Why does the step time grow with the batch?"]


def test_reshaping_words_and_code_are_not_claims(tmp_path: Path) -> None:
    cells = [_md("The step flattens the new tokens into one tensor; the flattened batch has T rows. "
                 "`latency_grows = faster(x)` is code.\n\n```python\nassert faster\n```\n\n"
                 "A thread past the end makes the simulator raise IndexError at that time. "
                 "The update lowers the step's count of computed tokens past the rejected guesses.")]
    assert _flagged(tmp_path, cells) == []


def test_a_ratio_column_of_a_table_is_data_not_a_printed_claim(tmp_path: Path) -> None:
    """Chapter 04's saved run: a table printing 1759.38 -> 10.25 (0.01x) sat above "TTFT falls about 5×"."""
    table = _code("print(compare(runs))", "mean TTFT (ms)   1759.38   904.05 (0.51x)   10.25 (0.01x)")
    claim = _md("TTFT falls about 5× at the mean.")
    assert _flagged(tmp_path, [table, claim]) == ["TTFT falls about 5× at the mean."]
