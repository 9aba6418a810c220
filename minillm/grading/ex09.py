"""Grader of exercise 09 (chapter 09: speculative decoding): the residual distribution, the rejection
sampler graded by its exact output distribution, and a seeded random source.

Task 2 does not sample. The learner's `verify(p, q, draft, rng)` draws its randomness only through
`rng.uniform()` and `rng.choice(probs)`; `ExactRng` answers every such call with *each* possible
outcome in turn (a uniform is a `SymbolicUniform` whose comparisons `u < x` branch with
probability x), replaying the function along every path. The probabilities of the paths give the
exact distribution of what the sampler emits, for every draft the proposer could have drawn,
which is then compared with the target's p, position by position, to 1e-9. The reference,
`minillm.spec.rejection`, is disabled while learner code runs.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable

import torch

from minillm.grading import Fail, forbid, task
from minillm.spec import rejection as reference

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
LEARNER_TOOLS = ("ExactRng", "SymbolicUniform")  # the rng verify draws from, and its uniforms

DTYPE = torch.float64
MAX_PATHS = 200_000
UNIFORM_BINS = 20  # task 3 tests uniform()'s law on this many equal bins


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


def _cases(num_random: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, p [k+1, V], q [k, V]): named corner cases, then seeded random ones."""
    gen = torch.Generator().manual_seed(9)
    v = 5
    cases = []
    p = torch.stack([_dist(gen, v) for _ in range(3)])
    cases.append(("q equals p: every guess accepted", p, p[:2].clone()))
    disjoint_p = torch.tensor([[0.5, 0.5, 0, 0, 0]] * 2, dtype=DTYPE)
    disjoint_q = torch.tensor([[0, 0, 0.3, 0.7, 0]], dtype=DTYPE)
    cases.append(("q and p disjoint: every guess rejected", disjoint_p, disjoint_q))
    one_hot = torch.zeros(2, v, dtype=DTYPE)
    one_hot[0, 1], one_hot[1, 3] = 1.0, 1.0
    cases.append(("one-hot q (an n-gram guess)", torch.stack([_dist(gen, v) for _ in range(3)]), one_hot))
    cases.append(("k = 1", torch.stack([_dist(gen, v) for _ in range(2)]), _dist(gen, v)[None]))
    cases.append(("k = 3, zeros in p and q", torch.stack([_dist(gen, v, zeros=2) for _ in range(4)]),
                  torch.stack([_dist(gen, v, zeros=1) for _ in range(3)])))
    for i in range(num_random):
        k = 1 + i % 3
        vocab = 3 + i % 3
        cases.append((f"random case {i} (k = {k}, vocab {vocab})",
                      torch.stack([_dist(gen, vocab, sharpness=0.5 + i % 4) for _ in range(k + 1)]),
                      torch.stack([_dist(gen, vocab, sharpness=0.5 + (i + 1) % 4) for _ in range(k)])))
    return cases


def _drafts(q: torch.Tensor):
    """Every draft the proposer could draw from q (positions independent here), with its probability."""
    supports = [[t for t in range(q.shape[1]) if q[i, t] > 0] for i in range(q.shape[0])]
    for draft in itertools.product(*supports):
        yield list(draft), math.prod(float(q[i, t]) for i, t in enumerate(draft))


# --- task 1: the residual ------------------------------------------------------------------------


@task(1, "residual")
def check_task_1(residual, num_random: int = 200) -> str:
    gen = torch.Generator().manual_seed(1)
    pairs = [("p equals q", torch.tensor([0.2, 0.3, 0.5], dtype=DTYPE), torch.tensor([0.2, 0.3, 0.5], dtype=DTYPE)),
             ("q one-hot", torch.tensor([0.1, 0.6, 0.3], dtype=DTYPE), torch.tensor([0.0, 1.0, 0.0], dtype=DTYPE))]
    for i in range(num_random):
        vocab = 2 + i % 7
        pairs.append((f"random pair {i}", _dist(gen, vocab, zeros=i % 2), _dist(gen, vocab)))
    for name, p, q in pairs:
        diff = (p - q).clamp(min=0)
        expected = p.clone() if float(diff.sum()) <= 0 else diff / diff.sum()
        with forbid(reference.rejection_sample, reference.target_probs):
            got = residual(p.clone(), q.clone())
        got = torch.as_tensor(got, dtype=DTYPE)
        if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-12):
            raise Fail(f"{name}: p = {_fmt(p)}, q = {_fmt(q)}: you return {_fmt(got.reshape(-1))}, "
                       f"expected {_fmt(expected)}")
    return f"{len(pairs)} (p, q) pairs, p == q and one-hot q included: normalize(max(0, p − q)) to 1e-12"


