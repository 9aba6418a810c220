"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p (chapter 00); penalties (chapter 11).

All rows of a step are sampled together, but each request draws its random numbers from its own
seeded `torch.Generator`, so what a request generates never depends on what else is in the batch.
Every tensor built here lives on the logits' device (and each generator on that device too):
on a GPU, one stray CPU tensor would fail, or force a copy per step.
"""

from __future__ import annotations

import torch

from minillm.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One next token per row of `logits` [N, vocab]; row i belongs to requests[i].

    `logits` is not changed (logprobs are reported from the model's own distribution): penalties
    and the min_tokens mask work on a copy."""
    logits = apply_logits_processors(logits, requests)
    greedy_tokens = logits.argmax(dim=-1)
    if all(r.params.greedy for r in requests):
        return greedy_tokens.tolist()
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    probs, order = filtered_probs(logits[rows].float(), [requests[i] for i in rows])
    picks = [torch.multinomial(probs[j], 1, generator=requests[i].generator) for j, i in enumerate(rows)]
    chosen = order.gather(1, torch.stack(picks)).squeeze(1)  # [len(rows)], still on the device
    tokens = greedy_tokens.index_copy(0, torch.tensor(rows, device=logits.device), chosen)
    return tokens.tolist()  # the step's one device → host copy


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Penalties and the min_tokens mask, on a copy of the rows that need them (else `logits` itself)."""
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties or r.num_output_tokens < r.params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        req = requests[i]
        if req.params.has_penalties:
            logits[i] = apply_penalties(logits[i], req.prompt_token_ids, req.output_token_ids, req.params)
        if req.num_output_tokens < req.params.min_tokens and req.stop_token_ids:
            banned = torch.tensor(sorted(req.stop_token_ids), device=logits.device)
            logits[i].index_fill_(0, banned, float("-inf"))
    return logits


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


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
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
    min_p None when no row uses it): what the worker's batched sampler calls."""
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


def sampled_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[list[dict] | None]:
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
