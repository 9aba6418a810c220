"""Grader of exercise 08 (chapter 08: chunked prefill): a stall-free order, filling a step's token
budget in whole KV blocks, the real engine with the learner's budget filler, Dynamic SplitFuse's step
in whole blocks, and a trace on which SplitFuse's even split costs TTFT.

Chapter 08 prints minillm's `_chunk`, `_running_order` and SplitFuse's `step_budget`; the exercise asks
for variants the chapter did not show (shortest remaining prefill first after the decodes; chunks that
end on a KV block boundary; SplitFuse's even share rounded up to whole blocks). Their reference is
grader-private (`minillm.grading.private.ex08_reference`, guarded while a check runs); minillm's
scheduler and chunk policies are disabled (`forbid`) while learner code runs.

Tasks 1–2 and 4's replays need no model: a stand-in executor emits token 7 for every row that
reaches the end of its known tokens and each step takes 1 ms of simulated time. `ChunkedHarness` is
the scheduler around a budget filler (the learner's, or the reference's): it keeps the queues,
reserves KV and checks the plan it is given (the pool is sized so that nobody is ever preempted).
Tasks 3 and 4 then build the real engine on the bundled model around the learner's function and
compare every step with the same engine around the reference, and the tokens with plain decoding.
Task 5 runs the learner's trace on the simulated 7B/A100 under minillm's two chunk policies, at a
target drawn when the check runs, and grades the learner's choice of why SplitFuse loses there.

Tasks 1-4 grade in a student release too, with answer keys (`minillm.grading.answer_key`): one digest
per case of the rule's whole output on it (task 1: the orders of 20 running lists; tasks 2 and 4: every
step's plan of four scenarios, or of all the named ones; tasks 3 and 4: every step's chunks and decodes
of the real engine, with the seeded knobs or one of the 54 combinations a drawn case runs with). The
harness's checks of each plan, the tokens against plain decoding and the order's membership need no
reference and run in both copies.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine, make_kv_manager
from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, run_until_done, task
from minillm.grading.answer_key import AnswerKey
from minillm.llm import BUNDLED_TARGET
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import ModelRunnerOutput, SchedulerBase, SchedulerPlan
from minillm.scheduler.chunk_policy import SarathiChunking, SplitFuseChunking, even_share, make_chunk_policy
from minillm.scheduler.continuous import ContinuousScheduler
from minillm.sim.simulate import simulate
from minillm.traces.trace import Trace, TraceRequest

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 3  # task 1's cases (of 20 running lists each) drawn at grade time, besides the seeded ones
# task 3: the scheduler around your fill_budget; task 5: both chunk policies on your trace
LEARNER_TOOLS = {"ChunkedHarness": (3,), "compare_policies": (5,)}
# What learner code may not call while a check runs: the scheduler and its chunk policies
REFERENCES = (ContinuousScheduler, SarathiChunking, SplitFuseChunking, even_share, make_chunk_policy)
# The variants' reference (grader-private: guarded while a check runs, withheld from a student release, where
# tasks 1-4 grade with their answer keys, minillm/grading/keys/ex08_chunked_budget.json)
_TEACHERS = (private_reference("ex08_reference"),)


def _private():
    """The grader-private reference, loaded at import. Held in a tuple, not as a module global, so that
    looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]

TOY_MODEL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=256, eos_token_ids=(2,))


