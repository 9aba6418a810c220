"""Seeded request traces: when requests arrive and how long their prompts and outputs are.

Chapters 02–04 run every batching strategy on ONE trace made here, so that the differences in
the plots come from the scheduler and not from the workload. A trace is fully determined by its
seed; it can be saved as JSONL and replayed by the engine, the simulator or a benchmark client.

Arrivals follow `vllm bench serve`: gaps are gamma-distributed with shape = burstiness and
mean 1/rate, so burstiness 1 is a Poisson process, < 1 is burstier, > 1 is more regular
(CV² of the gaps = 1/burstiness). Lengths are uniform, log-normal, Pareto or "ShareGPT-like";
uniform lengths hide head-of-line blocking (pitfall 5), heavy tails expose it.
Real lengths and arrivals: `azure_trace("conv" | "code", ...)`, Azure's 2023 production traces
(minillm.traces.azure), as they are or scaled down for the bundled model on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

# Re-exported: `from minillm.traces.synthetic import Trace, azure_trace` keeps working. Trace and TraceRequest live in
# minillm.traces.trace so that minillm.traces.azure builds its Trace without importing this module.
from minillm.traces.azure import AZURE_CITATION, AZURE_TRACES, AzureRows, azure_rows, azure_trace  # noqa: F401
from minillm.traces.trace import Trace, TraceRequest

# Mean prompt / output lengths of ShareGPT as reported in the vLLM paper (Kwon et al., 2023, Fig. 11).
SHAREGPT_MEAN_PROMPT_TOKENS = 161
SHAREGPT_MEAN_OUTPUT_TOKENS = 338


# --------------------------------------------------------------------------- arrivals


def gamma_arrivals(n: int, rate_per_s: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) whose gaps are Gamma(shape=burstiness, scale=1/(rate·burstiness)).

    The mean gap is 1/rate whatever the burstiness; CV² of the gaps is 1/burstiness.
    As in `vllm bench serve`, the first request arrives at t=0; rate inf sends all at once.
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate_per_s):
        return np.zeros(n)
    if rate_per_s <= 0 or burstiness <= 0:
        raise ValueError("rate_per_s and burstiness must be positive")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate_per_s * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def poisson_arrivals(n: int, rate_per_s: float, rng: np.random.Generator) -> np.ndarray:
    """A Poisson process: exponential gaps (gamma with burstiness 1, so the same draws)."""
    return gamma_arrivals(n, rate_per_s, 1.0, rng)


# --------------------------------------------------------------------------- lengths


def _clip(x: np.ndarray, min_len: int, max_len: int) -> np.ndarray:
    return np.clip(np.rint(x), min_len, max_len).astype(np.int64)


def uniform_lengths(n: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """Integers drawn uniformly from [lo, hi], both ends included."""
    return rng.integers(lo, hi + 1, size=n).astype(np.int64)


def lognormal_lengths(n: int, mean: float, sigma: float, rng: np.random.Generator,
                      min_len: int = 1, max_len: int = 1 << 30) -> np.ndarray:
    """Log-normal lengths with the given mean (before clipping); sigma is the log-space spread."""
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma²))] = exp(mu + sigma²/2) = mean
    return _clip(rng.lognormal(mu, sigma, size=n), min_len, max_len)


def pareto_lengths(n: int, scale: float, alpha: float, rng: np.random.Generator,
                   min_len: int = 1, max_len: int = 1 << 30) -> np.ndarray:
    """Pareto lengths ≥ scale with tail index alpha (smaller alpha = heavier tail;
    mean alpha·scale/(alpha−1) for alpha > 1). numpy's `pareto` is Lomax, hence the +1."""
    return _clip(scale * (rng.pareto(alpha, size=n) + 1.0), min_len, max_len)


# Log-space spreads chosen by eye to give ShareGPT's long right tail (median well below mean).
_SHAREGPT_SIGMA = {"prompt": 1.0, "output": 0.8}


