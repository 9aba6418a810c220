"""Grader of exercise 04 (chapter 04: continuous batching with fixed seats): retire, admit, the whole
step, the engine.

Tasks 1–3 need no model: a stand-in executor emits token 7 for every row that needs a token and
each step takes 1 ms of simulated time, so only the scheduling is exercised. The exercise's scheduler
keeps fixed seats (a variant chapter 04 does not show); its reference, `SeatScheduler`, is
grader-private (`minillm.grading.private.ex04_reference`), and minillm's `ContinuousScheduler` checks
the KV side of task 1 and the real engine of task 4. Both are disabled while the learner's code runs.

Tasks 1–3 grade in a student release too, with answer keys (`minillm.grading.answer_key`): one digest
per pool case of the reference's whole output (25 batches' seats and slabs; 20 admissions' seats,
queue and slabs; every step's plan of a trace). Task 2 runs the learner's `admit` on seat states the
grader builds (in both copies), and, where the private harness is (the teacher's copy), inside the
harness's step on whole traces as well.
"""

from __future__ import annotations

import random
from collections import deque

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine
from minillm.grading import (
    Fail,
    forbid,
    private_reference,
    refuse_subclass,
    run_until_done,
    task,
)
from minillm.grading.answer_key import AnswerKey
from minillm.grading.plug_in import knobs_reach_the_engine
from minillm.kv.slab import SlabKVManager
from minillm.llm import BUNDLED_TARGET
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.continuous import ContinuousScheduler

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 50  # task 1's cases drawn at grade time, besides the seeded ones
FRESH_SCENARIOS = 8  # tasks 2 and 3: scenarios drawn at grade time, besides the seeded ones
LEARNER_TOOLS = ()
_TEACHERS = (private_reference("ex04_reference"),)  # the seat scheduler: withheld in a student release


def _private():
    """The grader-private references, loaded at import. Held in a tuple, not as a module global, so
    that looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]


# A small model config for the stand-in runs: the scheduler only reads its context limit.
TOY_MODEL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=256, eos_token_ids=(2,))


class StandInExecutor:
    """Token 7 for every row that needs one (never EOS); every step takes 1 ms; it remembers each plan."""

    def __init__(self):
        self.plans = []

    def execute(self, batch):
        self.plans.append((tuple(r.request_id for r in batch.requests), tuple(batch.num_new_tokens),
                           tuple(r.status.name for r in batch.requests), tuple(r.request_id for r, _ in batch.admitted)))
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self):
        return 0.001


def _request(rid, prompt_len, max_tokens=8, arrival=0.0):
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival)


def _retire_case(seed):
    # A running batch after a step: some requests have just finished (any finished status).
    rng = random.Random(seed)
    num_slabs = rng.randint(1, 8)
    kv = SlabKVManager(1, 1, 8, num_slabs=num_slabs, slab_len=64, allocate_pool=False)
    running = []
    for i in range(rng.randint(0, num_slabs)):
        req = _request(f"r{i}", rng.randint(1, 40))
        assert kv.allocate(req, req.num_prompt_tokens)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_prompt_tokens
        running.append(req)
    rng.shuffle(running)
    for req in running:
        if rng.random() < 0.4:
            req.status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                                     RequestStatus.FINISHED_ABORTED])
    return running, kv


def _seated(running, rng):
    """The running requests placed in seats (some empty), as the learner's scheduler holds them."""
    seats = [None] * (len(running) + rng.randint(0, 3))
    for req, seat in zip(running, sorted(rng.sample(range(len(seats)), len(running)))):
        seats[seat] = req
    return seats


RETIRE_BATCHES = 25  # batches in one case of task 1: one digest covers all their seats and slabs


def _retire_seeds(number):
    return [number * RETIRE_BATCHES + j for j in range(RETIRE_BATCHES)]


def _kv_state(kv):
    return [sorted(kv.slab_of.items()), sorted(kv.free_slabs)]


def retired_batches(number):
    """Task 1's expected output on case `number`: per batch, the seats' request ids after retire
    (None: an empty seat) and the slabs held and free afterwards (as ContinuousScheduler.finish leaves them)."""
    out = []
    for seed in _retire_seeds(number):
        running, kv = _retire_case(seed)
        seats = _seated(running, random.Random(seed))
        expected = [getattr(r, "request_id", None) for r in _private().retired(seats)]
        reference = ContinuousScheduler(EngineConfig(kv_layout="slab").resolve(256), kv)
        reference.running = list(running)
        for req in running:
            if req.status.finished:
                reference.finish(req)  # update_from_output calls finish() for every request that finished
        out.append([expected, *_kv_state(kv)])
    return out


KEY_1 = AnswerKey("ex04_continuous_scheduler", 1, size=256, seeded=8, reference=retired_batches,
                  private=_TEACHERS[0])


