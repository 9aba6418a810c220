"""A draft model as proposer, run by one compiled loop per request (chapter 09).

The same proposer as `minillm.spec.draft.DraftModelProposer` — a small model of the same
tokenizer guesses k tokens, greedy guesses for greedy requests and samples from the draft's own
distribution q for the others — but the draft's passes do not go through the engine's machinery
(a plan, an input batch, a step layout, a paged pool, ~40 torch ops a pass). Each request keeps a
contiguous K/V cache of its own, and `minillm.spec.draft_kernel.draft_decode` does the catch-up and
all k greedy guesses in one call. A sampled request calls it once per guess (its random draw
happens in torch, from a generator of the draft's own, as the engine path does it).

Bookkeeping per step is O(k), not O(context): after the target's verdict, only the guesses this
proposer fed are compared with what the target kept; the tokens before them were already the
target's. `LLM` picks this proposer when the draft qualifies (`draft_kernel.supports`).

A long catch-up (a new prompt) is the one place where one token at a time loses: the loop's
per-token matrix-vector products cannot share a weight read between tokens. So a request's first
`BATCHED_CATCH_UP` tokens and more go through the draft model's own batched forward
(`LlamaModel.forward` with `ContiguousAttention`, which writes their K/V into the same cache), and
only the last one through the loop, which then guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minillm.model.llama import LlamaModel
from minillm.request import Request, derive_seed
from minillm.spec.draft_kernel import DraftWeights
from minillm.spec.rejection import target_probs

# Catch-ups this long or longer run the batched forward (all tokens but the last). Measured on the bundled
# draft (a catch-up from position 0, median of 7, one process): 16 tokens batched 851-1,046 µs, the loop
# 252-260; 64: 1,095-1,199 vs 838-928; 100: 1,455-1,579 vs 1,392-1,551; 200: 2,521-2,534 vs 3,182-3,715
# (the batched forward's fixed cost is ~0.8 ms of torch ops; the loop's cost per token grows with the context).
BATCHED_CATCH_UP = 96


class ContiguousAttention:
    """The attention `LlamaModel.forward` calls, over one sequence's contiguous cache: tokens at
    positions start … start+T-1 write their K/V there and attend causally to everything before."""

    def __init__(self, k_cache: np.ndarray, v_cache: np.ndarray, start: int) -> None:
        self.k_cache, self.v_cache = torch.from_numpy(k_cache), torch.from_numpy(v_cache)  # shared memory
        self.start = start

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.k_cache[layer, self.start : end] = k
        self.v_cache[layer, self.start : end] = v
        # [1, heads, tokens, D]: with a leading batch dimension PyTorch picks its fused CPU kernel
        # (without it, SDPA over a 1,000-token prompt took as long as the target's whole prefill)
        queries = q.transpose(0, 1)[None]
        keys, values = self.k_cache[None, layer, :end].transpose(1, 2), self.v_cache[None, layer, :end].transpose(1, 2)
        if self.start == 0:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        else:  # query i at position start + i sees keys 0 … start + i
            mask = torch.ones(q.shape[0], end, dtype=torch.bool).tril(diagonal=self.start)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)


@dataclass
class DraftState:
    """One request's draft: its K/V cache and which of its tokens that cache holds."""

    k_cache: np.ndarray
    v_cache: np.ndarray
    computed: int = 0  # the request's first `computed` tokens are in the cache
    fed: list[int] = field(default_factory=list)  # guesses fed after them (positions computed, computed+1, …)
    generator: torch.Generator | None = None  # sampled requests: the draft's own random stream


