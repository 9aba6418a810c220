"""Grader of exercise 13 (chapter 13: many engines): overloaded workers, the router's radix tree, and a
match-or-balance rule that the chapter did not show.

Chapter 13 prints SGLang's decision (`CacheAware.imbalanced` and `.choose`): once the loads are
imbalanced, affinity is dropped for the whole request. The exercise's rule is a variant: task 1 finds
the overloaded workers (the same two thresholds, per worker), task 2 is the router's multi-tenant
radix tree written from scratch (match, insert, size, and LRU evict with its return value), compared
operation by operation with minillm's `RadixTree` (the reference, disabled while learner code runs),
task 3 the decision that skips only the overloaded workers and keeps matching among the others, on
the learner's own tree, then the router on a seeded multi-tenant trace (`minillm.traces.tenant`) in
front of simulated workers. The rule's reference is grader-private
(`minillm.grading.private.ex13_reference`, guarded while a check runs); minillm's policies and tree
are disabled (`forbid`) while learner code runs.

Task 3 does not ask for a tie-breaking: at every request it computes from a shadow `RadixTree` (fed
the learner's own choices) the set of workers the rule allows, and the learner's choice must be in it;
the learner's tree must then hold what the shadow holds, after every request and every `evict()`,
whose return value must be the characters the shadow dropped. The trace's workers are simple queues
whose service time grows with the prompt characters their own cache (a per-worker LRU radix tree)
does not hold; the learner's prefix hit rate and peak load imbalance must be within bounds of the
reference rule's. Every task adds cases drawn when the check runs (`grade_time_seeds`).
"""

from __future__ import annotations

import contextlib
import heapq
import random
from dataclasses import dataclass

from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, task
from minillm.router import policies, radix
from minillm.router.policies import CacheAwareConfig
from minillm.router.radix import RadixTree
from minillm.traces.tenant import make_tenant_trace

LEARNER_TOOLS = ()  # nothing of this module is lent; CacheAwareConfig is minillm's
REFERENCE = (policies.CacheAware, policies.LeastLoad, policies.RoundRobin, policies.Policy,
             policies._least_loaded, policies.make_policy, radix.RadixTree, radix._common_len)
# The rule's reference (grader-private: guarded while a check runs, withheld from a student release)
private = private_reference("ex13_reference")
FRESH_CASES = 2

# --- task 1: the overloaded workers -------------------------------------------------------------------

THRESHOLDS = [(64, 1.5), (4, 1.5), (0, 1.0), (2, 3.0), (8, 1.2), (1, 2.0)]


