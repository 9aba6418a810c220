"""Grader of exercise 09 (chapter 09: speculative decoding): recursive rejection sampling over several
candidates at one position (a variant of chapter 09's sampler, which verifies one guess per
position): the chain of residuals, the verifier graded by its exact output distribution, and a
seeded random source. The reference for the variant is grader-private
(`minillm.grading.private.ex09_reference`, guarded while a check runs); minillm's sampler is disabled
(`forbid`) while learner code runs.

Task 2 does not sample. The learner's `verify(p, q, candidates, rng)` draws its randomness only through
`rng.uniform()` and `rng.choice(probs)`; `ExactRng` answers every such call with *each* possible
outcome in turn (a uniform is a `SymbolicUniform` whose comparisons `u < x` branch with
probability x), replaying the function along every path. The probabilities of the paths give the
exact distribution of what the sampler emits, for every tuple of candidates the proposer could
have drawn, which is then compared with the target's p to 1e-9, and with the rule's acceptance
probabilities and final residual, candidate by candidate.

Tasks 1 and 2 grade in a student release too, with answer keys (`minillm.grading.answer_key`): one
digest per case of the rule's whole output on it, its floats in whole steps (task 1: the residual
rows of 20 triples, or of the named ones, in 1e-8s; task 2: the exact outcomes of every tuple of
candidates, in 1e-7s). The checks that need no reference run in both copies: the rows' shape, row 0
= p, the first candidate accepted with probability min(1, p/q), and the emitted token following p.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable

import torch

from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, task
from minillm.grading.answer_key import AnswerKey, quantized
from minillm.spec import rejection as reference

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
LEARNER_TOOLS = ("ExactRng", "SymbolicUniform")  # the rng verify draws from, and its uniforms

DTYPE = torch.float64
MAX_PATHS = 200_000
UNIFORM_BINS = 20  # task 3 tests uniform()'s law on this many equal bins
FRESH_CASES = 2  # tasks 1 and 2 add cases drawn when the check runs
# The variant's reference (grader-private: guarded while a check runs, withheld from a student release, where
# tasks 1 and 2 grade with their answer keys, minillm/grading/keys/ex09_rejection_sampler.json)
_TEACHERS = (private_reference("ex09_reference"),)
RESIDUAL_STEP = 1e-8  # task 1's rows in an answer key: whole multiples of this (a correct row differs in its last bits)
LAW_STEP = 1e-7  # task 2's outcome probabilities in an answer key: the same


def _private():
    """The grader-private reference, loaded at import. Held in a tuple, not as a module global, so that
    looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]


# --- exact randomness ----------------------------------------------------------------------------


