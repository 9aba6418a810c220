"""Rotary position embeddings, RoPE (chapter 00).

Each pair of dimensions in a query or key is rotated by an angle proportional to the token's
position, so the dot product q·k depends only on the distance between the two tokens. The angles
are computed once for every position into a table; a step just indexes it by `positions`.

The table is computed in float32 exactly as HF transformers does (then cast), which is what lets
the float64 parity tests demand logits equal to 1e-6.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """One rotation speed per dimension pair: theta^(-2i/d), optionally llama3-rescaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: slow (long-wavelength) pairs are stretched by `factor`, fast ones kept, a smooth
    # blend between the two bands.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable:
    """cos/sin for positions [0, max_positions), shape [max_positions, head_dim] each."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", scaling: dict[str, Any] | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim]: x·cos + rotate_half(x)·sin, with rotate_half(a, b) = (-b, a)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
