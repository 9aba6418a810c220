"""Grader of exercise 03 (chapter 03: dynamic batching with a deadline per request): the firing rule,
who shares a batch, the rule inside minillm's scheduler, and choosing knobs on the simulator to meet
an SLO.

Everything runs on a simulated clock. The references are minillm's `DynamicScheduler` and engine
(task 1's rule is asked of one scheduler per request), and for task 3, a scheduler with a longest wait
per request (a variant chapter 03 does not show), the grader-private `DeadlineScheduler`
(`minillm.grading.private.ex03_reference`); all are disabled while the learner's code runs. Task 4 is graded by the simulator: the
learner's knobs run Poisson traces through the engine with a Llama-7B on an A100, costed step by step.

Task 3 grades in a student release too, with an answer key (`minillm.grading.answer_key`): one digest
per trace of the deadline scheduler's whole schedule (every batch's start and members, every token's
time, to the microsecond).
"""

from __future__ import annotations

import functools
from itertools import groupby

import numpy as np

from minillm import SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, build_engine, make_kv_manager
from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, task
from minillm.grading.answer_key import AnswerKey, quantized
from minillm.model.config import ModelConfig
from minillm.request import Request
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.dynamic import DynamicScheduler
from minillm.scheduler.static import StaticScheduler
from minillm.sim import A100_80GB, LLAMA_7B, SimExecutor
from minillm.traces.synthetic import make_trace

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = {"simulate": (4,)}  # task 4: explore the trace on the simulator
_TEACHERS = (private_reference("ex03_reference"),)  # the deadline-per-request scheduler: withheld in a student release


def _private():
    """The grader-private references, loaded at import. Held in a tuple, not as a module global, so
    that looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]


FIRING_RULES = ((DynamicScheduler, "should_fire"), (StaticScheduler, "should_fire"))

# The model the engine is told about: Llama-7B's shape (the simulator's cost model uses it).
SEVEN_B = ModelConfig(model_type="llama", vocab_size=LLAMA_7B.vocab_size, hidden_size=LLAMA_7B.hidden_size,
                      intermediate_size=LLAMA_7B.intermediate_size, num_layers=LLAMA_7B.num_layers,
                      num_heads=LLAMA_7B.num_heads, num_kv_heads=LLAMA_7B.num_kv_heads,
                      head_dim=LLAMA_7B.head_dim, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048)


def _library_fires(now, arrivals, max_batch_size, delay_s):
    """minillm's DynamicScheduler.should_fire on requests that arrived at `arrivals` with one delay."""
    config = EngineConfig(batching="dynamic", max_num_seqs=max_batch_size, max_queue_delay_ms=delay_s * 1000)
    scheduler = DynamicScheduler(config, kv=None)
    for i, t in enumerate(arrivals):
        scheduler.add_request(Request(str(i), [5], SamplingParams(temperature=0.0), t))
    return scheduler.should_fire(now, more_arrivals=True)


def _exact_in_ms(wait_s: float) -> bool:
    """The scheduler keeps its delay in ms: a wait that survives the round trip is compared exactly."""
    return wait_s * 1000 / 1000 == wait_s


NEVER_S = 1e9  # a delay no test reaches: the scheduler fires only when full


def _reference_should_fire(now, waiting, max_batch_size, max_queue_delay_s=None):
    """The deadline rule, asked of minillm's DynamicScheduler alone: full (one scheduler holding every
    waiting request, with a delay never reached) or some request's own deadline (one scheduler per
    request, holding it alone, never full, its longest wait as the delay). `waiting` holds
    (arrival, longest wait) pairs, or arrival times when one `max_queue_delay_s` is given (chapter 03's form)."""
    if max_queue_delay_s is not None:
        waiting = [(arrival, max_queue_delay_s) for arrival in waiting]
    if not all(_exact_in_ms(wait) for _, wait in waiting):
        raise ValueError("the check draws only waits that are exact in milliseconds")
    full = _library_fires(now, [arrival for arrival, _ in waiting], max_batch_size, NEVER_S)
    return full or any(_library_fires(now, [arrival], 2, wait) for arrival, wait in waiting)


