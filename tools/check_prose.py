"""Prose that cannot drift: every number typed into a chapter's markdown is printed above it.

The rule (COURSE.md, issue 18): a number that depends on the machine is never typed into prose --
the cell prints the sentence, or the prose says where to look and what shape to expect.
Deterministic numbers (simulator, counts, arithmetic) may be quoted, because a compared cell above
prints them and strict nbval keeps that output true on every run.

For each markdown cell of a chapter this script extracts the numbers and accepts one when

1. a code cell above it contains it in its source (a knob the reader can see: `rate=8`), or
2. a code cell above it that nbval compares (not tagged `nbval-ignore-output`) prints it, or
3. it matches the global allowlist of patterns (years, section and chapter numbers, model sizes
   such as 7B, hardware names, dtype names), or
4. it is in the chapter's own allowlist below, each entry with the source it is cited from.

A number printed only by a cell tagged `nbval-ignore-output` (a timing of this machine) does NOT
count: quoting it would freeze one machine's measurement into the text. Such a number is reported
as "machine-dependent". The check reads the saved notebooks only; nothing is executed.

Normalisation: thousands separators go (1,800 = 1800); values compare as numbers (46x = 46.0x);
a prose number matches an output that rounds to it at the prose's precision (0.90 matches 0.8977,
1,800 matches 1,793 but not 1,850; 90 % matches 0.8977 as a fraction too); each end of a range
(1.1-1.4x) is checked on its own; 4.9 s matches 4877.91 printed in ms (and ms matches s); the -fold words (tenfold, hundredfold) and the tens words
(twenty ... ninety) count as numbers.

Usage: python tools/check_prose.py [chapters/NN_x.ipynb ...]   (no argument: every chapter)
Exit status 1 when a prose number is unsupported; each one is listed with its cell and context.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IGNORE_TAG = "nbval-ignore-output"

# A number standing on its own: not part of an identifier (ex08, fp16, A100, p99, sm_90, Qwen2.5).
_NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.\-/])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d|(?![xkKMGBTsm])[A-Za-z_])"
)
# Number words that state a quantity; small ones (one, two, twice) are left alone.
_WORDS = {
    "tenfold": "10", "hundredfold": "100", "thousandfold": "1000",
    "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50",
    "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
}
_WORD = re.compile(r"\b(" + "|".join(_WORDS) + r")\b", re.IGNORECASE)
_NUMBER_FOLD = re.compile(r"\b(\d+)-fold\b")

# A term of written-out arithmetic: a number, maybe a unit of a few letters (13.5 GB ÷ 4.8 TB/s).
_TERM = r"\(*\d[\d,]*(?:\.\d+)?(?:\s?[A-Za-zµ%]{1,10}(?:/[A-Za-z]{1,5})?)?\)*"

_ARITHMETIC = re.compile(rf"{_TERM}(?:\s*[×÷·*/+−=≈^]\s*\(*\s*{_TERM}\)*)+")

# Global allowlist: spans of prose whose numbers are names, not quantities.
GLOBAL_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("year", re.compile(r"\b(?:19|20)\d\d\b")),
    ("model size", re.compile(r"\b\d+(?:\.\d+)?[BM]\b")),
    ("chapter/section/task/pitfall/question number",
     re.compile(r"\b(?:[Cc]hapters?|[Ss]ections?|§|[Tt]asks?|[Pp]itfalls?|[Ee]xercises?|[Ss]tep|[Cc]ells?|"
                r"[Ff]igure|[Tt]able|[Ee]q\.?|[Ee]quation|[Aa]lgorithm|[Pp]art|[Hh]int|[Qq]uestion|"
                r"[Ll]ines?|[Pp]age|[Vv]ersion|Python|v)\s*\d+(?:\.\d+)*(?:\s*(?:[-–,]|and|or|to)\s*\d+(?:\.\d+)*)*")),
    ("heading number", re.compile(r"^#+\s*\d+(?:\.\d+)*\.?", re.MULTILINE)),
    ("numbered list item", re.compile(r"^\s*\d+\.\s", re.MULTILINE)),
    ("hardware/dtype name", re.compile(
        r"\b(?:RTX|GTX|Tesla|Apple M|TPU ?v|PCIe|PCIe Gen|NVLink|HBM|DDR|float|bfloat|int|uint|fp|bf|FP|BF|INT)"
        r"\s?\d+\w*")),
    ("model family name", re.compile(
        r"\b(?:GPT|Llama|LLaMA|Qwen|Mistral|Mixtral|Gemma|OPT|Phi|DeepSeek|Falcon|Vicuna|T5)[- ]?\d+(?:\.\d+)*\w*")),
    ("power of two or unit of memory in a name", re.compile(r"\b2\^\d+\b|\b\d+-bit\b|\b\d+-way\b")),
    ("ordinal", re.compile(r"\b\d+(?:st|nd|rd|th)\b")),
    ("date or version string", re.compile(r"\b\d+\.\d+\.\d+\b")),
    ("arXiv id", re.compile(r"arXiv:\s?\d+\.\d+")),
    ("worked arithmetic", _ARITHMETIC),
]

# Per-chapter allowlist: constants and figures cited from papers or docs, each with its source.
# Keep it short: a number here is one the notebook cannot print because it is not ours.
_VLLM_BATCH_DEFAULTS = "vLLM EngineArgs.get_batch_defaults (vllm/engine/arg_utils.py): per entry point and GPU"
_SEEDS_PITFALL_1 = "the seeds' example of pitfall 1: a 4,000-token prompt arriving among thirty decodes"
_VLLM_SPEC_BLOG = ("vLLM blog 2024-10-17, 'How Speculative Decoding Boosts vLLM Performance by up to 2.8x': "
                   "Llama 3 70B, 4xH100, ShareGPT / CNN-DailyMail, QPS 1 and high QPS")
_OPENAI_RETRIES = "openai-python's client: retries 408, 409, 429 and >= 500 (DEFAULT_MAX_RETRIES = 2)"
_ORCA = ("Yu et al., OSDI 2022 (Orca): GPT-3 175B at 190 ms median normalized latency, Orca 6.81 req/s "
         "vs FasterTransformer 0.185 req/s, 36.9x (as seeds 004 quote it)")
CHAPTER_ALLOW: dict[str, dict[str, str]] = {
    "14": {
        "80": "seeds 000: A100 80GB serving a 7B model in FP16",
        "14": "seeds 000: a 7B model's FP16 weights are about 14 GB",
    },
    "00": {
        "312": "NVIDIA A100 datasheet: 312 TFLOP/s dense fp16/bf16 (minillm.sim.A100_80GB)",
        "6.74": "Llama-2-7B parameter count (its HF config; the next cell prints it)",
        "4.8": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
    },
    "01": {
        "80": "Llama-2-70B config: 80 layers (num_hidden_layers)",
        "13.5": "Llama-2-7B in fp16: 6.74e9 parameters x 2 bytes (chapter 00 prints it)",
        "20.4": "Kwon et al., SOSP 2023 (vLLM), Figure 2: 20.4-38.2 % of reserved KV memory used",
        "38.2": "Kwon et al., SOSP 2023 (vLLM), Figure 2: 20.4-38.2 % of reserved KV memory used",
    },
    "04": {  # requested by the chapter 04 owner (notes/prose-check-02-04.md)
        "20": "seeds 001: 70B GPU utilization 10-20 % with static batching, 60-80 % continuous",
        "60": "seeds 001: 70B GPU utilization 10-20 % with static batching, 60-80 % continuous",
        "80": "seeds 001: 70B GPU utilization 10-20 % with static batching, 60-80 % continuous",
        "6.81": _ORCA,
        "0.185": _ORCA,
        "190": _ORCA,
        "36.9": _ORCA,
        "13.5": "Llama-2-7B in fp16: 6.74e9 parameters x 2 bytes = 13.5 GB of weights",
        "2.04": "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e (minillm.sim.A100_80GB)",
    },
    "05": {
        "20.4": "Kwon et al., SOSP 2023 (vLLM), Figure 2: 20.4-38.2 % of reserved KV memory used",
        "38.2": "Kwon et al., SOSP 2023 (vLLM), Figure 2: 20.4-38.2 % of reserved KV memory used",
        "161": "Kwon et al., SOSP 2023 (vLLM), ShareGPT: mean input 161 tokens",
        "338": "Kwon et al., SOSP 2023 (vLLM), ShareGPT: mean output 338 tokens",
        "16": "vLLM's default block_size (16 tokens)",
    },
    "10": {
        "141": "NVIDIA H200 datasheet: 141 GB HBM3e",
        "4.8": "NVIDIA H200 datasheet: 4.8 TB/s",
        "164": "NVIDIA Ampere tuning guide: up to 164 KB of shared memory per SM on the A100",
        "228": "NVIDIA Hopper tuning guide: up to 228 KB of shared memory per SM on the H100",
        "32": "CUDA warp size: 32 threads",
        "40.3": "Dao et al. 2022 (FlashAttention), Figure 2: GPT-2 medium, N = 1024, A100",
        "41.7": "Dao et al. 2022 (FlashAttention), Figure 2: GPT-2 medium, N = 1024, A100",
        "7.3": "Dao et al. 2022 (FlashAttention), Figure 2: GPT-2 medium, N = 1024, A100",
        "4.4": "Dao et al. 2022 (FlashAttention), Figure 2: GPT-2 medium, N = 1024, A100",
        "50": "NVIDIA A100 (40 MB) and H100 (50 MB) L2 cache",
    },
    "11": {
        "408": _OPENAI_RETRIES,
        "409": _OPENAI_RETRIES,
        "429": _OPENAI_RETRIES,
        "500": "an example SLO (TTFT <= 500 ms, TPOT <= 50 ms), as vllm bench serve --goodput takes one",
    },
    "06": {
        "16": "vLLM's default block_size (16 tokens)",
        "0.9": "vLLM engine arguments: gpu_memory_utilization defaults to 0.9",
        "0.92": "a source text of the course (shared/seeds/004) gives 0.92; the chapter says vLLM's docs win",
    },
    "07": {
        "120": "minillm.traces.synthetic.make_chat_trace: reply_len defaults to log-normal with mean 120",
        "384": "minillm.traces.course: SIM_SHARED_PREFIX_LEN = 384 (four 384-token system prompts)",
    },
    "08": {
        "4000": _SEEDS_PITFALL_1,
        "30": _SEEDS_PITFALL_1,
        "28.3": "Sarathi-Serve (Agrawal et al. 2024, arXiv:2403.02310): TBT up to 28.3x worse",
        "16384": _VLLM_BATCH_DEFAULTS,
        "8192": _VLLM_BATCH_DEFAULTS,
        "70": _VLLM_BATCH_DEFAULTS + " (70 GiB of device memory)",
    },
    "09": {
        "61": "minillm.sim.hardware.A100_80GB_PRACTICAL: mbu=0.61, fitted to published Llama-2-7B latencies",
        "22": "TinyLlama-1.1B's config.json: num_hidden_layers = 22",
        "2.8": _VLLM_SPEC_BLOG,
        "1.5": _VLLM_SPEC_BLOG,
        "1.4": _VLLM_SPEC_BLOG,
        "1.8": _VLLM_SPEC_BLOG,
    },
}


@dataclass
class Finding:
    chapter: str
    cell: int
    number: str
    context: str
    machine_dependent: bool

    def __str__(self) -> str:
        why = ("printed above only by a cell tagged nbval-ignore-output (a measurement of one machine): "
               "print the sentence from the cell, or say where to look")
        if not self.machine_dependent:
            why = "no code or compared output above contains it; print it, or cite it in the chapter allowlist"
        return f"{self.chapter} cell {self.cell}: {self.number!r} in '...{self.context}...': {why}"


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def numbers_in(text: str) -> list[tuple[str, int]]:
    """Numbers (as typed) and their offsets in `text`."""
    found = [(m.group(0), m.start()) for m in _NUMBER.finditer(text)]
    found += [(_WORDS[m.group(1).lower()], m.start()) for m in _WORD.finditer(text)]
    found += [(m.group(1), m.start()) for m in _NUMBER_FOLD.finditer(text)]
    return found


def _values(text: str) -> set[Decimal]:
    """Every number in a code cell's source or output; not the digits of a name (p99, A100, x_2)."""
    values = set()
    text = re.sub(r"(?<=\d)_(?=\d)", "", text)  # 20_000 is 20000
    for match in re.finditer(
            r"(?<![A-Za-z0-9_.])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", text):
        value = _decimal(match.group(0))
        if value is not None:
            values.add(value)
    return values


