"""Known-wrong answers to exercise 09 (several candidates, one exact sampler): see tests/known_wrong/__init__.py.

Besides the bugs of the rule (no clamp, no normalization, acceptance against p instead of the residual,
the last draw from the wrong row), chapter 09's printed `rejection_sample` transcribed for the old
one-guess task (every candidate tested against p, the correction from max(0, p - q) once) fails."""

from known_wrong import Mutant, reads_the_checks_frame

STEP = "left = (rows[-1] - q).clamp(min=0)"
ACCEPT = "if rng.uniform() < min(1.0, float(rows[j, c] / q[c])):"
FINAL = "return None, rng.choice(rows[len(candidates)])"

# Chapter 09's rule for one guess, retyped for several candidates: each tested against p, one residual.
CHAPTER_TRANSCRIBED = """
def verify(p, q, candidates, rng):
    for j, d in enumerate(candidates):
        q_d, p_d = float(q[d]), float(p[d])
        if q_d > 0 and rng.uniform() < min(1.0, p_d / q_d):
            return j, d
    residual = (p - q).clamp(min=0.0)
    total = residual.sum()
    residual = p if float(total) <= 0 else residual / total
    return None, rng.choice(residual)
"""
# The old task 1's answer (one residual), repeated: every row is normalize(max(0, p - q)).
ONE_RESIDUAL_REPEATED = """
def residuals(p, q, n):
    diff = (p - q).clamp(min=0)
    one = p.clone() if float(diff.sum()) <= 0 else diff / diff.sum()
    return torch.stack([p.clone()] + [one] * n)
"""
# A verifier that never reads q: draws from p and keeps a candidate only if the draw equals it.
Q_BLIND = """
def verify(p, q, candidates, rng):
    x = rng.choice(p)
    for j, c in enumerate(candidates):
        if c == x:
            return j, c
    return None, x
"""

KNOWN_WRONG = [
    # task 1: the residuals
    Mutant(1, "no clamp at 0", edits=((STEP, "left = rows[-1] - q"),), expect="expected"),
    Mutant(1, "not normalized", edits=(("else left / total)", "else left)"),), expect="expected"),
    Mutant(1, "subtracts q from p every time, not from the last row (the chapter's residual repeated)",
           edits=((STEP, "left = (p - q).clamp(min=0)"),), expect="is what row"),
    Mutant(1, "the old task's answer: one residual, repeated", code=ONE_RESIDUAL_REPEATED, expect="is what row"),
    Mutant(1, "nothing left divides by zero", edits=(("rows[-1].clone() if float(total) <= 0 else left / total",
                                                      "left / total"),), expect="p equals q"),
    Mutant(1, "one row too few (r_1 … r_n, without p)", edits=(("return torch.stack(rows)", "return torch.stack(rows[1:])"),),
           expect="shape"),
    reads_the_checks_frame(1, "def residuals(p, q, n):\n    return _expected()\n"),
    # task 2: verify, exactly
    Mutant(2, "always accepts the first candidate", edits=((ACCEPT, "if True:"),), expect="accepted with probability"),
    Mutant(2, "every candidate tested against p, not the residual left by the rejections before it",
           edits=((ACCEPT, "if rng.uniform() < min(1.0, float(p[c] / q[c])):"),), expect="accepted with probability"),
    Mutant(2, "transcribes chapter 09's one-guess rule for each candidate", code=CHAPTER_TRANSCRIBED,
           expect="accepted with probability"),
    Mutant(2, "the last draw from p instead of r_n", edits=((FINAL, "return None, rng.choice(p)"),),
           expect="after rejecting all"),
    Mutant(2, "the last draw from r_1, the chapter's one residual", edits=((FINAL, "return None, rng.choice(rows[1])"),),
           expect="after rejecting all"),
    Mutant(2, "accepts with q/r instead of r/q", edits=((ACCEPT, "if rng.uniform() < min(1.0, float(q[c] / rows[j, c])):"),),
           expect="accepted with probability"),
    Mutant(2, "emits the next candidate after a rejection", edits=(("            return j, c\n",
                                                                    "            return j, candidates[(j + 1) % len(candidates)]\n"),),
           expect="emitted as it is"),
    Mutant(2, "draws its own random numbers", edits=((ACCEPT, "if float(torch.rand(())) < min(1.0, float(rows[j, c] / q[c])):"),),
           expect="different answers"),
    Mutant(2, "delegates to minillm.spec.rejection", code=(
        "from minillm.request import Request as _Req, SamplingParams as _SP\n"
        "from minillm.spec.rejection import rejection_sample as _reference\n"
        "def verify(p, q, candidates, rng):\n"
        "    out = _reference(_Req('x', [1], _SP(temperature=1.0, seed=0), 0.0), torch.log(p[None].repeat(2, 1)),\n"
        "                     candidates[:1], q[None])\n"
        "    return (0 if len(out) > 1 else None), out[0]\n"),
           expect="reference"),
    Mutant(2, "delegates to the grader's private reference residual_chain", code=(
        "from minillm.grading.private.ex09_reference import residual_chain as _chain\n"
        "def residuals(p, q, n):\n    return _chain(p, q, n)\n"), expect="reference"),
    Mutant(2, "never reads q: draws from p and keeps the guess only if the draw equals it", code=Q_BLIND,
           expect="accepted with probability"),
    Mutant(2, "never reads q either: accepts with u < r(x)", edits=((ACCEPT, "if rng.uniform() < float(rows[j, c]):"),)),
    Mutant(2, "patches the grader's random source (torch.randn) so that q equals p", code=(
        "import torch as _torch\n"
        "_torch.randn = lambda *shape, **kw: _torch.zeros(*shape, dtype=kw.get('dtype'))\n"),
        expect="changed the grader or minillm"),
    # task 3: a seeded random source
    Mutant(3, "choice ignores probs", edits=(
        ("return int(torch.multinomial(torch.as_tensor(probs, dtype=torch.float64), 1, generator=self.generator))",
         "return int(torch.randint(len(probs), (), generator=self.generator))"),), expect="does not follow probs"),
    Mutant(3, "choice returns the most likely", edits=(
        ("return int(torch.multinomial(torch.as_tensor(probs, dtype=torch.float64), 1, generator=self.generator))",
         "return int(torch.as_tensor(probs).argmax())"),)),
    Mutant(3, "draws from the global generator", edits=(
        ("return float(torch.rand((), generator=self.generator, dtype=torch.float64))",
         "return float(torch.rand((), dtype=torch.float64))"),), expect="same seed"),
    Mutant(3, "ignores the seed", edits=(("torch.Generator().manual_seed(seed)", "torch.Generator().manual_seed(0)"),),
           expect="the seed must matter"),
    Mutant(3, "a seed that only matters for the seeds the check shows (5 and 6)", edits=((
        "torch.Generator().manual_seed(seed)", "torch.Generator().manual_seed(seed if seed in (5, 6, 11) else 0)"),),
        expect="drawn as the check ran"),
    Mutant(3, "the grader's rng handed in: TorchRng = grader.ExactRng", code="TorchRng = grader.ExactRng\n",
           expect="handed in"),
    Mutant(3, "uniform() with the right mean and the wrong law: uniform on [0.01, 0.99)", edits=(
        ("return float(torch.rand((), generator=self.generator, dtype=torch.float64))",
         "return 0.01 + 0.98 * float(torch.rand((), generator=self.generator, dtype=torch.float64))"),),
        expect="uniform law"),
]
