"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p (chapter 00); penalties (chapter 11).

The one sampling module. The worker samples a step's rows together, reading each row's parameters
from the persistent `InputBatch` (`minillm.worker.input_batch`): temperature, top-k, top-p and
min-p are gathered per row with one vectorized read each, penalties are applied to all penalized
rows at once from token counts, and an all-greedy step is one `argmax`. Random rows draw from each
request's own seeded `torch.Generator`, one `multinomial` per row: torch has no batched call with a
generator per row, and a shared generator would make what a request samples depend on the rest of
the batch. Every tensor built here lives on the logits' device (and each generator on that device
too): on a GPU, one stray CPU tensor would fail, or force a copy per step.

`filtered_probs` and `sampled_logprobs` take anything with `params` and `generator` (a
`SamplingState`: the worker's `CachedRequestState`, or a `Request` for the driver-side draft
proposer and the tests); `apply_penalties` is the penalty rule for one row, the reference the
batched form is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from minillm.request import SamplingParams

if TYPE_CHECKING:
    from minillm.worker.input_batch import CachedRequestState, InputBatch


class SamplingState(Protocol):
    """What sampling reads of a request: its parameters and its random stream (None when greedy)."""

    params: SamplingParams
    generator: torch.Generator | None

def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params) -> torch.Tensor:
    """One row [vocab]: repetition penalty over prompt + output (HF/CTRL: positive logits divided,
    negative multiplied), then frequency (× count in the output) and presence (once if present)."""
    device, vocab = logits.device, logits.shape[-1]
    out = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=device), minlength=vocab).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filtered_probs(logits: torch.Tensor, requests: Sequence[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over tokens sorted by logit, after temperature, top-k and top-p.

    Returns (probs [N, vocab] in sorted order, the sorting permutation [N, vocab]).
    """
    vocab = logits.shape[-1]
    return filter_probs(logits, [r.params.temperature for r in requests],
                        [r.params.top_k if r.params.top_k > 0 else vocab for r in requests],
                        [r.params.top_p for r in requests],
                        [r.params.min_p for r in requests] if any(r.params.min_p > 0 for r in requests) else None)


def filter_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`filtered_probs` on per-row values (lists or arrays; top_k already `vocab` where unlimited,
    min_p None when no row uses it): what `sample` calls with the input batch's arrays."""
    device = logits.device
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=device)
    sorted_logits, order = torch.sort(logits / temperature.unsqueeze(1), dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=device).unsqueeze(0)

    top_k = torch.as_tensor(top_k, device=device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.as_tensor(top_p, dtype=probs.dtype, device=device)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass *before* it
    # already reaches top_p. The first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    if min_p is not None:
        # min-p: drop tokens below min_p × the most likely token's probability (sorted: column 0).
        min_p = torch.as_tensor(min_p, dtype=probs.dtype, device=device)
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def sampled_logprobs(logits: torch.Tensor, requests: Sequence[SamplingState],
                     tokens: list[int]) -> list[list[dict] | None]:
    """Per row: [{sampled token: logprob, then the `logprobs` most likely: logprob}] of the model's
    own distribution (before temperature, as vLLM reports by default), or None if not asked for."""
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    out: list[list[dict] | None] = [None] * len(requests)
    if not wanted:
        return out
    rows = logits[wanted]
    # In the model's precision, at least float32 (a float64 engine reports float64 logprobs).
    logp = torch.log_softmax(rows if rows.dtype in (torch.float32, torch.float64) else rows.float(), dim=-1)
    k = max(requests[i].params.logprobs for i in wanted)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device)).squeeze(1)
    chosen_list = chosen.tolist()
    tops = (top_ids.tolist(), top_vals.tolist()) if k else None
    for j, i in enumerate(wanted):
        entry = {tokens[i]: chosen_list[j]}
        n = requests[i].params.logprobs
        if n and tops is not None:
            for tid, val in zip(tops[0][j][:n], tops[1][j][:n]):
                entry.setdefault(tid, val)
        out[i] = [entry]
    return out


