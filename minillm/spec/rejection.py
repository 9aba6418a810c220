"""The rejection sampler of speculative decoding (Leviathan et al. 2023; chapter 09).

For draft tokens d_1 … d_k proposed with probabilities q_i(·) and the target's p_i(·) at the same
positions (after temperature, top-k and top-p — the distribution the target would sample from):

    for i = 1 … k:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
                    on the first rejection, emit a token drawn from normalize(max(0, p_i − q_i)); stop
    all accepted:   emit a bonus token drawn from p_{k+1}

Every emitted token is distributed exactly as the target alone would have sampled it. Greedy
requests accept while d_i equals the target's argmax and emit the argmax where it differs. A
proposer without a distribution (n-gram lookup) counts as q one-hot on its guess. Each request's
random numbers come from its own generator, so batching never changes what a request gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minillm.sampling import SamplingState, filtered_probs

if TYPE_CHECKING:  # (the worker imports this module: a runtime import back would be a circle)
    from minillm.worker.input_batch import CachedRequestState


def target_probs(logits: torch.Tensor, request: SamplingState) -> torch.Tensor:
    """[n, vocab] probabilities in vocabulary order after the request's temperature/top-k/top-p
    (`request`: the worker's `CachedRequestState`, or a `Request` for the driver-side draft proposer)."""
    probs, order = filtered_probs(logits.float(), [request] * logits.shape[0])
    return torch.zeros_like(probs).scatter_(1, order, probs)


def greedy_accept(draft: list[int], best: list[int]) -> list[int]:
    """A greedy request's tokens to emit, from the target's argmax at the pending token and at each
    guess (`best`, k+1 of them): the guesses up to the first that is not the argmax, then the argmax there
    (or, all accepted, the bonus token)."""
    for i, guess in enumerate(draft):
        if guess != best[i]:
            return list(draft[:i]) + [best[i]]
    return list(draft) + [best[len(draft)]]


def rejection_sample(request: CachedRequestState, logits: torch.Tensor, draft: list[int],
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens to emit (1 … k+1) for one request (the worker's state of it: its parameters and random
    stream): `logits` [k+1, vocab] are the target's at the pending token and at each draft token;
    `draft_probs` [k, vocab] the proposer's q (None: one-hot)."""
    k = len(draft)
    if request.params.greedy:
        return greedy_accept(draft, logits.argmax(dim=-1).tolist())
    p = target_probs(logits, request)
    gen = request.generator
    out: list[int] = []
    for i in range(k):
        d = draft[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[i, d])
        u = float(torch.rand((), generator=gen, device=gen.device))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i].to(p.device)).clamp(min=0.0)
        total = residual.sum()
        residual = p[i] if float(total) <= 0 else residual / total  # p == q exactly: any draw from p is right
        return out + [int(torch.multinomial(residual, 1, generator=gen))]
    return out + [int(torch.multinomial(p[k], 1, generator=gen))]
