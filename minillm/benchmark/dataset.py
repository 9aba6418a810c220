"""Benchmark prompts of an exact token count, on a seeded trace (chapter 11).

The trace (arrival order, prompt and output lengths, shared prefixes) comes from
`minillm.traces.synthetic.make_trace`; here its token ids are turned into text a server can tokenize back
to the same count. Random token ids decode to byte fragments that re-tokenize to MORE tokens, so
each id is mapped instead onto one of the tokenizer's whole-word tokens (" camels", " morning"):
a run of such words tokenizes back to itself. Every prompt is checked by re-encoding it, and
trimmed or topped up if the tokenizer merged or split something.

The tokenizer is HF `tokenizers` read from a model directory's `tokenizer.json` (the bundled
model's by default): loading it takes milliseconds and needs no transformers import.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from minillm.traces.synthetic import LengthDist, Trace, make_trace

DATASETS = ("random", "sharegpt-like", "jsonl")


@dataclass
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]  # what `prompt` encodes to (no special tokens)
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@functools.lru_cache(maxsize=8)
def _load_tokenizer_file(file: str) -> Tokenizer:
    return Tokenizer.from_file(file)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a model directory (its tokenizer.json) or a tokenizer.json file.
    Loaded once per file: a notebook that runs many short benchmarks gets the same object back."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path} (give a model directory or the file)")
    return _load_tokenizer_file(str(file.resolve()))


# Word lists by tokenizer object (kept alive here, so its id cannot be reused while cached).
_WORDS: dict[int, tuple[Tokenizer, np.ndarray]] = {}


def word_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of tokens that are one whole ASCII word starting with a word boundary (byte-level BPE's
    "Ġ", SentencePiece's "▁") and that encode back to exactly themselves. A piece without the
    boundary mark ("ers") would glue onto the word before it. Sorted: the same on every machine."""
    ids = []
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token[1:]
        if token[:1] in ("Ġ", "▁") and len(word) >= 2 and word.isascii() and word.isalpha() and \
                tokenizer.encode(tokenizer.decode([token_id]), add_special_tokens=False).ids == [token_id]:
            ids.append(token_id)
    if len(ids) < 16:
        raise ValueError(f"the tokenizer has only {len(ids)} whole-word tokens; it cannot build word prompts")
    return np.asarray(ids, dtype=np.int64)


def cached_word_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """`word_token_ids`, computed once per tokenizer object (it encodes the whole vocabulary)."""
    entry = _WORDS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _WORDS[id(tokenizer)] = (tokenizer, word_token_ids(tokenizer))
    return entry[1]


def exact_length_prompt(tokenizer: Tokenizer, ids: list[int], filler: np.ndarray, rng: np.random.Generator,
                        max_rounds: int = 8) -> tuple[str, list[int]]:
    """Text whose encoding has len(ids) tokens, starting from the decoded ids: trimmed when
    re-encoding grew it, topped up with filler words when it shrank."""
    target = len(ids)
    text = tokenizer.decode(ids)
    encoded = tokenizer.encode(text, add_special_tokens=False).ids
    for _ in range(max_rounds):
        if len(encoded) == target:
            break
        if len(encoded) > target:
            encoded = encoded[:target]
        else:
            encoded = encoded + rng.choice(filler, size=target - len(encoded)).tolist()
        text = tokenizer.decode(encoded)
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
    return text, encoded


def requests_from_trace(trace: Trace, tokenizer: Tokenizer, seed: int = 0) -> list[BenchRequest]:
    """Each trace request's ids (taken modulo the word list) become words; lengths and shared
    prefixes carry over, so a prefix-caching trace stays one."""
    words = cached_word_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    out = []
    for r in trace:
        mapped = words[np.asarray(r.prompt_token_ids, dtype=np.int64) % len(words)].tolist()
        text, ids = exact_length_prompt(tokenizer, mapped, words, rng)
        out.append(BenchRequest(text, ids, r.max_tokens))
    return out


def make_requests(
    dataset: str,
    num_prompts: int,
    tokenizer: Tokenizer,
    *,
    seed: int = 0,
    input_len: int = 128,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    dataset_path: str | Path | None = None,
) -> list[BenchRequest]:
    """The prompts of one run.

    random: lengths uniform in [len·(1 − range_ratio), len·(1 + range_ratio)] as vLLM's random
    dataset, after a `prefix_len`-token prefix shared by all. sharegpt-like: the heavy-tailed
    lengths of `minillm.traces.synthetic` (ShareGPT's means), clipped at max_input_len / max_output_len.
    jsonl: a trace saved by `Trace.save_jsonl`.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be ≥ 1, got {num_prompts}")
    if dataset == "jsonl":
        if dataset_path is None:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl (a saved minillm trace)")
        trace = Trace.load_jsonl(dataset_path)
        trace = Trace(trace.requests[:num_prompts], trace.meta)
        return requests_from_trace(trace, tokenizer, seed)
    common = dict(seed=seed, vocab_size=1 << 20)
    if dataset == "random":
        if input_len < 1 or output_len < 1:
            raise ValueError(f"--random-input-len and --random-output-len must be ≥ 1, got {input_len}, {output_len}")
        if not 0 <= range_ratio < 1:
            raise ValueError(f"--random-range-ratio must lie in [0, 1), got {range_ratio}")
        if prefix_len < 0:
            raise ValueError(f"--random-prefix-len must be ≥ 0, got {prefix_len}")

        def span(n: int) -> LengthDist:
            return LengthDist.uniform(max(1, math.floor(n * (1 - range_ratio))), math.ceil(n * (1 + range_ratio)))

        trace = make_trace(num_prompts, prompt_len=span(input_len), output_len=span(output_len),
                           min_prompt_len=prefix_len + 1, max_prompt_len=prefix_len + 2 * input_len + 1,
                           max_output_len=2 * output_len + 1, shared_prefix_len=prefix_len, **common)
    elif dataset == "sharegpt-like":
        trace = make_trace(num_prompts, prompt_len="sharegpt", output_len="sharegpt",
                           max_prompt_len=max_input_len, max_output_len=max_output_len, **common)
    else:
        raise ValueError(f"--dataset-name {dataset!r} is not one of {', '.join(DATASETS)}")
    return requests_from_trace(trace, tokenizer, seed)