class ExactRng:
    """Replays one path of decisions (`script`) and records the branch counts and the path's probability."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)
        self.position = 0
        self.num_options: list[int] = []
        self.probability = 1.0

    def _branch(self, weights: list[float]) -> int:
        if self.position == len(self.script):
            self.script.append(0)
        branch = self.script[self.position]
        self.num_options.append(len(weights))
        self.probability *= weights[branch]
        self.position += 1
        return branch

    def uniform(self) -> SymbolicUniform:
        """A uniform number in [0, 1): compare it with a number (`u < x`)."""
        return SymbolicUniform(self)

    def choice(self, probs) -> int:
        """An index drawn with probabilities `probs` (a 1-D tensor or list summing to 1)."""
        values = [float(x) for x in torch.as_tensor(probs, dtype=DTYPE).reshape(-1)]
        if any(math.isnan(v) for v in values):
            raise Fail(f"rng.choice got NaN probabilities {_fmt(values)}: did you divide by a zero sum?")
        if min(values, default=0.0) < -1e-12:
            raise Fail(f"rng.choice got negative probabilities {_fmt(values)}: clamp p − q at 0 first")
        total = sum(values)
        if abs(total - 1.0) > 1e-6:
            raise Fail(f"rng.choice got probabilities summing to {total:.4f}, not 1 ({_fmt(values)}): normalize them")
        support = [i for i, v in enumerate(values) if v > 0]
        branch = self._branch([values[i] for i in support])
        return support[branch]


class SymbolicUniform:
    """A uniform number the grader never fixes: each comparison splits the interval it may lie in."""

    def __init__(self, rng: ExactRng, scale: float = 1.0, state: list[float] | None = None) -> None:
        self.rng, self.scale = rng, scale
        self.state = state if state is not None else [0.0, 1.0]  # [lo, hi): where u may still lie

    def _below(self, threshold) -> bool:
        t = float(threshold) / self.scale
        lo, hi = self.state
        share = min(1.0, max(0.0, (t - lo) / (hi - lo)))
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        below = self.rng._branch([share, 1.0 - share]) == 0
        self.state[:] = [lo, t] if below else [t, hi]
        return below

    def __lt__(self, other) -> bool:
        return self._below(other)

    __le__ = __lt__  # u == x has probability 0

    def __gt__(self, other) -> bool:
        return not self._below(other)

    __ge__ = __gt__

    def __mul__(self, factor) -> SymbolicUniform:
        factor = float(factor)
        if factor <= 0:
            raise Fail("the exact grader's uniform can only be scaled by a positive number")
        return SymbolicUniform(self.rng, self.scale * factor, self.state)

    __rmul__ = __mul__

    def __truediv__(self, divisor) -> SymbolicUniform:
        return self * (1.0 / float(divisor))

    def __float__(self) -> float:
        raise Fail("the exact grader's rng.uniform() can only be compared with a number (write u < x): "
                   "it follows both outcomes of the comparison instead of fixing u")

    __index__ = __int__ = __float__

    def __bool__(self) -> bool:
        raise Fail("rng.uniform() is a number to compare (u < x), not a truth value")


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def exact_outputs(fn: Callable[[ExactRng], list[int]]) -> dict[tuple[int, ...], float]:
    """P(output) of `fn(rng)` over every path of its random choices (each path run twice: it must be
    a function of the choices alone)."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    pending = [[]]
    paths = 0
    while pending:
        script = pending.pop()
        rng = ExactRng(script)
        result = fn(rng)
        again = ExactRng(rng.script)
        if fn(again) != result or again.script != rng.script or abs(again.probability - rng.probability) > 1e-15:
            raise Fail("your sampler gave different answers for the same random choices: draw every random "
                       "number through rng.uniform() and rng.choice(), nothing else (no torch.rand, no random)")
        for depth in range(len(script), len(rng.num_options)):
            for alt in range(1, rng.num_options[depth]):
                pending.append(rng.script[:depth] + [alt])
        if not isinstance(result, list) or not all(isinstance(t, int) for t in result):
            raise Fail(f"verify returned {result!r}: return a list of token ids (ints)")
        out[tuple(result)] += rng.probability
        paths += 1
        if paths > MAX_PATHS:
            raise Fail(f"more than {MAX_PATHS} random paths: does verify draw far more random numbers than it needs?")
    return dict(out)


# --- cases ---------------------------------------------------------------------------------------


def _dist(gen: torch.Generator, vocab: int, sharpness: float = 1.5, zeros: int = 0) -> torch.Tensor:
    logits = torch.randn(vocab, generator=gen, dtype=DTYPE) * sharpness
    if zeros:
        logits[torch.randperm(vocab, generator=gen)[:zeros]] = -math.inf
    return torch.softmax(logits, dim=-1)


