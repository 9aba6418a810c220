"""Grader of exercise 13 (chapter 13: many engines): the cache-aware routing decision, match or balance.

The learner writes SGLang's router decision (`minillm.router.policies.CacheAware` is the reference,
disabled with the other policies while learner code runs): task 1 the imbalance test, task 2 the
whole decision on top of the router's radix tree (`minillm.router.radix.RadixTree`, lent: the
exercise is the decision, not the tree), task 3 the router on a seeded multi-tenant trace
(`minillm.tenant_trace`) in front of simulated workers, against the reference on the same trace.

Task 2 does not ask for the reference's tie-breaking (it rotates ties): at every request it computes
from a shadow tree (fed the learner's own choices) the set of workers the rules allow, and the
learner's choice must be in it; the learner's tree must then hold what the shadow holds, after
every request and after every `evict()`. Task 3's workers are simple queues whose service time
grows with the prompt characters their own cache (a per-worker LRU radix tree) does not hold;
the learner's prefix hit rate and peak load imbalance must be within bounds of the reference's.
Every task adds cases drawn when the check runs (`grade_time_seeds`).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from minillm.grading import Fail, forbid, grade_time_seeds, task
from minillm.router import policies
from minillm.router.policies import CacheAware, CacheAwareConfig
from minillm.router.radix import RadixTree
from minillm.tenant_trace import make_tenant_trace

LEARNER_TOOLS = ()  # nothing of this module is lent; RadixTree and CacheAwareConfig are minillm's
REFERENCE = (policies.CacheAware, policies.LeastLoad, policies.RoundRobin, policies.Policy,
             policies._least_loaded, policies.make_policy)
FRESH_CASES = 2

# --- task 1: the imbalance test ------------------------------------------------------------------------

THRESHOLDS = [(64, 1.5), (4, 1.5), (0, 1.0), (2, 3.0), (8, 1.2), (1, 2.0)]


def _reference_imbalanced(loads: list[int], abs_threshold: int, rel_threshold: float) -> bool:
    workers = [f"w{i}" for i in range(len(loads))]
    ref = CacheAware(CacheAwareConfig(balance_abs_threshold=abs_threshold, balance_rel_threshold=rel_threshold))
    return ref.imbalanced(workers, dict(zip(workers, loads)))


def _load_cases(seed: int, count: int) -> list[tuple[list[int], int, float]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        abs_t, rel_t = rng.choice(THRESHOLDS)
        n = rng.randint(1, 6)
        loads = [rng.randint(0, rng.choice([3, 10, 40, 120])) for _ in range(n)]
        cases.append((loads, abs_t, rel_t))
    return cases


# Boundaries: the difference exactly at the absolute threshold, the maximum exactly at rel x min, zeros.
EDGE_CASES = [([8, 4], 4, 1.5), ([9, 4], 4, 1.5), ([6, 0], 4, 1.5), ([5, 0], 4, 1.5), ([15, 10], 4, 1.5),
              ([16, 10], 4, 1.5), ([30, 20], 4, 1.5), ([31, 20], 4, 1.5), ([70, 0], 64, 1.5), ([64, 0], 64, 1.5),
              ([100, 90], 4, 1.5), ([3, 3, 3], 0, 1.0), ([4, 3, 3], 0, 1.0), ([0, 0], 0, 1.0), ([7], 0, 1.0),
              ([12, 2, 5], 8, 1.2), ([10, 2, 5], 8, 1.2), ([2, 9, 1], 2, 3.0), ([2, 3, 1], 2, 3.0)]


@task(1, "imbalance test")
def check_task_1(imbalanced) -> list[str]:
    cases = EDGE_CASES + _load_cases(13, 400)
    for seed in grade_time_seeds(FRESH_CASES):
        cases += _load_cases(seed, 100)
    for loads, abs_t, rel_t in cases:
        expected = _reference_imbalanced(loads, abs_t, rel_t)
        with forbid(*REFERENCE):
            got = imbalanced(list(loads), abs_t, rel_t)
        if not isinstance(got, bool):
            raise Fail(f"imbalanced({loads}, {abs_t}, {rel_t}) returned {got!r}; return True or False")
        if got != expected:
            high, low = max(loads), min(loads)
            raise Fail(f"imbalanced({loads}, abs_threshold={abs_t}, rel_threshold={rel_t}) returned {got}, expected "
                       f"{expected}: max - min = {high - low} (imbalanced needs > {abs_t}) and max = {high} vs "
                       f"{rel_t} x min = {rel_t * low:g} (needs >); both must hold")
    return [f"{len(cases)} load vectors (1 to 6 workers, {len(EDGE_CASES)} on the thresholds' edges, some drawn as "
            "the check ran): same answer as CacheAware.imbalanced"]


# --- task 2: the decision ---------------------------------------------------------------------------


def _allowed(shadow: RadixTree, text: str, workers: list[str], loads: dict[str, int],
             config: CacheAwareConfig) -> tuple[str, set[str]]:
    """The rule that applies and the workers it allows (any of them: ties may be broken either way)."""
    def least(among: list[str]) -> set[str]:
        low = min(loads.get(w, 0) for w in among)
        return {w for w in among if loads.get(w, 0) == low}

    values = [loads.get(w, 0) for w in workers]
    if len(workers) > 1 and max(values) - min(values) > config.balance_abs_threshold \
            and max(values) > config.balance_rel_threshold * min(values):
        return "imbalanced: the least loaded worker", least(workers)
    matched, holders = shadow.prefix_match(text, workers)
    if text and matched / len(text) > config.cache_threshold:
        return (f"match rate {matched}/{len(text)} = {matched / len(text):.2f} > cache_threshold "
                f"{config.cache_threshold}: the least loaded of the workers holding the longest match {holders}"), \
            least(holders)
    smallest = min(shadow.size(w) for w in workers)
    sizes = {w: shadow.size(w) for w in workers}
    return (f"match rate {matched}/{len(text)} not above cache_threshold {config.cache_threshold}: the least loaded "
            f"of the workers with the smallest tree (tree sizes {sizes})"), \
        least([w for w in workers if shadow.size(w) == smallest])


@dataclass(frozen=True)
class _Step:
    text: str
    workers: tuple[str, ...]
    loads: tuple[int, ...]
    evict_after: bool = False


_STORY = "You are a helpful assistant for the billing team. Answer briefly."
# One scenario per rule, each where another rule would pick differently (config: abs 4, rel 1.5, 0.3, 64 chars).
SCENARIOS: list[tuple[str, list[_Step]]] = [
    ("a match above the threshold goes to its holder", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 0)), _Step(_STORY + " Q2", ("a", "b"), (1, 0))]),
    ("imbalance beats the match", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 0)), _Step(_STORY + " Q2", ("a", "b"), (10, 2))]),
    ("imbalance needs both thresholds (16 - 11 > 4 but 16 <= 1.5 x 11)", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 0)), _Step(_STORY + " Q2", ("a", "b"), (16, 11)),
        _Step(_STORY + " Q3", ("a", "b"), (11, 16))]),
    ("a match at or below the threshold goes to the smallest tree", [
        _Step("abcdefghij", ("a", "b"), (0, 0)), _Step("abcdefghij" + "K" * 24, ("a", "b"), (0, 3)),
        _Step("abcXYZXYZX", ("a", "b", "c"), (0, 0, 3))]),
    ("several holders: the least loaded of them", [
        _Step(_STORY, ("a",), (0,)), _Step(_STORY, ("b",), (0,)),
        _Step(_STORY + " again", ("a", "b", "c"), (3, 1, 0))]),
    ("a worker not in `workers` (unhealthy) is never chosen, even if it holds the prefix", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 0)), _Step(_STORY + " Q2", ("b",), (0,)),
        _Step(_STORY + " Q3", ("b", "c"), (0, 0))]),
    ("the tree is cut back to max_tree_size by evict()", [
        _Step("x" * 50, ("a", "b"), (0, 0)), _Step("y" * 50, ("a", "b"), (0, 0)), _Step("x" * 50 + "z", ("a", "b"), (0, 0)),
        _Step("y" * 80, ("a", "b"), (0, 0), evict_after=True), _Step("x" * 40 + "w" * 20, ("a", "b"), (0, 0))]),
]
SCENARIO_CONFIG = dict(cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5, max_tree_size=64)


def _random_steps(seed: int) -> tuple[dict, list[_Step]]:
    rng = random.Random(seed)
    config = dict(cache_threshold=rng.choice([0.0, 0.3, 0.5, 0.8]), balance_abs_threshold=rng.choice([0, 2, 4, 64]),
                  balance_rel_threshold=rng.choice([1.0, 1.5, 3.0]), max_tree_size=rng.choice([40, 120, 1000]))
    pool = ["w0", "w1", "w2", "w3"][: rng.randint(2, 4)]
    prefixes = ["".join(rng.choice("abcd") for _ in range(rng.randint(0, 30))) for _ in range(4)]
    steps = []
    for _ in range(rng.randint(10, 40)):
        text = rng.choice(prefixes) + "".join(rng.choice("abcdefg") for _ in range(rng.randint(0, 12)))
        workers = [w for w in pool if rng.random() > 0.15] or [pool[0]]
        loads = [rng.randint(0, rng.choice([2, 8, 80])) for _ in workers]
        steps.append(_Step(text, tuple(workers), tuple(loads), evict_after=rng.random() < 0.2))
    return config, steps


def _replay(cls, config_kwargs: dict, steps: list[_Step], where: str) -> int:
    config = CacheAwareConfig(**config_kwargs)
    shadow = RadixTree()
    with forbid(*REFERENCE):
        router = cls(CacheAwareConfig(**config_kwargs))
    if not isinstance(getattr(router, "tree", None), RadixTree):
        raise Fail(f"{where}: your router has no .tree RadixTree (set self.tree = RadixTree() in __init__)")
    all_workers = sorted({w for s in steps for w in s.workers})
    for number, step in enumerate(steps, 1):
        loads = dict(zip(step.workers, step.loads))
        rule, allowed = _allowed(shadow, step.text, list(step.workers), loads, config)
        with forbid(*REFERENCE):
            got = router.choose(step.text, list(step.workers), dict(loads))
        if got not in allowed:
            raise Fail(f"{where}, request {number} ({step.text[:24]!r}..., {len(step.text)} chars), workers "
                       f"{list(step.workers)}, loads {loads}: you chose {got!r}; {rule}: {sorted(allowed)}")
        shadow.insert(step.text, got)
        if step.evict_after:
            shadow.evict(config.max_tree_size)
            with forbid(*REFERENCE):
                router.evict()
        for w in all_workers:
            if router.tree.size(w) != shadow.size(w):
                after = " after evict()" if step.evict_after else ""
                hint = (f" (max_tree_size is {config.max_tree_size}: was the tree cut back?)" if step.evict_after
                        else " (is the text inserted under the chosen worker, once?)")
                raise Fail(f"{where}, request {number}{after}: your tree gives worker {w!r} {router.tree.size(w)} "
                           f"characters, expected {shadow.size(w)}{hint}")
    return len(steps)


@task(2, "match or balance")
def check_task_2(router_class) -> list[str]:
    if not isinstance(router_class, type):
        raise Fail(f"expected a class, got {type(router_class).__name__}")
    if issubclass(router_class, policies.Policy):
        raise Fail(f"{router_class.__name__} inherits from minillm's Policy: write the router yourself")
    decisions = 0
    for name, steps in SCENARIOS:
        decisions += _replay(router_class, SCENARIO_CONFIG, steps, f"scenario '{name}'")
    for seed in range(60):
        config, steps = _random_steps(seed)
        decisions += _replay(router_class, config, steps, f"random case (config {config})")
    fresh = grade_time_seeds(FRESH_CASES * 5)
    for seed in fresh:
        config, steps = _random_steps(seed)
        _replay(router_class, config, steps, f"random case drawn as the check ran (seed {seed}, config {config})")
    return [f"{len(SCENARIOS)} scenarios, one per rule, and 60 seeded random sequences ({decisions} decisions), "
            f"plus {len(fresh)} sequences drawn as the check ran: every choice one the rules allow, the tree as "
            "expected after every request and every evict()"]


# --- task 3: the trace --------------------------------------------------------------------------------

WORKERS = ["w0", "w1", "w2", "w3"]
TRACE = dict(num_requests=400, num_tenants=12, system_prompt_len=64, question_len=8, output_len=4, zipf_s=1.0,
             vocab_size=1 << 16, rate_per_s=60.0)
TRACE_CONFIG = dict(cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5, max_tree_size=1500)
WORKER_CACHE_CHARS = 1500  # what each worker's KV cache holds (text characters), LRU
EVICT_EVERY = 8  # requests between two evict() calls (the router's eviction interval)
BASE_S, PER_UNCACHED_CHAR_S = 0.03, 1e-4  # a worker's service time: fixed + prefill of what it has not cached
HIT_SLACK, IMBALANCE_SLACK = 0.08, 3  # tie-breaking alone moves the hit rate by up to ~0.055 (100 traces)


@dataclass(frozen=True)
class TraceRun:
    hit_rate: float  # prompt characters found in the chosen worker's cache / all prompt characters
    peak_imbalance: int  # the largest max - min of requests in flight, seen at a routing decision
    per_worker: tuple[int, ...]


def _texts(seed: int) -> list[tuple[float, str]]:
    trace = make_tenant_trace(seed=seed, **TRACE)
    return [(r.arrival_time_s, " ".join(map(str, r.prompt_token_ids))) for r in trace]


def _serve(router, texts: list[tuple[float, str]]) -> TraceRun:
    cache = RadixTree()  # every worker's own KV cache, one tenant each
    free = dict.fromkeys(WORKERS, 0.0)
    in_flight: dict[str, list[float]] = {w: [] for w in WORKERS}
    counts = dict.fromkeys(WORKERS, 0)
    hit = total = peak = 0
    for number, (now, text) in enumerate(texts, 1):
        for w in WORKERS:
            while in_flight[w] and in_flight[w][0] <= now:
                heapq.heappop(in_flight[w])
        loads = {w: len(in_flight[w]) for w in WORKERS}
        peak = max(peak, max(loads.values()) - min(loads.values()))
        worker = router.choose(text, list(WORKERS), dict(loads))
        if worker not in free:
            raise Fail(f"request {number}: your router chose {worker!r}, not one of {WORKERS}")
        if number % EVICT_EVERY == 0:
            router.evict()
        cached = cache.prefix_match(text, [worker])[0]
        cache.insert(text, worker)
        cache.evict(WORKER_CACHE_CHARS)
        hit, total = hit + cached, total + len(text)
        free[worker] = max(now, free[worker]) + BASE_S + PER_UNCACHED_CHAR_S * (len(text) - cached)
        heapq.heappush(in_flight[worker], free[worker])
        counts[worker] += 1
    return TraceRun(hit / total, peak, tuple(counts[w] for w in WORKERS))


@task(3, "the multi-tenant trace")
def check_task_3(router_class) -> list[str]:
    lines = []
    for number, seed in enumerate([0, *grade_time_seeds(FRESH_CASES)]):
        texts = _texts(seed)
        ref = _serve(CacheAware(CacheAwareConfig(**TRACE_CONFIG)), texts)
        with forbid(*REFERENCE):
            yours = _serve(router_class(CacheAwareConfig(**TRACE_CONFIG)), texts)
        where = "the seeded trace" if number == 0 else f"a trace drawn as the check ran (seed {seed})"
        if yours.hit_rate < ref.hit_rate - HIT_SLACK:
            raise Fail(f"{where}: prefix hit rate {yours.hit_rate:.3f}, the reference's {ref.hit_rate:.3f} (at least "
                       f"{ref.hit_rate - HIT_SLACK:.3f} needed): requests miss the worker that holds their prefix "
                       "(does the match rule win when loads are even? is the tree cut back as the workers' caches are?)")
        if yours.peak_imbalance > ref.peak_imbalance + IMBALANCE_SLACK:
            raise Fail(f"{where}: requests in flight differed by up to {yours.peak_imbalance} between workers, the "
                       f"reference's by {ref.peak_imbalance} (at most {ref.peak_imbalance + IMBALANCE_SLACK} allowed): "
                       f"the hot tenants pile onto one worker (requests per worker {list(yours.per_worker)})")
        if number == 0:
            lines.append(f"seeded trace ({TRACE['num_requests']} requests, {TRACE['num_tenants']} tenants, Zipf "
                         f"{TRACE['zipf_s']:g}, {len(WORKERS)} workers): prefix hit rate {yours.hit_rate:.3f} "
                         f"(reference {ref.hit_rate:.3f}), peak imbalance {yours.peak_imbalance} in flight "
                         f"(reference {ref.peak_imbalance}), requests per worker {list(yours.per_worker)}")
    lines.append(f"{FRESH_CASES} traces drawn as the check ran: within {HIT_SLACK} of the reference's hit rate and "
                 f"{IMBALANCE_SLACK} of its peak imbalance")
    return lines
