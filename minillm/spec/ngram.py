"""N-gram prompt lookup (chapter 09): guess that the text repeats itself.

Take the last n tokens of the sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`);
if they occurred earlier, propose the k tokens that followed their most recent earlier occurrence.
No model at all — and right surprisingly often on code, quotes and summaries, where the output
copies the prompt. As a proposal distribution it is one-hot (q = 1 on its guess).

`propose_one` is the rule as a search, written to be read: it scans the sequence backwards, so
each step costs time proportional to the context (a 2,000-token prompt: thousands of list
slices per step, a visible share of a batch-1 step). The engine instead keeps, per request, an
index `NgramIndex`: for each n, every n-gram that has a token after it, mapped to its latest
start. A step adds the n-grams its new tokens completed (a few dictionary writes per token) and
looks the current suffix up (one read per n), so proposing costs the same at any context length.
Tokens a request accepted never change, so the index only grows; it is dropped when the request
finishes. Both give the same guesses (tests/test_speculative.py checks it on random sequences).
"""

from __future__ import annotations

from minillm.request import Request


class NgramIndex:
    """One sequence's n-grams (n in [min_n, max_n]) that have a token after them → their latest start."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first, as the lookup tries them
        self.starts: dict[tuple[int, ...], int] = {}  # keys of different n never collide (tuple lengths differ)
        self.length = 0  # tokens seen so far

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions length-1 … len(tokens)-2 (those now followed by a token)."""
        starts = self.starts
        for end in range(max(self.length - 1, 0), len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    starts[tuple(tokens[end + 1 - n : end + 1])] = end + 1 - n
        self.length = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """`propose_one`'s answer, read from the index (`tokens` are the sequence `extend` saw)."""
        length = len(tokens)
        for n in self.sizes:
            if n < length:
                start = self.starts.get(tuple(tokens[length - n :]))
                if start is not None:
                    return tokens[start + n : start + n + k]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min
        self.indexes: dict[str, NgramIndex] = {}  # per unfinished request

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
        guesses = []
        for req, budget in zip(requests, budgets):
            if budget <= 0:
                guesses.append([])
                continue
            index = self.indexes.get(req.request_id)
            if index is None or index.length > len(req.all_token_ids):  # (a sequence never shrinks; be safe)
                index = self.indexes[req.request_id] = NgramIndex(self.min_n, self.max_n)
            tokens = req.all_token_ids
            index.extend(tokens)
            guesses.append(index.lookup(tokens, min(self.k, budget)))
        return guesses, [None] * len(requests)

    def after_verify(self, request: Request) -> None:
        """Nothing to undo: the index holds accepted tokens only."""

    def free(self, request: Request) -> None:
        self.indexes.pop(request.request_id, None)
