"""Sentences that draw a lesson from numbers, so a chapter's words follow its outputs (issue 26).

`minillm.viz.sentences` formats one measured comparison; this module adds what chapters 06–11 need
on top: the direction of a change with a dead band, the shape of a series (monotone or not), and a
measured difference weighed against the noise of two runs that did identical work.

    from minillm.viz.claims import direction, shape, against_noise
    direction(23.7, 32.2)                          # 'rose'
    shape([12.3, 9.6, 13.8, 6.6])                  # 'zigzags (falls, rises, falls)'
    against_noise("8 seats vs 2 seats", 9.4, 10.4, noise=0.15)

Used by chapters 06, 07, 08, 09 and 11.
"""

from __future__ import annotations

from collections.abc import Sequence


def direction(before: float, after: float, rel_tol: float = 0.0) -> str:
    """'rose', 'fell' or 'did not change' (a relative change within `rel_tol` counts as none)."""
    if rel_tol < 0:
        raise ValueError(f"direction: rel_tol is a non-negative fraction, got {rel_tol}")
    scale = max(abs(before), abs(after))
    if scale == 0 or abs(after - before) <= rel_tol * scale:
        return "did not change"
    return "rose" if after > before else "fell"


def shape(values: Sequence[float], rel_tol: float = 0.0) -> str:
    """The shape of a series in words: 'rises at every step', 'falls at every step', 'stays flat',
    or 'zigzags (falls, rises, falls)' listing each step's direction."""
    if len(values) < 2:
        raise ValueError(f"shape: needs at least two values, got {len(values)}")
    steps = [direction(a, b, rel_tol) for a, b in zip(values, values[1:])]
    words = {"rose": "rises", "fell": "falls", "did not change": "stays"}
    if all(s == "did not change" for s in steps):
        return "stays flat"
    moving = {s for s in steps if s != "did not change"}
    if len(moving) == 1 and "did not change" not in steps:
        return f"{words[moving.pop()]} at every step"
    if len(moving) == 1:
        return f"{words[next(iter(moving))]} or stays, never the other way"
    return "zigzags (" + ", ".join(words[s] for s in steps) + ")"


def relative_gap(a: float, b: float) -> float:
    """|a − b| over the smaller of the two: how far apart two positive measurements are."""
    if a <= 0 or b <= 0:
        raise ValueError(f"relative_gap: both values must be positive, got {a} and {b}")
    return abs(a - b) / min(a, b)


def against_noise(what: str, a: float, b: float, noise: float, unit: str = "s") -> str:
    """'8 seats vs 2 seats: 9.44 s vs 10.38 s, 10 % apart, within the 15 % two identical runs
    differed by: no difference this machine can show' — or 'beyond … : a real difference'."""
    gap = relative_gap(a, b)
    if gap <= noise:
        verdict = f"within the {noise:.0%} that two identical runs differed by: no difference this run can show"
    else:
        verdict = f"beyond the {noise:.0%} that two identical runs differed by"
    return f"{what}: {a:.2f} {unit} vs {b:.2f} {unit}, {gap:.0%} apart, {verdict}"