def sharegpt_like_lengths(n: int, rng: np.random.Generator, kind: str = "prompt",
                          min_len: int = 1, max_len: int = 4096) -> np.ndarray:
    """Heavy-tailed lengths whose mean matches ShareGPT's (161 prompt / 338 output tokens)."""
    mean = {"prompt": SHAREGPT_MEAN_PROMPT_TOKENS, "output": SHAREGPT_MEAN_OUTPUT_TOKENS}[kind]
    return lognormal_lengths(n, mean, _SHAREGPT_SIGMA[kind], rng, min_len, max_len)


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: `kind` plus its two parameters.

    uniform (lo, hi) · lognormal (mean, sigma) · pareto (scale, alpha) · constant (n, -)
    · sharegpt (-, -): prompt or output flavour chosen by where it is used.
    """

    kind: str
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def uniform(cls, lo: int, hi: int) -> LengthDist:
        return cls("uniform", lo, hi)

    @classmethod
    def lognormal(cls, mean: float, sigma: float) -> LengthDist:
        return cls("lognormal", mean, sigma)

    @classmethod
    def pareto(cls, scale: float, alpha: float) -> LengthDist:
        return cls("pareto", scale, alpha)

    @classmethod
    def constant(cls, n: int) -> LengthDist:
        return cls("constant", n)

    @classmethod
    def sharegpt(cls) -> LengthDist:
        return cls("sharegpt")

    def sample(self, n: int, rng: np.random.Generator, min_len: int, max_len: int,
               sharegpt_kind: str = "prompt") -> np.ndarray:
        if self.kind == "uniform":
            x = uniform_lengths(n, int(self.a), int(self.b), rng)
        elif self.kind == "lognormal":
            x = lognormal_lengths(n, self.a, self.b, rng)
        elif self.kind == "pareto":
            x = pareto_lengths(n, self.a, self.b, rng)
        elif self.kind == "constant":
            x = np.full(n, int(self.a))
        elif self.kind == "sharegpt":
            x = sharegpt_like_lengths(n, rng, sharegpt_kind)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return _clip(x, min_len, max_len)


LengthSpec = LengthDist | int | str | tuple


def as_length_dist(spec: LengthSpec) -> LengthDist:
    """Accept a LengthDist, an int (constant), "sharegpt", or a tuple like ("uniform", 8, 64)."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, (int, np.integer)):
        return LengthDist.constant(int(spec))
    if isinstance(spec, str):
        return LengthDist(spec)
    return LengthDist(*spec)


# --------------------------------------------------------------------------- traces