class ChunkedHarness(SchedulerBase):
    """Continuous batching with chunked prefill in which `fill_budget` makes every token decision.

    Each step it calls `fill_budget(running, waiting, budget, long_prefill_token_threshold,
    max_num_seqs, block_size)` and checks the answer (known requests, 1 ≤ n ≤ missing tokens, within the budget
    and the sequence limit), admits the waiting requests it names, reserves their KV and returns
    the plan, decode rows first (as `ContinuousScheduler` orders them for the attention backend)."""

    def __init__(self, config: EngineConfig, kv, fill_budget: Callable) -> None:
        self.config, self.kv, self.fill_budget = config, kv, fill_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def next_wakeup(self, now: float) -> float | None:
        return None

    def has_request(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in (*self.waiting, *self.running))

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)

    def rollback(self, plan: SchedulerPlan) -> None:
        raise RuntimeError("ChunkedHarness cannot undo a failed step (the exercise's runs never fail one)")

    def abort(self, request_id: str) -> Request | None:
        return None

    def schedule(self, now: float, more_arrivals: bool = True) -> SchedulerPlan | None:
        budget = self.config.max_num_batched_tokens
        rows = self.fill_budget(list(self.running), list(self.waiting), budget,
                                self.config.long_prefill_token_threshold, self.config.max_num_seqs,
                                self.config.block_size)
        rows = [(req, n) for req, n in rows]
        total = sum(n for _, n in rows)
        if total > budget:
            raise Fail(f"your plan computes {total} tokens, over the budget of {budget}: {_show(rows)}")
        seen, admitted = set(), []
        for req, n in rows:
            if req.request_id in seen:
                raise Fail(f"your plan names {req.request_id} twice: {_show(rows)}")
            seen.add(req.request_id)
            missing = req.num_tokens - req.num_computed_tokens
            if not isinstance(n, int) or not 1 <= n <= missing:
                raise Fail(f"your plan gives {req.request_id} {n!r} tokens; it has {missing} to compute "
                           f"(give 1 to {missing}, or leave it out): {_show(rows)}")
            if req in self.waiting:
                self.waiting.remove(req)
                admitted.append((req, req.status))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            elif req not in self.running:
                raise Fail(f"your plan names {req.request_id}, which is neither running nor waiting")
            if not self.kv.allocate(req, n):
                raise Fail("the KV pool is full: the exercise sizes it so that this never happens")
        if len(self.running) > self.config.max_num_seqs:
            raise Fail(f"{len(self.running)} requests running after your plan, over max_num_seqs="
                       f"{self.config.max_num_seqs}: {_show(rows)}")
        if not rows:
            return None
        rows.sort(key=lambda row: not (row[1] == 1 and row[0].num_computed_tokens))
        return SchedulerPlan([r for r, _ in rows], [n for _, n in rows], admitted=admitted)


def _show(rows) -> str:
    return "[" + ", ".join(f"({r.request_id}, {n})" for r, n in rows) + "]"


class StandInExecutor:
    """Token 7 for every row that reaches the end of its tokens; 1 ms per step; remembers each plan."""

    def __init__(self) -> None:
        self.plans: list[tuple] = []

    def execute(self, batch: SchedulerPlan) -> ModelRunnerOutput:
        self.plans.append(tuple(zip((r.request_id for r in batch.requests), batch.num_new_tokens)))
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self) -> float:
        return 0.001


# --- task 1: the stall-free order ----------------------------------------------------------------


def _running_case(seed: int) -> list[Request]:
    """Running requests in admission order, in every state a running request can be in."""
    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(0, 10)):
        prompt_len = rng.randint(1, 40)
        req = Request(f"r{i}", [5] * prompt_len, SamplingParams(max_tokens=50, temperature=0.0), 0.0)
        state = rng.choice(["decoding", "partial", "last prompt token", "recomputing"])
        outputs = [7] * rng.randint(1, 5)
        if state == "decoding":
            req.output_token_ids += outputs
            req.all_token_ids += outputs
            req.num_computed_tokens = req.num_tokens - 1
        elif state == "partial" and prompt_len > 2:
            req.num_computed_tokens = rng.randint(1, prompt_len - 2)
        elif state == "last prompt token" and prompt_len > 1:
            req.num_computed_tokens = prompt_len - 1  # one prompt token left: costs one token, like a decode
        elif state == "recomputing":  # preempted by recompute and readmitted: its outputs need recomputing
            req.output_token_ids += outputs
            req.all_token_ids += outputs
            req.num_computed_tokens = 0
        out.append(req)
    return out


ORDER_GROUP = 20  # running lists per case of task 1: one answer is the orders of all of them
SEEDED_ORDER_CASES = 15  # cases 0 to 14: running lists 0 to 299


def _running_lists(number: int) -> list[tuple[int, list[Request]]]:
    """Task 1's case `number`: the running lists of seeds 20 number to 20 number + 19."""
    return [(seed, _running_case(seed)) for seed in range(ORDER_GROUP * number, ORDER_GROUP * (number + 1))]


def stall_free_orders(number: int) -> list[list[str]]:
    """Task 1's expected output on case `number`: the rule's order (request ids) of each of its running lists."""
    return [[r.request_id for r in _private().serve_order(list(running))] for _, running in _running_lists(number)]


