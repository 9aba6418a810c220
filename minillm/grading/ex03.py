"""Grader of exercise 03 (chapter 03: dynamic batching): the firing rule, who shares a batch, the
rule inside minillm's scheduler, and choosing knobs on the simulator to meet an SLO.

Everything runs on a simulated clock. The reference is minillm's `DynamicScheduler` (and the
engine), disabled (`forbid`) while the learner's code runs. Task 4 is graded by the simulator: the
learner's knobs run a Poisson trace through the engine with a Llama-7B on an A100, costed step by step.
"""

from __future__ import annotations

from itertools import groupby

import numpy as np

from minillm import SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, build_engine, make_kv_manager
from minillm.grading import Fail, forbid, grade_time_seeds, task
from minillm.model.config import ModelConfig
from minillm.request import Request
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.dynamic import DynamicScheduler
from minillm.scheduler.static import StaticScheduler
from minillm.sim import A100_80GB, LLAMA_7B, SimExecutor
from minillm.workload import make_trace

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = {"simulate": (4,)}  # task 4: explore the trace on the simulator

FIRING_RULES = ((DynamicScheduler, "should_fire"), (StaticScheduler, "should_fire"))

# The model the engine is told about: Llama-7B's shape (the simulator's cost model uses it).
SEVEN_B = ModelConfig(model_type="llama", vocab_size=LLAMA_7B.vocab_size, hidden_size=LLAMA_7B.hidden_size,
                      intermediate_size=LLAMA_7B.intermediate_size, num_layers=LLAMA_7B.num_layers,
                      num_heads=LLAMA_7B.num_heads, num_kv_heads=LLAMA_7B.num_kv_heads,
                      head_dim=LLAMA_7B.head_dim, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048)


def _reference_should_fire(now, waiting_arrival_times, max_batch_size, max_queue_delay_s):
    config = EngineConfig(batching="dynamic", max_num_seqs=max_batch_size, max_queue_delay_ms=max_queue_delay_s * 1000)
    scheduler = DynamicScheduler(config, kv=None)
    for i, t in enumerate(waiting_arrival_times):
        scheduler.add_request(Request(str(i), [5], SamplingParams(temperature=0.0), t))
    return scheduler.should_fire(now, more_arrivals=True)


class OneUnitPerStep:
    # A stand-in for the model: every row that needs a token gets token 7; every step takes 1 time unit.
    def execute(self, batch):
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self):
        return 1.0


def run_engine(scheduler_class, executor, requests, max_batch_size, max_queue_delay_s):
    # requests: (arrival_time, prompt_len, max_tokens) tuples. Returns the engine once all finished.
    config = EngineConfig(batching="dynamic", max_num_seqs=max_batch_size,
                          max_queue_delay_ms=max_queue_delay_s * 1000, max_model_len=2048)
    resolved = config.resolve(SEVEN_B.max_position_embeddings)
    kv = make_kv_manager(resolved, SEVEN_B, allocate_pool=False)
    engine = build_engine(config, SEVEN_B, kv=kv, scheduler_factory=lambda _, kv: scheduler_class(resolved, kv),
                          executor=executor, clock=SimClock())
    for i, (arrival, prompt_len, max_tokens) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5] * prompt_len},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=str(i), arrival_time=float(arrival))
    while engine.has_unfinished():
        steps_before, now = engine.num_steps, engine.clock.now()
        engine.step()
        if engine.num_steps == steps_before:
            engine.wait_for_work()
            if engine.clock.now() == now:
                raise Fail(f"stuck at t = {now}: {engine.scheduler.num_waiting} requests wait, "
                                   "nothing fires and the clock cannot move on")
    return engine


def batches_of(engine):
    # Requests first scheduled at the same time started in the same batch: [(start_time, [ids])].
    started = sorted((m.first_scheduled_time, int(rid)) for rid, m in engine.metrics.requests.items())
    return [(t, [rid for _, rid in group]) for t, group in groupby(started, key=lambda x: x[0])]