def _cases(num_random: int, seeds: tuple[int, ...] = ()) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, p [V], q [V], n candidates): named corner cases, seeded random ones, then ones drawn from `seeds`."""
    gen = torch.Generator().manual_seed(9)
    v = 4
    cases = []
    p = _dist(gen, v)
    cases.append(("q equals p: the first candidate is always accepted", p, p.clone(), 2))
    cases.append(("q and p disjoint: every candidate rejected", torch.tensor([0.5, 0.5, 0, 0], dtype=DTYPE),
                  torch.tensor([0, 0, 0.3, 0.7], dtype=DTYPE), 2))
    one_hot = torch.zeros(v, dtype=DTYPE)
    one_hot[1] = 1.0
    cases.append(("one-hot q (an n-gram guess, repeated)", _dist(gen, v), one_hot, 2))
    cases.append(("one candidate: chapter 09's rule", _dist(gen, v), _dist(gen, v), 1))
    cases.append(("three candidates, zeros in p and q", _dist(gen, v + 1, zeros=2), _dist(gen, v + 1, zeros=1), 3))
    cases.append(("q sharper than p: the residual moves twice", _dist(gen, v, sharpness=0.3), _dist(gen, v, sharpness=3.0),
                  3))
    for i in range(num_random):
        n, vocab = 1 + i % 3, 3 + i % 3
        cases.append((f"random case {i} ({n} candidates, vocab {vocab})",
                      _dist(gen, vocab, sharpness=0.5 + i % 4), _dist(gen, vocab, sharpness=0.5 + (i + 1) % 4), n))
    for seed in seeds:
        drawn = torch.Generator().manual_seed(seed)
        n, vocab = 2 + seed % 2, 3 + seed % 3
        cases.append((f"a case drawn as the check ran (seed {seed}, {n} candidates, vocab {vocab})",
                      _dist(drawn, vocab, sharpness=1.0 + seed % 3, zeros=seed % 2), _dist(drawn, vocab), n))
    return cases


def _candidates(q: torch.Tensor, n: int):
    """Every tuple of n candidates the proposer could draw from q (independently), with its probability."""
    support = [t for t in range(q.shape[0]) if q[t] > 0]
    for draw in itertools.product(support, repeat=n):
        yield list(draw), math.prod(float(q[t]) for t in draw)


def _forbidden() -> tuple:
    return (reference.rejection_sample, reference.target_probs)


# --- task 1: the residuals after each rejection ----------------------------------------------------


PAIR_GROUP = 20  # (p, q, n) triples per case of task 1 (one answer: the rows of all of them)
SEEDED_PAIR_CASES = 1 + 200 // PAIR_GROUP  # the named triples, then 200 seeded random ones


def _seeded_pairs() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(200):
        vocab = 2 + i % 7
        out.append((f"random pair {i}", _dist(gen, vocab, zeros=i % 2), _dist(gen, vocab), i % 4))
    return out


def _pair_case(number: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """Task 1's case `number`: the named triples (0), 20 of the 200 seeded random ones (1 to 10), or 20 drawn
    from the seed `number` (a pool case, or a seed drawn at grade time)."""
    if number == 0:
        return [("p equals q", torch.tensor([0.2, 0.3, 0.5], dtype=DTYPE), torch.tensor([0.2, 0.3, 0.5], dtype=DTYPE), 2),
                ("q one-hot", torch.tensor([0.1, 0.6, 0.3], dtype=DTYPE), torch.tensor([0.0, 1.0, 0.0], dtype=DTYPE), 3),
                ("q sharper than p", torch.tensor([0.3, 0.3, 0.4], dtype=DTYPE),
                 torch.tensor([0.05, 0.05, 0.9], dtype=DTYPE), 3)]
    if number < SEEDED_PAIR_CASES:
        return _seeded_pairs()[PAIR_GROUP * (number - 1):PAIR_GROUP * number]
    drawn, out = torch.Generator().manual_seed(number), []
    for i in range(PAIR_GROUP):
        vocab = 2 + (number + i) % 7
        out.append((f"a pair drawn as the check ran (seed {number}, #{i})", _dist(drawn, vocab, zeros=i % 2),
                    _dist(drawn, vocab, sharpness=0.5 + i % 4), 1 + i % 4))
    return out


def _quantized_rows(rows: torch.Tensor) -> list[list[int]]:
    return [[quantized(x, RESIDUAL_STEP) for x in row] for row in rows.tolist()]


def residual_rows(number: int) -> list[list[list[int]]]:
    """Task 1's expected output on case `number`: the residual chain of each triple, in whole RESIDUAL_STEPs."""
    return [_quantized_rows(_private().residual_chain(p, q, n)) for _, p, q, n in _pair_case(number)]


KEY_1 = AnswerKey("ex09_rejection_sampler", 1, size=256, seeded=SEEDED_PAIR_CASES, reference=residual_rows,
                  private=_TEACHERS[0])


def _rounding_difference(what: str, step: float, mine, want) -> str:
    """The teacher's copy's message when the learner's floats passed the check's tolerance but round to other
    whole steps than the rule's (a value that lies on a rounding boundary: vanishingly rare)."""
    path, a, b = [], mine, want
    while isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            break
        path.append(i)
        a, b = a[i], b[i]
    return (f"{what}: yours agree with the rule's to the check's tolerance but round to other whole {step:g}s at "
            f"{path}: yours {a}, the rule's {b} (a value on a rounding boundary: tell your teacher)")