KEY_1 = AnswerKey("ex08_chunked_budget", 1, size=256, seeded=SEEDED_ORDER_CASES, reference=stall_free_orders,
                  private=_TEACHERS[0])


def _order_difference(lists, mine, want) -> str:
    for (seed, running), got_ids, expected in zip(lists, mine, want):
        if got_ids != expected:
            states = ", ".join(f"{r.request_id}: {r.num_computed_tokens}/{r.num_tokens} computed" for r in running)
            return (f"case {seed}: you serve {got_ids}, expected {expected} ({states}): decodes first, in "
                    "admission order, then the fewest missing tokens first")
    return f"your orders {mine}, expected {want}"


@task(1, "stall-free order")
def check_task_1(serve_order) -> str:
    for case in KEY_1.cases(fresh=FRESH_CASES):  # fresh ones cannot be memoised
        lists = _running_lists(case.number)
        case.expected()  # the teacher's copy: the rule's orders, checked against the key
        mine = []
        for seed, running in lists:
            with forbid(*REFERENCES):
                got = serve_order(list(running))
            if not isinstance(got, list):
                raise Fail(f"case {seed}: serve_order returned {type(got).__name__}, not a list of requests")
            got_ids = [getattr(r, "request_id", r) for r in got]
            if sorted(map(str, got_ids)) != sorted(r.request_id for r in running):
                raise Fail(f"case {seed}: you serve {got_ids}; serve every running request once "
                           f"({[r.request_id for r in running]})")
            mine.append(got_ids)
        first, last = lists[0][0], lists[-1][0]
        case.judge(mine, f"running lists {first} to {last} (grader._running_case(seed)): your orders",
                   lambda got, want, lists=lists: _order_difference(lists, got, want))
    drawn = FRESH_CASES * ORDER_GROUP
    return KEY_1.report(f"{SEEDED_ORDER_CASES * ORDER_GROUP} seeded running lists and {drawn} drawn as the check ran: "
                        "decodes first, then the shortest remaining prefill first, ties in admission order")


# --- task 2: fill the budget ---------------------------------------------------------------------

# (name, max_num_seqs, budget, threshold, [(prompt_len, max_tokens, arrival_s), ...], block_size)
NAMED_SCENARIOS = [
    ("a long prompt arrives among decodes", 8, 16, 0, [(3, 12, 0.0)] * 3 + [(60, 2, 0.003)], 4),
    ("the cap: long_prefill_token_threshold", 8, 32, 8, [(4, 10, 0.0), (50, 3, 0.002)], 4),
    ("a chunk ends on a block boundary: 13 tokens left, blocks of 8, so 8", 8, 13, 0, [(40, 2, 0.0)], 8),
    ("a prompt that would stop mid-block waits for a whole one", 8, 12, 0,
     [(3, 3, 0.0), (30, 2, 0.0), (22, 2, 0.0)], 8),
    ("the shortest remaining prefill goes first", 8, 20, 10, [(45, 3, 0.0), (30, 3, 0.001), (6, 3, 0.001)], 4),
    ("a prompt that finishes needs no boundary", 8, 16, 0, [(17, 4, 0.0), (3, 6, 0.0), (33, 2, 0.0)], 8),
    ("a waiting prompt that gets no whole block stops the admissions", 8, 10, 0,
     [(6, 6, 0.0), (30, 2, 0.0), (3, 2, 0.0)], 8),
    ("more decodes than budget", 8, 4, 0, [(1, 6, 0.0)] * 7, 2),
    ("max_num_seqs caps admissions", 2, 64, 0, [(5, 4, 0.0)] * 5, 16),
    ("two long prompts share the budget", 8, 32, 12, [(2, 8, 0.0), (70, 2, 0.002), (70, 2, 0.002)], 4),
]


def _random_scenario(seed: int):
    rng = random.Random(seed)
    requests = [(rng.randint(1, 90), rng.randint(1, 10), round(rng.uniform(0, 0.02), 4))
                for _ in range(rng.randint(1, 20))]
    budget, threshold = rng.choice([1, 3, 8, 16, 32, 64]), rng.choice([0, 0, 4, 10, 24])
    # a block no larger than the budget and the cap: every prompt can always advance by a whole block
    return (f"random scenario {seed}", rng.randint(1, 8), budget, threshold, requests,
            rng.choice([b for b in (1, 2, 4, 8, 16) if b <= budget and b <= (threshold or budget)]))