# --- task 2: the whole rule, graded exactly ------------------------------------------------------


def _check_paths(name: str, outputs: dict, draft: list[int]) -> None:
    k = len(draft)
    for out, prob in outputs.items():
        if prob <= 1e-15:
            continue
        n = len(out)
        if n == 0 or n > k + 1:
            raise Fail(f"{name}: with draft {draft} you emitted {list(out)}: emit 1 to k + 1 = {k + 1} tokens")
        if list(out[: n - 1]) != draft[: n - 1]:
            raise Fail(f"{name}: with draft {draft} you emitted {list(out)}: every token but the last must be an "
                       f"accepted guess, in order")
        if n == k and list(out) == draft:
            raise Fail(f"{name}: with draft {draft} you emitted {list(out)}, all {k} guesses and nothing after "
                       f"them. If all were accepted, the target's bonus token (drawn from p[k]) is missing; if the "
                       f"last was rejected, its correction comes from normalize(max(0, p − q)), where the rejected "
                       f"token has no mass")
        if n <= k and out[-1] == draft[n - 1]:
            raise Fail(f"{name}: with draft {draft} you emitted {list(out)}: after a rejected guess the "
                       f"correction comes from normalize(max(0, p − q)), where the rejected token has no mass")


def _check_rule(name: str, outputs: dict, draft: list[int], p: torch.Tensor, q: torch.Tensor) -> None:
    """The properties that define the rejection sampler, for one draft, from the exact outputs: guess i
    is accepted (given guesses before it were) with probability min(1, p[i](x) / q[i](x)); after a
    rejection the correction follows normalize(max(0, p[i] − q[i])); after k acceptances the bonus
    follows p[k]. (Outputs distributed as p alone do not define it: a verifier that never reads q can
    get them for a one-hot q.)"""
    k = len(draft)
    accepted = defaultdict(float)  # number of accepted guesses -> probability
    last = defaultdict(lambda: torch.zeros(p.shape[1], dtype=DTYPE))  # accepted count -> law of the last token
    for out, prob in outputs.items():
        accepted[len(out) - 1] += prob
        last[len(out) - 1][out[-1]] += prob
    for i, x in enumerate(draft):
        reach = sum(prob for n, prob in accepted.items() if n >= i)
        if reach < 1e-12:
            break
        rate = sum(prob for n, prob in accepted.items() if n >= i + 1) / reach
        px, qx = float(p[i, x]), float(q[i, x])
        want = min(1.0, px / qx)
        if abs(rate - want) > 1e-9:
            raise Fail(f"{name}: with draft {draft}, guess {i + 1} (token {x}) is accepted with probability "
                       f"{rate:.6f}; the rule accepts it with min(1, p/q) = min(1, {px:.4f}/{qx:.4f}) = {want:.6f}")
        rejected = accepted.get(i, 0.0)
        if rejected > 1e-12:
            got = last[i] / last[i].sum()
            diff = (p[i] - q[i]).clamp(min=0)
            if float(diff.sum()) > 0 and not torch.allclose(got, diff / diff.sum(), atol=1e-9):
                raise Fail(f"{name}: with draft {draft}, after rejecting guess {i + 1} the correction follows "
                           f"{_fmt(got)}; it must follow normalize(max(0, p − q)) = {_fmt(diff / diff.sum())}")
    if accepted.get(k, 0.0) > 1e-12:
        got = last[k] / last[k].sum()
        if not torch.allclose(got, p[k], atol=1e-9):
            raise Fail(f"{name}: with draft {draft}, after accepting all {k} guesses the bonus token follows "
                       f"{_fmt(got)}; it must follow the target's p[{k}] = {_fmt(p[k])}")


