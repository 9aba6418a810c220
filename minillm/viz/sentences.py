"""Measured comparisons as sentences, so a chapter's prose never types a number of this machine.

A chapter's markdown may quote deterministic numbers (simulator, counts, arithmetic); a number that
depends on the machine is printed by the cell that measured it, in a sentence built here, and the
prose around it says where to look and what shape to expect (issue 18, tools/check_prose.py).
Used by chapters 08, 09 and 11.
"""

from __future__ import annotations


def ratio(a: float, b: float) -> str:
    """`a / b` as a factor: '13×', '2.4×', '0.90×' (two significant figures below 10)."""
    if b == 0:
        raise ValueError("ratio: the denominator is 0; compare against a measured non-zero value")
    r = a / b
    if r >= 10:
        return f"{r:.0f}×"
    if r >= 1:
        return f"{r:.1f}×"
    return f"{r:.2f}×"


def change(what: str, before: float, after: float, unit: str = "ms", digits: int = 1) -> str:
    """'the longest gap fell from 1495.2 ms to 111.1 ms (13× lower)'; 'rose' when it grew."""
    if before <= 0 or after <= 0:
        raise ValueError(f"change: {what} must be positive to compare, got {before} and {after}")
    verb, factor = ("fell", ratio(before, after)) if after < before else ("rose", ratio(after, before))
    direction = "lower" if after < before else "higher"
    return f"{what} {verb} from {before:.{digits}f} {unit} to {after:.{digits}f} {unit} ({factor} {direction})"


def speedup(what: str, baseline_s: float, faster_s: float, baseline: str = "the baseline") -> str:
    """'n-gram at batch 1: 0.90× plain decoding's speed (a slowdown)' from two times per token;
    above 1 a speedup, within 2 % 'no clear difference'."""
    factor = baseline_s / faster_s
    verdict = "a speedup" if factor > 1.02 else "a slowdown" if factor < 0.98 else "no clear difference"
    return f"{what}: {ratio(baseline_s, faster_s)} {baseline}'s speed ({verdict})"