def _row_hint(j: int) -> str:
    return "row 0 must be p itself" if j == 0 else (
        f"row {j} is what row {j - 1} has and q does not, normalized (row {j - 1} itself if nothing is left)")


@task(1, "residuals")
def check_task_1(residuals) -> str:
    count = 0
    for case in KEY_1.cases(fresh=FRESH_CASES):
        triples = _pair_case(case.number)
        case.expected()  # the teacher's copy: the rule's rows, checked against the key
        mine = []
        for name, p, q, n in triples:
            with forbid(*_forbidden()):
                got = residuals(p.clone(), q.clone(), n)
            got = torch.as_tensor(got, dtype=DTYPE)
            if got.shape != (n + 1, p.shape[0]):
                raise Fail(f"{name}: residuals(p, q, n={n}) has shape {tuple(got.shape)}; expected {(n + 1, p.shape[0])} "
                           f"(n + 1 rows: p, then one row per rejection)")
            shown = f"{name}: p = {_fmt(p)}, q = {_fmt(q)}"
            for j in range(n + 1):
                if not bool(torch.isfinite(got[j]).all()):
                    raise Fail(f"{shown}: row {j} of yours is {_fmt(got[j])}, not a distribution: {_row_hint(j)}")
            if not torch.allclose(got[0], p, atol=1e-12):
                raise Fail(f"{shown}: row 0 of yours is {_fmt(got[0])}: {_row_hint(0)}")
            if KEY_1.teacher:  # the rule's rows, to 1e-12, and where yours part from them
                expected = _private().residual_chain(p, q, n)
                for j in range(n + 1):
                    if not torch.allclose(got[j], expected[j], atol=1e-12):
                        raise Fail(f"{shown}: row {j} of yours is {_fmt(got[j])}, expected {_fmt(expected[j])}: "
                                   f"{_row_hint(j)}")
            mine.append(_quantized_rows(got))
        count += len(triples)
        names = "the named triples" if case.number == 0 else f"{triples[0][0]} to {triples[-1][0]}"
        case.judge(mine, f"{names} (p, q, n from grader._pair_case({case.number})): your rows, in whole "
                         f"{RESIDUAL_STEP:g}s: each row normalize(max(0, previous - q)), the previous if nothing is left",
                   lambda got, want, names=names: _rounding_difference(f"{names}: your rows", RESIDUAL_STEP, got, want))
    within = "to 1e-12" if KEY_1.teacher else f"in whole {RESIDUAL_STEP:g}s"
    return KEY_1.report(f"{count} (p, q, n) cases, p == q, one-hot q and {FRESH_CASES * PAIR_GROUP} drawn as the check "
                        f"ran: each row normalize(max(0, previous − q)) {within}")


# --- task 2: the whole rule, graded exactly ------------------------------------------------------


def _outcomes(name: str, outputs: dict, candidates: list[int]) -> dict[tuple[int, int], float]:
    """{(accepted index or -1, token): probability}, after checking the shape of every answer."""
    n, out = len(candidates), {}
    for (index, token), prob in outputs.items():
        if index == -1:
            pass  # drawn from the last residual: any token
        elif not 0 <= index < n:
            raise Fail(f"{name}: with candidates {candidates} you answered index {index}: the index of the accepted "
                       f"candidate (0 … {n - 1}) or None when every candidate was rejected")
        elif token != candidates[index]:
            raise Fail(f"{name}: with candidates {candidates} you answered ({index}, {token}): an accepted candidate "
                       f"is emitted as it is (token {candidates[index]})")
        out[(index, token)] = out.get((index, token), 0.0) + prob
    return out