def run_plans(make_scheduler: Callable, scenario, chunk_policy: str = "sarathi") -> list[tuple]:
    """Replays one scenario through the real engine loop; returns every step's plan."""
    _, max_num_seqs, budget, threshold, requests, block_size = scenario
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=128, max_num_batched_tokens=budget,
                          enable_chunked_prefill=True, long_prefill_token_threshold=threshold,
                          chunk_policy=chunk_policy, num_kv_blocks=-(-2048 // block_size),
                          block_size=block_size).resolve(TOY_MODEL.max_position_embeddings)
    kv = make_kv_manager(config, TOY_MODEL, allocate_pool=False)
    executor = StandInExecutor()
    engine = build_engine(config, TOY_MODEL, kv=kv, scheduler_factory=lambda _, kv: make_scheduler(config, kv),
                          executor=executor, clock=SimClock())
    engine.expect_more_requests = False
    for i, (prompt_len, max_tokens, arrival) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5] * prompt_len}, request_id=f"r{i}", arrival_time=arrival,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    run_until_done(engine, 5_000, "the engine stalled with {unfinished} unfinished request(s): does your plan "
                   "leave out everyone while the budget has room for a whole block?")
    return executor.plans


SCENARIO_GROUP = 4  # random scenarios per case of tasks 2 and 4: one answer is every step's plan of all four
FRESH_SCENARIO_CASES = 5  # cases drawn at grade time in tasks 2 and 4 (20 scenarios)
SEEDED_BUDGET_CASES = 1 + 80 // SCENARIO_GROUP  # task 2: the named scenarios, then random scenarios 0 to 79


def _scenario_group(first_seed: int) -> list[tuple]:
    return [_random_scenario(seed) for seed in range(first_seed, first_seed + SCENARIO_GROUP)]


def _budget_scenarios(number: int) -> list[tuple]:
    """Task 2's case `number`: the named scenarios (0), or random scenarios 4 (number - 1) to 4 number - 1."""
    return NAMED_SCENARIOS if number == 0 else _scenario_group(SCENARIO_GROUP * (number - 1))


def _plans_of(fill, scenarios) -> list[list[tuple]]:
    return [run_plans(lambda config, kv: ChunkedHarness(config, kv, fill), scenario) for scenario in scenarios]


def budget_plans(number: int) -> list[list[tuple]]:
    """Task 2's expected output on case `number`: every step's plan of each of its scenarios, under the rule."""
    return _plans_of(_private().fill_budget, _budget_scenarios(number))


KEY_2 = AnswerKey("ex08_chunked_budget", 2, size=128, seeded=SEEDED_BUDGET_CASES, reference=budget_plans,
                  private=_TEACHERS[0])


def _check_plans(case, fill, scenarios, target_word: str) -> int:
    """Replay `scenarios` with the learner's `fill` in the harness (its checks of each plan run in both copies
    of the course), compare every step with the rule's (the teacher's copy: where they part; a release: the
    answer key's digest of all of them). Returns the number of scenarios."""
    want = case.expected()
    mine = []
    for i, scenario in enumerate(scenarios):
        limits = (f"max_num_seqs={scenario[1]}, {target_word}={scenario[2]}, threshold={scenario[3]}, "
                  f"block_size={scenario[5]}")
        with forbid(*REFERENCES):
            try:
                plans = run_plans(lambda config, kv, fill=fill: ChunkedHarness(config, kv, fill), scenario)
            except Fail as failure:
                raise Fail(f"{scenario[0]} ({limits}): {failure}") from None
        if want is not None:
            expected = want[i]
            for step, (yours, ref) in enumerate(zip(plans + [None] * len(expected), expected)):
                if yours != ref:
                    raise Fail(f"{scenario[0]} ({limits}), step {step}: your plan {yours}, the rule's {ref} "
                               "((request id, tokens) per row, decode rows first)")
            if len(plans) != len(expected):
                raise Fail(f"{scenario[0]}: {len(plans)} steps, the rule takes {len(expected)}")
        mine.append(plans)
    named = scenarios is NAMED_SCENARIOS or scenarios is SPLITFUSE_SCENARIOS
    names = "the named scenarios" if named else ", ".join(scenario[0] for scenario in scenarios)
    case.judge(mine, f"{names} (rebuild one with grader._random_scenario(seed) and grader.run_plans): your plans")
    return len(scenarios)