class CompiledDraftProposer:
    def __init__(self, model: LlamaModel, num_speculative_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.weights = DraftWeights.from_model(model)
        self.states: dict[str, DraftState] = {}
        self._guesses = np.zeros(num_speculative_tokens, dtype=np.int64)
        self._logits = np.zeros(self.weights.head.shape[0], dtype=self.weights.head.dtype)
        k_cache, v_cache = self.weights.new_cache(2)  # compile (or load from numba's cache) now, not mid-request
        self.weights.decode(k_cache, v_cache, np.zeros(1, np.int64), 0, 1, self._guesses, self._logits)

    def _state_of(self, req: Request, length: int) -> DraftState:
        state = self.states.get(req.request_id)
        if state is None:
            state = DraftState(*self.weights.new_cache(min(max(64, 2 * length), self.max_model_len)))
            if not req.params.greedy:
                seed = derive_seed(req.params.seed, "draft") if req.params.seed is not None \
                    else derive_seed(0, "draft:" + req.request_id)
                state.generator = torch.Generator().manual_seed(seed)
            self.states[req.request_id] = state
        elif state.k_cache.shape[1] < length:  # grow by doubling, up to max_model_len
            capacity = min(max(length, 2 * state.k_cache.shape[1]), self.max_model_len)
            k_cache, v_cache = self.weights.new_cache(capacity)
            k_cache[:, : state.computed] = state.k_cache[:, : state.computed]
            v_cache[:, : state.computed] = state.v_cache[:, : state.computed]
            state.k_cache, state.v_cache = k_cache, v_cache
        return state

    def propose(self, requests: list[Request], budgets: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per request at most `budgets[i]` guesses, and their draft distributions q [n, vocab]
        (None for greedy requests: the test compares with the target's argmax)."""
        guesses, dists = [], []
        for req, budget in zip(requests, budgets):
            k = min(self.k, budget)
            tokens = req.all_token_ids
            if k <= 0 or len(tokens) + k - 1 > self.max_model_len:
                guesses.append([])
                dists.append(None)
                continue
            state = self._state_of(req, len(tokens) + k - 1)
            feed = np.asarray(tokens[state.computed :], dtype=np.int64)  # what the target accepted since last time
            start, state.computed = state.computed, len(tokens)
            if len(feed) >= BATCHED_CATCH_UP:  # all but the last token in one batched forward
                self._batched_forward(state, feed[:-1], start)
                start, feed = start + len(feed) - 1, feed[-1:]
            if req.params.greedy:
                self.weights.decode(state.k_cache, state.v_cache, feed, start, k, self._guesses, self._logits)
                out = self._guesses[:k].tolist()
                guesses.append(out)
                dists.append(None)
            else:
                out, q = self._sample(req, state, feed, start, k)
                guesses.append(out)
                dists.append(q)
            state.fed = out[:-1]  # the last guess was never fed
        return guesses, dists

    def _batched_forward(self, state: DraftState, feed: np.ndarray, start: int) -> None:
        """K/V of `feed` (positions start, …) into the cache; nothing else is kept."""
        ids = torch.from_numpy(feed)
        positions = torch.arange(start, start + len(feed))
        attention = ContiguousAttention(state.k_cache, state.v_cache, start)
        self.model.forward(ids, positions, attention, output_rows=torch.tensor([len(feed) - 1]))

    def _sample(self, req: Request, state: DraftState, feed: np.ndarray, start: int, k: int):
        out, qs = [], []
        for _ in range(k):
            self.weights.decode(state.k_cache, state.v_cache, feed, start, 1, self._guesses, self._logits)
            q = target_probs(torch.from_numpy(self._logits)[None], req)[0]
            token = int(torch.multinomial(q, 1, generator=state.generator))
            out.append(token)
            qs.append(q)
            start += len(feed)
            feed = np.array([token], dtype=np.int64)
        return out, torch.stack(qs)

    def after_verify(self, req: Request) -> None:
        """The target kept `req.all_token_ids`: the cache stays valid up to the first guess it did not keep."""
        state = self.states.get(req.request_id)
        if state is None or not state.fed:
            return
        tokens, base = req.all_token_ids, state.computed
        kept = 0
        for guess in state.fed:  # (the newest token is never counted: feeding it gives the next guess)
            if base + kept >= len(tokens) - 1 or tokens[base + kept] != guess:
                break
            kept += 1
        state.computed, state.fed = base + kept, []

    def free(self, req: Request) -> None:
        self.states.pop(req.request_id, None)