class OneUnitPerStep:
    # A stand-in for the model: every row that needs a token gets token 7; every step takes 1 time unit.
    def execute(self, batch):
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self):
        return 1.0


def run_engine(scheduler_class, executor, requests, max_batch_size, max_queue_delay_s, priorities=None):
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
                           request_id=str(i), arrival_time=float(arrival),
                           priority=priorities[i] if priorities else 0)
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


# Task 1's cases, (now, waiting (arrival, longest wait) pairs, max_batch_size): these, then
# SEEDED_FIRING_CASES drawn from seed 7, then FRESH_CASES drawn at grade time.
WRITTEN_FIRING_CASES = (
    (1.0, [], 4),  # nobody waits
    (0.0, [(0.0, 0.5)], 1),  # a batch of one is full at once
    (0.30, [(0.25, 1.0), (0.26, 1.0), (0.28, 1.0)], 3),  # full before any deadline
    (0.30, [(0.25, 0.1), (0.26, 0.1)], 3),  # not full, the oldest waited 0.05 s of 0.1 s
    (0.7 + 0.1, [(0.7, 0.1), (0.75, 0.1)], 4),  # exactly oldest + delay: the engine's timer wakes here
    (0.5, [(0.5, 0.0)], 4),  # no delay at all
    (2.0, [(0.1, 5.0), (0.2, 5.0), (0.3, 5.0), (0.4, 5.0), (0.5, 5.0)], 4),  # more than a full batch waits
    (0.30, [(0.10, 0.5), (0.25, 0.05)], 4),  # a younger request's deadline (0.30) comes first
    (0.29, [(0.10, 0.5), (0.25, 0.05)], 4),  # ... but not yet
    (0.2 + 0.1, [(0.0, 1.0), (0.2, 0.1)], 4),  # exactly a younger request's deadline
)
SEEDED_FIRING_CASES = 300


def _firing_case(rng: np.random.Generator) -> tuple[float, list[tuple[float, float]], int]:
    """A case of task 1 drawn from `rng`: (now, the waiting (arrival, longest wait) pairs, max_batch_size).
    `now` is at an earliest or latest deadline, near the earliest, or at the last arrival."""
    arrivals = np.sort(rng.uniform(0, 1, size=rng.integers(0, 7))).tolist()
    delay = float(rng.choice([0.0, 0.005, 0.01, 0.05, 0.1, 0.25]))
    uniform = rng.random() < 0.4
    waits = [delay if uniform else float(rng.choice([delay, delay / 10, 2 * delay])) for _ in arrivals]
    waits = [wait if _exact_in_ms(wait) else delay for wait in waits]
    deadlines = [a + w for a, w in zip(arrivals, waits)] or [0.0]
    now = float(rng.choice([min(deadlines), max(deadlines), min(deadlines) * rng.uniform(0.5, 1.5),
                            max(arrivals, default=0.0)]))
    return max(now, max(arrivals, default=0.0)), list(zip(arrivals, waits)), int(rng.integers(1, 6))


def _shaped_firing_case(rng: np.random.Generator, full: bool,
                        due: bool) -> tuple[float, list[tuple[float, float]], int]:
    """A case of a chosen shape: someone waits, max_batch_size reached (`full`) or not, and `now` at or after
    a request's deadline (`due`: one of them drawn, or the last arrival if later) or between the last arrival
    and the earliest deadline. The reference still judges it."""
    while True:
        _, waiting, _ = _firing_case(rng)
        deadlines = [arrival + wait for arrival, wait in waiting]
        last_arrival = max((arrival for arrival, _ in waiting), default=0.0)
        if waiting and (due or min(deadlines) > last_arrival):
            break
    if due:
        now = max(last_arrival, float(rng.choice(deadlines)))
    else:
        now = last_arrival + (min(deadlines) - last_arrival) * float(rng.uniform(0.0, 0.95))
    count = len(waiting)
    return now, waiting, int(rng.integers(1, count + 1) if full else rng.integers(count + 1, 8))