def _retire_difference(number, mine, want):
    for seed, (ids, *kv), (ref_ids, *ref_kv) in zip(_retire_seeds(number), mine, want):
        seats = _seated(_retire_case(seed)[0], random.Random(seed))
        if ids != ref_ids:
            return (f"case {seed}: seats before {[getattr(r, 'request_id', None) for r in seats]} "
                    f"(finished: {[r.request_id for r in seats if r is not None and r.status.finished]}); "
                    f"you left {ids}, expected {ref_ids} (a finished request's seat empty, every other "
                    "request in its own seat)")
        if kv != ref_kv:
            return (f"case {seed}: KV slabs held afterwards {[rid for rid, _ in kv[0]]}, expected "
                    f"{[rid for rid, _ in ref_kv[0]]}: free every finished request's slab, and only theirs")
    return f"cases {_retire_seeds(number)[0]}..{_retire_seeds(number)[-1]}: your seats or slabs differ"


@task(1, "retire")
def check_task_1(retire) -> str | list[str]:
    for case in KEY_1.cases(fresh=FRESH_CASES // RETIRE_BATCHES):  # fresh ones cannot be memoised
        case.expected()
        mine = []
        for seed in _retire_seeds(case.number):
            running, kv = _retire_case(seed)
            seats = _seated(running, random.Random(seed))
            with forbid(ContinuousScheduler):
                kept = retire(list(seats), kv)
            if not isinstance(kept, list):
                raise Fail(f"case {seed}: retire returned {type(kept).__name__}, not the list of seats")
            if len(kept) != len(seats):
                raise Fail(f"case {seed}: {len(seats)} seats went in, {len(kept)} came back: every seat stays (a "
                           "finished request's empty, None), every other request in its own seat")
            mine.append([[getattr(r, "request_id", r) for r in kept], *_kv_state(kv)])
        seeds = _retire_seeds(case.number)
        case.judge(mine, f"cases {seeds[0]}..{seeds[-1]} (seats and slabs after retire)",
                   lambda mine, want, number=case.number: _retire_difference(number, mine, want))
    seeded = KEY_1.seeded * RETIRE_BATCHES
    return KEY_1.report(f"{seeded} seeded batches and {FRESH_CASES} drawn now: seats emptied, slabs freed as by "
                        "ContinuousScheduler.finish")


# Named scenarios first (each stresses one rule), then random ones. A scenario is
# (name, max_num_seqs, max_num_batched_tokens, num_slabs, [(prompt_len, max_tokens, arrival_s), ...]).
NAMED_SCENARIOS = [
    ("max_num_seqs caps the batch", 2, 256, 6, [(5, 4, 0.0)] * 6),
    ("the token budget caps a step", 8, 64, 8, [(40, 3, 0.0), (30, 3, 0.0), (20, 2, 0.0), (50, 2, 0.0)]),
    ("the KV pool can say no", 8, 256, 2, [(6, 5, 0.0), (7, 3, 0.0), (8, 4, 0.0), (3, 2, 0.0)]),
    ("oldest first: no overtaking", 8, 64, 8, [(10, 6, 0.0)] * 3 + [(62, 2, 0.0005), (3, 2, 0.0005)]),
    ("seats are reused at once", 2, 256, 2, [(4, 2, 0.0), (4, 6, 0.0), (5, 2, 0.0), (6, 3, 0.0), (4, 2, 0.004)]),
    ("running requests first, budget exactly spent", 4, 64, 4, [(30, 9, 0.0), (34, 4, 0.0), (20, 3, 0.0015),
                                                              (62, 2, 0.0015), (1, 2, 0.003)]),
]


def _random_scenario(seed):
    rng = random.Random(seed)
    requests = [(rng.randint(1, 52), rng.randint(1, 12), round(rng.uniform(0, 0.02), 4))
                for _ in range(rng.randint(1, 24))]
    return (f"random scenario {seed}", rng.randint(1, 8), rng.choice([64, 80, 128, 256]), rng.randint(1, 8),
            requests)


def run_plans(make_scheduler, scenario):
    """Replays one scenario through the real engine loop; returns every step's plan."""
    _, max_num_seqs, budget, num_slabs, requests = scenario
    config = EngineConfig(batching="continuous", kv_layout="slab", max_num_seqs=max_num_seqs,
                          max_model_len=64, max_num_batched_tokens=budget).resolve(TOY_MODEL.max_position_embeddings)
    kv = SlabKVManager(1, 1, 8, num_slabs=num_slabs, slab_len=64, allocate_pool=False)
    executor = StandInExecutor()
    engine = build_engine(config, TOY_MODEL, kv=kv, scheduler_factory=lambda _, kv: make_scheduler(config, kv),
                          executor=executor, clock=SimClock())
    engine.expect_more_requests = False
    for i, (prompt_len, max_tokens, arrival) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5] * prompt_len}, request_id=f"r{i}", arrival_time=arrival,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    run_until_done(engine, 2_000, "the engine stalled with {unfinished} unfinished request(s)")
    return executor.plans


