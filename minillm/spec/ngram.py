"""N-gram prompt lookup (chapter 09): guess that the text repeats itself.

Take the last n tokens of the sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`);
if they occurred earlier, propose the k tokens that followed their most recent earlier occurrence.
Free to compute, no model at all — and right surprisingly often on code, quotes and summaries,
where the output copies the prompt. As a proposal distribution it is one-hot (q = 1 on its guess).
"""

from __future__ import annotations

from minillm.request import Request


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose_one(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        k = self.k if k is None else k
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # latest earlier start i < length - n with tokens[i:i+n] == suffix
            for i in range(length - n - 1, -1, -1):
                if tokens[i : i + n] == suffix:
                    return tokens[i + n : i + n + k]
        return []

    def propose(self, requests: list[Request], budgets: list[int]) -> tuple[list[list[int]], list[None]]:
        """Per request, at most `budgets[i]` proposed tokens (its room before max_tokens / max_model_len),
        and no distribution: n-gram guesses are one-hot (the rejection test uses q = 1)."""
        guesses = [self.propose_one(r.all_token_ids, min(self.k, b)) if b > 0 else [] for r, b in zip(requests, budgets)]
        return guesses, [None] * len(requests)

    def after_verify(self, request: Request) -> None:
        """No per-request state."""

    def free(self, request: Request) -> None:
        """No per-request state."""
