"""Exercise 09's reference (chapter 09: speculative decoding): recursive rejection sampling over several
candidates at one position. Grader-private: imported only by minillm.grading.ex09."""

from __future__ import annotations

import torch


def residual_chain(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """[n + 1, V]: row 0 is p; row j is what is left of row j - 1 once a candidate drawn from q was rejected
    (normalize(max(0, r - q)), or r itself when nothing is left)."""
    out = torch.empty(n + 1, p.shape[0], dtype=p.dtype)
    out[0] = p
    for j in range(1, n + 1):
        excess = torch.relu(out[j - 1] - q)
        mass = excess.sum().item()
        out[j] = excess / mass if mass > 0 else out[j - 1]
    return out