@task(2, "fill the budget")
def check_task_2(fill_budget) -> str:
    count = sum(_check_plans(case, fill_budget, _budget_scenarios(case.number), "budget")
                for case in KEY_2.cases(fresh=FRESH_SCENARIO_CASES))
    return KEY_2.report(f"{count} traces ({FRESH_SCENARIO_CASES * SCENARIO_GROUP} drawn as the check ran), every "
                        "step's plan the rule's: shortest remaining prefill first, chunks ending on block boundaries")


# --- task 3: the real engine ---------------------------------------------------------------------

ENGINE_KNOBS = dict(max_num_seqs=3, max_model_len=512, enable_chunked_prefill=True, max_num_batched_tokens=24,
                    long_prefill_token_threshold=16, block_size=8)
PROMPT_LENS = [5, 140, 9, 3, 61, 12, 200, 7]
OUTPUT_LENS = [20, 6, 14, 25, 8, 3, 5, 18]


# the knobs a case drawn at grade time runs with: every block size, sequence limit, budget and cap below
DRAWN_KNOBS = [dict(ENGINE_KNOBS, block_size=block_size, max_num_seqs=seqs, max_num_batched_tokens=budget,
                    long_prefill_token_threshold=cap)
               for block_size in (4, 8, 16) for seqs in (2, 3, 4) for budget in (16, 24, 32) if budget >= block_size
               for cap in (0, max(block_size, 12))]

DRAWN_KNOB_NAMES = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")


def _engine_run(llm: LLM):
    rng = random.Random(8)
    prompts = [{"prompt_token_ids": [rng.randrange(6, 4096) for _ in range(n)]} for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in OUTPUT_LENS]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # all waiting at t = 0: a deterministic schedule
    steps = [[list(s.prefill_chunk_sizes), s.num_decode_tokens] for s in llm.engine.metrics.steps]
    return [o.outputs[0].token_ids for o in outputs], steps


def _engine_knobs(number: int) -> dict:
    """Task 3's case `number`: the seeded knobs (0), or one of the 54 combinations of DRAWN_KNOBS."""
    return ENGINE_KNOBS if number == 0 else DRAWN_KNOBS[(number - 1) % len(DRAWN_KNOBS)]


def rule_engine_steps(number: int) -> list:
    """Task 3's expected output on case `number`: every step's prefill chunks and decode count when the real
    engine, with case `number`'s knobs, runs the rule's budget filler (the schedule does not depend on which
    tokens the model emits: every request has a fixed output length)."""
    return _engine_run(LLM(BUNDLED_TARGET, **_engine_knobs(number), scheduler_factory=lambda config, kv:
                           ChunkedHarness(config, kv, _private().fill_budget)))[1]


KEY_3 = AnswerKey("ex08_chunked_budget", 3, size=1 + len(DRAWN_KNOBS), seeded=1, reference=rule_engine_steps,
                  private=_TEACHERS[0])


