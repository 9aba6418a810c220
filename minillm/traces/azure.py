"""Real production traces: Azure's 2023 LLM inference traces (chapters 02 and 04; pitfall 5).

Every other trace in the course is synthetic. The source texts' pitfall 5 warns that a benchmark on
made-up lengths can hide what a real length distribution does (head-of-line blocking, padding
waste), so the course also runs two real traces: one hour each of request arrivals and token counts
from Azure's LLM inference services, a coding assistant (`"code"`) and a chat service (`"conv"`),
published by Microsoft with Splitwise (Patel et al., "Splitwise: Efficient generative LLM inference
using phase splitting", ISCA 2024) under CC-BY 4.0. The files are bundled in `data/traces/`, with
their attribution in `data/traces/README.md`.

    from minillm.traces.synthetic import azure_trace
    sim = azure_trace("conv", duration_s=300)                      # as they are: 7B on the simulator
    cpu = azure_trace("conv", duration_s=60, speedup=4, length_scale=(1/16, 1/4),
                      max_model_len=512, vocab_size=llm.vocab_size, token_id_range=(6, llm.vocab_size))

The files hold no prompt text (privacy), only lengths: a prompt here is `ContextTokens` random token
ids (seeded, distinct between requests, so no two prompts share a prefix), and `max_tokens` is
`GeneratedTokens`, an exact output length (the engine runs traces with ignore_eos), as
`vllm bench serve` replays such traces. For the bundled model on a CPU the trace is scaled down:
`speedup` divides every arrival time (the same requests, `speedup` times as fast), `length_scale`
multiplies the lengths (one factor, or a (prompt, output) pair), and `max_prompt_len`,
`max_output_len` and `max_model_len` clip what is still too long; `meta` counts what was clipped.
"""

from __future__ import annotations

import csv
import functools
import gzip
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from minillm.traces.trace import Trace, TraceRequest

TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE_TRACES = {"code": "AzureLLMInferenceTrace_code.csv.gz", "conv": "AzureLLMInferenceTrace_conv.csv.gz"}
AZURE_CITATION = ("Azure LLM inference trace 2023 (Microsoft, AzurePublicDataset, CC-BY 4.0); Patel et al., "
                  "Splitwise: Efficient generative LLM inference using phase splitting, ISCA 2024")


@dataclass(frozen=True)
class AzureRows:
    """One trace file as arrays: seconds since its first request, prompt and output lengths."""

    kind: str
    arrival_s: np.ndarray  # float64, starts at 0, non-decreasing
    prompt_lens: np.ndarray  # int64, ContextTokens
    output_lens: np.ndarray  # int64, GeneratedTokens

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0


def _check_kind(kind: str) -> str:
    if kind not in AZURE_TRACES:
        raise ValueError(f"unknown Azure trace {kind!r}: choose one of {sorted(AZURE_TRACES)}")
    return kind


@functools.cache
def azure_rows(kind: str) -> AzureRows:
    """The whole file, read once per process (`"code"`: 8,819 requests; `"conv"`: 19,366)."""
    path = TRACES_DIR / AZURE_TRACES[_check_kind(kind)]
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the Azure traces ship in the repository's data/traces/ "
                                "(minillm must be installed from a checkout, as `make install` does)")
    stamps, prompts, outputs = [], [], []
    with gzip.open(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: unexpected columns {header}")
        for stamp, ctx, gen in reader:
            stamps.append(datetime.fromisoformat(stamp[:26]))  # 7 decimals; datetime keeps microseconds
            prompts.append(int(ctx))
            outputs.append(int(gen))
    t0 = stamps[0]
    arrival = np.array([(s - t0).total_seconds() for s in stamps], dtype=np.float64)
    return AzureRows(kind, arrival, np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64))


def _scale(lens: np.ndarray, factor: float, lo: int, hi: int | None) -> np.ndarray:
    scaled = np.rint(lens * factor).astype(np.int64)
    return np.clip(scaled, lo, hi if hi is not None else max(int(scaled.max(initial=lo)), lo))