def _precision(typed: str) -> int:
    """Decimal places to round an output to, to compare it with `typed` (negative: tens, hundreds...)."""
    plain = typed.replace(",", "")
    if "." in plain:
        return len(plain.split(".")[1])
    stripped = plain.rstrip("0")
    return -(len(plain) - len(stripped)) if stripped else 0


def supported(typed: str, values: set[Decimal], percent: bool, unit: str = "") -> bool:
    target = _decimal(typed)
    if target is None:
        return True
    places = _precision(typed)
    quantum = Decimal(1).scaleb(-places)
    candidates = set(values)
    if percent:
        candidates |= {v * 100 for v in values}
    if unit == "s":  # 4.9 s in prose, 4877.91 ms printed
        candidates |= {v / 1000 for v in values}
    elif unit == "ms":
        candidates |= {v * 1000 for v in values}
    for value in candidates:
        if value == target:
            return True
        if abs(value - target) > abs(quantum):
            continue
        for rounding in (ROUND_HALF_UP, ROUND_HALF_EVEN):
            if value.quantize(quantum, rounding=rounding) == target:
                return True
    return False


def _is_small_count(typed: str, after: str) -> bool:
    """0 to 10 written as a plain integer counts things (four prompts, 2 tokens); not 2x, not 5 %."""
    return typed.isdigit() and int(typed) <= 10 and not re.match(r"\s?[×x%]", after)