def _scenario(number):
    """The scenario built from `number`: the named ones first, then random ones."""
    if number < len(NAMED_SCENARIOS):
        return NAMED_SCENARIOS[number]
    return _random_scenario(number - len(NAMED_SCENARIOS))


SEEDED_SCENARIOS = len(NAMED_SCENARIOS) + 64


def seat_plans(number):
    """Tasks 2 and 3's expected output on scenario `number`: every step's plan by the seat rules."""
    return run_plans(_private().SeatScheduler, _scenario(number))


KEY_3 = AnswerKey("ex04_continuous_scheduler", 3, size=256, seeded=SEEDED_SCENARIOS, reference=seat_plans,
                  private=_TEACHERS[0])


def _plan_difference(scenario, what, mine, want):
    limits = f"max_num_seqs={scenario[1]}, budget={scenario[2]}, slabs={scenario[3]}"
    for step, (plan, ref) in enumerate(zip(mine + [None] * len(want), want)):
        if plan != ref:
            return (f"{scenario[0]} ({limits}), step {step}: {what} planned {plan}, "
                    f"the seat rules plan {ref} (request ids, new tokens, statuses, admitted)")
    return f"{scenario[0]}: {len(mine)} steps, the seat rules take {len(want)}"


def _compare_plans(make_scheduler, cases, what):
    for case in cases:
        scenario = _scenario(case.number)
        case.expected()
        with forbid(ContinuousScheduler):
            try:
                plans = run_plans(make_scheduler, scenario)
            except Fail as failure:
                raise Fail(f"{scenario[0]}: {failure}") from None
            except Exception as error:  # noqa: BLE001
                raise Fail(f"{scenario[0]}: {type(error).__name__}: {error}") from None
        limits = f"max_num_seqs={scenario[1]}, budget={scenario[2]}, slabs={scenario[3]}"
        case.judge(plans, f"{scenario[0]} ({limits}): {what}'s plans",
                   lambda mine, want, scenario=scenario: _plan_difference(scenario, what, mine, want))


# Task 2 in both copies: the learner's admit on seat states the grader builds (a case: twenty of them).
ADMITS = 20


def _admit_state(seed):
    """A seat scheduler's state before admit: some seats taken (their slabs held), a queue, a budget."""
    rng = random.Random(seed)
    max_num_seqs, num_slabs = rng.randint(1, 8), rng.randint(1, 8)
    config = EngineConfig(batching="continuous", kv_layout="slab", max_num_seqs=max_num_seqs, max_model_len=64,
                          max_num_batched_tokens=256).resolve(TOY_MODEL.max_position_embeddings)
    kv = SlabKVManager(1, 1, 8, num_slabs=num_slabs, slab_len=64, allocate_pool=False)
    seats = [None] * max_num_seqs
    for seat in sorted(rng.sample(range(max_num_seqs), rng.randint(0, min(max_num_seqs, num_slabs)))):
        req = _request(f"s{seat}", rng.randint(1, 40))
        kv.allocate(req, req.num_prompt_tokens)
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, req.num_prompt_tokens
        seats[seat] = req
    waiting = [_request(f"w{i}", rng.randint(1, 52)) for i in range(rng.randint(0, 6))]
    return config, kv, seats, waiting, rng.choice([0, 4, 16, 40, 64, 128, 256])


def _admit_seeds(number):
    return [number * ADMITS + j for j in range(ADMITS)]


def _admit_once(make_scheduler, seed):
    config, kv, seats, waiting, budget = _admit_state(seed)
    scheduler = make_scheduler(config, kv)
    scheduler.seats, scheduler.waiting = seats, deque(waiting)
    admitted = scheduler.admit(budget)
    return [[[getattr(req, "request_id", req), n] for req, n in admitted],
            [getattr(r, "request_id", r) for r in scheduler.seats], [r.request_id for r in scheduler.waiting],
            [r.status.name for r in waiting], *_kv_state(kv)]


def admissions(number):
    """Task 2's expected output on case `number`: for each of its seat states, what the seat rules' admit
    returns and leaves (seats, queue, statuses, slabs)."""
    return [_admit_once(_private().SeatScheduler, seed) for seed in _admit_seeds(number)]


KEY_2 = AnswerKey("ex04_continuous_scheduler", 2, size=256, seeded=20, reference=admissions, private=_TEACHERS[0])


