"""Grader of exercise 06 (chapter 06: preemption): the least-work victim, preemption by recompute with
aging, the engine, and the whole schedule() step with a bulk retraction.

Tasks 1, 2 and 4 need no model: a stand-in executor emits token 7 for every row that needs a token
and each step takes 1 ms of simulated time, so only the scheduling and the paged KV manager are
exercised. The references of the variants chapter 06 does not show are grader-private
(`minillm.grading.private.ex06_reference`: minillm's `ContinuousScheduler` with another victim,
aging, and another step); `ContinuousScheduler`'s methods each task asks for are disabled
(`forbid`) while the learner's code runs. A student release, which has no private references,
grades every task with its answer key (`minillm.grading.answer_key`): a digest of the references'
whole output per case (64 victim choices; a whole schedule), and the properties that need no
reference (what `_guard` checks after each preemption, every block back at the end, greedy outputs
that preemption leaves unchanged) checked first, for their better messages.
"""

from __future__ import annotations

import random
from functools import partial

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine, make_kv_manager
from minillm.grading import Fail, forbid, private_reference, run_until_done, task
from minillm.grading.answer_key import AnswerKey
from minillm.grading.plug_in import knobs_reach_the_engine
from minillm.llm import BUNDLED_TARGET
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.continuous import ContinuousScheduler

VICTIMS_PER_CASE = 64  # task 1: one case is 64 victim choices (one digest over a single choice could be searched)
SEEDED_VICTIM_CASES, FRESH_VICTIM_CASES = 5, 1  # task 1: 320 seeded choices, 64 drawn at grade time
SEEDED_SCENARIOS = 60  # tasks 2 and 4: seeded traces
FRESH_SCENARIOS = 6  # tasks 2 and 4: traces drawn at grade time, besides the seeded ones
# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
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
    # The greedy outputs, and the schedule: per step (requests, prefill tokens, decode tokens, preemptions,
    # KV tokens in use), then the preemptions and the prefill tokens in all. Every request generates its
    # fixed length (ignore_eos), so the schedule does not depend on the tokens: only integers, on any machine.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in OUTPUT_LENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # all requests waiting at t = 0
    steps = llm.engine.metrics.steps
    schedule = [[(s.num_seqs, s.num_prefill_tokens, s.num_decode_tokens, s.num_preemptions, s.kv_used_tokens)
                 for s in steps], llm.engine.scheduler.num_preemptions, sum(s.num_prefill_tokens for s in steps)]
    return [o.outputs[0].token_ids for o in outputs], schedule


def _aging_scheduler(config, kv):
    return _private().AgingScheduler(config, kv)


def aging_engine_schedule(number):
    """Task 3's expected output (its one case, number 0): the schedule of minillm's engine on the bundled
    model under the least-work victim and aging."""
    return _engine_run(LLM(MODEL, scheduler_factory=_aging_scheduler, **ENGINE_KNOBS))[1]


KEY_3 = AnswerKey("ex06_preemption", 3, size=1, seeded=1, reference=aging_engine_schedule, private=_TEACHERS[0])


def _engine_difference(mine, want):
    steps, preemptions, prefill = mine
    ref_steps, ref_preemptions, ref_prefill = want
    first = next((i for i, (a, b) in enumerate(zip(steps, ref_steps)) if a != b), min(len(steps), len(ref_steps)))
    return (f"your engine run differs from minillm's under the same rules: preemptions yours {preemptions}, "
            f"minillm {ref_preemptions}; prefill tokens yours {prefill}, minillm {ref_prefill}; steps yours "
            f"{len(steps)}, minillm {len(ref_steps)}, first different at step {first} (requests, prefill tokens, "
            f"decode tokens, preemptions, KV tokens in use): yours {steps[first] if first < len(steps) else None}, "
            f"minillm {ref_steps[first] if first < len(ref_steps) else None}")


def _victim_cases(number):
    # Task 1's case `number`: VICTIMS_PER_CASE victim choices (case 0 holds choices 0-63, and so on).
    return [_victim_case(number * VICTIMS_PER_CASE + j) for j in range(VICTIMS_PER_CASE)]