def _load_cases(seed: int, count: int) -> list[tuple[list[int], int, float]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        abs_t, rel_t = rng.choice(THRESHOLDS)
        n = rng.randint(1, 6)
        loads = [rng.randint(0, rng.choice([3, 10, 40, 120])) for _ in range(n)]
        cases.append((loads, abs_t, rel_t))
    return cases


# Boundaries: a difference exactly at the absolute threshold, a load exactly at rel x the idlest's, zeros, and
# several workers over one threshold but not the other.
EDGE_CASES = [([8, 4], 4, 1.5), ([9, 4], 4, 1.5), ([6, 0], 4, 1.5), ([5, 0], 4, 1.5), ([15, 10], 4, 1.5),
              ([16, 10], 4, 1.5), ([30, 20], 4, 1.5), ([31, 20], 4, 1.5), ([70, 0], 64, 1.5), ([64, 0], 64, 1.5),
              ([100, 90], 4, 1.5), ([3, 3, 3], 0, 1.0), ([4, 3, 3], 0, 1.0), ([0, 0], 0, 1.0), ([7], 0, 1.0),
              ([12, 2, 5], 8, 1.2), ([10, 2, 5], 8, 1.2), ([2, 9, 1], 2, 3.0), ([2, 3, 1], 2, 3.0),
              ([20, 9, 10, 4], 4, 1.5), ([20, 7, 6, 4], 4, 2.0), ([11, 11, 3], 4, 1.5)]


@task(1, "overloaded workers")
def check_task_1(overloaded) -> list[str]:
    cases = EDGE_CASES + _load_cases(13, 400)
    for seed in grade_time_seeds(FRESH_CASES):
        cases += _load_cases(seed, 100)
    for loads, abs_t, rel_t in cases:
        by_worker = {f"w{i}": load for i, load in enumerate(loads)}
        expected = private.overloaded(by_worker, abs_t, rel_t)
        with forbid(*REFERENCE):
            got = overloaded(dict(by_worker), abs_t, rel_t)
        if not isinstance(got, set | list | tuple | frozenset) or not all(w in by_worker for w in got):
            raise Fail(f"overloaded({by_worker}, {abs_t}, {rel_t}) returned {got!r}; return the overloaded workers' "
                       "names (a set or a list)")
        if set(got) != expected:
            low = min(loads)
            wrong = sorted(set(got) ^ expected)[0]
            load = by_worker[wrong]
            raise Fail(f"overloaded({by_worker}, abs_threshold={abs_t}, rel_threshold={rel_t}) returned "
                       f"{sorted(got)}, expected {sorted(expected)}: {wrong} has {load}, the idlest {low}: "
                       f"{load} - {low} = {load - low} (overloaded needs > {abs_t}) and {load} vs {rel_t} x {low} = "
                       f"{rel_t * low:g} (needs >); both must hold")
    return [f"{len(cases)} load vectors (1 to 6 workers, {len(EDGE_CASES)} on the thresholds' edges, "
            f"{FRESH_CASES * 100} drawn as the check ran): the same workers as the rule"]


# --- task 2: the radix tree ---------------------------------------------------------------------------

_PROBES = ("", "a", "ab", "abc", "abd", "b", "ba", "bab")


def _tree_ops(seed: int) -> list[tuple]:
    """A random sequence of tree operations on short texts over a small alphabet (so edges split often)."""
    rng = random.Random(seed)
    stems = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 6))) for _ in range(4)]
    workers = ["w0", "w1", "w2"][: rng.randint(1, 3)]
    ops = []
    for _ in range(rng.randint(15, 40)):
        roll = rng.random()
        text = rng.choice(stems) + "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
        if roll < 0.55:
            ops.append(("insert", text, rng.choice(workers)))
        elif roll < 0.85:
            ops.append(("match", text, tuple(w for w in workers if rng.random() > 0.3)))
        else:
            ops.append(("evict", rng.choice([0, 2, 5, 10, 30])))
    return ops


TREE_SCENARIOS: list[tuple[str, list[tuple]]] = [
    ("one text, matched in full, in part and not at all", [
        ("insert", "hello world", "a"), ("match", "hello world", ("a",)), ("match", "hello there", ("a",)),
        ("match", "goodbye", ("a",)), ("match", "", ("a",))]),
    ("a second text splits an edge", [
        ("insert", "hello world", "a"), ("insert", "help me", "b"), ("match", "hello", ("a", "b")),
        ("match", "help", ("a", "b")), ("match", "hel", ("a", "b"))]),
    ("match among some workers only", [
        ("insert", "abcdef", "a"), ("insert", "abcxyz", "b"), ("match", "abcdef", ("b",)),
        ("match", "abcdef", ("c",)), ("match", "abcdef", ())]),
    ("the same text twice, then by another worker: sizes count each worker's distinct characters", [
        ("insert", "abcdef", "a"), ("insert", "abcdef", "a"), ("insert", "abc", "b"), ("insert", "abcdXY", "b"),
        ("match", "abcdXYZ", ("a", "b"))]),
    ("evict drops the least recently used leaves first, whole edges, and says how many characters", [
        ("insert", "aaaa1111", "a"), ("insert", "aaaa2222", "a"), ("insert", "aaaa3", "a"), ("evict", 10),
        ("match", "aaaa1111", ("a",)), ("match", "aaaa2222", ("a",)), ("evict", 3), ("match", "aaaa3", ("a",))]),
    ("evict keeps what another worker still holds", [
        ("insert", "shared prefix one", "a"), ("insert", "shared prefix two", "b"), ("evict", 5),
        ("match", "shared prefix one", ("a", "b")), ("match", "shared prefix two", ("a", "b"))]),
    ("an edge split by a text that was evicted stays split", [
        ("insert", "abcdef", "a"), ("insert", "abcxyz", "b"), ("evict", 0), ("insert", "abcdeQ", "b"),
        ("evict", 4), ("match", "abcdef", ("a", "b"))]),
]