@task(1, "firing rule")
def check_task_1(should_fire) -> str:
    cases = [
        (1.0, [], 4, 0.1),  # nobody waits
        (0.0, [0.0], 1, 0.5),  # a batch of one is full at once
        (0.30, [0.25, 0.26, 0.28], 3, 1.0),  # full before the delay
        (0.30, [0.25, 0.26], 3, 0.1),  # not full, the oldest waited 0.05 s of 0.1 s
        (0.7 + 0.1, [0.7, 0.75], 4, 0.1),  # exactly oldest + delay: the engine's timer wakes here
        (0.5, [0.5], 4, 0.0),  # no delay at all
        (2.0, [0.1, 0.2, 0.3, 0.4, 0.5], 4, 5.0),  # more than a full batch waits
    ]
    rng = np.random.default_rng(7)
    for number in range(300 + FRESH_CASES):
        if number == 300:  # then cases drawn at grade time: they cannot be memoised
            rng = np.random.default_rng(grade_time_seeds(1)[0])
        arrivals = np.sort(rng.uniform(0, 1, size=rng.integers(0, 7))).tolist()
        delay = float(rng.choice([0.0, 0.005, 0.01, 0.05, 0.1, 0.25]))
        oldest = arrivals[0] if arrivals else 0.0
        now = float(rng.choice([oldest + delay, oldest + delay * rng.uniform(0, 2), max(arrivals, default=0.0)]))
        cases.append((max(now, max(arrivals, default=0.0)), arrivals, int(rng.integers(1, 6)), delay))
    for now, arrivals, size, delay in cases:
        want = _reference_should_fire(now, arrivals, size, delay)
        with forbid(*FIRING_RULES):
            got = bool(should_fire(now, list(arrivals), size, delay))
        if got != want:
            raise Fail(f"now={now!r}, waiting since {arrivals}, max_batch_size={size}, delay={delay} s: "
                       f"you said {got}, expected {want}")
    return f"{len(cases) - FRESH_CASES} cases agree with DynamicScheduler.should_fire"  # the seeded ones


def _engine_batches(arrival_times, durations, max_batch_size, max_queue_delay):
    """minillm's answer: each request has a 1-token prompt and `duration` output tokens, one step per unit."""
    requests = [(t, 1, d) for t, d in zip(arrival_times, durations)]
    return batches_of(run_engine(DynamicScheduler, OneUnitPerStep(), requests, max_batch_size, max_queue_delay))


@task(2, "who shares a batch")
def check_task_2(dynamic_batches) -> str:
    cases = [
        ([0], [5], 4, 3),  # one request waits for its deadline
        ([0, 1, 2, 3], [5, 5, 5, 5], 4, 10),  # the batch fills before the deadline
        ([0, 1, 6, 7, 20], [10, 3, 2, 2, 1], 2, 2),  # arrivals during a batch wait for its end
        ([0, 0, 0, 0, 0], [3, 1, 4, 1, 5], 2, 0),  # all at once, batches of two
        ([0, 4, 4], [2, 2, 2], 3, 0),  # no delay
        ([5, 9], [1, 1], 1, 7),  # a batch of one is always full
    ]
    rng = np.random.default_rng(8)
    for _ in range(40):
        n = int(rng.integers(1, 25))
        arrivals = np.cumsum(rng.integers(0, 6, size=n)).tolist()
        cases.append((arrivals, rng.integers(1, 20, size=n).tolist(), int(rng.integers(1, 7)), int(rng.integers(0, 9))))
    for arrivals, durations, max_batch_size, delay in cases:
        want = _engine_batches(arrivals, durations, max_batch_size, delay)
        with forbid(*FIRING_RULES, DynamicScheduler, StaticScheduler, LLMEngine, run_engine, _engine_batches):
            got = [(float(t), sorted(int(i) for i in batch))
                   for t, batch in dynamic_batches(list(arrivals), list(durations), max_batch_size, delay)]
        if got != want:
            raise Fail(f"arrivals {arrivals}, durations {durations}, max_batch_size {max_batch_size}, delay {delay}: "
                       f"you formed {got}, the engine {want}")
    return f"{len(cases)} cases: the same batches, at the same times, as minillm's engine"


TRACE = dict(num_requests=200, seed=11, vocab_size=32000, rate_per_s=4, prompt_len=("lognormal", 256, 0.8),
             output_len=("lognormal", 64, 0.8), max_prompt_len=1024, max_output_len=512)


