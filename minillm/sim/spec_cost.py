"""Speculative decoding on the simulator (chapter 09): what guessing costs, and how many guesses survive.

A speculative step has two parts. First the proposer guesses up to k tokens per running request:

  * a draft model runs k one-token forward passes of its own (the k-th guess needs the (k−1)-th),
    each over the whole batch of requests still guessing, so its cost is k draft decode steps of
    the roofline model (`draft_time_s`); the first pass also catches up on the tokens the target
    accepted last step, which at decode sizes costs what a one-token pass costs;
  * n-gram prompt lookup is a string search on the host: no forward pass, ≈ free (0 s here).

Then the target verifies all guesses in one forward pass: a request's row holds 1 + k query tokens
after its cached context, which `SimExecutor` already costs as a small prefill — the verification
cost. While decode is memory-bound those extra query tokens ride along with the weight reads
almost for free; as the batch grows the step moves toward the compute roof and they stop being free.
(One simplification: `step_time` charges the lm_head once per row, while a verification row needs
logits at all 1 + k positions; for a 7B model that is about 2 % of a token's FLOPs per guess.)

How many guesses survive is the trace's business, not the simulated model's (it has no text).
`SimSpeculativeProposer` draws it: guess i is accepted with probability α_i given that guesses
1 … i−1 were (one α for every position, or a measured α per position), so with a constant α the
expected tokens emitted per verification row are (1 − α^{k+1}) / (1 − α) (Leviathan et al. 2023,
`expected_tokens_per_step`). Accepted guesses are the simulated model's own token, the first
rejected one is a different token, and the engine's rejection test (greedy: argmax match) and
rollback (`trim`) do the rest exactly as in a real run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.request import Request
from minillm.sim.cost_model import step_time
from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape, get_model_shape

# Draft shapes for a Llama-2-7B target (same 32000-token vocabulary), from their published config.json:
# LLaMA-68M (Miao et al. 2024, SpecInfer; https://huggingface.co/JackFram/llama-68m) and
# TinyLlama-1.1B (Zhang et al. 2024; https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0).
LLAMA_68M = ModelShape("llama-68m", 2, 768, 12, 12, 64, 3072, 32000)
TINYLLAMA_1B = ModelShape("tinyllama-1.1b", 22, 2048, 32, 4, 64, 5632, 32000)
DRAFT_PRESETS: dict[str, ModelShape] = {m.name: m for m in (LLAMA_68M, TINYLLAMA_1B)}


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one verification row emits when each of k guesses is accepted with
    probability α independently (stopping at the first rejection), the bonus/correction token
    included: 1 + α + α² + … + α^k = (1 − α^{k+1}) / (1 − α)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is an acceptance probability in [0, 1], got {alpha!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (num_speculative_tokens) must be an integer >= 0, got {k!r}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_time_s(hw: Hardware, draft: ModelShape | None, context_lens: Sequence[int],
                 num_guesses: Sequence[int]) -> float:
    """Time the proposer spends guessing for one step.

    context_lens[i]: request i's context before its first guess (its pending token included);
    num_guesses[i]: how many tokens it guesses. The draft's j-th pass (j = 0 … max−1) is one
    decode step over every request that still wants a j-th guess, each reading context + j keys.
    `draft=None` is n-gram lookup: no forward pass, 0 s.
    """
    if len(context_lens) != len(num_guesses):
        raise ValueError("draft_time_s needs one context length per entry of num_guesses")
    if draft is None:
        return 0.0
    total = 0.0
    for j in range(max(num_guesses, default=0)):
        lens = [c + j for c, g in zip(context_lens, num_guesses) if g > j]
        total += step_time(hw, draft, decode_context_lens=lens).time_s
    return total


class SimSpeculativeProposer:
    """A proposer for the simulator whose guesses are accepted with a chosen probability.

    alpha: the acceptance probability of every position, or one per position (position i's
        probability of being accepted given that the ones before it were; positions past the list
        reuse its last entry). Chapter 09 feeds it the α measured on the tiny engine.
    token_id: the token the simulated model always emits (`SimExecutor.token_id`): an accepted guess
        is that token; reject_token_id: any other token, for the first rejected guess.
    seed: acceptance draws come from one generator per (seed, request id), so a request's luck does
        not depend on what else is in the batch.
    """

    def __init__(self, num_speculative_tokens: int, alpha: float | Sequence[float], token_id: int,
                 reject_token_id: int, seed: int = 0) -> None:
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        alphas = [alpha] if isinstance(alpha, (int, float)) else list(alpha)
        if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
            raise ValueError(f"alpha must be a probability in [0, 1] or a non-empty list of them, got {alpha!r}")
        if token_id == reject_token_id:
            raise ValueError("reject_token_id must differ from token_id, or rejected guesses would be accepted")
        self.k = num_speculative_tokens
        self.alphas = alphas
        self.token_id, self.reject_token_id = token_id, reject_token_id
        self.seed = seed
        self._rngs: dict[str, random.Random] = {}

    def _alpha(self, position: int) -> float:
        return self.alphas[min(position, len(self.alphas) - 1)]

    def _rng(self, request_id: str) -> random.Random:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = random.Random(f"{self.seed}:{request_id}")
        return rng

    def propose(self, requests: list[Request], budgets: list[int]) -> tuple[list[list[int]], list[None]]:
        """Per request min(k, budget) guesses: accepted ones (the model's token) until the first draw
        that fails, then one it will reject, then filler that is never looked at."""
        guesses = []
        for req, budget in zip(requests, budgets):
            n = min(self.k, budget)
            rng = self._rng(req.request_id)
            accepted = 0
            while accepted < n and rng.random() < self._alpha(accepted):
                accepted += 1
            guesses.append([self.token_id] * accepted + [self.reject_token_id] * (n - accepted))
        return guesses, [None] * len(requests)

    def after_verify(self, request: Request) -> None:
        """No state to roll back: acceptance is drawn fresh each step."""

    def free(self, request: Request) -> None:
        self._rngs.pop(request.request_id, None)


@dataclass(frozen=True)
class SimSpeculation:
    """Speculative decoding for `simulate(..., speculation=SimSpeculation(...))`.

    num_speculative_tokens: k, guesses per row; alpha: acceptance per position (see
    `SimSpeculativeProposer`); draft: the draft model's shape (a `ModelShape`, or a name from
    `DRAFT_PRESETS` or the model presets),
    or None for n-gram lookup (no forward pass); seed: the acceptance draws' seed.
    """

    num_speculative_tokens: int
    alpha: float | tuple[float, ...]
    draft: ModelShape | str | None = None
    seed: int = 0

    @property
    def draft_shape(self) -> ModelShape | None:
        if isinstance(self.draft, str):
            return DRAFT_PRESETS[self.draft] if self.draft in DRAFT_PRESETS else get_model_shape(self.draft)
        return self.draft

    def proposer(self, token_id: int, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> SimSpeculativeProposer:
        """The proposer for a simulated model that always emits `token_id`."""
        taken = {token_id, *eos_token_ids}
        reject = next(t for t in range(vocab_size) if t not in taken)
        alpha = self.alpha if isinstance(self.alpha, (int, float)) else list(self.alpha)
        return SimSpeculativeProposer(self.num_speculative_tokens, alpha, token_id, reject, self.seed)