def _replay_tree(tree_class, ops: list[tuple], where: str) -> int:
    ref = RadixTree()
    with forbid(*REFERENCE):
        tree = tree_class()
    workers = sorted({op[2] for op in ops if op[0] == "insert"} | {"w0", "nobody"})
    for number, op in enumerate(ops, 1):
        shown = f"{where}, operation {number} ({op[0]}{op[1:]!r})"
        if op[0] == "insert":
            ref.insert(op[1], op[2])
            with forbid(*REFERENCE):
                tree.insert(op[1], op[2])
        elif op[0] == "match":
            want = ref.prefix_match(op[1], list(op[2]))
            with forbid(*REFERENCE):
                got = tree.match(op[1], list(op[2]))
            if not isinstance(got, tuple | list) or len(got) != 2 or (got[0], sorted(got[1])) != want:
                raise Fail(f"{shown}: match returned {got!r}, expected {want}: the longest prefix held by one of the "
                           "workers given, and every one of them that holds all of it (0 and [] when none)")
        else:
            want = ref.evict(op[1])
            with forbid(*REFERENCE):
                got = tree.evict(op[1])
            if got != want:
                raise Fail(f"{shown}: evict returned {got!r}, expected {want}, the characters it dropped in all "
                           "(whole least recently used leaves, per worker, until it owns at most max_chars)")
        for w in workers:
            want = ref.size(w)
            with forbid(*REFERENCE):
                got = tree.size(w)
            if got != want:
                raise Fail(f"{shown}: size({w!r}) is {got!r}, expected {want}: the characters of the tree {w!r} owns "
                           "(each character once, however many texts share it)")
    return len(ops)


@task(2, "the radix tree")
def check_task_2(tree_class) -> list[str]:
    if not isinstance(tree_class, type):
        raise Fail(f"expected a class, got {type(tree_class).__name__}")
    if issubclass(tree_class, RadixTree):
        raise Fail(f"{tree_class.__name__} inherits from minillm's RadixTree: write the tree yourself")
    ops = 0
    for name, steps in TREE_SCENARIOS:
        ops += _replay_tree(tree_class, steps, f"scenario '{name}'")
    for seed in range(80):
        ops += _replay_tree(tree_class, _tree_ops(seed), f"random sequence (seed {seed})")
    fresh = grade_time_seeds(FRESH_CASES * 5)
    for seed in fresh:
        _replay_tree(tree_class, _tree_ops(seed), f"a sequence drawn as the check ran (seed {seed})")
    return [f"{len(TREE_SCENARIOS)} scenarios and 80 seeded random sequences ({ops} operations), plus {len(fresh)} "
            "drawn as the check ran: every match, size and evict() equal to minillm's RadixTree"]