@task(3, "real engine")
def check_task_3(make_llm, fill_budget) -> list[str]:
    plain_tokens, _ = _engine_run(LLM(BUNDLED_TARGET, max_num_seqs=3, max_model_len=512))
    lines = []
    for case in KEY_3.cases(fresh=1):  # the seeded knobs, then knobs drawn as the check runs
        knobs = _engine_knobs(case.number)
        ref_steps = case.expected()  # the teacher's copy: the rule's engine, checked against the key
        with forbid(*REFERENCES):
            llm = make_llm(**knobs)
            scheduler = llm.engine.scheduler
            if not isinstance(scheduler, ChunkedHarness):
                raise Fail(f"the engine runs {type(scheduler).__name__}, not a ChunkedHarness around your fill_budget")
            tokens, steps = _engine_run(llm)
        same = "?" if ref_steps is None else steps == ref_steps
        if case.number != 0:  # knobs drawn as the check runs: an engine that ignores **knobs fails here
            built = {name: getattr(llm.engine.config, name) for name in DRAWN_KNOB_NAMES}
            drawn = {name: knobs[name] for name in DRAWN_KNOB_NAMES}
            if built != drawn:  # (some draws schedule exactly as the seeded knobs: the steps alone cannot tell)
                raise Fail(f"make_learner_llm(**knobs) with knobs drawn as the check ran built an engine with {built}, "
                           f"not {drawn}: pass every knob on to LLM")
            if tokens != plain_tokens or same is False:
                raise Fail(f"with knobs drawn as the check ran ({knobs}): greedy outputs identical to unchunked "
                           f"decoding: {tokens == plain_tokens}; every step identical to the rule's engine: {same} "
                           "(are the knobs passed through to LLM?)")
            case.judge(steps, f"with knobs drawn as the check ran ({knobs}): every step's chunks and decodes "
                              "(are the knobs passed through to LLM?)")
            continue
        longest = max(max(chunks, default=0) for chunks, _ in steps)
        lines = [f"scheduler in the engine: ChunkedHarness({fill_budget.__name__})",
                 f"greedy outputs identical to unchunked decoding: {tokens == plain_tokens}",
                 f"engine steps: yours {len(steps)}, the rule's {len(steps) if same == '?' else len(ref_steps)}; "
                 f"largest chunk {longest} tokens (threshold {ENGINE_KNOBS['long_prefill_token_threshold']}, blocks "
                 f"of {ENGINE_KNOBS['block_size']})",
                 f"every step's chunks and decodes identical to the rule's engine: {same}"]
        if tokens != plain_tokens or same is False:
            raise Fail("your engine run differs from the rule's: " + "; ".join(lines[1:]))
        case.judge(steps, f"your engine run with {knobs}: every step's chunks and decodes")
        lines[-1] = "every step's chunks and decodes identical to the rule's engine: True"  # judged just now
    return KEY_3.report(lines + ["and with knobs drawn as the check ran (budget, cap, block size, sequences): the same"])


# --- task 4: Dynamic SplitFuse's step ------------------------------------------------------------

# (name, max_num_seqs, target, threshold, [(prompt_len, max_tokens, arrival_s), ...]); each named for
# the rule a wrong step breaks first
SPLITFUSE_SCENARIOS = [
    ("a pool of 40 prompt tokens at target 32 runs as two passes of 20, not 32 + 8", 8, 32, 0, [(40, 2, 0.0)], 1),
    ("the same pool in blocks of 8: the share 20 rounds up to 24", 8, 32, 0, [(40, 2, 0.0)], 8),
    ("an odd pool (41 tokens) splits 21 + 20: the passes differ by one token at most", 8, 32, 0, [(41, 2, 0.0)], 1),
    ("a share rounded up past the room stays at the room", 8, 30, 0, [(50, 2, 0.0)], 16),
    ("only requests that get a seat count: 2 seats, four prompts of 20 queued", 2, 32, 0, [(20, 3, 0.0)] * 4, 4),
    ("decodes take their tokens first; the prompts split what is left of the target", 8, 16, 0,
     [(3, 12, 0.0)] * 3 + [(60, 2, 0.003)], 4),
    ("more decodes than the target", 8, 4, 0, [(1, 6, 0.0)] * 7, 2),
    ("running prefills and new prompts share one pool", 8, 24, 0, [(45, 3, 0.0), (30, 3, 0.001), (6, 3, 0.001)], 4),
    ("the cap still cuts each chunk", 8, 32, 8, [(4, 10, 0.0), (50, 3, 0.002)], 4),
]
SPLITFUSE_RANDOM = 60  # seeded random scenarios, besides the named ones and those drawn at grade time
SEEDED_SPLITFUSE_CASES = 2 + SPLITFUSE_RANDOM // SCENARIO_GROUP  # the engine run, the named scenarios, random 0-59

SPLITFUSE_KNOBS = dict(max_num_seqs=3, max_model_len=512, enable_chunked_prefill=True, max_num_batched_tokens=24,
                       block_size=8)


def _splitfuse_scenarios(number: int) -> list[tuple]:
    """Task 4's case `number` >= 1: the named scenarios (1), or random scenarios 4 (number - 2) to 4 number - 5.
    Case 0 is the real engine around the step (SPLITFUSE_KNOBS)."""
    return SPLITFUSE_SCENARIOS if number == 1 else _scenario_group(SCENARIO_GROUP * (number - 2))


def _splitfuse_llm(step) -> LLM:
    return LLM(BUNDLED_TARGET, scheduler_factory=lambda config, kv: ChunkedHarness(config, kv, step), **SPLITFUSE_KNOBS)


