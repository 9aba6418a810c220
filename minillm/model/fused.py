"""The decoder's operations fused by numba, for float32 on a CPU (chapter 10).

`LlamaModel.forward` (minillm/model/llama.py, the one to read first) runs one sequence of steps
for every model and layout; what each step computes with is a choice of operations. `TorchOps`
(in llama.py) are HF's ops, op for op; `FusedOps` here do the same computation with the
token-wise ops between the matmuls done by `kernels/cpu_fused_ops.py` in one pass each: RMSNorm
fused with the residual add before it, RoPE rotated in place in the q|k|v output (measured 3-15x
faster than the torch ops; SiLU·mul stays torch, which measured faster). What remains per layer is
four matmuls, the attention, three numba calls and SiLU·mul. The numpy views of the constant
tensors (norm weights, the RoPE table) are made once, on first use.

The matmuls go to oneDNN with each weight packed into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, the ops torch's compiler
uses for oneDNN linears; vLLM's CPU backend runs its linears on oneDNN too) instead of `F.linear`'s
MKL sgemm. oneDNN picks its kernels by the CPU's instruction set (ONEDNN_VERBOSE=1 names them: AVX-512
on the AMD host these timings come from, `brg_matmul:avx2` on a Zen 3 host without AVX-512; MKL does not
say which it picks) and measured faster (one-off timings, scratch script). One thread, best of 5, µs per
call (F.linear → oneDNN), rows
1 / 2 / 16 / 200: q|k|v 11 → 22 / 20 → 22 / 61 → 54 / 547 → 476, gate|up 27 → 37 / 51 → 39 /
147 → 120 / 1404 → 1259, lm_head 72 → 78 / 140 → 86 / 536 → 324 / 4576 → 3882 (o and down within
±20 % either way). One row is MKL's matrix-vector path, faster; so oneDNN takes the calls of
`ONEDNN_MIN_ROWS` rows or more. On the ladder's trace (bench/ladder.py, batch 16), three runs of each
interleaved in one process: 6.54 → 5.05 ms CPU per step at best, 6.68 → 5.57 on average (the VM's
speed drifts; the ladder's own step time, an hour apart: 5.32 → 4.94 ms). The first call at a new
row count builds a oneDNN primitive (~0.5-1 ms, kept for the process). A weight is packed on first
use and again if it is changed in place or replaced (`linear` checks its version). The sums are
the same products in another order: float32 results differ in the last bits (tests compare the
greedy tokens with the torch ops: tests/test_cpu_fused_ops.py). The packed copies are kept beside
the plain weights (one-row matmuls and the float64 path use those), so a float32 CPU model holds its
matmul weights twice.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 2  # matmuls of this many rows or more go to oneDNN (see above)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [out, in] in oneDNN's blocked layout, or None where this torch has no oneDNN linear."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)  # laid out for ~16 rows: measured best
    except (AttributeError, RuntimeError):
        return None


def _version(w: torch.Tensor) -> int:
    try:
        return w._version  # bumped by every in-place change of w
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return -1


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, packed: dict) -> torch.Tensor:
    """F.linear(x, w, bias), by oneDNN on w's packed copy from ONEDNN_MIN_ROWS rows. `packed` is the
    model's cache, id(w) -> (w, w's version, packed w); the copy is made
    on first use and again whenever w was changed in place (its version) or replaced (the cache
    holds w itself, so its id cannot be reused by another tensor)."""
    entry = packed.get(id(w))
    if entry is None or entry[0] is not w or entry[1] != _version(w):
        entry = packed[id(w)] = (w, _version(w), _onednn_pack(w))
    if entry[2] is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")
    return F.linear(x, w, bias)


class FusedOps:
    """The forward's operations, fused (see the module docstring). The residual stream `h` is updated
    in place: the forward hands these ops only tensors it made itself."""

    def __init__(self, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        from minillm.kernels import cpu_fused_ops

        self.kernels = cpu_fused_ops
        self.eps, self.cos, self.sin = eps, cos.numpy(), sin.numpy()
        self.packed: dict = {}  # the matmul weights in oneDNN's layout (`linear` fills it)
        self.linear = functools.partial(linear, packed=self.packed)  # linear(x, w, bias) on this cache
        self._views: dict = {}  # id(norm weight) -> (the weight, its numpy view)

    def _numpy(self, w: torch.Tensor):
        entry = self._views.get(id(w))
        if entry is None or entry[0] is not w:
            entry = self._views[id(w)] = (w, w.numpy())
        return entry[1]

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = torch.empty_like(h)
        self.kernels.rms_norm(h.numpy(), self._numpy(weight), self.eps, x.numpy())
        return x

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                 x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h += delta; then rms_norm(h) · weight written into x (reused while its shape fits)."""
        if weight is None:
            return h.add_(delta), None
        if x is None or x.shape != h.shape:
            x = torch.empty_like(h)
        self.kernels.add_rms_norm(h.numpy(), delta.numpy(), self._numpy(weight), self.eps, x.numpy())
        return h, x

    def rotation(self, positions: torch.Tensor):
        """rotate(qkv, n): the first n heads of qkv [T, heads, D] rotated in place, returned as a view."""
        pos, cos, sin, rotary = positions.numpy(), self.cos, self.sin, self.kernels.rotary

        def rotate(qkv: torch.Tensor, n: int) -> torch.Tensor:
            rotary(qkv.numpy(), n, pos, cos, sin)
            return qkv[:, :n]
        return rotate

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).mul_(up)