def azure_trace(
    kind: str,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    speedup: float = 1.0,
    length_scale: float | tuple[float, float] = 1.0,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    max_model_len: int | None = None,
    min_prompt_len: int = 1,
    min_output_len: int = 1,
    vocab_size: int = 32000,
    token_id_range: tuple[int, int] | None = None,
    seed: int = 0,
) -> Trace:
    """Requests of the Azure `kind` trace ("code" or "conv") arriving in [start_s, start_s + duration_s)
    of the original hour (all of it by default), at most `max_requests` of them.

    The first request kept arrives at 0; arrivals keep their real gaps divided by `speedup`. Lengths
    are multiplied by `length_scale` (a float for both, or (prompt, output)), rounded, raised to the
    minimums and clipped to `max_prompt_len` / `max_output_len`; with `max_model_len` the prompt is
    then cut so that prompt + output fits (output first cut to leave `min_prompt_len`). Defaults
    leave the trace as it is (for a 7B model on the simulator). Prompt token ids are seeded random
    ids from `token_id_range` = [lo, hi) (default the whole vocabulary) whose first token differs
    between requests while the range allows, so a prefix cache finds nothing to share.
    """
    rows = azure_rows(_check_kind(kind))
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a positive number, got {speedup!r}")
    if start_s < 0 or (duration_s is not None and not duration_s > 0):
        raise ValueError(f"start_s must be >= 0 and duration_s > 0 (or None), got {start_s!r}, {duration_s!r}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1 (or None), got {max_requests!r}")
    p_scale, o_scale = (length_scale, length_scale) if isinstance(length_scale, (int, float)) else length_scale
    if not (p_scale > 0 and o_scale > 0):
        raise ValueError(f"length_scale must be positive (a float or a (prompt, output) pair), got {length_scale!r}")
    if min_prompt_len < 1 or min_output_len < 1:
        raise ValueError("min_prompt_len and min_output_len must be >= 1")
    if max_model_len is not None and max_model_len < min_prompt_len + min_output_len:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a {min_prompt_len}-token prompt "
                         f"and a {min_output_len}-token output")
    lo, hi = token_id_range if token_id_range is not None else (0, vocab_size)
    if not 0 <= lo < hi <= vocab_size:
        raise ValueError(f"token_id_range {(lo, hi)} must lie within [0, {vocab_size})")

    end_s = math.inf if duration_s is None else start_s + duration_s
    idx = np.flatnonzero((rows.arrival_s >= start_s) & (rows.arrival_s < end_s))
    if max_requests is not None:
        idx = idx[:max_requests]
    if len(idx) == 0:
        raise ValueError(f"no request of the {kind!r} trace arrives in [{start_s}, {end_s}) s "
                         f"(it spans 0 to {rows.span_s:.0f} s)")
    arrivals = (rows.arrival_s[idx] - rows.arrival_s[idx[0]]) / speedup
    prompts = _scale(rows.prompt_lens[idx], p_scale, min_prompt_len, max_prompt_len)
    outputs = _scale(rows.output_lens[idx], o_scale, min_output_len, max_output_len)
    raw_p, raw_o = np.rint(rows.prompt_lens[idx] * p_scale), np.rint(rows.output_lens[idx] * o_scale)
    if max_model_len is not None:
        outputs = np.minimum(outputs, max_model_len - min_prompt_len)
        prompts = np.minimum(prompts, max_model_len - outputs)

    rng = np.random.default_rng(seed)
    pool = np.arange(lo, hi).astype(object)  # shared int objects: a prompt list costs 8 bytes a token
    firsts = rng.permutation(hi - lo)[: len(idx)] if len(idx) <= hi - lo else rng.integers(0, hi - lo, len(idx))
    requests = []
    for i, (t, p, o) in enumerate(zip(arrivals.tolist(), prompts.tolist(), outputs.tolist())):
        ids = rng.integers(0, hi - lo, size=p)
        ids[0] = firsts[i]
        requests.append(TraceRequest(f"{kind}-{int(idx[i])}", float(t), pool[ids].tolist(), int(o)))
    meta = dict(
        source="azure-llm-inference-2023", kind=kind, citation=AZURE_CITATION, num_requests=len(requests),
        start_s=start_s, duration_s=duration_s, max_requests=max_requests, speedup=speedup,
        length_scale=[p_scale, o_scale], max_prompt_len=max_prompt_len, max_output_len=max_output_len,
        max_model_len=max_model_len, min_prompt_len=min_prompt_len, min_output_len=min_output_len,
        vocab_size=vocab_size, token_id_range=[lo, hi], seed=seed,
        clipped_prompts=int(np.sum(prompts < raw_p)), clipped_outputs=int(np.sum(outputs < raw_o)),
    )
    return Trace(requests, meta)