# The grade-time cases of task 1, in turn: as the seeded ones, (not full, too early), (not full, due),
# (full, too early). Drawn as the seeded ones only, 82 % should fire and 4 % have someone waiting in vain,
# so a memo of the seeded cases that answered the others with bool(waiting) passed 859 of 2,000 grades
# (43 %), with True 31, with the deadlines alone (no size rule) 1,558. Now every grade has FRESH_CASES // 4
# = 5 cases of each shape: True or bool(waiting) is wrong on the (not full, too early) ones, False or the
# size rule alone on the (not full, due) ones, the deadlines alone on the (full, too early) ones, so each
# fails every grade, by construction (0 of 2,000 seeds each; tests/known_wrong/ex03.py holds the first).
# A memo that guesses at random passes 2**-20 < 1e-6 of grades.
FRESH_SHAPES = (None, (False, False), (False, True), (True, False))


def _fresh_firing_cases(seed: int) -> list[tuple[float, list[tuple[float, float]], int]]:
    """Task 1's FRESH_CASES cases drawn at grade time from `seed`, each shape of FRESH_SHAPES in turn."""
    rng = np.random.default_rng(seed)
    shapes = [FRESH_SHAPES[number % len(FRESH_SHAPES)] for number in range(FRESH_CASES)]
    return [_firing_case(rng) if shape is None else _shaped_firing_case(rng, *shape) for shape in shapes]


