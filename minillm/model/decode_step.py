"""The compiled decode step: a CPU's analogue of a captured CUDA graph (chapters 04 and 10).

On a GPU, vLLM captures the decode forward once per batch size as a CUDA graph: the inputs, the
attention metadata and every intermediate tensor live in buffers fixed at capture, and a step only
writes the new inputs into them and replays the graph — one launch instead of hundreds. On a CPU
the cost being cut is the same one (per-op dispatch, tensor creation, Python between the ops,
not arithmetic), and `CompiledDecode` cuts it the same way: for a step of 1 … `max_rows` decode
rows it keeps one set of buffers per batch size, made on first use and reused by every later step
of that size, and runs the whole forward (embedding → layers → lm_head, the step's positions,
slots and K/V writes included) as one compiled call, `kernels/cpu_decode_step.py`. Nothing is
rebuilt per step: no layout pass, no attention metadata, no tensors — the kernel reads each row's
position, token and block-table row straight from the worker's input batch.

Why numba and not torch.compile or a C++ extension: the repository already compiles its CPU kernels
with numba (`cache=True`: compiled once per machine, nothing to build at install time), the norms,
RoPE and attention it needs are those kernels, called from the compiled step without going back
to Python, and a C++ extension needs a compiler wherever minillm is installed. torch.compile's CPU
backend (inductor) was tried once with a scratch script on the same decode step at batch 1 (the
bundled model, a static 512-slot cache so that one graph serves every position): its step still
makes 288 Python calls (guards, the generated wrapper) against 6 for this one, took minutes to
compile on the course's VM, and ran 2.6–5.0× slower than this step in seven interleaved rounds —
no faster than eager torch there (2.4–4.4×).

Where it is taken (`CompiledDecode.supported`, then `rows_of` per step): a float32 dense
Llama-family model on a CPU in one process running the fused ops (float64 keeps HF's ops, op for op:
the parity tests' path), no biases, no per-head q/k norms, no sliding windows, the `numba_cpu`
attention backend on a float32 pool; a step whose rows all sample and are decode rows or
speculative verify rows, with no static batch or KV connector, and at most `max_rows` decode rows
(`max_verify_rows` kernel rows when the step verifies guesses). Everything else runs the op-by-op forward.

A verify row (chapter 09: a request's pending token at position L and its k guesses) runs as 1+k
of the kernel's rows, all reading the same block-table row, at positions L … L+k. Causality holds
without a mask because each layer writes every row's K/V before its attention, and a row's
attention reads keys 0 … its own position only: the row at L+j sees the K/V that rows L … L+j−1
wrote, and never a later row's (nor a rejected guess's from an earlier step): those lie past its
length. Each row's arithmetic is the same as if it were alone in a step (the kernel's register tiles,
one shape per number of rows, sum every output in one order: kernels/cpu_decode_step.py), so a verify
row's logits are those plain decoding computes at the same position, bit for bit, and greedy
speculation emits exactly plain decoding's tokens. The same holds for a large decode step's rows: each
row's logits are those it would get alone.

The weights: the layers' matmul weights are moved into one tensor per kind, [layers, in, out] —
each layer's weight becomes a view of it, with the same storage order as before (`column_major`
in llama.py), so the op-by-op forward reads the very same memory. The compiled step reads them as
[out, in] rows (HF's own layout), a copy made once: for the bundled target, 15.8 MB more.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

# Decode steps of this many rows or fewer run compiled. A verify row counts as 1+k rows, and such steps run
# compiled up to MAX_VERIFY_ROWS rows (batch 1, k ≤ 7). Measured under load (2-core VM shared, load average
# 5-6; CPU time, scratch scripts, one process): on bench/llamacpp.py section 3's 32 requests, decode steps of
# 9-32 rows went from 998 ms op by op to 686 ms compiled (60 steps; two runs a minute apart), the whole run's
# step CPU 2198 -> 1869 ms; old/new per generate 0.97-1.17x in 3 interleaved rounds. Per call at 32 rows, the
# kernel's matmuls / oneDNN's over one layer's four matmuls x4 and the lm_head: 7.6 / 8.4 ms (the gain is
# the op-by-op step's dispatch). The ladder's trace (bench/ladder.py, batch 16, 200 requests): 1.16x less CPU
# per run (2 interleaved rounds, 1.16-1.16), all 200 outputs identical.
# Then (2026-12-02, same VM under load, CPU time in one process): the 4 x 3 tile with its prefetch of the next
# output block and one attention call per layer, on the same captured steps of that run (7 interleaved rounds),
# old/new 1.12x [1.09-1.14] at 32 rows, 1.24x [1.20-1.32] at 12, 1.17x [1.02-1.26] at 9, logits
# bit-identical; with the attention's exp kept float32 too, the whole generate 1.05x [1.03-1.11] (10 interleaved
# rounds), all 32 outputs identical. Steps of 1-5 rows run tiles made for their size (2026-12-03: the
# kernel's docstring has the measurements).
MAX_ROWS = 32
MAX_VERIFY_ROWS = 8
_KINDS = ("qkv", "o", "gate_up", "down")


@dataclass
class _Buffers:
    """One batch size's buffers, reused by every step of that size (a CUDA graph's static tensors): the
    first rows of one set made for the most rows, so that every size reuses the same (cached) memory."""

    positions: np.ndarray
    seq_lens: np.ndarray
    h: np.ndarray
    x: np.ndarray
    qkv: np.ndarray
    attn: np.ndarray
    delta: np.ndarray
    gate_up: np.ndarray
    act: np.ndarray
    logits: np.ndarray
    logits_tensor: torch.Tensor  # the same memory as `logits`, as a tensor (made once)


def stack_layer_weights(model) -> dict[str, np.ndarray]:
    """Each matmul kind's weights as one array [layers, in, out]; the layers' weights become views
    of it (same values, same storage order). Done once per model; the fused ops' packed copies of the
    old tensors are dropped (they are re-packed from the views on first use)."""
    stacked = getattr(model, "_stacked_weights", None)
    if stacked is not None:
        return stacked
    stacked = {}
    for kind in _KINDS:
        linears = [getattr(layer, kind) for layer in model.layers]
        n_out, n_in = linears[0].weight.shape
        storage = torch.empty(len(linears), n_in, n_out, dtype=model.dtype, device=model.device)
        for i, linear in enumerate(linears):
            storage[i].copy_(linear.weight.t())
            linear.weight = storage[i].t()
        stacked[kind] = storage.numpy()
    if model._fused_ops is not None:
        model._fused_ops.packed.clear()
    model._stacked_weights = stacked
    return stacked


class CompiledDecode:
    """Decode steps of 1 … `max_rows` rows as one compiled call over per-batch-size buffers."""

    @staticmethod
    def supported(model, k_pool: torch.Tensor | None, attention_backend: str) -> str | None:
        """None if this model and pool can run compiled, else why not (one sentence). The checks run
        in order and stop at the first that fails (a stand-in model need not have what the later ones read)."""
        checks = [
            (lambda: model.dtype != torch.float32, f"the model is {model.dtype}, the compiled step is float32 only"),
            (lambda: attention_backend != "numba_cpu", f"attention backend {attention_backend!r}, not 'numba_cpu'"),
            (lambda: k_pool is None or k_pool.dtype != torch.float32, "no float32 paged KV pool"),
            (lambda: not model.fused_ops, "the forward does not run the fused CPU ops"),
            (lambda: model.layout.world_size != 1, "a parallel layout"),
            (lambda: model.embed_tokens is None or model.lm_head is None, "not the whole model"),
            (lambda: any(layer.moe is not None or layer.gate_up is None for layer in model.layers), "an MoE model"),
            (lambda: any(layer.q_norm is not None for layer in model.layers), "per-head q/k norms (Qwen3)"),
            (lambda: any(getattr(layer, kind).bias is not None for layer in model.layers for kind in _KINDS),
             "biases"),
            (lambda: any(w is not None for w in model.config.sliding_windows), "sliding-window layers"),
        ]
        return next((why for failed, why in checks if failed()), None)

    def __init__(self, model, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int,
                 max_rows: int = MAX_ROWS) -> None:
        from minillm.kernels.cpu_decode_step import decode_forward

        self.kernel = decode_forward
        self.max_rows, self.max_verify_rows = max_rows, MAX_VERIFY_ROWS
        self.model, self.block_size = model, block_size
        c = model.config
        stacked = stack_layer_weights(model)
        # the kernel's tiles read each weight as [out, in] rows (HF's layout): a copy of each, made once
        self.weights = (model.embed_tokens.weight.numpy(),
                        np.ascontiguousarray(np.stack([layer.input_norm.numpy() for layer in model.layers])),
                        np.ascontiguousarray(np.stack([layer.post_attention_norm.numpy() for layer in model.layers])),
                        model.final_norm.contiguous().numpy(),
                        *(np.ascontiguousarray(stacked[kind].transpose(0, 2, 1)) for kind in _KINDS),
                        model.lm_head.weight.contiguous().numpy())
        self.rope = (model.rope.cos.numpy(), model.rope.sin.numpy())
        shape = (k_pool.shape[0], -1, block_size, *k_pool.shape[2:])
        self.pools = (k_pool.numpy().reshape(shape), v_pool.numpy().reshape(shape))
        self.heads = (c.num_heads, c.num_kv_heads, np.float32(c.rms_norm_eps))
        self.buffers: dict[int, _Buffers] = {}  # per batch size, views of `_full`
        self._full: _Buffers | None = None
        self._replayed: tuple[object, np.ndarray] | None = None  # (a plan, its input-batch rows): see rows_of

    def rows_of(self, plan, batch) -> tuple[np.ndarray, np.ndarray] | None:
        """The kernel's rows for `plan` if this step can run compiled, else None: per row its input-batch
        row and the position of its token. A decode row is one kernel row; a verify row with k guesses,
        1+k consecutive ones (the same input-batch row, positions L … L+k), in plan order: the logits'
        rows are the rejection sampler's, request after request.

        A plan object seen again is a steady decode plan replayed by the builder (minillm.scheduler.output:
        the same requests, nothing added or removed since): its rows are those found the step before."""
        replayed = self._replayed
        if replayed is not None and replayed[0] is plan and self.model.fused_ops:
            return replayed[1], np.asarray(plan.num_computed_tokens, dtype=np.int64)
        n = len(plan.req_ids)
        if (not 0 < n <= self.max_rows or not self.model.fused_ops or plan.padded is not None
                or plan.kv_connector_metadata is not None or not all(plan.samples)):
            return None
        spec = plan.spec_token_ids
        if not spec:
            if not all(plan.is_decode):
                return None
            rows = batch.rows_of(plan.req_ids)
            self._replayed = (plan, rows)
            return rows, np.asarray(plan.num_computed_tokens, dtype=np.int64)
        if sum(plan.num_scheduled_tokens) > self.max_verify_rows:
            return None
        rows: list[int] = []
        positions: list[int] = []
        requests = batch.requests
        for rid, start, width, decode in zip(plan.req_ids, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                             plan.is_decode):
            guesses = spec.get(rid)
            if not ((width == 1 + len(guesses) and start > 0) if guesses else decode):
                return None  # (a prefill chunk, or more than one pending token before the guesses)
            rows += [requests[rid].row] * width
            positions += range(start, start + width)
        # (lists, then two arrays: a handful of rows, where each numpy call costs more than the work)
        return np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64)

    def _buffers(self, rows: int) -> _Buffers:
        buffers = self.buffers.get(rows)
        if buffers is None:
            if self._full is None or len(self._full.h) < rows:  # (max_rows raised since: made again, larger)
                size, c, f32 = max(rows, self.max_rows), self.model.config, np.float32
                inter = self.weights[7].shape[2]
                logits = np.empty((size, self.weights[8].shape[0]), f32)
                self._full = _Buffers(
                    np.empty(size, np.int64), np.empty(size, np.int32), np.empty((size, c.hidden_size), f32),
                    np.empty((size, c.hidden_size), f32),
                    np.empty((size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim), f32),
                    np.empty((size, c.num_heads * c.head_dim), f32), np.empty((size, c.hidden_size), f32),
                    np.empty((size, 2 * inter), f32), np.empty((size, inter), f32), logits, torch.from_numpy(logits))
                self.buffers.clear()
            arrays = [getattr(self._full, f.name)[:rows] for f in fields(_Buffers)[:-1]]
            buffers = self.buffers[rows] = _Buffers(*arrays, torch.from_numpy(arrays[-1]))
        return buffers

    def run(self, batch_rows: np.ndarray, starts: np.ndarray, batch) -> tuple[torch.Tensor, np.ndarray]:
        """Logits [rows, vocab] of one decode step (row b: input-batch row `batch_rows[b]`, its new token
        at position `starts[b]`), which also writes the step's K/V into the pool; as a tensor and as
        the numpy array it shares memory with. Both are views of the steps' buffer: read them before
        the next step."""
        b = self._buffers(len(batch_rows))
        self.kernel(batch_rows, starts, batch.token_ids, batch.block_table.table, self.block_size, *self.weights,
                    *self.rope, *self.pools, *self.heads, b.positions, b.seq_lens, b.h, b.x,
                    b.qkv, b.attn, b.delta, b.gate_up, b.act, b.logits)
        return b.logits_tensor, b.logits