def _distinct_tokens(k: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """k token ids from [lo, hi), all different when the range allows it."""
    if k <= hi - lo:
        return rng.choice(hi - lo, size=k, replace=False) + lo
    return rng.integers(lo, hi, size=k)


def make_trace(
    num_requests: int,
    *,
    seed: int,
    vocab_size: int,
    rate_per_s: float = math.inf,
    burstiness: float = 1.0,
    prompt_len: LengthSpec = "sharegpt",
    output_len: LengthSpec = "sharegpt",
    min_prompt_len: int = 1,
    max_prompt_len: int = 2048,
    min_output_len: int = 1,
    max_output_len: int = 2048,
    token_id_range: tuple[int, int] | None = None,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
    shared_prefix_fraction: float = 1.0,
    num_priorities: int = 1,
) -> Trace:
    """A seeded trace of `num_requests` requests.

    Prompts are random token ids from `token_id_range` = [lo, hi) (default: the whole vocab; pass a
    range to avoid special tokens). With `shared_prefix_len` > 0 every prompt is one of
    `num_prefixes` fixed random prefixes followed by a unique random suffix whose length is drawn
    from `prompt_len`; the total prompt stays within [min_prompt_len, max_prompt_len].
    Requests with the same `prefix_id` share exactly `shared_prefix_len` leading tokens; prompts
    from different prefixes share none (first tokens are drawn distinct while the range allows).
    `shared_prefix_fraction` < 1 gives the prefix to that share of requests only (each request
    independently); the others are the suffix alone (prefix_id None), so their prompts are shorter
    by `shared_prefix_len`: the prefix is extra content, like a system prompt some apps send.

    Arrivals, lengths and tokens use separate child streams of the seed, so changing the rate or
    burstiness replays the same prompts at different times.
    """
    lo, hi = token_id_range if token_id_range is not None else (0, vocab_size)
    if not 0 <= lo < hi <= vocab_size:
        raise ValueError(f"token_id_range {(lo, hi)} must lie within [0, {vocab_size})")
    if shared_prefix_len >= max_prompt_len:
        raise ValueError("shared_prefix_len must leave room for a suffix below max_prompt_len")
    if not 0.0 <= shared_prefix_fraction <= 1.0:
        raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {shared_prefix_fraction!r}")
    prompt_dist, output_dist = as_length_dist(prompt_len), as_length_dist(output_len)
    # A sixth stream for who gets the prefix: the first five are those of older traces, unchanged.
    arrival_rng, prompt_rng, output_rng, token_rng, priority_rng, share_rng = np.random.default_rng(seed).spawn(6)

    arrivals = gamma_arrivals(num_requests, rate_per_s, burstiness, arrival_rng)
    suffix_lens = prompt_dist.sample(num_requests, prompt_rng,
                                     max(min_prompt_len - shared_prefix_len, 1),
                                     max_prompt_len - shared_prefix_len, "prompt")
    output_lens = output_dist.sample(num_requests, output_rng, min_output_len, max_output_len, "output")

    # Prefixes first (distinct first tokens), then which prefix each request uses.
    if shared_prefix_len > 0:
        prefixes = token_rng.integers(lo, hi, size=(num_prefixes, shared_prefix_len))
        prefixes[:, 0] = _distinct_tokens(num_prefixes, lo, hi, token_rng)
        prefix_ids = token_rng.integers(0, num_prefixes, size=num_requests)
    else:
        prefixes = np.zeros((1, 0), dtype=np.int64)
        prefix_ids = np.zeros(num_requests, dtype=np.int64)
    if shared_prefix_len > 0 and shared_prefix_fraction < 1.0:
        has_prefix = share_rng.random(num_requests) < shared_prefix_fraction
    else:
        has_prefix = np.ones(num_requests, dtype=bool)
    # Within a prefix group the first suffix tokens are distinct, so the common prefix is exact.
    first_suffix_tokens = np.zeros(num_requests, dtype=np.int64)
    for group in range(len(prefixes)):
        members = np.flatnonzero((prefix_ids == group) & has_prefix)
        first_suffix_tokens[members] = _distinct_tokens(len(members), lo, hi, token_rng)
    loners = np.flatnonzero(~has_prefix)  # no prefix: their first tokens need not differ
    if len(loners):
        first_suffix_tokens[loners] = token_rng.integers(lo, hi, size=len(loners))

    priorities = priority_rng.integers(0, num_priorities, size=num_requests)
    requests = []
    for i in range(num_requests):
        suffix = token_rng.integers(lo, hi, size=int(suffix_lens[i]))
        suffix[0] = first_suffix_tokens[i]
        group = int(prefix_ids[i])
        prefix = prefixes[group].tolist() if has_prefix[i] else []
        requests.append(TraceRequest(
            request_id=f"req-{i}",
            arrival_time_s=float(arrivals[i]),
            prompt_token_ids=prefix + suffix.tolist(),
            max_tokens=int(output_lens[i]),
            prefix_id=group if shared_prefix_len > 0 and has_prefix[i] else None,
            priority=int(priorities[i]),
        ))
    meta = dict(
        num_requests=num_requests, seed=seed, vocab_size=vocab_size, rate_per_s=rate_per_s,
        burstiness=burstiness, prompt_len=asdict(prompt_dist), output_len=asdict(output_dist),
        min_prompt_len=min_prompt_len, max_prompt_len=max_prompt_len,
        min_output_len=min_output_len, max_output_len=max_output_len, token_id_range=[lo, hi],
        shared_prefix_len=shared_prefix_len, num_prefixes=num_prefixes,
        shared_prefix_fraction=shared_prefix_fraction, num_priorities=num_priorities,
    )
    return Trace(requests, meta)


def trace_from_prompts(
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    arrivals: Sequence[float] | None = None,
) -> Trace:
    """Wrap given token-id prompts as a trace (all arriving at 0 unless `arrivals` is given)."""
    n = len(prompts)
    outs = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    times = [0.0] * n if arrivals is None else [float(t) for t in arrivals]
    if not len(outs) == len(times) == n:
        raise ValueError("prompts, max_tokens and arrivals must have the same length")
    requests = [TraceRequest(f"req-{i}", times[i], [int(t) for t in p], int(outs[i]))
                for i, p in enumerate(prompts)]
    return Trace(requests, {"source": "prompts", "num_requests": n})


def make_chat_trace(
    num_conversations: int,
    *,
    seed: int,
    vocab_size: int,
    turns: int | tuple[int, int] = (2, 6),
    system_prompt_len: int = 0,
    user_len: LengthSpec = ("lognormal", 60, 0.6),
    reply_len: LengthSpec = ("lognormal", 120, 0.6),
    think_time_s: float = 10.0,
    rate_per_s: float = 1.0,
    max_user_len: int = 512,
    max_reply_len: int = 512,
    token_id_range: tuple[int, int] | None = None,
) -> Trace:
    """A multi-turn chat trace (chapter 07): every turn re-sends the whole conversation so far.

    Conversations start as a Poisson process at `rate_per_s`; each has `turns` turns (an int, or a
    uniform (lo, hi) range). Turn k's prompt is the optional shared system prompt, then every
    earlier user message and assistant reply, then the new user message; the reply is `max_tokens`
    long. Turn k + 1 arrives `think_time_s` (exponential with that mean) plus an estimate of the
    reply time after turn k, so a replayed trace sends it about when a user would.

    The replies in later prompts are fixed random tokens from the trace, not what the engine
    generated, so a prefix cache can serve a turn's previous *prompt* from cache but not the
    reply tokens the engine produced: real chat reuses those too, so hits here are a lower bound.
    `prefix_id` is the conversation's index.
    """
    lo, hi = token_id_range if token_id_range is not None else (0, vocab_size)
    if not 0 <= lo < hi <= vocab_size:
        raise ValueError(f"token_id_range {(lo, hi)} must lie within [0, {vocab_size})")
    if num_conversations < 1 or think_time_s < 0 or not rate_per_s > 0:
        raise ValueError("num_conversations must be >= 1, think_time_s >= 0 and rate_per_s > 0")
    turn_lo, turn_hi = (turns, turns) if isinstance(turns, int) else turns
    if not 1 <= turn_lo <= turn_hi:
        raise ValueError(f"turns must be >= 1 (an int or a (lo, hi) range), got {turns!r}")
    start_rng, turn_rng, len_rng, token_rng, think_rng = np.random.default_rng(seed).spawn(5)
    starts = gamma_arrivals(num_conversations, rate_per_s, 1.0, start_rng)
    system = token_rng.integers(lo, hi, size=system_prompt_len).tolist()
    user_dist, reply_dist = as_length_dist(user_len), as_length_dist(reply_len)
    requests = []
    for c in range(num_conversations):
        n_turns = int(turn_rng.integers(turn_lo, turn_hi + 1))
        users = user_dist.sample(n_turns, len_rng, 1, max_user_len, "prompt")
        replies = reply_dist.sample(n_turns, len_rng, 1, max_reply_len, "output")
        history, t = list(system), float(starts[c])
        for k in range(n_turns):
            history += token_rng.integers(lo, hi, size=int(users[k])).tolist()
            requests.append(TraceRequest(f"chat-{c}-turn-{k}", t, list(history), int(replies[k]), prefix_id=c))
            history += token_rng.integers(lo, hi, size=int(replies[k])).tolist()
            # the user reads the reply (~20 ms a token of streaming), thinks, then answers
            t += 0.02 * int(replies[k]) + (float(think_rng.exponential(think_time_s)) if think_time_s else 0.0)
    requests.sort(key=lambda r: r.arrival_time_s)
    meta = dict(kind="chat", num_conversations=num_conversations, seed=seed, vocab_size=vocab_size,
                turns=[turn_lo, turn_hi], system_prompt_len=system_prompt_len,
                user_len=asdict(user_dist), reply_len=asdict(reply_dist), think_time_s=think_time_s,
                rate_per_s=rate_per_s, token_id_range=[lo, hi])
    return Trace(requests, meta)