def splitfuse_plans(number: int) -> list:
    """Task 4's expected output on case `number`: the real engine's steps (0), or every step's plan of each
    scenario, under the rule (SplitFuse's even share in whole blocks, filled as in task 2)."""
    if number == 0:
        return _engine_run(_splitfuse_llm(_private().splitfuse_fill))[1]
    return _plans_of(_private().splitfuse_fill, _splitfuse_scenarios(number))


KEY_4 = AnswerKey("ex08_chunked_budget", 4, size=128, seeded=SEEDED_SPLITFUSE_CASES, reference=splitfuse_plans,
                  private=_TEACHERS[0])


@task(4, "SplitFuse's step")
def check_task_4(splitfuse_fill) -> list[str]:
    cases = KEY_4.cases(fresh=FRESH_SCENARIO_CASES)
    count = sum(_check_plans(case, splitfuse_fill, _splitfuse_scenarios(case.number), "target")
                for case in cases if case.number != 0)
    lines = [f"{count} traces ({FRESH_SCENARIO_CASES * SCENARIO_GROUP} drawn as the check ran), every step's plan the "
             "rule's: SplitFuse's even share in whole blocks, filled as in task 2"]
    return KEY_4.report(lines + _splitfuse_engine(splitfuse_fill, next(case for case in cases if case.number == 0)))


def _splitfuse_engine(splitfuse_fill, case) -> list[str]:
    """The bundled model served by the engine `LLM` builds around the learner's step: the greedy tokens of
    plain decoding, and the chunks and decodes of every step of the same engine around the rule's step."""
    plain_tokens, _ = _engine_run(LLM(BUNDLED_TARGET, max_num_seqs=3, max_model_len=512))
    ref_steps = case.expected()  # the teacher's copy: the rule's engine, checked against the key
    with forbid(*REFERENCES):
        tokens, steps = _engine_run(_splitfuse_llm(splitfuse_fill))
    target = SPLITFUSE_KNOBS["max_num_batched_tokens"]
    sizes = [sum(chunks) + decodes for chunks, decodes in steps]
    same = "?" if ref_steps is None else steps == ref_steps
    lines = [f"the real engine around {getattr(splitfuse_fill, '__name__', 'your step')}, target {target}: "
             f"{len(steps)} steps (the rule's {len(steps) if same == '?' else len(ref_steps)}), step sizes "
             f"{min(sizes)} to {max(sizes)} tokens",
             f"greedy outputs identical to unchunked decoding: {tokens == plain_tokens}",
             f"every step's chunks and decodes identical to the rule's engine: {same}"]
    if tokens != plain_tokens or same is False:
        raise Fail("your engine run differs from the rule's engine: " + "; ".join(lines))
    case.judge(steps, f"the real engine around your step ({SPLITFUSE_KNOBS}): every step's chunks and decodes")
    lines[-1] = "every step's chunks and decodes identical to the rule's engine: True"  # judged just now
    return lines


# --- task 5: a trace on which the even split costs TTFT -------------------------------------------

HURT_HARDWARE, HURT_MODEL, HURT_TARGET = "A100-80GB", "llama-7b", 256
HURT_MARGIN = 1.10  # SplitFuse's p99 TTFT must be at least this many times Sarathi's
HURT_MAX_REQUESTS, HURT_MAX_PROMPT, HURT_MAX_OUTPUT, HURT_MAX_ARRIVAL_S = 8, 2048, 64, 10.0


HURT_TARGETS = tuple(t for t in range(128, 1025, 32) if t != 256)  # where the drawn targets come from
WHY_CHOICES = {
    "a": "SplitFuse's steps hold more tokens than the fixed budget's, so each of them takes longer",
    "b": "SplitFuse sized its even passes for the queue it saw; the prompt that arrived later joined the pool, "
         "the split was made again, and the first prompt's last tokens slid into an extra step",
    "c": "SplitFuse runs the decodes after the prefills, so a first token waits for every prompt in the step",
    "d": "SplitFuse needs more steps than the fixed budget for the same requests queued all at once",
}
WHY_ANSWER = "b"


