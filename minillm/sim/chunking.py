"""Dynamic SplitFuse against Sarathi's fixed budget on the simulator (chapter 08).

    from minillm.sim.chunking import compare_chunk_policies, print_policy_table, sweet_spot_tokens
    spot = sweet_spot_tokens("A100-80GB-practical", "llama-7b")    # where a step's throughput saturates
    rows = compare_chunk_policies(budgets=(256, 512, 2048, spot))   # the course trace, 7B on the A100
    print_policy_table(rows)

    python -m minillm.sim.chunking      # both tables: chapter 08's heavy trace and the course trace

Both policies are `minillm.scheduler.chunk_policy`'s, run by the engine's own scheduler (see there
for what each does). `sweet_spot_tokens` reads DeepSpeed-FastGen's "sweet spot" off the roofline
cost model: the throughput of one step (tokens per second) grows with its token count while the
weight reads dominate, then flattens once the step is compute-bound; the sweet spot is the smallest
count that reaches `fraction` of the best throughput. A larger step buys almost no throughput and
makes every decoding request wait longer for its next token. The numbers are the simulator's,
deterministic on any machine.

One import here points up, out of the simulator: `compare_chunk_policies()` with no trace (as
chapter 08 calls it for its course-trace table) and `main()` take their defaults (trace, hardware,
model, knobs, SLO) from `minillm.traces.course`, which sits above the simulator (it runs
`minillm.sim.simulate`). The import is inside those two functions, on purpose: importing
`minillm.sim` or this module never loads the course trace, and no circle forms, since
`minillm.traces.course` imports nothing from here (tests/test_import_cycles.py checks). A caller that
passes its own trace, hardware, model, engine_config and slo never touches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minillm.metrics import SLO
from minillm.sim.cost_model import step_time
from minillm.sim.hardware import Hardware, get_hardware
from minillm.sim.model_shapes import ModelShape, get_model_shape
from minillm.sim.simulate import simulate
from minillm.traces.synthetic import LengthDist, Trace, make_trace

POLICIES = ("sarathi", "splitfuse")


def step_throughput(hardware: str | Hardware, model: str | ModelShape, num_tokens: int, *,
                    num_decodes: int = 0, context_len: int = 1024) -> float:
    """Tokens per second of one step holding `num_decodes` decodes (each after `context_len` tokens)
    and a prompt chunk filling the rest of `num_tokens` (after `context_len` cached tokens)."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    shape = get_model_shape(model) if isinstance(model, str) else model
    chunk = num_tokens - num_decodes
    if chunk < 0:
        raise ValueError(f"num_tokens={num_tokens} cannot hold num_decodes={num_decodes}")
    cost = step_time(hw, shape, prefill_tokens=[chunk] if chunk else [],
                     prefill_context=[context_len] if chunk else None,
                     decode_context_lens=[context_len + 1] * num_decodes)
    return num_tokens / cost.time_s