def _check_rule(name: str, outcomes: dict, candidates: list[int], chain: torch.Tensor, q: torch.Tensor) -> None:
    """The properties that define recursive rejection sampling, for one tuple of candidates: candidate j is
    accepted (given the ones before it were rejected) with probability min(1, r_j(c) / q(c)), r_0 = p and
    r_{j+1} = normalize(max(0, r_j − q)); after n rejections the token follows r_n. (A token law equal to p
    alone does not define it: a verifier that never reads q can get that.) `chain` holds r_0 … r_n, or only
    the rows known here (a student release knows r_0 = p alone: the rest is the answer key's to judge)."""
    n = len(candidates)
    reach = 1.0
    for j, c in enumerate(candidates):
        if reach < 1e-12 or j >= chain.shape[0]:
            return
        accepted = sum(prob for (index, _), prob in outcomes.items() if index == j)
        rate, rx, qx = accepted / reach, float(chain[j, c]), float(q[c])
        want = min(1.0, rx / qx)
        if abs(rate - want) > 1e-9:
            law = "p" if j == 0 else f"r_{j}, the residual after {j} rejection(s)"
            raise Fail(f"{name}: with candidates {candidates}, candidate {j} (token {c}) is accepted with probability "
                       f"{rate:.6f}, once the ones before it were rejected; the rule accepts it with min(1, r(x)/q(x)) "
                       f"= min(1, {rx:.4f}/{qx:.4f}) = {want:.6f}, r being {law} = {_fmt(chain[j])}")
        reach -= accepted
    if reach > 1e-12 and chain.shape[0] > n:
        law = torch.zeros(chain.shape[1], dtype=DTYPE)
        for (index, token), prob in outcomes.items():
            if index == -1:
                law[token] += prob
        got = law / law.sum()
        if not torch.allclose(got, chain[n], atol=1e-9):
            raise Fail(f"{name}: with candidates {candidates}, after rejecting all {n} the token follows {_fmt(got)}; "
                       f"it must follow r_{n}, the residual after {n} rejections, = {_fmt(chain[n])}")


SEEDED_VERIFY_CASES = 13  # task 2's case 0: the six named (p, q, n); cases 1 to 12: the seeded random ones