def compare_policies(requests, target: int = HURT_TARGET) -> dict[str, dict]:
    """Task 5's setting: `requests`, a list of (arrival_s, prompt_len, output_len), simulated with Llama-2-7B
    on an A100-80GB, chunked prefill at max_num_batched_tokens `target` (SplitFuse's target; 256 unless
    given), max_num_seqs 8, under each chunk policy. Returns, per policy, "p99_ttft_ms", "ttft_ms" (per
    request, in your order) and "steps": one (prefill chunk sizes, decode tokens, step ms) per engine step.
    Deterministic."""
    requests = _checked_trace(requests)
    if isinstance(target, bool) or not isinstance(target, int) or not 16 <= target <= 4096:
        raise Fail(f"target is an int from 16 to 4096 tokens, not {target!r}")
    trace = Trace([TraceRequest(f"r{i}", float(arrival), [100 + i] * prompt, output)
                   for i, (arrival, prompt, output) in enumerate(requests)])
    out = {}
    for policy in ("sarathi", "splitfuse"):
        res = simulate(trace, hardware=HURT_HARDWARE, model=HURT_MODEL,
                       engine_config=dict(max_num_seqs=8, max_model_len=4096, enable_chunked_prefill=True,
                                          max_num_batched_tokens=target, chunk_policy=policy))
        out[policy] = {"p99_ttft_ms": res.summary.ttft.percentiles_ms[99],
                       "ttft_ms": [1e3 * m.ttft for m in res.requests],
                       "steps": [(tuple(s.prefill_chunk_sizes), s.num_decode_tokens, 1e3 * c.time_s)
                                 for s, c in zip(res.steps, res.costs)]}
    return out


def _checked_trace(requests) -> list[tuple[float, int, int]]:
    if not isinstance(requests, (list, tuple)) or not 1 <= len(requests) <= HURT_MAX_REQUESTS:
        raise Fail(f"give a list of 1 to {HURT_MAX_REQUESTS} requests (arrival_s, prompt_len, output_len), "
                   f"not {requests!r}")
    out = []
    for i, item in enumerate(requests):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise Fail(f"request {i}: {item!r} is not (arrival_s, prompt_len, output_len)")
        arrival, prompt, output = item
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival <= HURT_MAX_ARRIVAL_S:
            raise Fail(f"request {i}: arrival_s is a number of seconds from 0 to {HURT_MAX_ARRIVAL_S:g}, not {arrival!r}")
        for label, value, top in (("prompt_len", prompt, HURT_MAX_PROMPT), ("output_len", output, HURT_MAX_OUTPUT)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise Fail(f"request {i}: {label} is an int from 1 to {top}, not {value!r}")
        out.append((float(arrival), prompt, output))
    return out


@task(5, "when the even split hurts")
def check_task_5(splitfuse_hurts, why_splitfuse_loses) -> list[str]:
    # Not under forbid(*REFERENCES): the answer is a trace, judged by simulating it, and the learner may
    # search for it with compare_policies (lent for this task), which runs both chunk policies itself.
    draw = random.Random(grade_time_seeds(1)[0])
    targets = [HURT_TARGET, *draw.sample(HURT_TARGETS, 2)]
    lines = []
    for target in targets:
        requests = splitfuse_hurts(target)
        runs = compare_policies(requests, target)
        fixed, split = runs["sarathi"]["p99_ttft_ms"], runs["splitfuse"]["p99_ttft_ms"]
        found = (f"your trace on the simulated 7B/A100, target {target} tokens: p99 TTFT {fixed:.1f} ms "
                 f"with Sarathi's fixed budget, {split:.1f} ms with SplitFuse ({split / fixed:.2f}x)")
        if split < HURT_MARGIN * fixed:
            where = "" if target == HURT_TARGET else " (a target drawn as the check ran: build the trace from it)"
            raise Fail(f"SplitFuse's p99 TTFT is not {HURT_MARGIN:.2f}x Sarathi's or more on your trace{where}: {found}")
        if target == HURT_TARGET:
            lines.append(f"your trace on the simulated 7B/A100, target {target} tokens: SplitFuse's p99 TTFT at least "
                         f"{HURT_MARGIN:.2f}x Sarathi's")
    lines.append(f"and at 2 targets drawn as the check ran (128 to 1024 tokens): at least {HURT_MARGIN:.2f}x")
    why = why_splitfuse_loses()
    if why not in WHY_CHOICES:
        raise Fail(f"why_splitfuse_loses() returns one of {sorted(WHY_CHOICES)}, not {why!r}")
    if why != WHY_ANSWER:
        raise Fail(f"your trace works, but ({why}) {WHY_CHOICES[why]} is not what happens on it: compare the first "
                   "steps of both policies in compare_policies' output, and whose first token moves")
    lines.append("why: your choice is what the steps show")
    return lines
