"""Grader of exercise 06 (chapter 06: preemption): the least-work victim, preemption by recompute with
aging, the engine, and the whole schedule() step with a bulk retraction.

Tasks 1, 2 and 4 need no model: a stand-in executor emits token 7 for every row that needs a token
and each step takes 1 ms of simulated time, so only the scheduling and the paged KV manager are
exercised. The references of the variants chapter 06 does not show are grader-private
(`minillm.grading.private.ex06_reference`: minillm's `ContinuousScheduler` with another victim,
aging, and another step); `ContinuousScheduler`'s methods each task asks for are disabled
(`forbid`) while the learner's code runs.
"""

from __future__ import annotations

import random

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine, make_kv_manager
from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, run_until_done, task
from minillm.grading.plug_in import knobs_reach_the_engine
from minillm.llm import BUNDLED_TARGET
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.continuous import ContinuousScheduler

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 50  # task 1's cases drawn at grade time, besides the seeded ones
FRESH_SCENARIOS = 6  # tasks 2 and 4: traces drawn at grade time, besides the seeded ones
LEARNER_TOOLS = ()
_TEACHERS = (private_reference("ex06_reference"),)  # the variants' references: withheld in a student release


def _private():
    """The grader-private references, loaded at import. Held in a tuple, not as a module global, so
    that looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]


MODEL = BUNDLED_TARGET
# What tasks 1-3 write, and what task 4 writes on top: disabled while the learner's code runs.
VICTIM_AND_PREEMPT = ((ContinuousScheduler, "_pick_victim"), (ContinuousScheduler, "_preempt"))
THE_STEP = VICTIM_AND_PREEMPT + tuple((ContinuousScheduler, name) for name in (
    "schedule", "_try_admit", "_queue_head", "_admission_order", "_running_order", "_chunk", "_sort_by_cached_prefix"))

# A small model config for the stand-in runs: the scheduler only reads its context limit.
TOY_MODEL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=256, eos_token_ids=(2,))


class StandInExecutor:
    # Token 7 for every row that needs one (never EOS); every step takes 1 ms; it remembers each plan.
    def __init__(self):
        self.plans = []

    def execute(self, batch):
        self.plans.append((tuple(r.request_id for r in batch.requests), tuple(batch.num_new_tokens),
                           tuple(r.request_id for r in batch.preempted)))
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self):
        return 0.001


def _guard(scheduler, limit=5_000):
    # Checks what every preemption leaves behind, and stops a run whose preemptions never end
    # (a preempted request left in `running` is picked again and again).
    inner, calls = scheduler._preempt, [0]

    def guarded(req, plan):
        calls[0] += 1
        if calls[0] > limit:
            raise RuntimeError(f"more than {limit} preemptions: does _preempt take the request out of self.running?")
        before = req.num_preemptions
        inner(req, plan)
        if scheduler.config.preemption_mode == "recompute" and req.num_computed_tokens != 0:
            raise AssertionError(f"after _preempt, {req.request_id} has num_computed_tokens={req.num_computed_tokens}, "
                                 "not 0: recompute starts again from the first token")
        if scheduler.kv.block_tables.get(req.request_id):
            raise AssertionError(f"after _preempt, {req.request_id} still holds KV blocks")
        if req.num_preemptions != before + 1:
            raise AssertionError(f"after _preempt, {req.request_id}.num_preemptions is {req.num_preemptions}, "
                                 f"expected {before + 1}")
        if req not in plan.preempted:
            raise AssertionError(f"after _preempt, {req.request_id} is not in plan.preempted")
        if req not in scheduler.waiting:
            raise AssertionError(f"after _preempt, {req.request_id} is not back in self.waiting")

    scheduler._preempt = guarded
    return scheduler


def _victim_case(seed):
    # A running list in admission order, and a policy.
    rng = random.Random(seed)
    running = []
    for i in range(rng.randint(1, 8)):
        req = Request(f"r{i}", [5] * rng.randint(1, 30), SamplingParams(max_tokens=8), rng.choice([0.0, 0.001, 0.002]),
                      priority=rng.randint(0, 3))
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = rng.choice([0, req.num_prompt_tokens, rng.randint(1, 40), rng.randint(1, 40)])
        running.append(req)
    rng.shuffle(running)  # preempted requests come back later, so admission order is not arrival order
    return running, rng.choice(["fcfs", "priority"])


def _random_scenario(seed):
    # (name, max_num_seqs, num_kv_blocks, block_size, policy, [(prompt_len, max_tokens, arrival_s, priority), ...],
    #  max_model_len: the longest request, the step's token budget: the default, or tight for odd seeds)
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    requests = [(rng.randint(1, 30), rng.randint(1, 24), round(rng.uniform(0, 0.01), 4), rng.randint(0, 2))
                for _ in range(rng.randint(2, 16))]
    longest = max(p + m for p, m, _, _ in requests)
    num_blocks = -(-longest // block_size) + rng.randint(1, 6)  # room for the longest, little more: preemptions
    scenario = (f"scenario {seed}", rng.randint(2, 8), num_blocks, block_size, rng.choice(["fcfs", "priority"]),
                requests, longest)
    budget = longest + rng.randint(0, 12) if seed % 2 else None  # drawn last: the rest as before
    return (*scenario, budget)


def run_plans(make_scheduler, scenario):
    # Replays one scenario through the real engine loop with paged KV; returns every step's plan.
    _, max_num_seqs, num_blocks, block_size, policy, requests, longest, budget = scenario
    config = EngineConfig(batching="continuous", kv_layout="paged", max_num_seqs=max_num_seqs, max_model_len=longest,
                          block_size=block_size, num_kv_blocks=num_blocks, kv_watermark=0.0,
                          preemption_mode="recompute", scheduling_policy=policy,
                          **({"max_num_batched_tokens": budget} if budget else {}))
    resolved = config.resolve(TOY_MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, TOY_MODEL, allocate_pool=False)
    executor = StandInExecutor()
    engine = build_engine(config, TOY_MODEL, kv=kv, scheduler_factory=lambda _, kv: _guard(make_scheduler(resolved, kv)),
                          executor=executor, clock=SimClock())
    engine.expect_more_requests = False
    for i, (prompt_len, max_tokens, arrival, priority) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5] * prompt_len}, request_id=f"r{i}", arrival_time=arrival,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0), priority=priority)
    run_until_done(engine, 5_000, "the engine stalled with {unfinished} unfinished request(s)")
    return executor.plans, engine.scheduler.num_preemptions, kv.num_free_blocks


PROMPTS = ["Once upon a time", "The little robot", "In the morning the market", "She opened the door and",
           "A long time ago", "The rain fell on", "He looked at the map", "Every evening the old man",
           "The train was late", "Under the bridge", "They walked to the river", "The garden was quiet"]
OUTPUT_LENS = [60, 23, 70, 39, 56, 32, 61, 42, 36, 50, 44, 57]
ENGINE_KNOBS = dict(batching="continuous", kv_layout="paged", block_size=8, num_kv_blocks=24, max_num_seqs=8,
                    max_model_len=128)  # 192 KV slots for 8 seats: preemptions are certain


def _engine_run(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in OUTPUT_LENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # all requests waiting at t = 0
    steps = llm.engine.metrics.steps
    return ([o.outputs[0].token_ids for o in outputs], llm.engine.scheduler.num_preemptions,
            sum(s.num_prefill_tokens for s in steps))


@task(1, "pick victim")
def check_task_1(pick_victim, num_cases: int = 300) -> str:
    for seed in [*range(num_cases), *grade_time_seeds(FRESH_CASES)]:  # fresh ones cannot be memoised
        running, policy = _victim_case(seed)
        expected = _private().least_work_victim(list(running), policy).request_id
        with forbid(*VICTIM_AND_PREEMPT):
            got = pick_victim(list(running), policy)
        got = getattr(got, "request_id", got)
        if got != expected:
            desc = [(r.request_id, f"priority={r.priority}", f"computed={r.num_computed_tokens}") for r in running]
            raise Fail(f"case {seed} ({policy}): you picked {got}, expected {expected}; "
                       f"running in admission order: {desc}")
    return f"{num_cases} seeded cases and {FRESH_CASES} drawn now agree with the least-work rule"


def _compare_plans(make_scheduler, disabled, reference, num_cases=60):
    scenarios = [_random_scenario(seed) for seed in range(num_cases)]
    scenarios += [_random_scenario(seed) for seed in grade_time_seeds(FRESH_SCENARIOS)]  # cannot be memoised
    total = 0
    for number, scenario in enumerate(scenarios):
        expected, ref_preemptions, ref_free = run_plans(reference, scenario)
        total += ref_preemptions * (number < num_cases)
        with forbid(*disabled):
            try:
                plans, preemptions, free = run_plans(make_scheduler, scenario)
            except Fail as failure:
                raise Fail(f"{scenario[0]}: {failure}") from None
            except Exception as error:  # noqa: BLE001
                raise Fail(f"{scenario[0]}: {type(error).__name__}: {error}") from None
        limits = (f"max_num_seqs={scenario[1]}, blocks={scenario[2]}x{scenario[3]}, {scenario[4]}"
                  + (f", budget={scenario[7]}" if scenario[7] else ""))
        for step, (mine, ref) in enumerate(zip(plans + [None] * len(expected), expected)):
            if mine != ref:
                raise Fail(f"{scenario[0]} ({limits}), step {step}: your plan {mine}, the rules' {ref} "
                           f"(request ids, new tokens, preempted this step)")
        if len(plans) != len(expected):
            raise Fail(f"{scenario[0]}: {len(plans)} steps, the rules take {len(expected)}")
        if (preemptions, free) != (ref_preemptions, ref_free):
            raise Fail(f"{scenario[0]}: {preemptions} preemptions counted and {free} blocks free at the end, "
                       f"expected {ref_preemptions} and {ref_free}")
    return num_cases, total


@task(2, "preempt by recompute, with aging")
def check_task_2(make_scheduler, num_cases: int = 60) -> str:
    count, total = _compare_plans(make_scheduler, VICTIM_AND_PREEMPT, _private().AgingScheduler, num_cases)
    return (f"{count} seeded traces ({total} preemptions) and {FRESH_SCENARIOS} drawn now, every step's plan "
            "as the least-work victim and aging say")


@task(3, "real engine")
def check_task_3(make_llm, scheduler_class) -> list[str]:
    with forbid(*VICTIM_AND_PREEMPT):
        llm = make_llm(**ENGINE_KNOBS)
        used = type(llm.engine.scheduler).__name__
        if not isinstance(llm.engine.scheduler, scheduler_class):
            raise Fail(f"the engine runs {used}, not your {scheduler_class.__name__}")
        knobs_reach_the_engine(make_llm, ENGINE_KNOBS, lambda other: isinstance(other.engine.scheduler, scheduler_class))
    ref_tokens, ref_preemptions, ref_prefill = _engine_run(
        LLM(MODEL, scheduler_factory=lambda config, kv: _private().AgingScheduler(config, kv), **ENGINE_KNOBS))
    roomy_tokens, _, _ = _engine_run(LLM(MODEL, **{**ENGINE_KNOBS, "num_kv_blocks": 256}))
    with forbid(*VICTIM_AND_PREEMPT):
        _guard(llm.engine.scheduler)
        tokens, preemptions, prefill = _engine_run(llm)
    lines = [f"scheduler in the engine: {used}",
             f"preemptions: yours {preemptions}, minillm {ref_preemptions} (> 0: {preemptions > 0})",
             f"prefill tokens computed: yours {prefill}, minillm {ref_prefill}",
             f"outputs identical to minillm's with the same rules: {tokens == ref_tokens}",
             f"outputs identical to a run without preemption: {tokens == roomy_tokens}"]
    if (tokens, preemptions, prefill) != (ref_tokens, ref_preemptions, ref_prefill) or preemptions == 0:
        raise Fail("your engine run differs from minillm's: " + "; ".join(lines[1:]))
    return lines


@task(4, "the whole step with a bulk retraction")
def check_task_4(step_scheduler_class, num_cases: int = 60) -> str:
    if "schedule" not in vars(step_scheduler_class):
        raise Fail(f"{step_scheduler_class.__name__} does not define its own schedule()")
    count, total = _compare_plans(step_scheduler_class, THE_STEP, _private().RetractScheduler, num_cases)
    return (f"{count} seeded traces ({total} preemptions) and {FRESH_SCENARIOS} drawn now, every step of your "
            "schedule() as the retraction rules say")
