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

Task 3 does not ask for a tie-breaking, and its graded sequences need none: their loads are distinct
(and the named scenarios' first requests have a worker of least load), so at every request the rule
allows exactly one worker, computed from a shadow `RadixTree` fed the learner's own choices; the
learner's tree must then hold what the shadow holds, after every request and every `evict()`, whose
return value must be the characters the shadow dropped. The trace's workers are simple queues whose
service time grows with the prompt characters their own cache (a per-worker LRU radix tree) does not
hold; there ties are common and any tie-breaking passes: the learner's prefix hit rate and peak load
imbalance must be within bounds of the reference rule's. Every task adds cases drawn when the check
runs (`grade_time_seeds`).

Tasks 1 and 3 grade in a student release too, with answer keys (`minillm.grading.answer_key`): one
digest per case of the rule's whole answer on it (task 1: the overloaded sets of 20 to 100 load
vectors; task 3: every choice of five sequences, or of all the named scenarios), and, as public facts,
the rule's hit rate and peak imbalance on each case's trace. The tree checks need no reference and
run in both copies.
"""

from __future__ import annotations

import contextlib
import heapq
import random
from dataclasses import dataclass

from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, task
from minillm.grading.answer_key import AnswerKey
from minillm.router import policies, radix
from minillm.router.policies import CacheAwareConfig
from minillm.router.radix import RadixTree
from minillm.traces.tenant import make_tenant_trace

LEARNER_TOOLS = ()  # nothing of this module is lent; CacheAwareConfig is minillm's
REFERENCE = (policies.CacheAware, policies.LeastLoad, policies.RoundRobin, policies.Policy,
             policies._least_loaded, policies.make_policy, radix.RadixTree, radix._common_len)
# The rule's reference (grader-private: guarded while a check runs, withheld from a student release, where
# tasks 1 and 3 grade with their answer keys, minillm/grading/keys/ex13_cache_aware_routing.json)
_TEACHERS = (private_reference("ex13_reference"),)
FRESH_CASES = 2


def _private():
    """The grader-private reference, loaded at import. Held in a tuple, not as a module global, so that
    looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]

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


SEEDED_GROUP = 20  # task 1's 400 seeded load vectors are graded (and keyed) in groups of this many
FRESH_GROUP = 100  # the load vectors of a case drawn at grade time (or from the pool, in a release)
SEEDED_LOAD_CASES = 1 + 400 // SEEDED_GROUP  # the edge cases, then the seeded groups


def _load_group(number: int) -> tuple[str, list[tuple[list[int], int, float]]]:
    """Task 1's case `number`: the edge cases (0), a group of the 400 seeded load vectors (1 to 20), or
    100 vectors of their own (a pool case or a seed drawn at grade time). One answer per case is the
    overloaded sets of all its vectors: a yes/no per worker is never keyed alone."""
    if number == 0:
        return "the edge cases", EDGE_CASES
    if number < SEEDED_LOAD_CASES:
        start = (number - 1) * SEEDED_GROUP
        return f"seeded vectors {start} to {start + SEEDED_GROUP - 1}", _load_cases(13, 400)[start:start + SEEDED_GROUP]
    return f"the {FRESH_GROUP} vectors of case {number}", _load_cases(number, FRESH_GROUP)


def _by_worker(loads: list[int]) -> dict[str, int]:
    return {f"w{i}": load for i, load in enumerate(loads)}


def overloaded_sets(number: int) -> list[list[str]]:
    """Task 1's expected output on case `number`: the rule's overloaded workers of every vector, sorted."""
    return [sorted(_private().overloaded(_by_worker(loads), abs_t, rel_t)) for loads, abs_t, rel_t in _load_group(number)[1]]


KEY_1 = AnswerKey("ex13_cache_aware_routing", 1, size=256, seeded=SEEDED_LOAD_CASES, reference=overloaded_sets,
                  private=_TEACHERS[0])


