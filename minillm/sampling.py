"""Turning logits into tokens: greedy, temperature, top-k, top-p (chapter 00).

All rows of a step are sampled together, but each request draws its random numbers from its own
seeded `torch.Generator`, so what a request generates never depends on what else is in the batch.
"""

from __future__ import annotations

import torch

from minillm.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One next token per row of `logits` [N, vocab]; row i belongs to requests[i]."""
    greedy_tokens = logits.argmax(dim=-1)
    if all(r.params.greedy for r in requests):
        return greedy_tokens.tolist()
    tokens = greedy_tokens.tolist()
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    probs, order = filtered_probs(logits[rows].float(), [requests[i] for i in rows])
    for j, i in enumerate(rows):
        pick = torch.multinomial(probs[j], 1, generator=requests[i].generator)
        tokens[i] = int(order[j, pick])
    return tokens


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over tokens sorted by logit, after temperature, top-k and top-p.

    Returns (probs [N, vocab] in sorted order, the sorting permutation [N, vocab]).
    """
    temperature = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    sorted_logits, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab)[None, :]

    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in requests])
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=probs.dtype)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass *before* it
    # already reaches top_p. The first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order