def _admit_difference(number, mine, want):
    for seed, got, ref in zip(_admit_seeds(number), mine, want):
        if got != ref:
            config, _, seats, waiting, budget = _admit_state(seed)
            return (f"seat state {seed} (max_num_seqs={config.max_num_seqs}, seats "
                    f"{[getattr(r, 'request_id', None) for r in seats]}, queue "
                    f"{[(r.request_id, r.num_prompt_tokens) for r in waiting]}, budget {budget}): your admit "
                    f"returned {got[0]} and left seats {got[1]}, queue {got[2]}; the seat rules: {ref[0]}, seats "
                    f"{ref[1]}, queue {ref[2]} (statuses and slabs too)")
    return f"seat states {_admit_seeds(number)[0]}..{_admit_seeds(number)[-1]}: your admissions differ"


@task(2, "admit")
def check_task_2(scheduler_class) -> str | list[str]:
    refuse_subclass(scheduler_class, ContinuousScheduler)
    if "admit" not in {name for klass in scheduler_class.__mro__ for name in vars(klass)}:
        raise Fail(f"{scheduler_class.__name__} has no admit method")
    lines = []
    if KEY_2.teacher:  # the harness (the seat step without admit) is grader-private: whole traces here only
        probe = type("YourAdmit", (_private().AdmitHarness, scheduler_class), {})  # the harness's step, your admit
        _compare_plans(probe, KEY_3.cases(fresh=FRESH_SCENARIOS), "your admit")
        lines.append(f"{SEEDED_SCENARIOS} seeded traces and {FRESH_SCENARIOS} drawn now, every step's admissions "
                     "as the seat rules say")
    for case in KEY_2.cases(fresh=FRESH_SCENARIOS // 4):
        case.expected()
        with forbid(ContinuousScheduler):
            mine = [_admit_once(scheduler_class, seed) for seed in _admit_seeds(case.number)]
        seeds = _admit_seeds(case.number)
        case.judge(mine, f"seat states {seeds[0]}..{seeds[-1]} (what admit returns and leaves)",
                   lambda mine, want, number=case.number: _admit_difference(number, mine, want))
    lines.append(f"{KEY_2.seeded * ADMITS} seeded seat states and {FRESH_SCENARIOS // 4 * ADMITS} drawn now: admit "
                 "alone returns and leaves what the seat rules say")
    return KEY_2.report(lines)


@task(3, "the whole step")
def check_task_3(scheduler_class) -> str | list[str]:
    refuse_subclass(scheduler_class, ContinuousScheduler)
    _compare_plans(scheduler_class, KEY_3.cases(fresh=FRESH_SCENARIOS), "your schedule")
    return KEY_3.report(f"{SEEDED_SCENARIOS} seeded traces and {FRESH_SCENARIOS} drawn now, every step's plan as "
                        "the seat rules say")


PROMPTS = ["Once upon a time", "The little robot", "In the morning the market", "She opened the door and",
           "A long time ago", "The rain fell on", "He looked at the map", "Every evening the old man",
           "The train was late", "Under the bridge", "They walked to the river", "The garden was quiet"]
OUTPUT_LENS = [24, 3, 40, 9, 16, 2, 31, 12, 6, 20, 4, 27]
ENGINE_KNOBS = dict(max_num_seqs=4, max_model_len=256, kv_layout="slab")


def _engine_run(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in OUTPUT_LENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # all requests waiting at t = 0
    steps = llm.engine.metrics.steps
    return [o.outputs[0].token_ids for o in outputs], len(steps), sum(s.num_computed_tokens for s in steps)


@task(4, "real engine")
def check_task_4(make_llm, scheduler_class) -> list[str]:
    refuse_subclass(scheduler_class, ContinuousScheduler)
    with forbid(ContinuousScheduler):
        llm = make_llm(**ENGINE_KNOBS)
        used = type(llm.engine.scheduler).__name__
        if not isinstance(llm.engine.scheduler, scheduler_class):
            raise Fail(f"the engine runs {used}, not your {scheduler_class.__name__}")
        knobs_reach_the_engine(make_llm, ENGINE_KNOBS, lambda other: isinstance(other.engine.scheduler, scheduler_class))
    ref_tokens, ref_steps, ref_computed = _engine_run(LLM(BUNDLED_TARGET, batching="continuous", **ENGINE_KNOBS))
    with forbid(ContinuousScheduler):
        tokens, steps, computed = _engine_run(llm)
    lines = [f"scheduler in the engine: {used}",
             f"greedy outputs identical to minillm's continuous engine: {tokens == ref_tokens}",
             f"engine steps: yours {steps}, minillm {ref_steps}",
             f"tokens computed: yours {computed}, minillm {ref_computed}"]
    if (tokens, steps, computed) != (ref_tokens, ref_steps, ref_computed):
        raise Fail("your engine run differs from minillm's: " + "; ".join(lines[1:]))
    return lines
