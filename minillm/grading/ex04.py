"""Grader of exercise 04 (chapter 04: continuous batching with fixed seats): retire, admit, the whole
step, the engine.

Tasks 1–3 need no model: a stand-in executor emits token 7 for every row that needs a token and
each step takes 1 ms of simulated time, so only the scheduling is exercised. The exercise's scheduler
keeps fixed seats (a variant chapter 04 does not show); its reference, `SeatScheduler`, is
grader-private (`minillm.grading.private.ex04_reference`), and minillm's `ContinuousScheduler` checks
the KV side of task 1 and the real engine of task 4. Both are disabled while the learner's code runs.
"""

from __future__ import annotations

import random

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine
from minillm.grading import (
    Fail,
    forbid,
    grade_time_seeds,
    private_reference,
    refuse_subclass,
    run_until_done,
    task,
)
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


@task(1, "retire")
def check_task_1(retire, num_cases: int = 200) -> str:
    for seed in [*range(num_cases), *grade_time_seeds(FRESH_CASES)]:  # fresh ones cannot be memoised
        mine_running, mine_kv = _retire_case(seed)
        ref_running, ref_kv = _retire_case(seed)
        reference = ContinuousScheduler(EngineConfig(kv_layout="slab").resolve(256), ref_kv)
        reference.running = list(ref_running)
        for req in ref_running:
            if req.status.finished:
                reference.finish(req)  # update_from_output calls finish() for every request that finished
        seats = _seated(mine_running, random.Random(seed))
        expected = [getattr(r, "request_id", None) for r in _private().retired(seats)]
        with forbid(ContinuousScheduler):
            kept = retire(list(seats), mine_kv)
        if not isinstance(kept, list):
            raise Fail(f"case {seed}: retire returned {type(kept).__name__}, not the list of seats")
        got = [getattr(r, "request_id", r) for r in kept]
        if got != expected:
            raise Fail(f"case {seed}: seats before {[getattr(r, 'request_id', None) for r in seats]} "
                       f"(finished: {[r.request_id for r in seats if r is not None and r.status.finished]}); "
                       f"you left {got}, expected {expected} (a finished request's seat empty, every other "
                       "request in its own seat)")
        if mine_kv.slab_of != ref_kv.slab_of or sorted(mine_kv.free_slabs) != sorted(ref_kv.free_slabs):
            raise Fail(f"case {seed}: KV slabs held afterwards {sorted(mine_kv.slab_of)}, expected "
                       f"{sorted(ref_kv.slab_of)}: free every finished request's slab, and only theirs")
    return f"{num_cases} seeded batches and {FRESH_CASES} drawn now: seats emptied, slabs freed as by ContinuousScheduler.finish"


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


def _compare_plans(make_scheduler, num_random, what):
    scenarios = NAMED_SCENARIOS + [_random_scenario(seed) for seed in range(num_random)]
    scenarios += [_random_scenario(seed) for seed in grade_time_seeds(FRESH_SCENARIOS)]  # cannot be memoised
    for scenario in scenarios:
        expected = run_plans(_private().SeatScheduler, scenario)
        with forbid(ContinuousScheduler):
            try:
                plans = run_plans(make_scheduler, scenario)
            except Fail as failure:
                raise Fail(f"{scenario[0]}: {failure}") from None
            except Exception as error:  # noqa: BLE001
                raise Fail(f"{scenario[0]}: {type(error).__name__}: {error}") from None
        limits = f"max_num_seqs={scenario[1]}, budget={scenario[2]}, slabs={scenario[3]}"
        for step, (mine, ref) in enumerate(zip(plans + [None] * len(expected), expected)):
            if mine != ref:
                raise Fail(f"{scenario[0]} ({limits}), step {step}: {what} planned {mine}, "
                           f"the seat rules plan {ref} (request ids, new tokens, statuses, admitted)")
        if len(plans) != len(expected):
            raise Fail(f"{scenario[0]}: {len(plans)} steps, the seat rules take {len(expected)}")
    return len(scenarios) - FRESH_SCENARIOS


@task(2, "admit")
def check_task_2(scheduler_class, num_random: int = 64) -> str:
    refuse_subclass(scheduler_class, ContinuousScheduler)
    if "admit" not in {name for klass in scheduler_class.__mro__ for name in vars(klass)}:
        raise Fail(f"{scheduler_class.__name__} has no admit method")
    probe = type("YourAdmit", (_private().AdmitHarness, scheduler_class), {})  # the harness's step, your admit
    count = _compare_plans(probe, num_random, "your admit")
    return f"{count} seeded traces and {FRESH_SCENARIOS} drawn now, every step's admissions as the seat rules say"


@task(3, "the whole step")
def check_task_3(scheduler_class, num_random: int = 64) -> str:
    refuse_subclass(scheduler_class, ContinuousScheduler)
    count = _compare_plans(scheduler_class, num_random, "your schedule")
    return f"{count} seeded traces and {FRESH_SCENARIOS} drawn now, every step's plan as the seat rules say"


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