@task(2, "verify, exactly")
def check_task_2(verify, num_random: int = 12) -> str:
    cases = _cases(num_random)
    total_paths = 0
    for name, p, q in cases:
        k = q.shape[0]
        emitted: dict[tuple[int, ...], float] = defaultdict(float)
        for draft, weight in _drafts(q):
            with forbid(reference.rejection_sample, reference.target_probs):
                outputs = exact_outputs(lambda rng, d=draft, p=p, q=q: verify(p.clone(), q.clone(), list(d), rng))
            _check_paths(name, outputs, draft)
            _check_rule(name, outputs, draft, p, q)
            total_paths += len(outputs)
            for out, prob in outputs.items():
                emitted[out] += weight * prob
        mass = sum(emitted.values())
        if abs(mass - 1.0) > 1e-9:
            raise Fail(f"{name}: your outputs' probabilities sum to {mass:.6f}, not 1")
        # position i: given the first i emitted tokens (accepted guesses), token i must follow p[i]
        for i in range(k + 1):
            vocab = p.shape[1]
            by_prefix: dict[tuple[int, ...], torch.Tensor] = defaultdict(lambda v=vocab: torch.zeros(v, dtype=DTYPE))
            for out, prob in emitted.items():
                if len(out) > i:
                    by_prefix[out[:i]][out[i]] += prob
            for prefix, weights in by_prefix.items():
                if float(weights.sum()) < 1e-12:
                    continue
                got = weights / weights.sum()
                if not torch.allclose(got, p[i], atol=1e-9):
                    where = "the first token" if i == 0 else f"token {i + 1}, after accepting {list(prefix)},"
                    raise Fail(f"{name}: {where} follows {_fmt(got)}, but the target's p[{i}] is {_fmt(p[i])}")
    return [f"{len(cases)} cases (q = p, disjoint, one-hot, k = 1 … 3): every draft q could propose, every path "
            f"of your random choices ({total_paths} outputs)",
            "each guess accepted with probability min(1, p/q), each correction drawn from normalize(max(0, p − q)), "
            "the bonus from p[k] (to 1e-9)",
            "each emitted position follows the target's p exactly (to 1e-9); 1 … k + 1 tokens, bonus included"]


# --- task 3: a seeded random source --------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=DTYPE), stat / 2))


def _sample_run(verify, rng_class, p, q, num_samples: int, seed: int):
    rng = rng_class(seed)
    draw = torch.Generator().manual_seed(seed + 1)  # the proposer's draws: the grader's own
    first = torch.zeros(p.shape[1], dtype=DTYPE)
    second = torch.zeros(p.shape[1], dtype=DTYPE)
    lengths = []
    for _ in range(num_samples):
        draft = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(q.shape[0])]
        out = verify(p, q, draft, rng)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
        lengths.append(len(out))
    return first, second, lengths


@task(3, "seeded sampling")
def check_task_3(verify, rng_class, num_samples: int = 20_000) -> list[str]:
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([_dist(gen, 6) for _ in range(3)])
    q = torch.stack([_dist(gen, 6) for _ in range(2)])
    with forbid(reference.rejection_sample, reference.target_probs):
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
        if not all(0.0 <= u < 1.0 for u in draws_a[:50]):
            raise Fail(f"uniform() returned values outside [0, 1): {draws_a[:5]}")
        uniforms = [float(a.uniform()) for _ in range(num_samples)]
        picks = torch.zeros(6, dtype=DTYPE)
        for _ in range(num_samples):
            picks[int(a.choice(p[1]))] += 1
        first, second, lengths = _sample_run(verify, rng_class, p, q, num_samples, seed=11)
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
    p_first, p_second = _chi_square_p_value(first, p[0]), _chi_square_p_value(second, p[1])
    if p_first < 0.001 or p_second < 0.001:
        raise Fail(f"with your generator, verify's tokens do not follow p: chi-square p-values {p_first:.2g} "
                   f"(first token) and {p_second:.2g} (second, after an accepted guess)")
    return [f"same seed, same draws; seeds 5 and 6 differ; {num_samples} uniforms in [0, 1), mean within 0.01 of "
            f"0.5, a chi-square test against the uniform law ({UNIFORM_BINS} bins, p > 0.001)",
            f"{num_samples} seeded verify calls (k = 2): first and second tokens pass a chi-square test against p "
            f"(p > 0.001)"]
