"""The course trace: one seeded workload for chapters 02–09, its 7B/A100 twin, one SLO, one ladder.

Every chapter from 02 on adds one feature to the engine. To say what each feature bought, they all
serve the same requests under the same service level objective, and each chapter's bar on the
cumulative chart (`minillm.viz.feature_chart`) is a real run of the simulator on that trace with
every feature so far switched on.

    from minillm.traces.course import sim_trace, simulate_course, ladder_summaries, SIM_SLO
    trace = sim_trace()                         # 200 requests, 4 req/s, ShareGPT-like lengths
    result = simulate_course({"batching": "continuous", "kv_layout": "paged"})
    bars = ladder_summaries(upto="prefix")      # {"static": Summary, ..., "prefix": Summary}

Two twins of one recipe (same seed, same structure, sizes scaled to what each can serve):

- `sim_trace()`: the simulated twin, Llama-2-7B in fp16 on one A100-80GB. 200 requests at 4
  requests/s (Poisson), ShareGPT-like heavy-tailed lengths (vLLM paper's means, 161 prompt / 338
  output tokens, clipped at 1,024 each), half of them starting with one of 4 system prompts of 384
  tokens. The simulated hardware is `A100_80GB_PRACTICAL`, the A100 with efficiency factors
  fitted to NVIDIA's published Llama-2-7B latencies (minillm.sim.hardware), and `max_model_len`
  is Llama-2's 4,096, what a slab reserves per request.
- `cpu_trace(vocab_size)`: the measured twin for the bundled ~5M-parameter model on this CPU,
  chapter 04's trace: 48 requests at 16 requests/s, log-normal lengths (prompts ~24, outputs ~40).

One SLO per twin, both TTFT and TPOT (DistServe's goodput, as `vllm bench serve --goodput` counts):
`SIM_SLO` (TTFT ≤ 1 s, TPOT ≤ 50 ms, a chat service's targets) and `CPU_SLO` (500 ms, 25 ms).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minillm.metrics import SLO, Summary
from minillm.sim.hardware import A100_80GB_PRACTICAL, Hardware
from minillm.sim.simulate import SimResult, simulate
from minillm.traces.synthetic import LengthDist, Trace, make_trace

COURSE_SEED = 0
SIM_SLO = SLO(ttft_ms=1000, tpot_ms=50)
CPU_SLO = SLO(ttft_ms=500, tpot_ms=25)
SIM_HARDWARE: Hardware = A100_80GB_PRACTICAL
SIM_MODEL = "llama-7b"
SIM_MAX_MODEL_LEN = 4096  # Llama-2's context: what one slab reserves
SIM_RATE_PER_S = 4.0
SIM_NUM_REQUESTS = 200
SIM_SHARED_PREFIX_LEN, SIM_NUM_PREFIXES, SIM_SHARED_PREFIX_FRACTION = 384, 4, 0.5


def sim_trace(num_requests: int = SIM_NUM_REQUESTS, rate_per_s: float = SIM_RATE_PER_S, *,
              shared_prefix_fraction: float = SIM_SHARED_PREFIX_FRACTION, seed: int = COURSE_SEED,
              **overrides: Any) -> Trace:
    """The simulated twin (7B on A100). Playgrounds shrink `num_requests` or move the rate and the
    shared-prefix share; the same seed keeps the same prompts (see `make_trace`)."""
    kw: dict[str, Any] = dict(vocab_size=32000, rate_per_s=rate_per_s, prompt_len=LengthDist.sharegpt(),
                              output_len=LengthDist.sharegpt(), max_prompt_len=1024, max_output_len=1024,
                              shared_prefix_len=SIM_SHARED_PREFIX_LEN, num_prefixes=SIM_NUM_PREFIXES,
                              shared_prefix_fraction=shared_prefix_fraction)
    kw.update(overrides)
    return make_trace(num_requests, seed=seed, **kw)


def cpu_trace(vocab_size: int, num_requests: int = 48, rate_per_s: float = 16.0, *, seed: int = 4,
              **overrides: Any) -> Trace:
    """The measured twin, for the bundled model on this CPU (token ids 0-5 are its special tokens)."""
    kw: dict[str, Any] = dict(vocab_size=vocab_size, rate_per_s=rate_per_s,
                              prompt_len=LengthDist.lognormal(24, 0.8), output_len=LengthDist.lognormal(40, 1.0),
                              min_prompt_len=4, max_prompt_len=128, min_output_len=4, max_output_len=320,
                              token_id_range=(6, vocab_size))
    kw.update(overrides)
    return make_trace(num_requests, seed=seed, **kw)


_MEMO: dict[tuple, SimResult] = {}
_MEMO_SIZE = 64


def _trace_key(trace: Trace) -> str:
    """A digest of everything in a trace that a simulation reads (equal traces, equal keys)."""
    h = hashlib.sha256()
    for r in trace:
        h.update(f"{r.request_id}|{r.arrival_time_s!r}|{r.max_tokens}|{r.prefix_id}|{r.priority}|".encode())
        h.update(array("q", r.prompt_token_ids).tobytes())
    return h.hexdigest()


def simulate_course(engine_config: dict[str, Any], trace: Trace | None = None, *,
                    slo: SLO | None = SIM_SLO, **simulate_kwargs: Any) -> SimResult:
    """`simulate` on the course's hardware, model and SLO (the trace defaults to `sim_trace()`);
    `engine_config` gets `max_model_len` 4,096 unless it sets its own.

    The simulator is deterministic, so a run with the same knobs on an equal trace is answered from
    a small memo (a chapter's own sweep and its course-chart bar often ask for the same run): treat
    the returned result as read-only. Runs with extra `simulate_kwargs` are never memoised.
    """
    config = {"max_model_len": SIM_MAX_MODEL_LEN, **engine_config}
    trace = trace if trace is not None else sim_trace()
    key = None
    if not simulate_kwargs:
        key = (json.dumps(config, sort_keys=True, default=repr), _trace_key(trace), repr(slo))
        if key in _MEMO:
            return _MEMO[key]
    kwargs: dict[str, Any] = dict(hardware=SIM_HARDWARE, model=SIM_MODEL, slo=slo)
    kwargs.update(simulate_kwargs)
    result = simulate(trace, engine_config=config, **kwargs)
    if key is not None:
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = result
    return result


# --- the ladder: each chapter's feature, on top of everything before it --------------------------


@dataclass(frozen=True)
class Rung:
    """One feature of the ladder: the knobs it changes, on top of every earlier rung's."""

    label: str  # the bar's name; `minillm.viz.style.system_color` colors it
    chapter: str  # "04"
    engine_config: dict[str, Any]  # EngineConfig knobs this feature sets
    simulate_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. speculation=SimSpeculation(...)
    note: str = ""


LADDER: list[Rung] = [
    Rung("static", "02", {"batching": "static", "kv_layout": "slab", "max_num_seqs": 32,
                          "static_batch_timeout_ms": 500},
         note="a batch of up to 32 fires when full or after 500 ms; it runs until its longest member ends"),
    Rung("dynamic", "03", {"batching": "dynamic", "max_queue_delay_ms": 100},
         note="fires after 100 ms of queueing"),
    Rung("continuous", "04", {"batching": "continuous"},
         note="iteration-level scheduling, one max_model_len slab per request"),
    Rung("paged", "05", {"kv_layout": "paged", "block_size": 16, "max_num_seqs": 256},
         note="16-token blocks on demand: memory, not the slab count, bounds the batch"),
    Rung("paged + swap", "06", {"preemption_mode": "swap", "swap_space": 4},
         note="preempted requests swap to 4 GiB of host memory instead of recomputing"),
    Rung("prefix", "07", {"enable_prefix_caching": True},
         note="vLLM's hash-chain prefix cache: shared system prompts are prefilled once"),
]


def rung_index(label: str, ladder: Sequence[Rung] | None = None) -> int:
    rungs = LADDER if ladder is None else ladder
    labels = [r.label for r in rungs]
    if label not in labels:
        raise ValueError(f"no rung named {label!r}; the ladder has {labels}")
    return labels.index(label)


def cumulative_configs(upto: str | None = None, extra: Sequence[Rung] = (),
                       ladder: Sequence[Rung] | None = None) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """{label: (engine_config, simulate_kwargs)} for every rung up to `upto` (default: all), then
    `extra` rungs in order, each with the knobs of all rungs before it."""
    rungs = list(LADDER if ladder is None else ladder)
    if upto is not None:
        rungs = rungs[: rung_index(upto, rungs) + 1]
    rungs += list(extra)
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    config: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for rung in rungs:
        if rung.label in out:
            raise ValueError(f"rung {rung.label!r} appears twice")
        config = {**config, **rung.engine_config}
        kwargs = {**kwargs, **rung.simulate_kwargs}
        out[rung.label] = (config, kwargs)
    return out


def ladder_results(upto: str | None = None, extra: Sequence[Rung] = (), trace: Trace | None = None,
                   slo: SLO | None = SIM_SLO) -> dict[str, SimResult]:
    """Simulate every rung up to `upto` (plus `extra`) on the course trace: the chart's bars."""
    trace = trace if trace is not None else sim_trace()
    return {label: simulate_course(config, trace, slo=slo, **kwargs)
            for label, (config, kwargs) in cumulative_configs(upto, extra).items()}


def ladder_summaries(upto: str | None = None, extra: Sequence[Rung] = (), trace: Trace | None = None,
                     slo: SLO | None = SIM_SLO) -> dict[str, Summary]:
    """`ladder_results`, summaries only."""
    return {label: r.summary for label, r in ladder_results(upto, extra, trace, slo).items()}