def _running_desc(running):
    return [(r.request_id, f"priority={r.priority}", f"computed={r.num_computed_tokens}") for r in running]


def least_work_victims(number):
    """Task 1's expected output on case `number`: the victim's request id in each of its choices."""
    return [_private().least_work_victim(list(running), policy).request_id for running, policy in _victim_cases(number)]


KEY_1 = AnswerKey("ex06_preemption", 1, size=256, seeded=SEEDED_VICTIM_CASES, reference=least_work_victims,
                  private=_TEACHERS[0])


def _victim_difference(number, choices, mine, want):
    index = next(i for i, (m, w) in enumerate(zip(mine, want)) if m != w)
    running, policy = choices[index]
    return (f"case {number}, choice {index} ({policy}): you picked {mine[index]}, expected {want[index]}; "
            f"running in admission order: {_running_desc(running)}")


@task(1, "pick victim")
def check_task_1(pick_victim) -> str:
    for case in KEY_1.cases(fresh=FRESH_VICTIM_CASES):  # drawn ones cannot be memoised
        choices, mine = _victim_cases(case.number), []
        for index, (running, policy) in enumerate(choices):
            with forbid(*VICTIM_AND_PREEMPT):
                got = pick_victim(list(running), policy)
            where = f"case {case.number}, choice {index} ({policy}), running in admission order: {_running_desc(running)}"
            if not any(got is r for r in running):
                raise Fail(f"{where}: you returned {got!r}, not one of the running requests")
            if policy == "priority" and got.priority != max(r.priority for r in running):
                raise Fail(f"{where}: you picked {got.request_id} (priority={got.priority}); under \"priority\" "
                           f"expected one of the least important (largest priority value, "
                           f"{max(r.priority for r in running)})")
            mine.append(got.request_id)
        case.judge(mine, f"case {case.number} ({len(choices)} choices, rebuilt by grader._victim_cases({case.number}))",
                   explain=partial(_victim_difference, case.number, choices))
    return KEY_1.report(f"{SEEDED_VICTIM_CASES * VICTIMS_PER_CASE} seeded cases and "
                        f"{FRESH_VICTIM_CASES * VICTIMS_PER_CASE} drawn now agree with the least-work rule")


def aging_plans(number):
    """Task 2's expected output on case `number` (the scenario of that seed): every step's plan, the
    preemptions counted and the blocks free at the end, under the least-work victim and aging."""
    return run_plans(_private().AgingScheduler, _random_scenario(number))


def retraction_plans(number):
    """Task 4's expected output on case `number`: the same, under the bulk retraction's step."""
    return run_plans(_private().RetractScheduler, _random_scenario(number))


KEY_2 = AnswerKey("ex06_preemption", 2, size=256, seeded=SEEDED_SCENARIOS, reference=aging_plans, private=_TEACHERS[0])
KEY_4 = AnswerKey("ex06_preemption", 4, size=256, seeded=SEEDED_SCENARIOS, reference=retraction_plans,
                  private=_TEACHERS[0])


def _plan_difference(name, limits, mine, want):
    plans, preemptions, free = mine
    expected, ref_preemptions, ref_free = want
    for step, (ours, ref) in enumerate(zip(list(plans) + [None] * len(expected), expected)):
        if ours != ref:
            return (f"{name} ({limits}), step {step}: your plan {ours}, the rules' {ref} "
                    f"(request ids, new tokens, preempted this step)")
    if len(plans) != len(expected):
        return f"{name}: {len(plans)} steps, the rules take {len(expected)}"
    return (f"{name}: {preemptions} preemptions counted and {free} blocks free at the end, "
            f"expected {ref_preemptions} and {ref_free}")


