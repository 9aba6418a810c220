"""KV eviction: keep a per-sequence budget of tokens, drop the rest from attention (chapter 14).

Exact caching keeps every token's K and V until the request ends. Eviction keeps at most
`budget_tokens` of them per sequence and lets attention forget the others, trading quality for a
bound on memory. Two policies from the literature:

- "streaming" (StreamingLLM, Xiao et al., 2023, "Efficient Streaming Language Models with Attention
  Sinks"): the first `num_sinks` tokens (the "attention sinks" that soak up probability mass) plus
  the most recent `budget_tokens - num_sinks`. Its keep-set is a function of the length alone.
- "h2o" (H2O, Zhang et al., 2023, "Heavy-Hitter Oracle"): the most recent `num_recent` tokens plus
  the "heavy hitters": the tokens with the largest attention probability accumulated so far. It needs
  the attention probabilities each kept token received, which `EvictingAttention`
  (minillm.attention.evicting) adds to `EvictionTracker.scores` at every layer.

Where minillm applies it, and what it simplifies (say so when you quote a number):
- Decode steps attend to the kept set only; prompt rows (a prefill, a chunk, a recompute) attend
  exactly, as both papers let the prompt see itself before generation evicts.
- One keep-set per sequence, shared by every layer and head (H2O's paper keeps one per head; a set
  shared by the layers is what could free whole slots). Scores sum over layers, heads and queries.
- Evicted tokens are masked out of attention; their slots stay allocated (the chapter counts the
  memory a budget would free, the pool does not shrink). Nothing here is exact by design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

EVICTION_POLICIES = ("streaming", "h2o")


@dataclass(frozen=True)
class KVEvictionConfig:
    """`LLM(kv_eviction={"policy": "streaming", "budget_tokens": 64})`: a per-sequence token budget.

    `num_sinks` (streaming): the first tokens always kept. `num_recent` (h2o): the recent window;
    the rest of the budget goes to heavy hitters (default: half the budget, as H2O's paper splits it).
    """

    policy: str
    budget_tokens: int
    num_sinks: int = 4
    num_recent: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction policy={self.policy!r}; choose one of {EVICTION_POLICIES}")
        _require_int("kv_eviction budget_tokens", self.budget_tokens, 2)
        _require_int("kv_eviction num_sinks", self.num_sinks, 0)
        if self.policy == "streaming" and self.num_sinks >= self.budget_tokens:
            raise ValueError(f"kv_eviction num_sinks={self.num_sinks} leaves no recent window in budget_tokens="
                             f"{self.budget_tokens}: use num_sinks < budget_tokens")
        if self.num_recent is not None:
            _require_int("kv_eviction num_recent", self.num_recent, 1)
            if self.num_recent > self.budget_tokens:
                raise ValueError(f"kv_eviction num_recent={self.num_recent} exceeds budget_tokens={self.budget_tokens}")

    @property
    def recent_tokens(self) -> int:
        """H2O's recent window (at least 1: the token being decoded is always seen)."""
        return self.num_recent if self.num_recent is not None else max(1, self.budget_tokens // 2)

    @classmethod
    def parse(cls, value: Any) -> KVEvictionConfig:
        """A KVEvictionConfig from itself or its dict (the keys of its fields)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_eviction must be a dict such as {{'policy': 'streaming', 'budget_tokens': 64}} "
                             f"(or None for exact caching), got {value!r}")
        known = {"policy", "budget_tokens", "num_sinks", "num_recent"}
        unknown = sorted(set(value) - known)
        if unknown or "policy" not in value or "budget_tokens" not in value:
            raise ValueError(f"kv_eviction={value!r}: needs 'policy' and 'budget_tokens', may have 'num_sinks' "
                             f"(streaming) and 'num_recent' (h2o); unknown keys: {unknown}")
        return cls(**value)


def streaming_keep_positions(seq_len: int, budget_tokens: int, num_sinks: int) -> np.ndarray:
    """StreamingLLM's keep-set of a sequence of `seq_len` tokens: sinks, then the recent window."""
    if not 0 <= num_sinks < budget_tokens:
        raise ValueError(f"num_sinks={num_sinks} must be >= 0 and leave room for a recent window in "
                         f"budget_tokens={budget_tokens}")
    if seq_len <= budget_tokens:
        return np.arange(seq_len)
    recent = budget_tokens - num_sinks
    return np.concatenate([np.arange(num_sinks), np.arange(seq_len - recent, seq_len)])


def h2o_keep_positions(kept: np.ndarray, scores: np.ndarray, budget_tokens: int, recent_tokens: int) -> np.ndarray:
    """H2O's keep-set among the positions still `kept` (bool [L]): the last `recent_tokens` of them, then the
    highest accumulated `scores` [L] among the others until `budget_tokens` (ties: the earlier position)."""
    alive = np.flatnonzero(kept)
    if len(alive) <= budget_tokens:
        return alive
    recent, older = alive[len(alive) - recent_tokens :], alive[: len(alive) - recent_tokens]
    # a stable sort on -score keeps the earlier position first among equal scores
    heavy = older[np.argsort(-scores[older], kind="stable")[: budget_tokens - recent_tokens]]
    return np.sort(np.concatenate([heavy, recent]))


@dataclass
class _SequenceState:
    kept: np.ndarray  # bool [length]: still attended
    scores: np.ndarray  # float64 [length]: attention probability received (h2o)


class EvictionTracker:
    """Per request: which of its positions decode still attends to, and (h2o) their accumulated scores.
    Lives in the worker, keyed by request id; `forget` when the request finishes. `streaming_keep`: the
    function that gives StreamingLLM's keep-set (exercise 14 plugs the learner's in here)."""

    def __init__(self, config: KVEvictionConfig,
                 streaming_keep: Callable[[int, int, int], Any] = streaming_keep_positions) -> None:
        self.config = config
        self.streaming_keep = streaming_keep
        self.states: dict[str, _SequenceState] = {}
        self.evicted_tokens = 0  # over the tracker's life: positions dropped from attention

    @property
    def needs_scores(self) -> bool:
        return self.config.policy == "h2o"

    def keep_mask(self, req_id: str, seq_len: int) -> np.ndarray:
        """Bool [seq_len]: the positions a decode row of `seq_len` tokens (its new one last) attends to,
        evicting down to the budget first. Evicted positions never come back."""
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = _SequenceState(np.ones(0, dtype=bool), np.zeros(0))
        grow = seq_len - len(state.kept)
        if grow > 0:  # positions computed since the last call (a prompt, a decoded token): kept, unscored
            state.kept = np.concatenate([state.kept, np.ones(grow, dtype=bool)])
            state.scores = np.concatenate([state.scores, np.zeros(grow)])
        kept = state.kept[:seq_len]
        cfg = self.config
        if int(kept.sum()) > cfg.budget_tokens:
            if cfg.policy == "streaming":
                survivors = np.asarray(self.streaming_keep(seq_len, cfg.budget_tokens, cfg.num_sinks), dtype=np.int64)
            else:
                survivors = h2o_keep_positions(kept, state.scores[:seq_len], cfg.budget_tokens, cfg.recent_tokens)
            new = np.zeros(seq_len, dtype=bool)
            new[survivors] = True
            new &= kept  # (streaming's set only shrinks; never revive a position)
            self.evicted_tokens += int(kept.sum() - new.sum())
            state.kept[:seq_len] = new
        return state.kept[:seq_len]

    def add_scores(self, req_id: str, mass: np.ndarray) -> None:
        """Add attention probability mass [n] received by positions 0 … n-1 (h2o's accumulated score)."""
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = _SequenceState(np.ones(0, dtype=bool), np.zeros(0))
        n = len(mass)
        if n > len(state.kept):
            grow = n - len(state.kept)
            state.kept = np.concatenate([state.kept, np.ones(grow, dtype=bool)])
            state.scores = np.concatenate([state.scores, np.zeros(grow)])
        state.scores[:n] += mass

    def kept_positions(self, req_id: str) -> np.ndarray:
        """The positions of `req_id` still attended (after the last decode step's eviction)."""
        state = self.states.get(req_id)
        return np.zeros(0, dtype=np.int64) if state is None else np.flatnonzero(state.kept)

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