def _verify_case(number: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """Task 2's case `number`: the named triples (0), one of the 12 seeded random ones (1 to 12), or one drawn
    from the seed `number` (a pool case, or a seed drawn at grade time)."""
    if number < SEEDED_VERIFY_CASES:
        fixed = _cases(SEEDED_VERIFY_CASES - 1)
        named = len(fixed) - (SEEDED_VERIFY_CASES - 1)
        return fixed[:named] if number == 0 else [fixed[named + number - 1]]
    return _cases(0, (number,))[-1:]


def _law(outcomes: dict[tuple[int, int], float]) -> list[list[int]]:
    """One tuple's outcomes as an answer key holds them: [index (-1: all rejected), token, probability in whole
    LAW_STEPs], sorted, the ones that round to 0 left out."""
    return sorted([index, token, quantized(prob, LAW_STEP)] for (index, token), prob in outcomes.items()
                  if quantized(prob, LAW_STEP) != 0)


def rule_laws(number: int) -> list[list[list[list[int]]]]:
    """Task 2's expected output on case `number`: for each triple, for every tuple of candidates q can propose
    (in `_candidates` order), the rule's exact outcomes: candidate j accepted with probability reach_j x min(1,
    r_j(c_j) / q(c_j)), and after n rejections each token t with probability reach_n x r_n(t)."""
    out = []
    for _, p, q, n in _verify_case(number):
        chain, laws = _private().residual_chain(p, q, n), []
        for candidates, _ in _candidates(q, n):
            outcomes, reach = {}, 1.0
            for j, c in enumerate(candidates):
                accept = min(1.0, float(chain[j, c]) / float(q[c]))
                outcomes[(j, c)] = reach * accept
                reach *= 1.0 - accept
            for token in range(p.shape[0]):
                outcomes[(-1, token)] = reach * float(chain[n, token])
            laws.append(_law(outcomes))
        out.append(laws)
    return out


KEY_2 = AnswerKey("ex09_rejection_sampler", 2, size=256, seeded=SEEDED_VERIFY_CASES, reference=rule_laws,
                  private=_TEACHERS[0])


@task(2, "verify several candidates, exactly")
def check_task_2(verify) -> list[str]:
    total_paths = count = 0
    for case in KEY_2.cases(fresh=FRESH_CASES):
        triples = _verify_case(case.number)
        case.expected()  # the teacher's copy: the rule's outcomes, checked against the key
        mine, emitted_laws = [], []
        for name, p, q, n in triples:
            # the residuals this copy knows: all of them in the teacher's copy, r_0 = p alone in a release
            chain = _private().residual_chain(p, q, n) if KEY_2.teacher else p.unsqueeze(0)
            emitted, laws = torch.zeros(p.shape[0], dtype=DTYPE), []
            for candidates, weight in _candidates(q, n):
                def run(rng, c=candidates, p=p, q=q):
                    answer = verify(p.clone(), q.clone(), list(c), rng)
                    if not isinstance(answer, tuple | list) or len(answer) != 2:
                        raise Fail(f"verify returned {answer!r}: return (index of the accepted candidate or None, token)")
                    index, token = answer
                    if index is not None and not isinstance(index, int) or not isinstance(token, int):
                        raise Fail(f"verify returned {answer!r}: the index (or None) and the token are ints")
                    return [-1 if index is None else index, token]
                with forbid(*_forbidden()):
                    outputs = exact_outputs(run)
                outcomes = _outcomes(name, {tuple(k): v for k, v in outputs.items()}, candidates)
                _check_rule(name, outcomes, candidates, chain, q)
                if case.number < KEY_2.seeded:
                    total_paths += len(outputs)  # the seeded cases' count
                for (_, token), prob in outcomes.items():
                    if not 0 <= token < p.shape[0]:
                        raise Fail(f"{name}: with candidates {candidates} you emitted token {token}, outside the "
                                   f"vocabulary (0 … {p.shape[0] - 1})")
                    emitted[token] += weight * prob
                laws.append(_law(outcomes))
            mine.append(laws)
            emitted_laws.append((name, p, emitted))
        count += len(triples)
        names = "the named triples" if case.number == 0 else triples[0][0]
        case.judge(mine, f"{names} (p, q, n from grader._verify_case({case.number})): your exact outcomes for every "
                         f"tuple of candidates, in whole {LAW_STEP:g}s (candidate j accepted with probability "
                         "min(1, r_j/q) once the ones before it were rejected, r_j the residual after j rejections; "
                         "after n rejections the token drawn from r_n)",
                   lambda got, want, names=names: _rounding_difference(f"{names}: your outcomes", LAW_STEP, got, want))
        for name, p, emitted in emitted_laws:
            if abs(float(emitted.sum()) - 1.0) > 1e-9:
                raise Fail(f"{name}: your outputs' probabilities sum to {float(emitted.sum()):.6f}, not 1")
            if not torch.allclose(emitted, p, atol=1e-9):
                raise Fail(f"{name}: the emitted token follows {_fmt(emitted)}, but the target's p is {_fmt(p)}")
    within = "to 1e-9" if KEY_2.teacher else f"in whole {LAW_STEP:g}s"
    return KEY_2.report([
        f"{count} cases (q = p, disjoint, one-hot, 1 … 3 candidates, {FRESH_CASES} drawn as the check ran): every "
        f"tuple of candidates q could propose, every path of your random choices ({total_paths} outputs in the "
        "seeded cases)",
        "each candidate accepted with probability min(1, r/q), r the residual after the rejections before it; "
        f"after n rejections the token drawn from r_n ({within})",
        "the emitted token follows the target's p exactly (to 1e-9)"])


# --- task 3: a seeded random source --------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=DTYPE), stat / 2))


def _sample_run(verify, rng_class, p, q, num_samples: int, seed: int, n: int = 2):
    rng = rng_class(seed)
    draw = torch.Generator().manual_seed(seed + 1)  # the proposer's draws: the grader's own
    tokens = torch.zeros(p.shape[0], dtype=DTYPE)
    first_accepted = 0
    for _ in range(num_samples):
        candidates = torch.multinomial(q, n, replacement=True, generator=draw).tolist()
        index, token = verify(p, q, candidates, rng)
        tokens[token] += 1
        first_accepted += index == 0
    return tokens, first_accepted


@task(3, "seeded sampling")
def check_task_3(verify, rng_class, num_samples: int = 20_000) -> list[str]:
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([_dist(gen, 6) for _ in range(2)])
    q = _dist(gen, 6)
    drawn_a, drawn_b = grade_time_seeds(2)
    while drawn_b == drawn_a:  # once in ~1e9 grades: then a correct generator would "draw the same numbers"
        (drawn_b,) = grade_time_seeds(1)
    with forbid(*_forbidden()):
        a, b = rng_class(5), rng_class(5)
        draws_a = [float(a.uniform()) for _ in range(50)] + [int(a.choice(p[0])) for _ in range(50)]
        draws_b = [float(b.uniform()) for _ in range(50)] + [int(b.choice(p[0])) for _ in range(50)]
        other = rng_class(6)
        draws_c = [float(other.uniform()) for _ in range(50)] + [int(other.choice(p[0])) for _ in range(50)]
        if draws_a != draws_b:
            raise Fail("two generators made with the same seed drew different numbers: seed your own generator "
                       "(torch.Generator().manual_seed(seed)) and draw only from it")
        if draws_a == draws_c:
            raise Fail("seeds 5 and 6 drew the same numbers: the seed must matter")
        again = [rng_class(drawn_a), rng_class(drawn_a), rng_class(drawn_b)]
        seen = [[float(r.uniform()) for _ in range(20)] + [int(r.choice(p[1])) for _ in range(20)] for r in again]
        if seen[0] != seen[1] or seen[0] == seen[2]:
            raise Fail(f"seeds {drawn_a} and {drawn_b}, drawn as the check ran: the same seed must draw the same "
                       "numbers and another seed others (a generator of your own, seeded with the seed you are given)")
        if not all(0.0 <= u < 1.0 for u in draws_a[:50]):
            raise Fail(f"uniform() returned values outside [0, 1): {draws_a[:5]}")
        uniforms = [float(a.uniform()) for _ in range(num_samples)]
        picks = torch.zeros(6, dtype=DTYPE)
        for _ in range(num_samples):
            picks[int(a.choice(p[1]))] += 1
        tokens, first_accepted = _sample_run(verify, rng_class, p[0], q, num_samples, seed=11)
    mean_u = sum(uniforms) / len(uniforms)
    if abs(mean_u - 0.5) > 0.01:
        raise Fail(f"the mean of {num_samples} uniform() draws is {mean_u:.4f}: uniform on [0, 1) has mean 0.5")
    if not all(0.0 <= u < 1.0 for u in uniforms):
        raise Fail(f"uniform() returned values outside [0, 1): {[u for u in uniforms if not 0.0 <= u < 1.0][:5]}")
    # the law, not only the mean: a uniform on [0.01, 0.99) has the right mean and accepts guesses it should not
    bins = torch.zeros(UNIFORM_BINS, dtype=DTYPE)
    for u in uniforms:
        bins[min(int(u * UNIFORM_BINS), UNIFORM_BINS - 1)] += 1
    p_uniform = _chi_square_p_value(bins, torch.full((UNIFORM_BINS,), 1.0 / UNIFORM_BINS, dtype=DTYPE))
    if p_uniform < 0.001:
        raise Fail(f"uniform() does not follow the uniform law on [0, 1): counts per {UNIFORM_BINS}th of [0, 1) "
                   f"{[int(c) for c in bins.tolist()]} (chi-square p = {p_uniform:.2g})")
    p_choice = _chi_square_p_value(picks, p[1])
    if p_choice < 0.001:
        raise Fail(f"choice(probs) does not follow probs: counts {picks.tolist()} against {_fmt(p[1])} "
                   f"(chi-square p = {p_choice:.2g})")
    p_tokens = _chi_square_p_value(tokens, p[0])
    if p_tokens < 0.001:
        raise Fail(f"with your generator, verify's tokens do not follow p: counts {[int(c) for c in tokens.tolist()]} "
                   f"against {_fmt(p[0])} (chi-square p = {p_tokens:.2g})")
    rate = float(torch.minimum(p[0], q).sum())  # P(the first candidate is accepted) = sum of min(p, q)
    z = (first_accepted - num_samples * rate) / math.sqrt(num_samples * rate * (1 - rate))
    if abs(z) > 4:
        raise Fail(f"with your generator, the first candidate was accepted {first_accepted} times in {num_samples}; "
                   f"the rule accepts it with probability sum(min(p, q)) = {rate:.4f} ({z:+.1f} standard deviations)")
    return [f"same seed, same draws (seeds drawn as the check ran too); seeds 5 and 6 differ; {num_samples} uniforms "
            f"in [0, 1), mean within 0.01 of 0.5, a chi-square test against the uniform law ({UNIFORM_BINS} bins, "
            "p > 0.001)",
            f"{num_samples} seeded verify calls (2 candidates): the tokens pass a chi-square test against p (p > 0.001), "
            "the first candidate accepted as often as sum(min(p, q)) says (within 4 standard deviations)"]
