"""The draft model's decode loop as one compiled function (chapter 09): k guesses, one call.

A draft model is worth running only if its k passes cost little next to one target step. The
bundled draft is tiny (2 layers, hidden size 64: about 0.36 M multiply-adds per token), so its
arithmetic takes tens of microseconds; run as the engine runs the target (a plan, an input batch,
a layout, ~40 dispatched torch ops per pass), each pass cost as much overhead as a target step,
and the draft made batch-1 decoding slower, not faster. Here the whole loop — feed the tokens the
target accepted, then guess, feed the guess, guess again, k times — is one `@njit` function over
numpy arrays (chapter 10's CPU kernels are written the same way): no Python between tokens, no
tensor created, no op dispatched. Attention is chapter 10's CPU decode kernel (its compiled body,
inlined), reading the request's cache as one block.

`draft_decode` runs one sequence. Its K/V live in a contiguous cache of its own
([layers, capacity, H_kv, D]; the draft's K/V are 512 bytes a token, so a whole context is
well under a megabyte), written at each fed token's position; positions past the kept length are
simply overwritten later, which is how rejected guesses are forgotten. `DraftWeights.from_model`
copies a `LlamaModel`'s weights into the row-major arrays the loop reads (`supports` says which
models qualify: a plain Llama-family decoder on a CPU in float32 or float64, one process).

It computes what `LlamaModel.forward` computes — RMSNorm, fused q|k|v, RoPE from the model's own
table, grouped-query attention, SwiGLU MLP, tied or untied head — in a different summation order
(fastmath), so a near-tie between two draft tokens may come out the other way. That changes a
guess, never an emitted token: the target verifies every guess (tests/test_speculative.py compares
the logits with the model's and the engine's output with plain decoding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from minillm.kernels.cpu_decode_attention import _decode
from minillm.kernels.cpu_fused_ops import silu_mul
from minillm.model.llama import LlamaModel


def supports(model: LlamaModel) -> bool:
    """Whether `draft_decode` computes exactly this model's function (else the engine's torch path runs it)."""
    c = model.config
    plain_layers = all(layer.qkv.bias is None and layer.o.bias is None and layer.q_norm is None
                       and layer.moe is None and layer.gate_up is not None and layer.gate_up.bias is None
                       and layer.down.bias is None for layer in model.layers)
    return (model.device.type == "cpu" and str(model.dtype) in ("torch.float32", "torch.float64")
            and model.layout.world_size == 1 and plain_layers and not any(w is not None for w in c.sliding_windows)
            and model.embed is not None and model.lm_head is not None)


@dataclass(frozen=True)
class DraftWeights:
    """A draft model's weights as contiguous row-major numpy arrays, layers stacked."""

    embed: np.ndarray  # [vocab, hidden]
    input_norm: np.ndarray  # [L, hidden]
    qkv: np.ndarray  # [L, (H_q + 2·H_kv)·D, hidden]
    o: np.ndarray  # [L, hidden, H_q·D]
    post_norm: np.ndarray  # [L, hidden]
    gate_up: np.ndarray  # [L, 2·intermediate, hidden]
    down: np.ndarray  # [L, hidden, intermediate]
    final_norm: np.ndarray  # [hidden]
    head: np.ndarray  # [vocab, hidden]
    head_t: np.ndarray  # [hidden, vocab]: the head transposed (the logits' loop runs along the vocabulary)
    cos: np.ndarray  # [max_positions, D] (the model's RoPE table)
    sin: np.ndarray
    eps: float
    num_heads: int
    num_kv_heads: int

    @classmethod
    def from_model(cls, model: LlamaModel) -> DraftWeights:
        if not supports(model):
            raise ValueError("the compiled draft loop runs a plain Llama-family model on a CPU in float32/float64 "
                             "(no biases, q/k norms, experts or sliding windows, one process)")

        def rows(t) -> np.ndarray:
            return np.ascontiguousarray(t.detach().numpy())

        def stacked(get) -> np.ndarray:
            return np.ascontiguousarray(np.stack([rows(get(layer)) for layer in model.layers]))

        c = model.config
        return cls(embed=rows(model.embed), input_norm=stacked(lambda la: la.input_norm),
                   qkv=stacked(lambda la: la.qkv.weight), o=stacked(lambda la: la.o.weight),
                   post_norm=stacked(lambda la: la.post_attention_norm), gate_up=stacked(lambda la: la.gate_up.weight),
                   down=stacked(lambda la: la.down.weight), final_norm=rows(model.final_norm),
                   head=rows(model.lm_head.weight), head_t=rows(model.lm_head.weight.t()), cos=rows(model.rope.cos),
                   sin=rows(model.rope.sin),
                   eps=float(c.rms_norm_eps), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads)

    def new_cache(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """Empty K and V caches for one sequence of up to `capacity` tokens."""
        d = self.cos.shape[1]
        shape = (self.qkv.shape[0], capacity, self.num_kv_heads, d)
        return np.zeros(shape, self.embed.dtype), np.zeros(shape, self.embed.dtype)

    def decode(self, k_cache: np.ndarray, v_cache: np.ndarray, feed: np.ndarray, start: int, steps: int,
               guesses: np.ndarray, logits: np.ndarray) -> None:
        """`draft_decode` with this model's weights."""
        draft_decode(self.embed, self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down,
                     self.final_norm, self.head_t, self.cos, self.sin, self.eps, self.num_heads, self.num_kv_heads,
                     k_cache, v_cache, feed, start, steps, guesses, logits, self.embed.dtype == np.float32)


@njit(fastmath=True, nogil=True, inline="always")
def _matvec(w, x, out, zero):
    """out = w @ x for a row-major w [n, m] (each output a contiguous dot product: SIMD lanes)."""
    for r in range(w.shape[0]):
        s = zero
        for c in range(w.shape[1]):
            s += w[r, c] * x[c]
        out[r] = s


@njit(fastmath=True, nogil=True, inline="always")
def _matvec_t(w_t, x, out, zero):
    """out = x @ w_t for w_t [m, n] row-major (the transposed head: m = hidden, n = vocab): four of its
    rows per pass over `out`, a multiply-add along the vocabulary (SIMD lanes, no horizontal sums —
    each output of `_matvec` ends in one, and the head has 4,096 outputs of 64 terms). With `_argmax`,
    measured against `_matvec` and a compare-and-keep scan on the bundled draft (1 catch-up token and
    4 guesses at ~200 tokens of context, 7 interleaved rounds, CPU time on a shared 2-core VM): the
    loop 1.21× [1.12-1.30] faster, the same guesses."""
    n_in, n_out = w_t.shape
    for o in range(n_out):
        out[o] = zero
    i = 0
    while i + 4 <= n_in:
        w0, w1, w2, w3 = w_t[i], w_t[i + 1], w_t[i + 2], w_t[i + 3]
        x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        for o in range(n_out):
            out[o] += x0 * w0[o] + x1 * w1[o] + x2 * w2[o] + x3 * w3[o]
        i += 4
    while i < n_in:
        wi, xi = w_t[i], x[i]
        for o in range(n_out):
            out[o] += xi * wi[o]
        i += 1


@njit(fastmath=True, nogil=True, inline="always")
def _argmax(v):
    """The first index of v's largest value: its max (a SIMD reduction), then a scan for it."""
    m = v[0]
    for i in range(1, v.shape[0]):
        m = max(m, v[i])
    i = 0
    while i < v.shape[0] - 1 and v[i] != m:
        i += 1
    return i


@njit(fastmath=True, nogil=True, inline="always")
def _rms_norm(h, weight, eps, out, zero):
    ss = zero
    for i in range(h.shape[0]):
        ss += h[i] * h[i]
    inv = 1.0 / math.sqrt(ss / h.shape[0] + eps)
    for i in range(h.shape[0]):
        out[i] = weight[i] * (h[i] * inv)


@njit(cache=True, fastmath=True, nogil=True)
def draft_decode(embed, input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w, final_norm, head_t, cos, sin, eps,
                 num_heads, num_kv_heads, k_cache, v_cache, feed, start, steps, guesses, logits, simd_exp):
    """Feed `feed` (tokens at positions start, start+1, …), then guess `steps` tokens greedily, each
    guess but the last fed in turn: guesses[:steps] ← the draft's argmax after each. `logits` [vocab]
    ← the logits after the last token fed (steps = 1: the distribution a sampled guess is drawn from).
    K/V of every fed token are written into k_cache, v_cache [L, capacity, H_kv, D] at its position.
    `simd_exp`: float32's polynomial exp in the attention kernel (float64 keeps math.exp)."""
    num_layers, hidden, dim = qkv_w.shape[0], embed.shape[1], cos.shape[1]
    half = dim // 2
    inter = down_w.shape[2]
    scale = 1.0 / math.sqrt(dim)
    dt = embed.dtype
    zero = np.zeros(1, dt)[0]  # sums start at 0 in the model's dtype
    h = np.empty(hidden, dt)
    x = np.empty(hidden, dt)
    qkv = np.empty(qkv_w.shape[1], dt)
    rot = np.empty(dim, dt)
    att = np.empty(num_heads * dim, dt)
    proj = np.empty(hidden, dt)
    gu = np.empty(2 * inter, dt)
    act = np.empty(inter, dt)
    bits = np.empty(inter, np.int32)  # the SIMD exp's scratch
    one = zero + 1.0
    ceiling = zero + 88.0  # (see silu_mul)
    block_shape = (1,) + k_cache.shape[1:]  # one sequence's cache seen as a single block of the kernel's pool
    table = np.zeros((1, 1), np.int64)
    seq_len = np.zeros(1, np.int64)
    total = feed.shape[0] + steps - 1  # tokens fed: the catch-up, then every guess but the last
    for t in range(total):
        token = feed[t] if t < feed.shape[0] else guesses[t - feed.shape[0]]
        pos = start + t
        for i in range(hidden):
            h[i] = embed[token, i]
        for layer in range(num_layers):
            _rms_norm(h, input_norm[layer], eps, x, zero)
            _matvec(qkv_w[layer], x, qkv, zero)
            for head_i in range(num_heads + num_kv_heads):  # RoPE on every query and key head
                base = head_i * dim
                for i in range(dim):
                    other = -qkv[base + i + half] if i < half else qkv[base + i - half]
                    rot[i] = qkv[base + i] * cos[pos, i] + other * sin[pos, i]
                for i in range(dim):
                    qkv[base + i] = rot[i]
            kbase, vbase = num_heads * dim, (num_heads + num_kv_heads) * dim
            for kvh in range(num_kv_heads):
                for i in range(dim):
                    k_cache[layer, pos, kvh, i] = qkv[kbase + kvh * dim + i]
                    v_cache[layer, pos, kvh, i] = qkv[vbase + kvh * dim + i]
            # attention over positions 0 … pos: chapter 10's CPU decode kernel, the cache as one block
            seq_len[0] = pos + 1
            _decode(qkv[:kbase].reshape((1, num_heads, dim)), k_cache[layer].reshape(block_shape),
                    v_cache[layer].reshape(block_shape), table, seq_len, scale, 0, att.reshape((1, num_heads, dim)),
                    zero, simd_exp)
            _matvec(o_w[layer], att, proj, zero)
            for i in range(hidden):
                h[i] += proj[i]
            _rms_norm(h, post_norm[layer], eps, x, zero)
            _matvec(gate_up_w[layer], x, gu, zero)
            silu_mul(gu, act, bits, one, ceiling, simd_exp)  # (the compiled decode step's, as its exp)
            _matvec(down_w[layer], act, proj, zero)
            for i in range(hidden):
                h[i] += proj[i]
        if t >= feed.shape[0] - 1:  # the logits are needed from the last catch-up token on
            _rms_norm(h, final_norm, eps, x, zero)
            _matvec_t(head_t, x, logits, zero)
            guesses[t - feed.shape[0] + 1] = _argmax(logits)
