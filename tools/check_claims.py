"""Claims that hold: a directional claim about a measured quantity in a chapter's prose has something behind it.

tools/check_prose.py keeps every *number* typed into a chapter's markdown true. This check keeps the
*words* true (issue 26): a sentence that says a measured quantity went somewhere -- faster, slower,
grows, falls, increases, improves, jumps, flattens, wins, "3×", "several times", "an order of
magnitude", "barely moves", "about the same", "roughly in proportion" -- must rest on a cell that
prints that sentence from its numbers or asserts it.
Prose written after one run and left behind when the engine changed is what this catches.

A sentence is a *claim* when it has a directional word (`DIRECTIONAL_WORDS`, or a factor such as 3×) and names a measured
quantity (`QUANTITIES`: time, TTFT, TPOT, ITL, throughput, goodput, utilisation, memory, ...).
Headings, code and link targets are not prose. A claim is accepted when one of these holds:

1. **A neighbouring code cell backs it.** The code cells right above the markdown cell (up to the
   previous markdown cell) or right below it (up to the next one) contain an `assert` statement, or
   print a sentence with a directional word (e.g. one built by `minillm.viz.sentences`; a table's
   ratio column such as "10.25 (0.01x)" is data, not a sentence, and does not count), and that
   assertion or printed line names the same quantity as the claim (a claim about TTFT needs an
   assert or printed line that mentions TTFT; `ttft_ms` counts). So: put the claim next to the cell
   that checks it, e.g. ``assert cb_ttft * 5 < static_ttft, f"continuous batching should cut TTFT
   at least 5x, got {static_ttft / cb_ttft:.1f}x"``, or let that cell print the sentence.
2. **A marker names what backs it.** ``<!-- claim: TEXT -->`` anywhere in the claim's paragraph,
   where TEXT occurs in an `assert` statement of some code cell, or in the output of some code cell
   (a printed sentence, a table's title). Use it when the backing cell is not next to the claim:
   end-of-chapter questions and their folded answers, a summary. The marker is invisible in the
   rendered notebook; the check fails when TEXT is found nowhere, so it cannot go stale silently.
3. **It cites its source or works its arithmetic in place.** A sentence that names a publication
   (`CITATION`: "et al.", arXiv, OSDI, SOSP, a paper's or vendor's report) states someone else's
   measurement; a sentence with worked arithmetic (``0.5 MiB × 512 × 256 ≈ 69 GB``) shows its
   derivation. Neither needs a cell.
4. **It is a learning goal**: a list item starting with a lower-case verb in the chapter's first
   markdown cell ("- explain why TP made this CPU slower;") promises what the chapter then shows.
5. **It is on the chapter's allowlist** (`CHAPTER_ALLOW`): a fragment of the sentence and the source
   it comes from. Keep it short; a general truth that needs no measurement ("other programs can only
   make a timing slower") goes here with its reason.

Heuristics, not proof: the check cannot tell whether an assert tests the very claim; it only makes
sure that every directional sentence points at something a reviewer can read, and fails on one that
points at nothing. Reads the saved notebooks only; nothing is executed.

It also checks that every end-of-chapter question has a folded answer a teacher can check
(`unanswered_questions`): the "Check your understanding" section numbers its questions, and a
`<details><summary>Answers</summary>` block after them answers each by its number.

Usage: python tools/check_claims.py [chapters/NN_x.ipynb ...]   (no argument: every chapter)
Exit status 1 when a claim has nothing behind it or a question has no folded answer; each is listed
with its file, cell and sentence.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_check_prose():
    """tools/check_prose.py, for the way it reads a cell's source and outputs (tools/ is not a package)."""
    module = sys.modules.get("check_prose")
    if module is None:
        spec = importlib.util.spec_from_file_location("check_prose", Path(__file__).with_name("check_prose.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_prose"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module


_check_prose = _load_check_prose()
_cell_text, _output_text = _check_prose._cell_text, _check_prose._output_text

# Not here: "raises" and "lowers", which this course's prose uses for exceptions and counters
# ("the simulator raises IndexError", "lowers num_computed_tokens").
DIRECTIONAL_WORDS = re.compile(
    r"\b(?:faster|slower|quicker|grows?|grew|growing|rises?|rose|rising|climbs|climbed|climbing|falls?|fell|"
    r"falling|drops?|dropped|shrinks?|shrank|plateaus?|levels off|saturates?|wins?|won|beats?|"
    r"flattens?(?!\s+(?:their|the|them|it|its|each|a|an|one|all|into)\b)|"
    r"flattened(?!\s+(?:tensor|batch|sequences?|list|view|array|inputs?|tokens?|form)\b)|"
    r"loses|outperforms?|doubles|(?<!both )(?<!two )(?<!the )halves|triples|quadruples|doubled|halved|tripled|quadrupled|several[- ]fold|"
    r"increases?|increased|decreases?|decreased|reduces|improves|improved|worsens|degrades?|jumps?|jumped|"
    r"spikes?|spiked|"
    r"several times|many times|orders? of magnitude|speeds? up|speedup|slowdown|collapses?|explodes?)\b"
    r"|\b(?:roughly|about|nearly|almost) (?:in proportion|proportional(?:ly)?|linear(?:ly)?)\b"
    r"|\b(?:barely|hardly|scarcely) (?:moves?|changes?|grows?|shows?|matters?|costs?|differs?)\b"
    r"|\b(?:about|nearly|roughly) the same\b|\bthe same whatever\b"
    r"|\b(?:much|far) (?:better|worse|higher|lower|faster|slower|cheaper|more|less)\b"
    r"|\b(?:higher|lower|better|worse|cheaper) than\b",
    re.IGNORECASE,
)
# A factor ("3.5×", "2x") is directional in prose; in an output it is a table's ratio column, data
# that does not say which way a claim should read, so only DIRECTIONAL_WORDS count as a printed claim.
_FACTOR = re.compile(r"\b\d+(?:\.\d+)?\s?[×x](?!\w)")

# Measured quantities, grouped: a claim and its backing must name a quantity of the same group.
QUANTITIES: dict[str, re.Pattern[str]] = {
    name: re.compile(pattern, re.IGNORECASE)
    for name, pattern in {
        "TTFT": r"\b(?:ttft|time to first token)\b",
        "TPOT/ITL": r"\b(?:tpot|itl|tbt|time per output token|inter-token|between tokens)\b",
        "throughput": r"\b(?:throughput|tokens?/s|tok/s|tokens per second|tokens_per_s|tps)\b",
        "goodput": r"\b(?:goodput|slo)\b",
        "utilisation": r"\butili[sz]ation\b",
        "memory": r"\b(?:memory|kv|gb|gib|mib|bytes?)\b",
        "rate": r"\b(?:req/s|requests? per second|rate)\b",
        "time": r"\b(?:time|times|timings?|durations?|latency|latencies|ms|seconds?|steps?|speed|wall|delay|wait|waits|queue|"
                r"costs?|p50|p90|p99)\b",
    }.items()
}
# "several times", "3 times" are directional words, not the quantity "time".
_TIMES_AS_FACTOR = re.compile(r"\b(?:\d+(?:\.\d+)?|several|many|two|three|four|five|ten) times\b", re.IGNORECASE)

CITATION = re.compile(
    r"\bet al\.|\barXiv\b|\b(?:OSDI|SOSP|NSDI|MLSys|ISCA|ASPLOS|EuroSys)\b|\bpaper\b|\breports?\b|\breported\b"
    r"|\bdatasheet\b|\bblog\b",
    re.IGNORECASE,
)
_ARITHMETIC = re.compile(r"\d[\d,.]*\s?[A-Za-z%]{0,6}\s*[×÷=≈]\s*\(?\d")
_OBJECTIVE = re.compile(r"(?:[-*]|\d+\.)\s+[a-z]")
MARKER = re.compile(r"<!--\s*claim:\s*(.*?)\s*-->", re.DOTALL)

# Per-chapter allowlist: a fragment of the sentence (case-insensitive) and the source or reason.
CHAPTER_ALLOW: dict[str, dict[str, str]] = {}


@dataclass
class Finding:
    chapter: str
    path: str
    cell: int
    sentence: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} cell {self.cell}: '{self.sentence}': {self.why}"


def _assert_statements(source: str) -> list[str]:
    """Each `assert` with the lines that continue it (its message often names the quantity)."""
    lines = source.splitlines()
    found = []
    for index, line in enumerate(lines):
        if re.match(r"\s*assert\b", line):
            statement = [line]
            depth = line.count("(") + line.count("[") - line.count(")") - line.count("]")
            for later in lines[index + 1:]:
                if depth <= 0 and not statement[-1].rstrip().endswith("\\"):
                    break
                statement.append(later)
                depth += later.count("(") + later.count("[") - later.count(")") - later.count("]")
            found.append("\n".join(statement))
    return found


def _is_directional(text: str) -> bool:
    return bool(DIRECTIONAL_WORDS.search(text) or _FACTOR.search(text))


def _printed_claims(output: str) -> list[str]:
    """Lines of output that say which way something went ("fell from 1759 ms to 10 ms (172× lower)")."""
    return [line for line in output.splitlines() if DIRECTIONAL_WORDS.search(line)]


def quantities_in(text: str) -> set[str]:
    text = _TIMES_AS_FACTOR.sub(" ", text.replace("_", " "))
    return {name for name, pattern in QUANTITIES.items() if pattern.search(text)}


def _prose(text: str) -> str:
    """Drop what is not prose: inline code, link targets, HTML tags and comments, URLs, headings."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<[^>]+>", " ", text)
    text = re.sub(r"\bhttps?://\S+", " ", text)
    return re.sub(r"^#+ .*$", " ", text, flags=re.MULTILINE)


def paragraphs(markdown: str) -> list[tuple[str, list[str]]]:
    """(prose, markers) for each paragraph or list item of a markdown cell; fenced code dropped."""
    markdown = re.sub(r"```.*?```", "\n\n", markdown, flags=re.DOTALL)
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)", markdown)
    return [(_prose(block), MARKER.findall(block)) for block in blocks]


def sentences(prose: str) -> list[str]:
    flat = " ".join(prose.split())
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*_\"'\[])", flat) if s]


def _is_open_question(sentence: str) -> bool:
    """A question that asserts nothing ("What would shrink the transfer?"); "Why does X grow?" asserts X grows."""
    opening = re.sub(r"^[\s\-*\d.)]*(?:\*\*[^*]*\*\*)?\s*", "", sentence)
    return sentence.rstrip().endswith("?") and not re.match(r"(?:why|how come)\b", opening, re.IGNORECASE)


def claims_in(prose: str) -> list[str]:
    """The sentences of `prose` that draw a direction from a measured quantity."""
    return [s for s in sentences(prose)
            if _is_directional(s) and quantities_in(s) and not _is_open_question(s)]


def _neighbour_code(cells: list[dict], index: int) -> list[dict]:
    around = []
    for step in (-1, 1):
        at = index + step
        while 0 <= at < len(cells) and cells[at]["cell_type"] == "code":
            around.append(cells[at])
            at += step
    return around


def _backing_texts(code_cells: list[dict]) -> list[str]:
    texts = []
    for cell in code_cells:
        texts += _assert_statements(_cell_text(cell))
        texts += _printed_claims(_output_text(cell))
    return texts


def _marker_found(text: str, cells: list[dict]) -> bool:
    needle = " ".join(text.split())
    if not needle:
        return False
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        haystacks = _assert_statements(_cell_text(cell)) + [_output_text(cell)]
        if any(needle in " ".join(h.split()) for h in haystacks):
            return True
    return False


def check_notebook(path: Path, allow: dict[str, str] | None = None) -> list[Finding]:
    chapter = path.name[:2]
    allow = CHAPTER_ALLOW.get(chapter, {}) if allow is None else allow
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    first_markdown = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
    findings = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        backing = _backing_texts(_neighbour_code(cells, index))
        backed_quantities = set().union(*(quantities_in(t) for t in backing)) if backing else set()
        for prose, markers in paragraphs(_cell_text(cell)):
            stale = [m for m in markers if not _marker_found(m, cells)]
            for marker in stale:
                findings.append(Finding(chapter, str(where), index, f"<!-- claim: {marker} -->",
                                        "the marker names text that no assert statement or output contains"))
            for sentence in claims_in(prose):
                if markers and not stale:
                    continue
                if CITATION.search(sentence) or _ARITHMETIC.search(sentence):
                    continue
                if index == first_markdown and _OBJECTIVE.match(sentence):
                    continue  # "- explain why TP made this CPU slower;": a goal the chapter then backs
                if any(fragment.lower() in sentence.lower() for fragment in allow):
                    continue
                wanted = quantities_in(sentence)
                if wanted & backed_quantities:
                    continue
                why = (f"a directional claim about {', '.join(sorted(wanted))} with nothing behind it: "
                       "let the cell next to it print the sentence or assert it (naming the quantity), "
                       "or add <!-- claim: TEXT --> naming the assert or output that backs it "
                       "(see tools/check_claims.py)")
                findings.append(Finding(chapter, str(where), index, sentence, why))
    return findings


# ---- every end-of-chapter question has a folded answer a teacher can check (issue 26) ----------------

QUESTIONS_HEADING = re.compile(r"^#+\s.*check your understanding", re.IGNORECASE | re.MULTILINE)
_NUMBERED = re.compile(r"^(\d+)\.\s", re.MULTILINE)


def unanswered_questions(cells: list[dict]) -> str | None:
    """What is missing from the chapter's "Check your understanding" section, or None.

    The section (from its heading to the next heading of level 1 or 2) numbers its questions `1.`,
    `2.`, ... and then folds the answers into a `<details><summary>Answers</summary>` block, one
    numbered answer per question (an answer may run over several lines; its number is what counts)."""
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    heading = QUESTIONS_HEADING.search(text)
    if heading is None:
        return "no 'Check your understanding' section"
    section = text[heading.end():]
    end = re.search(r"^#{1,2}\s", section, re.MULTILINE)
    section = section[:end.start()] if end else section
    asked_text, fold, rest = section.partition("<details")
    asked = sorted({int(n) for n in _NUMBERED.findall(asked_text)})
    if not asked:
        return "the section has no numbered questions (1., 2., ...)"
    if not fold:
        return "its questions have no folded answers: add <details><summary>Answers</summary> ... </details>"
    answers, closed, _ = rest.partition("</details>")
    if not closed:
        return "the answers' <details> block is never closed"
    if not re.search(r"<summary>[^<]*answer", fold + answers, re.IGNORECASE):
        return "the fold after the questions is not the answers (<summary>Answers</summary>)"
    answered = {int(n) for n in _NUMBERED.findall(answers)}
    missing = [n for n in asked if n not in answered]
    if missing:
        return f"question(s) {', '.join(map(str, missing))} have no numbered answer in the fold"
    return None


def check_questions(path: Path) -> list[Finding]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    problem = unanswered_questions(cells)
    if problem is None:
        return []
    where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    at = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
               and QUESTIONS_HEADING.search("".join(c["source"]))), len(cells) - 1)
    return [Finding(path.name[:2], str(where), at, "Check your understanding", problem)]


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    bad = unanswered = 0
    for path in paths:
        for finding in check_notebook(path):
            print(finding)
            bad += 1
        for finding in check_questions(path):
            print(finding)
            unanswered += 1
    print(f"{bad} unbacked directional claim(s), {unanswered} chapter(s) with questions lacking folded answers, "
          f"in {len(paths)} chapter(s)")
    return 1 if bad or unanswered else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