@task(1, "firing rule")
def check_task_1(should_fire) -> str:
    cases = list(WRITTEN_FIRING_CASES)
    rng = np.random.default_rng(7)
    cases += [_firing_case(rng) for _ in range(SEEDED_FIRING_CASES)]
    cases += _fresh_firing_cases(grade_time_seeds(1)[0])  # drawn at grade time: they cannot be memoised
    for now, waiting, size in cases:
        want = _reference_should_fire(now, waiting, size)
        with forbid(*FIRING_RULES):
            got = bool(should_fire(now, [tuple(pair) for pair in waiting], size))
        if got != want:
            raise Fail(f"now={now!r}, waiting (arrival, longest wait) {waiting}, max_batch_size={size}: "
                       f"you said {got}, expected {want}")
    return f"{len(cases) - FRESH_CASES} seeded cases and {FRESH_CASES} drawn now agree with the rule"  # counts the seeded ones


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
    for number in range(40 + FRESH_CASES // 4):
        if number == 40:  # then cases drawn at grade time: they cannot be memoised
            rng = np.random.default_rng(grade_time_seeds(1)[0])
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
    return (f"{len(cases) - FRESH_CASES // 4} seeded cases and {FRESH_CASES // 4} drawn now: the same batches, at the "
            "same times, as minillm's engine")


TRACE = dict(num_requests=200, seed=11, vocab_size=32000, rate_per_s=4, prompt_len=("lognormal", 256, 0.8),
             output_len=("lognormal", 64, 0.8), max_prompt_len=1024, max_output_len=512)


def _token_times(engine, n):
    return [engine.metrics.requests[str(i)].token_times for i in range(n)]


def _priorities(seed, n):
    """Which requests are interactive (priority 0: a tenth of the delay) and which are not (1)."""
    rng = np.random.default_rng(seed)
    return [int(p) for p in rng.choice([0, 1], size=n, p=[0.3, 0.7])]


SEEDED_DELAYS_S = (0.05, 0.5, 2.0)  # the seeded trace's three runs
MICROSECOND = 1e-6  # times are compared to the microsecond (a correct timer may differ in the last bits)


def _deadline_case(number):
    """Case `number` of task 3: (requests, priorities, delay): the seeded trace with each seeded delay
    first, then other traces, each with its own priorities and one of the delays."""
    seed, priority_seed = (TRACE["seed"], 13) if number < len(SEEDED_DELAYS_S) else (number, number)
    requests = [(r.arrival_time_s, r.prompt_len, r.max_tokens) for r in make_trace(**dict(TRACE, seed=seed))]
    return requests, _priorities(priority_seed, len(requests)), SEEDED_DELAYS_S[number % len(SEEDED_DELAYS_S)]


def _schedule(engine, num_requests):
    """What a run did, as plain data: every batch (start in µs, members) and every request's token times (µs)."""
    return [[[quantized(start, MICROSECOND), ids] for start, ids in batches_of(engine)],
            [[quantized(t, MICROSECOND) for t in times] for times in _token_times(engine, num_requests)]]


def deadline_schedule(number):
    """Task 3's expected output on case `number`: the deadline rule's schedule of that trace."""
    requests, priorities, delay_s = _deadline_case(number)
    engine = run_engine(_private().DeadlineScheduler, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests, 8,
                        delay_s, priorities)
    return _schedule(engine, len(requests))


KEY_3 = AnswerKey("ex03_dynamic_batcher", 3, size=64, seeded=len(SEEDED_DELAYS_S), reference=deadline_schedule,
                  private=_TEACHERS[0])


def _schedule_difference(where, mine, want):
    (batches, _), (ref_batches, _) = mine, want
    first = next((i for i, (a, b) in enumerate(zip(batches, ref_batches)) if a != b), None)
    yours, expected = ((batches[first], ref_batches[first]) if first is not None else (None, None))
    return (f"{where}: your scheduler's batches or token times differ from the deadline rule's "
            f"({len(batches)} batches vs {len(ref_batches)}; first different batch: {first}, yours "
            f"{_in_seconds(yours)}, expected {_in_seconds(expected)})")


def _in_seconds(batch):
    return None if batch is None else (batch[0] * MICROSECOND, batch[1])


@task(3, "your rule in the real scheduler")
def check_task_3(scheduler_class) -> list[str]:
    missing = [name for name in ("should_fire", "next_wakeup") if name not in vars(scheduler_class)]
    if missing:
        raise Fail(f"{scheduler_class.__name__} does not override {' and '.join(missing)}")
    lines = []
    for case in KEY_3.cases(fresh=1):  # a trace and its priorities drawn now: they cannot be answered in advance
        requests, priorities, delay_s = _deadline_case(case.number)
        seeded = case.number < KEY_3.seeded
        where = f"{'seeded trace' if seeded else f'trace drawn now (case {case.number})'}, delay {delay_s * 1e3:.0f} ms"
        case.expected()
        with forbid(*FIRING_RULES):
            mine = run_engine(scheduler_class, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests, 8, delay_s,
                              priorities)
        case.judge(_schedule(mine, len(requests)), f"{where}: your scheduler's batches and token times",
                   lambda got, want, where=where: _schedule_difference(where, got, want))
        if seeded:
            batches, summary = batches_of(mine), mine.metrics.summary()
            lines.append(f"delay {delay_s * 1e3:4.0f} ms: {len(batches)} batches of {len(requests) / len(batches):.1f} "
                         f"requests on average, mean TTFT {summary.ttft.mean_ms:.0f} ms, "
                         f"p99 TTFT {summary.ttft.percentiles_ms[99]:.0f} ms")
    return KEY_3.report(lines + ["and a trace drawn now, with its own priorities: the same batches and token times"])


# --- task 4: knobs for an SLO ---------------------------------------------------------------------

SLO_TRACE = dict(TRACE, rate_per_s=10)
SLO_P99_TTFT_MS = 8000.0
SLO_P99_TPOT_MS = 16.0


def simulate(max_num_seqs: int, max_queue_delay_ms: float, trace: dict | None = None) -> dict[str, float]:
    """Task 4's trace (200 requests, Poisson at 10/s; `trace` another spec of make_trace) through the
    dynamic batcher on the simulated 7B/A100: p99 TTFT and TPOT in ms, output tokens per second,
    number of batches."""
    requests = [(r.arrival_time_s, r.prompt_len, r.max_tokens) for r in make_trace(**(trace or SLO_TRACE))]
    engine = run_engine(DynamicScheduler, SimExecutor(A100_80GB, LLAMA_7B, token_id=7), requests,
                        max_num_seqs, max_queue_delay_ms / 1000)
    summary = engine.metrics.summary()
    return {"p99_ttft_ms": summary.ttft.percentiles_ms[99], "p99_tpot_ms": summary.tpot.percentiles_ms[99],
            "output_tokens_per_s": summary.output_throughput, "batches": len(batches_of(engine))}


# Traces drawn at grade time: one with a tight TPOT promise (small batches), one with a loose one.
FRESH_TPOT_SLOS_MS = (12.0, 24.0)
FRESH_GRID = (4, 8, 16, 32, 64, 128)  # the sizes the grader tries to set a reachable TTFT promise
FRESH_TTFT_SLACK = 1.1  # the TTFT promise: 10 % above the best the grid reaches within the TPOT promise


def _knobs_of(choose_knobs, simulate_trace, ttft_slo_ms, tpot_slo_ms, where):
    knobs = choose_knobs(simulate_trace, ttft_slo_ms, tpot_slo_ms)
    if not isinstance(knobs, dict) or set(knobs) != {"max_num_seqs", "max_queue_delay_ms"}:
        raise Fail(f"{where}: choose_knobs returns a dict with exactly the keys max_num_seqs and max_queue_delay_ms, "
                   f"not {knobs!r}")
    size, delay = knobs["max_num_seqs"], knobs["max_queue_delay_ms"]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 256:
        raise Fail(f"{where}: max_num_seqs is an int from 1 to 256, not {size!r}")
    if not isinstance(delay, (int, float)) or isinstance(delay, bool) or not 0 <= delay <= 60_000:
        raise Fail(f"{where}: max_queue_delay_ms is a number of ms from 0 to 60000, not {delay!r}")
    return size, float(delay)


@task(4, "knobs that meet the SLO")
def check_task_4(choose_knobs) -> list[str]:
    size, delay = _knobs_of(choose_knobs, simulate, SLO_P99_TTFT_MS, SLO_P99_TPOT_MS, "the seeded trace")
    result = simulate(size, delay)
    line = (f"max_num_seqs={size}, max_queue_delay_ms={delay:g}: p99 TTFT {result['p99_ttft_ms']:.0f} ms "
            f"(SLO {SLO_P99_TTFT_MS:.0f}), p99 TPOT {result['p99_tpot_ms']:.1f} ms (SLO {SLO_P99_TPOT_MS:.0f}), "
            f"{result['output_tokens_per_s']:.0f} output tokens/s, {result['batches']} batches")
    if result["p99_ttft_ms"] > SLO_P99_TTFT_MS or result["p99_tpot_ms"] > SLO_P99_TPOT_MS:
        raise Fail(f"the SLO is missed on the seeded trace: {line}")
    for tpot_slo, seed in zip(FRESH_TPOT_SLOS_MS, grade_time_seeds(len(FRESH_TPOT_SLOS_MS))):
        spec = dict(SLO_TRACE, seed=seed, num_requests=120)  # drawn now: its best knobs are not known in advance
        grid = [simulate(n, 0, spec) for n in FRESH_GRID]
        best_ttft, best_size = min((r["p99_ttft_ms"], n) for n, r in zip(FRESH_GRID, grid) if r["p99_tpot_ms"] <= tpot_slo)
        ttft_slo = FRESH_TTFT_SLACK * best_ttft
        where = f"a trace drawn now (seed {seed}; SLO p99 TTFT {ttft_slo:.0f} ms, p99 TPOT {tpot_slo:.0f} ms)"
        size, delay = _knobs_of(choose_knobs, functools.partial(simulate, trace=spec), ttft_slo, tpot_slo, where)
        got = simulate(size, delay, spec)
        if got["p99_ttft_ms"] > ttft_slo or got["p99_tpot_ms"] > tpot_slo:
            raise Fail(f"{where}: your knobs max_num_seqs={size}, max_queue_delay_ms={delay:g} give p99 TTFT "
                       f"{got['p99_ttft_ms']:.0f} ms and p99 TPOT {got['p99_tpot_ms']:.1f} ms: the SLO is missed "
                       f"(max_num_seqs={best_size} with no delay meets it)")
    return [line, f"and {len(FRESH_TPOT_SLOS_MS)} traces drawn now, each with its own SLO: met"]