def sweet_spot_tokens(hardware: str | Hardware, model: str | ModelShape, *, fraction: float = 0.9,
                      num_decodes: int = 16, context_len: int = 1024, multiple: int = 16,
                      max_tokens: int = 8192) -> int:
    """The smallest step size (a multiple of `multiple`) whose throughput reaches `fraction` of the
    best step size's up to `max_tokens`, with `num_decodes` decodes in the step."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    sizes = [n for n in range(multiple, max_tokens + 1, multiple) if n > num_decodes]
    rates = [step_throughput(hardware, model, n, num_decodes=num_decodes, context_len=context_len) for n in sizes]
    best = max(rates)
    return next(n for n, r in zip(sizes, rates) if r >= fraction * best)


@dataclass(frozen=True)
class PolicyRow:
    """One simulated run: a chunk policy at one budget (SplitFuse: its target step size)."""

    policy: str
    budget: int
    output_throughput: float  # output tokens/s
    itl_p99_ms: float
    max_step_ms: float  # the longest step: the worst gap a decoding request can see
    ttft_mean_ms: float
    ttft_p99_ms: float
    num_steps: int
    mean_step_tokens: float
    goodput: float | None  # requests/s meeting the SLO (None without one)


def compare_chunk_policies(trace: Trace | None = None, budgets: Sequence[int] = (256, 512, 2048), *,
                           policies: Sequence[str] = POLICIES, hardware: str | Hardware | None = None,
                           model: str | ModelShape | None = None, engine_config: dict[str, Any] | None = None,
                           slo: SLO | None = None) -> list[PolicyRow]:
    """Simulate `trace` once per (policy, budget) with chunked prefill on.

    Defaults are the course's (`minillm.traces.course`): its trace, hardware (the practical A100),
    model (Llama-2-7B), knobs (everything up to prefix caching) and SLO (goodput)."""
    from minillm.traces import course

    if trace is None:
        trace = course.sim_trace()
    if engine_config is None:
        engine_config = dict(course.cumulative_configs("prefix")["prefix"][0])
        engine_config.setdefault("max_model_len", course.SIM_MAX_MODEL_LEN)
    hardware = hardware if hardware is not None else course.SIM_HARDWARE
    model = model if model is not None else course.SIM_MODEL
    slo = slo if slo is not None else course.SIM_SLO
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy {p!r}; choose from {POLICIES}")
    rows = []
    for budget in budgets:
        for policy in policies:
            config = {**engine_config, "enable_chunked_prefill": True, "max_num_batched_tokens": int(budget),
                      "chunk_policy": policy}
            res = simulate(trace, hardware=hardware, model=model, engine_config=config, slo=slo)
            s = res.summary
            tokens = [st.num_prefill_tokens + st.num_decode_tokens for st in res.steps]
            rows.append(PolicyRow(policy, int(budget), s.output_throughput, s.itl.percentiles_ms[99],
                                  1e3 * max(c.time_s for c in res.costs),
                                  s.ttft.mean_ms, s.ttft.percentiles_ms[99], len(res.steps),
                                  sum(tokens) / len(tokens), s.request_goodput))
    return rows


def print_policy_table(rows: Sequence[PolicyRow]) -> None:
    """One line per run (times in ms)."""
    print(f"{'policy':<10} {'budget':>6} {'out tok/s':>9} {'p99 ITL ms':>10} {'max step':>8} {'TTFT ms':>8} {'p99 TTFT':>9} "
          f"{'steps':>6} {'tok/step':>8} {'goodput':>8}")
    for r in rows:
        good = "" if r.goodput is None else f"{r.goodput:.2f}"
        print(f"{r.policy:<10} {r.budget:>6} {r.output_throughput:>9.0f} {r.itl_p99_ms:>10.1f} {r.max_step_ms:>8.1f} "
              f"{r.ttft_mean_ms:>8.0f} "
              f"{r.ttft_p99_ms:>9.0f} {r.num_steps:>6} {r.mean_step_tokens:>8.1f} {good:>8}")


def heavy_trace(num_requests: int = 192, rate_per_s: float = 240.0, seed: int = 0) -> Trace:
    """Chapter 08's (and bench/chunked.py's) simulated trace: Poisson arrivals, heavy-tailed prompts
    up to 4,000 tokens, for 7B on the A100-80GB with max_num_seqs 64."""
    return make_trace(num_requests, seed=seed, vocab_size=32000, rate_per_s=rate_per_s,
                      prompt_len=LengthDist.lognormal(200, 1.3), output_len=LengthDist.lognormal(128, 0.4),
                      min_prompt_len=4, max_prompt_len=4000, min_output_len=8, max_output_len=512)


def main() -> None:
    from minillm.traces.course import SIM_HARDWARE

    spot = sweet_spot_tokens("A100-80GB", "llama-7b")
    print(f"chapter 08's heavy trace, 7B on the A100-80GB, max_num_seqs 64 (sweet spot {spot} tokens)")
    print_policy_table(compare_chunk_policies(heavy_trace(), (spot, 512, 2048), hardware="A100-80GB",
                                              engine_config={"max_num_seqs": 64}))
    spot = sweet_spot_tokens(SIM_HARDWARE, "llama-7b")
    print(f"\nthe course trace, 7B on the practical A100, up to prefix caching (sweet spot {spot} tokens)")
    print_policy_table(compare_chunk_policies(budgets=(spot, 512, 2048)))


if __name__ == "__main__":
    main()
