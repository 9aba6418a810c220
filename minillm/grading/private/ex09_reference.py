"""Exercise 09's reference (chapter 09: speculative decoding): recursive rejection sampling over several
candidates at one position. Grader-private: imported only by minillm.grading.ex09."""

from __future__ import annotations

import torch


def residual_chain(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """[n + 1, V]: row 0 is p; row j is what is left of row j - 1 once a candidate drawn from q was rejected
    (normalize(max(0, r - q)), or r itself when nothing is left)."""
    rows = [p.clone()]
    for _ in range(n):
        left = (rows[-1] - q).clamp(min=0)
        total = float(left.sum())
        rows.append(rows[-1].clone() if total <= 0 else left / total)
    return torch.stack(rows)
