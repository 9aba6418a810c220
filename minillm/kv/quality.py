"""What squeezing the KV cache costs in quality, measured through the engine (chapter 14).

Each row of the table is one engine configuration, given as `LLM` keyword arguments — exact caching
(`{}`), eviction (`{"kv_eviction": {"policy": "h2o", "budget_tokens": 64}}`), a quantized KV pool
(`{"kv_cache_dtype": "int8"}`, minillm.kv.quant), or both — and is compared with the first row,
the reference. On held-out text the bundled models never trained on (data/heldout/, every 50th
chapter of the corpus, tools/export_heldout.py), per row:

- perplexity, teacher-forced: a short prompt is prefilled, then the text's next tokens are fed one
  decode step at a time through the engine's own step (plan, the worker's KV pool and attention,
  eviction included), so every token after the first is predicted from what the cache kept;
- the largest difference between the row's and the reference's logprob of the same held-out token;
- greedy agreement: from the same prompts, `num_greedy_tokens` greedy tokens each, the share equal to
  the reference's at the same position, and where the first difference came (mean over prompts).

The same table on a tiny random model in float64 (`random_control_model`) is the control: there the
reference agrees with itself to ~1e-15, so whatever a row loses is its own doing, not float32 noise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.kv.simulated_quant import simulate_kv_dtype
from minillm.request import SamplingParams
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.output import SchedulerOutput

HELDOUT_PATH = Path(__file__).resolve().parents[2] / "data" / "heldout" / "kjv_heldout.jsonl"


@dataclass(frozen=True)
class QualityRow:
    """One configuration: a name for the table and the `LLM` keyword arguments that make it."""

    name: str
    knobs: dict[str, Any] = field(default_factory=dict)
    # K/V rounded through "int8" or "fp8_e4m3" as written (minillm.kv.simulated_quant; needs the torch
    # backend): a stand-in for an engine without `kv_cache_dtype`, labelled as simulated in the name
    simulated_kv_dtype: str | None = None


@dataclass
class QualityResult:
    name: str
    knobs: dict[str, Any]
    perplexity: float
    max_logprob_diff: float  # vs the reference row, over every scored held-out token
    greedy_agreement: float  # share of greedy tokens equal to the reference's at the same position
    first_divergence: float  # mean index of the first greedy token that differs (num_greedy_tokens if none)
    tokens_scored: int
    logprobs: list[list[float]] = field(repr=False, default_factory=list)  # per text, per scored token
    greedy: list[list[int]] = field(repr=False, default_factory=list)


def heldout_token_ids(tokenizer: Any, num_texts: int, tokens_per_text: int, path: Path = HELDOUT_PATH) -> list[list[int]]:
    """The first `tokens_per_text` tokens of the first `num_texts` held-out chapters long enough to give them."""
    texts = []
    for line in path.read_text().splitlines():
        ids = list(tokenizer(json.loads(line)["text"]).input_ids)
        if len(ids) >= tokens_per_text:
            texts.append(ids[:tokens_per_text])
        if len(texts) == num_texts:
            return texts
    raise ValueError(f"only {len(texts)} held-out chapters in {path} have {tokens_per_text} tokens; "
                     f"ask for fewer texts or shorter ones")


class _TeacherForcing:
    """Stands in for the worker while a row is scored: the same step (plan → `update_state` →
    `compute_logits`: the row's attention, eviction, KV pool), then records the held-out token's
    logprob and feeds that token instead of a sampled one."""

    def __init__(self, worker: Any, targets: dict[str, list[int]]) -> None:
        self.worker = worker
        self.targets = targets  # request id -> the tokens to feed, in order
        self.logprobs: dict[str, list[float]] = {rid: [] for rid in targets}

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if plan.padded is not None or plan.spec_token_ids:
            raise ValueError("the quality harness scores continuous batching without speculative decoding")
        self.worker.update_state(plan)
        logits, inputs = self.worker.compute_logits(plan)
        logp = torch.log_softmax(logits.double(), dim=-1)
        out: list[list[int]] = [[] for _ in plan.req_ids]
        for j, i in enumerate(inputs.sampled):
            rid = plan.req_ids[i]
            scored = self.logprobs[rid]
            token = self.targets[rid][len(scored)]
            scored.append(float(logp[j, token]))
            out[i] = [token]
        return ModelRunnerOutput(out)

    def __getattr__(self, name: str) -> Any:  # stats, model, … : the worker's own
        return getattr(self.worker, name)


def _score(llm: Any, texts: list[list[int]], prompt_tokens: int) -> list[list[float]]:
    engine = llm.engine
    worker = engine.executor.worker
    params = SamplingParams(max_tokens=len(texts[0]) - prompt_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request({"prompt_token_ids": t[:prompt_tokens]}, params) for t in texts]
    forcing = _TeacherForcing(worker, {r.request_id: t[prompt_tokens:] for r, t in zip(requests, texts)})
    engine.executor.worker = forcing
    try:
        engine.expect_more_requests = False
        if not engine.run_until_done():
            raise RuntimeError("the quality harness's requests did not finish: is the KV pool too small for them?")
    finally:
        engine.expect_more_requests = True
        engine.executor.worker = worker
    return [forcing.logprobs[r.request_id] for r in requests]


def _greedy(llm: Any, texts: list[list[int]], prompt_tokens: int, num_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": t[:prompt_tokens]} for t in texts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def measure_quality(rows: Sequence[QualityRow], texts: list[list[int]], *, make_llm: Any, prompt_tokens: int = 16,
                    num_greedy_tokens: int = 64) -> list[QualityResult]:
    """Score every row on `texts` (token ids; the first `prompt_tokens` of each are its prompt); the first row
    is the reference. `make_llm(**knobs)` builds the engine of a row (e.g. `lambda **k: LLM(**k)`)."""
    if not rows:
        raise ValueError("measure_quality needs at least one row (the first is the reference)")
    if not texts or min(len(t) for t in texts) <= prompt_tokens or len({len(t) for t in texts}) != 1:
        raise ValueError(f"texts must be equally long and longer than prompt_tokens={prompt_tokens}")
    results: list[QualityResult] = []
    for row in rows:
        llm = make_llm(**row.knobs)
        if row.simulated_kv_dtype is not None:
            simulate_kv_dtype(llm, row.simulated_kv_dtype)
        logprobs = _score(llm, texts, prompt_tokens)
        greedy = _greedy(llm, texts, prompt_tokens, num_greedy_tokens)
        flat = [lp for per_text in logprobs for lp in per_text]
        ref = results[0] if results else None
        diff = 0.0 if ref is None else max(abs(a - b) for a, b in zip(flat, (x for t in ref.logprobs for x in t)))
        agree, first = _agreement(greedy, greedy if ref is None else ref.greedy)
        results.append(QualityResult(row.name, dict(row.knobs), math.exp(-sum(flat) / len(flat)), diff, agree, first,
                                     len(flat), logprobs, greedy))
    return results


def _agreement(greedy: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    same = total = 0
    firsts = []
    for mine, theirs in zip(greedy, reference):
        equal = [a == b for a, b in zip(mine, theirs)]
        same, total = same + sum(equal), total + len(equal)
        firsts.append(equal.index(False) if False in equal else len(equal))
    return same / total, sum(firsts) / len(firsts)


def format_table(results: Sequence[QualityResult], title: str = "") -> str:
    """The table a chapter prints: one line per row, the reference first."""
    head = f"{'configuration':<28} {'perplexity':>10} {'max |dlogp|':>12} {'greedy agree':>12} {'1st diff':>8}"
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.name:<28} {r.perplexity:>10.3f} {r.max_logprob_diff:>12.2e} {r.greedy_agreement:>12.3f} "
                     f"{r.first_divergence:>8.1f}")
    return "\n".join(lines)


def random_control_model(vocab_size: int = 4096, seed: int = 0) -> Any:
    """A tiny random Llama in float64 (transformers), the control: float64 leaves no rounding near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(config).to(torch.float64).eval()