# --- task 3: the decision, then the trace -------------------------------------------------------------


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
    ("an overloaded holder is skipped", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 0)), _Step(_STORY + " Q2", ("a", "b"), (10, 2))]),
    ("an overloaded worker elsewhere does not stop the match (SGLang's rule would balance here)", [
        _Step(_STORY + " Q1", ("a", "b", "c"), (0, 0, 0)), _Step(_STORY + " Q2", ("a", "b", "c"), (3, 0, 10))]),
    ("overloaded needs both thresholds (16 - 11 > 4 but 16 <= 1.5 x 11)", [
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
    tree = getattr(router, "tree", None)
    if tree is None or isinstance(tree, RadixTree) or not callable(getattr(tree, "size", None)):
        raise Fail(f"{where}: your router has no .tree of your own (set self.tree = PrefixTree() in __init__: "
                   "task 2's tree, not minillm's RadixTree)")
    all_workers = sorted({w for s in steps for w in s.workers})
    for number, step in enumerate(steps, 1):
        loads = dict(zip(step.workers, step.loads))
        rule, allowed = private.allowed(shadow, step.text, list(step.workers), loads, config)
        with forbid(*REFERENCE):
            got = router.choose(step.text, list(step.workers), dict(loads))
        if got not in allowed:
            raise Fail(f"{where}, request {number} ({step.text[:24]!r}..., {len(step.text)} chars), workers "
                       f"{list(step.workers)}, loads {loads}: you chose {got!r}; {rule}: {sorted(allowed)}")
        shadow.insert(step.text, got)
        if step.evict_after:
            want = shadow.evict(config.max_tree_size)
            with forbid(*REFERENCE):
                dropped = router.evict()
            if dropped != want:
                raise Fail(f"{where}, request {number}: evict() returned {dropped!r}, expected {want}: the characters "
                           f"the tree dropped to bring every worker to max_tree_size = {config.max_tree_size}")
        for w in all_workers:
            with forbid(*REFERENCE):
                size = router.tree.size(w)
            if size != shadow.size(w):
                after = " after evict()" if step.evict_after else ""
                hint = (f" (max_tree_size is {config.max_tree_size}: was the tree cut back?)" if step.evict_after
                        else " (is the text inserted under the chosen worker, once?)")
                raise Fail(f"{where}, request {number}{after}: your tree gives worker {w!r} {size} "
                           f"characters, expected {shadow.size(w)}{hint}")
    return len(steps)


def _decisions(router_class) -> list[str]:
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
    return [f"{len(SCENARIOS)} scenarios and 60 seeded random sequences ({decisions} decisions), plus {len(fresh)} "
            "sequences drawn as the check ran: every choice one the rule allows, the tree as expected after every "
            "request and every evict(), and evict()'s count of dropped characters"]


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


def _serve(router, texts: list[tuple[float, str]], guard=contextlib.nullcontext) -> TraceRun:
    """Route `texts` with `router` (its calls made inside `guard()`) in front of the simulated workers."""
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
        with guard():
            worker = router.choose(text, list(WORKERS), dict(loads))
        if worker not in free:
            raise Fail(f"request {number}: your router chose {worker!r}, not one of {WORKERS}")
        if number % EVICT_EVERY == 0:
            with guard():
                router.evict()
        cached = cache.prefix_match(text, [worker])[0]
        cache.insert(text, worker)
        cache.evict(WORKER_CACHE_CHARS)
        hit, total = hit + cached, total + len(text)
        free[worker] = max(now, free[worker]) + BASE_S + PER_UNCACHED_CHAR_S * (len(text) - cached)
        heapq.heappush(in_flight[worker], free[worker])
        counts[worker] += 1
    return TraceRun(hit / total, peak, tuple(counts[w] for w in WORKERS))


@task(3, "match or balance", check_time_limit_s=240)
def check_task_3(router_class) -> list[str]:
    lines = _decisions(router_class)
    for number, seed in enumerate([0, *grade_time_seeds(FRESH_CASES)]):
        texts = _texts(seed)
        ref = _serve(private.Router(CacheAwareConfig(**TRACE_CONFIG)), texts)
        with forbid(*REFERENCE):
            router = router_class(CacheAwareConfig(**TRACE_CONFIG))
        yours = _serve(router, texts, guard=lambda: forbid(*REFERENCE))
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