def _token_times(engine, n):
    return [engine.metrics.requests[str(i)].token_times for i in range(n)]


@task(3, "your rule in the real scheduler")
def check_task_3(scheduler_class) -> list[str]:
    if "should_fire" not in vars(scheduler_class):
        raise Fail(f"{scheduler_class.__name__} does not override should_fire")
    requests = [(r.arrival_time_s, r.prompt_len, r.max_tokens) for r in make_trace(**TRACE)]
    lines = []
    for delay_s in (0.0, 0.05, 2.0):
        ref = run_engine(DynamicScheduler, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests, 8, delay_s)
        with forbid(*FIRING_RULES):
            mine = run_engine(scheduler_class, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests, 8, delay_s)
        if batches_of(mine) != batches_of(ref) or _token_times(mine, len(requests)) != _token_times(ref, len(requests)):
            raise Fail(f"delay {delay_s * 1e3:.0f} ms: your scheduler's batches or token times differ from "
                       f"DynamicScheduler's ({len(batches_of(mine))} batches vs {len(batches_of(ref))})")
        batches, summary = batches_of(mine), mine.metrics.summary()
        lines.append(f"delay {delay_s * 1e3:4.0f} ms: {len(batches)} batches of {len(requests) / len(batches):.1f} "
                     f"requests on average, {mine.num_steps} steps, mean TTFT {summary.ttft.mean_ms:.0f} ms, "
                     f"p99 TTFT {summary.ttft.percentiles_ms[99]:.0f} ms")
    return lines


# --- task 4: knobs for an SLO ---------------------------------------------------------------------

SLO_TRACE = dict(TRACE, rate_per_s=10)
SLO_P99_TTFT_MS = 8000.0
SLO_P99_TPOT_MS = 16.0


def simulate(max_num_seqs: int, max_queue_delay_ms: float) -> dict[str, float]:
    """Task 4's trace (200 requests, Poisson at 10/s) through the dynamic batcher on the simulated
    7B/A100: p99 TTFT and TPOT in ms, output tokens per second, number of batches."""
    requests = [(r.arrival_time_s, r.prompt_len, r.max_tokens) for r in make_trace(**SLO_TRACE)]
    engine = run_engine(DynamicScheduler, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests,
                        max_num_seqs, max_queue_delay_ms / 1000)
    summary = engine.metrics.summary()
    return {"p99_ttft_ms": summary.ttft.percentiles_ms[99], "p99_tpot_ms": summary.tpot.percentiles_ms[99],
            "output_tokens_per_s": summary.output_throughput, "batches": len(batches_of(engine))}


@task(4, "knobs that meet the SLO")
def check_task_4(choose_knobs) -> list[str]:
    knobs = choose_knobs()
    if not isinstance(knobs, dict) or set(knobs) != {"max_num_seqs", "max_queue_delay_ms"}:
        raise Fail(f"choose_knobs() returns a dict with exactly the keys max_num_seqs and max_queue_delay_ms, "
                   f"not {knobs!r}")
    size, delay = knobs["max_num_seqs"], knobs["max_queue_delay_ms"]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 256:
        raise Fail(f"max_num_seqs is an int from 1 to 256, not {size!r}")
    if not isinstance(delay, (int, float)) or isinstance(delay, bool) or not 0 <= delay <= 60_000:
        raise Fail(f"max_queue_delay_ms is a number of ms from 0 to 60000, not {delay!r}")
    result = simulate(size, float(delay))
    line = (f"max_num_seqs={size}, max_queue_delay_ms={delay}: p99 TTFT {result['p99_ttft_ms']:.0f} ms "
            f"(SLO {SLO_P99_TTFT_MS:.0f}), p99 TPOT {result['p99_tpot_ms']:.1f} ms (SLO {SLO_P99_TPOT_MS:.0f}), "
            f"{result['output_tokens_per_s']:.0f} output tokens/s, {result['batches']} batches")
    if result["p99_ttft_ms"] > SLO_P99_TTFT_MS or result["p99_tpot_ms"] > SLO_P99_TPOT_MS:
        raise Fail(f"the SLO is missed: {line}")
    return [line]