def apply_logits_processors(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray,
                            states: list[CachedRequestState]) -> torch.Tensor:
    """Penalties and the min_tokens mask for the step's rows (a copy of `logits`, or itself)."""
    if not batch.num_penalized and not batch.num_min_tokens:
        return logits
    penalized = np.flatnonzero(batch.has_penalties[rows])
    num_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    early = np.flatnonzero(num_out < batch.min_tokens[rows])
    if not len(penalized) and not len(early):
        return logits
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    if len(penalized):
        r = rows[penalized]
        lens = batch.num_tokens[r]
        width = int(lens.max())
        tokens = torch.from_numpy(batch.token_ids[r, :width]).to(device)
        pos = torch.arange(width, device=device)[None, :]
        n_prompt = torch.from_numpy(batch.num_prompt_tokens[r]).to(device)[:, None]
        in_output = (pos >= n_prompt) & (pos < torch.from_numpy(lens).to(device)[:, None])
        seen_rows = pos < torch.from_numpy(lens).to(device)[:, None]
        sink = torch.full_like(tokens, vocab)  # masked-out positions count into an extra column
        seen = torch.zeros(len(r), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(seen_rows, tokens, sink), True)
        counts = torch.zeros(len(r), vocab + 1, dtype=logits.dtype, device=device)
        counts.scatter_add_(1, torch.where(in_output, tokens, sink), torch.ones_like(tokens, dtype=logits.dtype))
        seen, counts = seen[:, :vocab], counts[:, :vocab]
        idx = torch.from_numpy(penalized).to(device)
        out = logits.index_select(0, idx)
        rep = torch.from_numpy(batch.repetition_penalty[r]).to(device=device, dtype=logits.dtype)[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
        freq = torch.from_numpy(batch.frequency_penalty[r]).to(device=device, dtype=logits.dtype)[:, None]
        pres = torch.from_numpy(batch.presence_penalty[r]).to(device=device, dtype=logits.dtype)[:, None]
        out -= freq * counts + pres * (counts > 0).to(out.dtype)
        logits.index_copy_(0, idx, out)
    for j in early:  # rare (min_tokens): a stop token must not end the request yet
        banned = torch.tensor(states[j].stop_token_ids, device=device)
        logits[j].index_fill_(0, banned, float("-inf"))
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit, the first one on a tie (torch's and numpy's rule both).
    On a CPU numpy's vectorized argmax is used: for [64, 4096] fp32 logits it measured 22 us
    against 249 us for `torch.argmax` (one thread), a tenth of a batch-64 step's work outside the model."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray, states: list[CachedRequestState]) -> list[int]:
    """One next token per row of `logits` [N, vocab]; row i is input-batch row `rows[i]`."""
    logits = apply_logits_processors(logits, batch, rows, states)
    greedy_tokens = argmax_rows(logits)
    if not batch.num_random:
        return greedy_tokens.tolist()
    random_rows = np.flatnonzero(~batch.greedy[rows])
    if not len(random_rows):
        return greedy_tokens.tolist()
    r = rows[random_rows]
    vocab = logits.shape[-1]
    top_k = np.where(batch.top_k[r] > 0, batch.top_k[r], vocab)
    min_p = batch.min_p[r] if (batch.min_p[r] > 0).any() else None
    idx = torch.from_numpy(random_rows).to(logits.device)
    probs, order = filter_probs(logits.index_select(0, idx).float(), batch.temperature[r], top_k, batch.top_p[r], min_p)
    picks = [torch.multinomial(probs[j], 1, generator=states[i].generator) for j, i in enumerate(random_rows)]
    chosen = order.gather(1, torch.stack(picks)).squeeze(1)
    return greedy_tokens.index_copy(0, idx, chosen).tolist()  # the step's one device → host copy