def _compare_plans(make_scheduler, disabled, key):
    total = 0
    for case in key.cases(fresh=FRESH_SCENARIOS):  # drawn ones cannot be memoised
        scenario = _random_scenario(case.number)
        name, num_blocks = scenario[0], scenario[2]
        case.expected()  # the teacher's copy runs the rules first, before any learner code
        with forbid(*disabled):
            try:
                mine = run_plans(make_scheduler, scenario)
            except Fail as failure:
                raise Fail(f"{name}: {failure}") from None
            except Exception as error:  # noqa: BLE001
                raise Fail(f"{name}: {type(error).__name__}: {error}") from None
        limits = (f"max_num_seqs={scenario[1]}, blocks={num_blocks}x{scenario[3]}, {scenario[4]}"
                  + (f", budget={scenario[7]}" if scenario[7] else ""))
        if mine[2] != num_blocks:
            raise Fail(f"{name} ({limits}): {mine[2]} of {num_blocks} blocks free once every request has "
                       "finished: a preempted or finished request kept its blocks")
        case.judge(mine, f"{name} ({limits}): your schedule (every step's plan, preemptions, blocks free at the end)",
                   explain=partial(_plan_difference, name, limits))
        total += mine[1] if case.number < key.seeded else 0  # equal to the rules' count: judged above
    return key.seeded, total


@task(2, "preempt by recompute, with aging")
def check_task_2(make_scheduler) -> str:
    count, total = _compare_plans(make_scheduler, VICTIM_AND_PREEMPT, KEY_2)
    return KEY_2.report(f"{count} seeded traces ({total} preemptions) and {FRESH_SCENARIOS} drawn now, every step's "
                        "plan as the least-work victim and aging say")


@task(3, "real engine")
def check_task_3(make_llm, scheduler_class) -> list[str]:
    with forbid(*VICTIM_AND_PREEMPT):
        llm = make_llm(**ENGINE_KNOBS)
        used = type(llm.engine.scheduler).__name__
        if not isinstance(llm.engine.scheduler, scheduler_class):
            raise Fail(f"the engine runs {used}, not your {scheduler_class.__name__}")
        knobs_reach_the_engine(make_llm, ENGINE_KNOBS, lambda other: isinstance(other.engine.scheduler, scheduler_class))
    (case,) = KEY_3.cases(fresh=0)  # one fixed run: the knobs above, checked by a size drawn now
    case.expected()  # the teacher's copy: minillm's engine under the same rules, first
    roomy_tokens, _ = _engine_run(LLM(MODEL, **{**ENGINE_KNOBS, "num_kv_blocks": 256}))
    with forbid(*VICTIM_AND_PREEMPT):
        _guard(llm.engine.scheduler)
        tokens, schedule = _engine_run(llm)
    steps, preemptions, prefill = schedule
    if preemptions == 0:
        raise Fail(f"your scheduler counted no preemption in {len(steps)} steps, on a pool far too small for 8 seats "
                   "(does _preempt count on self.num_preemptions?)")
    if tokens != roomy_tokens:
        first = next((i for i, (a, b) in enumerate(zip(tokens, roomy_tokens)) if a != b), len(roomy_tokens))
        raise Fail(f"prompt {first}'s greedy output differs from a run without preemption: a request preempted by "
                   "recompute must generate what it would have generated undisturbed")
    case.judge(schedule, "your engine run (each step's requests, prefill and decode tokens, preemptions and KV "
               "tokens in use)", explain=_engine_difference)
    return KEY_3.report([f"scheduler in the engine: {used}",
                         f"preemptions: {preemptions}, as minillm's engine with the same rules (> 0: True)",
                         f"prefill tokens computed: {prefill}, as minillm's engine with the same rules",
                         f"every one of the {len(steps)} steps as minillm's engine with the same rules: True",
                         f"outputs identical to a run without preemption: {tokens == roomy_tokens}"])


@task(4, "the whole step with a bulk retraction")
def check_task_4(step_scheduler_class) -> str:
    if "schedule" not in vars(step_scheduler_class):
        raise Fail(f"{step_scheduler_class.__name__} does not define its own schedule()")
    count, total = _compare_plans(step_scheduler_class, THE_STEP, KEY_4)
    return KEY_4.report(f"{count} seeded traces ({total} preemptions) and {FRESH_SCENARIOS} drawn now, every step of "
                        "your schedule() as the retraction rules say")
