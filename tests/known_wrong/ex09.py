"""Known-wrong answers to exercise 09 (rejection sampler): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame

ACCEPT = "if rng.uniform() < min(1.0, float(p[i, d] / q[i, d])):"
CORRECTION = "return out + [rng.choice(residual(p[i], q[i]))]"
BONUS = "return out + [rng.choice(p[len(draft)])]"

KNOWN_WRONG = [
    # task 1: the residual
    Mutant(1, "no clamp at 0", edits=(("diff = (p - q).clamp(min=0)", "diff = p - q"),), expect="expected"),
    Mutant(1, "not normalized", edits=(("    return diff / total", "    return diff"),), expect="expected"),
    Mutant(1, "p equals q divides by zero", edits=(("    if float(total) <= 0:\n        return p.clone()\n", ""),),
           expect="p equals q"),
    # task 2: verify, exactly
    Mutant(2, "always accept", edits=((ACCEPT, "if True:"),), expect="accepted with probability"),
    Mutant(2, "resample from p instead of max(0, p - q)", edits=((CORRECTION, "return out + [rng.choice(p[i])]"),),
           expect="rejected token has no mass"),
    Mutant(2, "forgets the bonus token", edits=((BONUS, "return out"),), expect="bonus token"),
    Mutant(2, "accepts with q/p instead of p/q", edits=(("float(p[i, d] / q[i, d])", "float(q[i, d] / p[i, d])"),),
           expect="accepted with probability"),
    Mutant(2, "goes on after a rejection", edits=((CORRECTION, "out.append(rng.choice(residual(p[i], q[i])))"),),
           expect="every token but the last"),
    Mutant(2, "bonus from the wrong row", edits=((BONUS, "return out + [rng.choice(p[len(draft) - 1])]"),),
           expect="follows"),
    Mutant(2, "draws its own random numbers", edits=((ACCEPT, "if float(torch.rand(())) < min(1.0, float(p[i, d] / q[i, d])):"),),
           expect="different answers"),
    Mutant(2, "delegates to minillm.spec.rejection", code=(
        "from minillm.request import Request as _Req, SamplingParams as _SP\n"
        "from minillm.spec.rejection import rejection_sample as _reference\n"
        "def verify(p, q, draft, rng):\n"
        "    return _reference(_Req('x', [1], _SP(temperature=1.0, seed=0), 0.0), torch.log(p), draft, q)\n"),
           expect="reference"),
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
]

# issue 18: a verifier that never reads q (its outputs still follow p), the grader's rng handed in, the check's frame
Q_BLIND = """
def verify(p, q, draft, rng):
    out = []
    for i, d in enumerate(draft):
        x = rng.choice(p[i])
        if x != d:
            return out + [x]
        out.append(d)
    return out + [rng.choice(p[len(draft)])]
"""

KNOWN_WRONG += [
    Mutant(2, "never reads q: draws from p and keeps the guess only if the draw equals it", code=Q_BLIND,
           expect="accepted with probability"),
    Mutant(2, "never reads q either: accepts with u < p(x)", edits=((ACCEPT, "if rng.uniform() < float(p[i, d]):"),)),
    Mutant(3, "the grader's rng handed in: TorchRng = grader.ExactRng", code="TorchRng = grader.ExactRng\n",
           expect="handed in"),
    reads_the_checks_frame(1, "def residual(p, q):\n    return _expected()\n"),
    Mutant(2, "patches the grader's random source (torch.randn) so that q equals p", code=(
        "import torch as _torch\n"
        "_torch.randn = lambda *shape, **kw: _torch.zeros(*shape, dtype=kw.get('dtype'))\n"),
        expect="changed the grader or minillm"),
]

# issue 18: a check that tests one observable — task 3 tested uniform() by its mean alone
KNOWN_WRONG += [
    Mutant(3, "uniform() with the right mean and the wrong law: uniform on [0.01, 0.99)", edits=(
        ("return float(torch.rand((), generator=self.generator, dtype=torch.float64))",
         "return 0.01 + 0.98 * float(torch.rand((), generator=self.generator, dtype=torch.float64))"),),
        expect="uniform law"),
]