def _strip_markdown(text: str) -> str:
    """Drop what is not prose: code (fenced and inline), link targets, HTML tags, URLs, file names."""
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<[^>]+>", " ", text)
    text = re.sub(r"\bhttps?://\S+", " ", text)
    text = re.sub(r"[\w./-]*\w\.(?:ipynb|py|md|json|csv|txt|toml)\b", " ", text)
    return text


def _allowed_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for _, pattern in GLOBAL_PATTERNS for m in pattern.finditer(text)]


def _cell_text(cell: dict) -> str:
    return "".join(cell.get("source", ""))


def _output_text(cell: dict) -> str:
    texts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            texts.append("".join(output["text"]))
        elif "data" in output:
            for kind in ("text/plain", "text/markdown", "text/html"):
                value = output["data"].get(kind)
                if value:
                    texts.append("".join(value) if isinstance(value, list) else value)
    return "\n".join(texts)


def check_notebook(path: Path, allow: dict[str, str] | None = None) -> list[Finding]:
    chapter = path.name[:2]
    allow = CHAPTER_ALLOW.get(chapter, {}) if allow is None else allow
    allowed_values = {_decimal(k) for k in allow}
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    trusted: set[Decimal] = set()  # code above, and outputs nbval compares
    measured: set[Decimal] = set()  # outputs of ignore-output cells above
    findings = []
    for index, cell in enumerate(cells):
        # The code a markdown cell introduces (up to the next markdown cell) is shown right below it.
        introduced: set[Decimal] = set()
        for later in cells[index + 1:]:
            if later["cell_type"] != "code":
                break
            introduced |= _values(_cell_text(later))
        if cell["cell_type"] == "code":
            trusted |= _values(_cell_text(cell))
            ignored = IGNORE_TAG in cell.get("metadata", {}).get("tags", [])
            (measured if ignored else trusted).update(_values(_output_text(cell)))
            continue
        if cell["cell_type"] != "markdown":
            continue
        text = _strip_markdown(_cell_text(cell))
        spans = _allowed_spans(text)
        # Check-your-understanding questions pose hypothetical numbers; the answers may use them.
        # The operands of a calculation written out in a cell are its givens for the rest of that cell.
        givens: set[Decimal] = {v for m in _ARITHMETIC.finditer(text) for v in _values(m.group(0))}
        if "check your understanding" in text.lower() and "Answers" in text:
            answers_at = text.index("Answers")
            givens |= _values(text[:answers_at])
            spans.append((0, answers_at))
        for typed, start in numbers_in(text):
            if any(a <= start < b for a, b in spans):
                continue
            if _decimal(typed) in allowed_values:
                continue
            after = text[start + len(typed): start + len(typed) + 3]
            percent = "%" in after or "percent" in text[start: start + 12]
            unit_match = re.match(r"\s?(ms|s)\b", text[start + len(typed):])
            unit = unit_match.group(1) if unit_match else ""
            if _is_small_count(typed, after) or supported(typed, trusted | introduced | givens, percent, unit):
                continue
            context = " ".join(text[max(0, start - 40): start + len(typed) + 30].split())
            findings.append(Finding(chapter, index, typed, context, supported(typed, measured, percent, unit)))
    return findings


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    bad = 0
    for path in paths:
        for finding in check_notebook(path):
            print(finding)
            bad += 1
    print(f"{bad} unsupported prose number(s) in {len(paths)} chapter(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