def _overloaded_difference(vectors, mine, want) -> str:
    for (loads, abs_t, rel_t), got, expected in zip(vectors, mine, want):
        if got != expected:
            by_worker, low = _by_worker(loads), min(loads)
            wrong = sorted(set(got) ^ set(expected))[0]
            load = by_worker[wrong]
            return (f"overloaded({by_worker}, abs_threshold={abs_t}, rel_threshold={rel_t}) returned {got}, "
                    f"expected {expected}: {wrong} has {load}, the idlest {low}: {load} - {low} = {load - low} "
                    f"(overloaded needs > {abs_t}) and {load} vs {rel_t} x {low} = {rel_t * low:g} (needs >); "
                    "both must hold")
    return f"your overloaded sets {mine}, expected {want}"


@task(1, "overloaded workers")
def check_task_1(overloaded) -> list[str]:
    count = 0
    for case in KEY_1.cases(fresh=FRESH_CASES):
        name, vectors = _load_group(case.number)
        case.expected()  # the teacher's copy: the rule's answers, checked against the key first
        mine = []
        for loads, abs_t, rel_t in vectors:
            by_worker = _by_worker(loads)
            with forbid(*REFERENCE):
                got = overloaded(dict(by_worker), abs_t, rel_t)
            if not isinstance(got, set | list | tuple | frozenset) or not all(w in by_worker for w in got):
                raise Fail(f"overloaded({by_worker}, {abs_t}, {rel_t}) returned {got!r}; return the overloaded "
                           "workers' names (a set or a list)")
            mine.append(sorted(set(got)))
        count += len(vectors)
        case.judge(mine, f"{name} ({len(vectors)} load vectors; the first, overloaded({_by_worker(vectors[0][0])}, "
                           f"{vectors[0][1]}, {vectors[0][2]}) -> yours {mine[0]}; a worker is overloaded when both "
                         "thresholds hold)",
                   lambda got, want, vectors=vectors: _overloaded_difference(vectors, got, want))
    return KEY_1.report([f"{count} load vectors (1 to 6 workers, {len(EDGE_CASES)} on the thresholds' edges, "
                         f"{FRESH_CASES * FRESH_GROUP} drawn as the check ran): the same workers as the rule"])


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
# In every one the rule allows exactly one worker at each request (no tie to break): the whole sequence of
# choices is then the answer, which an answer key can hold as one digest.
SCENARIOS: list[tuple[str, list[_Step]]] = [
    ("a match above the threshold goes to its holder", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 1)), _Step(_STORY + " Q2", ("a", "b"), (1, 0))]),
    ("an overloaded holder is skipped", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 1)), _Step(_STORY + " Q2", ("a", "b"), (10, 2))]),
    ("an overloaded worker elsewhere does not stop the match (SGLang's rule would balance here)", [
        _Step(_STORY + " Q1", ("a", "b", "c"), (0, 1, 2)), _Step(_STORY + " Q2", ("a", "b", "c"), (3, 0, 10))]),
    ("overloaded needs both thresholds (16 - 11 > 4 but 16 <= 1.5 x 11)", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 1)), _Step(_STORY + " Q2", ("a", "b"), (16, 11)),
        _Step(_STORY + " Q3", ("a", "b"), (11, 16))]),
    ("a match at or below the threshold goes to the smallest tree", [
        _Step("abcdefghij", ("a", "b"), (0, 1)), _Step("abcdefghij" + "K" * 24, ("a", "b"), (0, 3)),
        _Step("abcXYZXYZX", ("a", "b", "c"), (0, 0, 3))]),
    ("several holders: the least loaded of them", [
        _Step(_STORY, ("a",), (0,)), _Step(_STORY, ("b",), (0,)),
        _Step(_STORY + " again", ("a", "b", "c"), (3, 1, 0))]),
    ("a worker not in `workers` (unhealthy) is never chosen, even if it holds the prefix", [
        _Step(_STORY + " Q1", ("a", "b"), (0, 1)), _Step(_STORY + " Q2", ("b",), (0,)),
        _Step(_STORY + " Q3", ("b", "c"), (0, 0))]),
    ("the tree is cut back to max_tree_size by evict()", [
        _Step("x" * 50, ("a", "b"), (0, 1)), _Step("y" * 50, ("a", "b"), (0, 0)), _Step("x" * 50 + "z", ("a", "b"), (0, 0)),
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
        # distinct loads: the least loaded of any set of workers is one worker, so the rule allows exactly one
        loads = rng.sample(range(max(rng.choice([2, 8, 80]), len(workers)) + 1), len(workers))
        steps.append(_Step(text, tuple(workers), tuple(loads), evict_after=rng.random() < 0.2))
    return config, steps


def _replay(cls, config_kwargs: dict, steps: list[_Step], where: str, teacher: bool) -> list[str]:
    """The learner's router on one sequence of requests; returns its choices. Checked as it goes, in both
    copies of the course: its tree against a shadow `RadixTree` fed the same choices (sizes after every
    request, evict()'s return value); in the teacher's copy also every choice against the rule (the
    grader-private reference), with the reason. A release compares the choices with the answer key."""
    config = CacheAwareConfig(**config_kwargs)
    shadow = RadixTree()
    with forbid(*REFERENCE):
        router = cls(CacheAwareConfig(**config_kwargs))
    tree = getattr(router, "tree", None)
    if tree is None or isinstance(tree, RadixTree) or not callable(getattr(tree, "size", None)):
        raise Fail(f"{where}: your router has no .tree of your own (set self.tree = PrefixTree() in __init__: "
                   "task 2's tree, not minillm's RadixTree)")
    all_workers = sorted({w for s in steps for w in s.workers})
    choices = []
    for number, step in enumerate(steps, 1):
        loads = dict(zip(step.workers, step.loads))
        with forbid(*REFERENCE):
            got = router.choose(step.text, list(step.workers), dict(loads))
        shown = (f"{where}, request {number} ({step.text[:24]!r}..., {len(step.text)} chars), workers "
                 f"{list(step.workers)}, loads {loads}: you chose {got!r}")
        if got not in step.workers:
            raise Fail(f"{shown}, not one of the workers given")
        if teacher:
            rule, allowed = _private().allowed(shadow, step.text, list(step.workers), loads, config)
            if got not in allowed:
                raise Fail(f"{shown}; {rule}: {sorted(allowed)}")
        choices.append(got)
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
    return choices


SEQUENCES_PER_CASE = 5  # task 3's random sequences are graded (and keyed) five to a case
SEEDED_DECISION_CASES = 1 + 60 // SEQUENCES_PER_CASE  # the named scenarios, then 60 seeded random sequences


def _decision_case(number: int) -> list[tuple[str, dict, list[_Step]]]:
    """Task 3's case `number`: the named scenarios (0), or five random sequences (seeds 5(number - 1) to
    5 number - 1: cases 1 to 12 are the 60 seeded ones). Its answer is every choice of every sequence."""
    if number == 0:
        return [(f"scenario '{name}'", SCENARIO_CONFIG, steps) for name, steps in SCENARIOS]
    out = []
    for seed in range(SEQUENCES_PER_CASE * (number - 1), SEQUENCES_PER_CASE * number):
        config, steps = _random_steps(seed)
        out.append((f"random sequence {seed} (config {config})", config, steps))
    return out


def rule_choices(number: int) -> list[list[str]]:
    """Task 3's expected output on case `number`: the rule's choice at every request of every sequence. The
    cases are built so that the rule allows one worker at each request (a tie would have no single answer)."""
    out = []
    for where, config_kwargs, steps in _decision_case(number):
        config, shadow, choices = CacheAwareConfig(**config_kwargs), RadixTree(), []
        for step in steps:
            loads = dict(zip(step.workers, step.loads))
            _, allowed = _private().allowed(shadow, step.text, list(step.workers), loads, config)
            if len(allowed) != 1:
                raise ValueError(f"{where}: the rule allows {sorted(allowed)} at {step}: a case with a tie cannot be keyed")
            choices.append(next(iter(allowed)))
            shadow.insert(step.text, choices[-1])
            if step.evict_after:
                shadow.evict(config.max_tree_size)
        out.append(choices)
    return out


def _decisions(router_class, cases) -> list[str]:
    if not isinstance(router_class, type):
        raise Fail(f"expected a class, got {type(router_class).__name__}")
    if issubclass(router_class, policies.Policy):
        raise Fail(f"{router_class.__name__} inherits from minillm's Policy: write the router yourself")
    decisions = 0
    for case in cases:
        sequences = _decision_case(case.number)
        teacher = case.expected() is not None  # the teacher's copy: the rule's choices, checked against the key
        mine = [_replay(router_class, config, steps, where, teacher) for where, config, steps in sequences]
        if case.number < KEY_3.seeded:
            decisions += sum(len(choices) for choices in mine)
        names = "the named scenarios" if case.number == 0 else ", ".join(where.split(" (")[0] for where, _, _ in sequences)
        case.judge(mine, f"{names}: your {sum(map(len, mine))} choices",
                   lambda got, want, names=names: f"{names}: your choices {got}, the rule's {want}")
    drawn = len(cases) - KEY_3.seeded
    return [f"{len(SCENARIOS)} scenarios and 60 seeded random sequences ({decisions} decisions), plus "
            f"{drawn * SEQUENCES_PER_CASE} sequences drawn as the check ran: every choice the one the rule allows, "
            "the tree as expected after every request and every evict(), and evict()'s count of dropped characters"]


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


def reference_on_trace(number: int) -> dict:
    """Public facts of task 3's case `number` (stored in plain in the answer key: a metric, no answer): the
    rule's router (ties to the first worker listed) on the tenant trace of seed `number`."""
    ref = _serve(_private().Router(CacheAwareConfig(**TRACE_CONFIG)), _texts(number))
    return {"hit_rate": ref.hit_rate, "peak_imbalance": ref.peak_imbalance}


KEY_3 = AnswerKey("ex13_cache_aware_routing", 3, size=64, seeded=SEEDED_DECISION_CASES, reference=rule_choices,
                  private=_TEACHERS[0], facts=reference_on_trace)


@task(3, "match or balance", check_time_limit_s=240)
def check_task_3(router_class) -> list[str]:
    cases = KEY_3.cases(fresh=FRESH_CASES)
    lines = _decisions(router_class, cases)
    # the router on whole traces: the seeded one (case 0's) and those of the cases drawn now
    for case in [case for case in cases if case.number == 0 or case.number >= KEY_3.seeded]:
        ref = case.facts()  # the rule's hit rate and peak imbalance on this trace
        with forbid(*REFERENCE):
            router = router_class(CacheAwareConfig(**TRACE_CONFIG))
        yours = _serve(router, _texts(case.number), guard=lambda: forbid(*REFERENCE))
        where = "the seeded trace" if case.number == 0 else f"a trace drawn as the check ran (seed {case.number})"
        if yours.hit_rate < ref["hit_rate"] - HIT_SLACK:
            raise Fail(f"{where}: prefix hit rate {yours.hit_rate:.3f}, the reference's {ref['hit_rate']:.3f} (at least "
                       f"{ref['hit_rate'] - HIT_SLACK:.3f} needed): requests miss the worker that holds their prefix "
                       "(does the match rule win when loads are even? is the tree cut back as the workers' caches are?)")
        if yours.peak_imbalance > ref["peak_imbalance"] + IMBALANCE_SLACK:
            raise Fail(f"{where}: requests in flight differed by up to {yours.peak_imbalance} between workers, the "
                       f"reference's by {ref['peak_imbalance']} (at most {ref['peak_imbalance'] + IMBALANCE_SLACK} "
                       f"allowed): the hot tenants pile onto one worker (requests per worker {list(yours.per_worker)})")
        if case.number == 0:
            lines.append(f"seeded trace ({TRACE['num_requests']} requests, {TRACE['num_tenants']} tenants, Zipf "
                         f"{TRACE['zipf_s']:g}, {len(WORKERS)} workers): prefix hit rate {yours.hit_rate:.3f} "
                         f"(reference {ref['hit_rate']:.3f}), peak imbalance {yours.peak_imbalance} in flight "
                         f"(reference {ref['peak_imbalance']}), requests per worker {list(yours.per_worker)}")
    lines.append(f"{FRESH_CASES} traces drawn as the check ran: within {HIT_SLACK} of the reference's hit rate and "
                 f"{IMBALANCE_SLACK} of its peak imbalance")
    return KEY_3.report(lines)
