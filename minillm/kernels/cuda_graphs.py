"""CUDA graphs for decode steps: capture one graph per batch-size bucket, replay it every step (chapter 10).

A CUDA graph replays a recorded sequence of kernel launches with one launch, on the same memory
addresses and the same launch shapes it recorded. Decode steps change their batch size and their
sequences' lengths every step, so (as vLLM does) a graph is captured for each of a few batch sizes,
the *buckets*, on static input buffers, and a step of B sequences runs the graph of the smallest
bucket ≥ B:

- its inputs are copied into the bucket's buffers, padded: a padding row decodes token 0 at
  position 0, writes no K/V (slot -1) and reads one key (seq_len 1) from the KV manager's
  `null_block`, which is never handed out; its output row is dropped;
- block tables are padded with -1 to the width the graph was captured with, so the attention kernel
  reads each row's true length and blocks from memory at replay: new lengths need no new graph;
- the numba kernels compile on their first launch (not a GPU operation, so not allowed inside a
  capture): every bucket runs eagerly on a side stream first, then is captured. Inside
  `torch.cuda.graph` torch's current stream is the capturing stream, and the launchers launch on
  `cuda.external_stream(torch.cuda.current_stream().cuda_stream)`, so numba's kernels are recorded
  with torch's.

`pick_bucket` and `pad_decode_inputs` are plain torch and are tested on the CPU (and the padded
forward against the unpadded one, in the simulator: tests/kernel_checks.py). `DecodeGraphs` needs
CUDA; bench/gpu.py measures it. The engine does not use it yet: that needs a hook in the model
runner's decode path (run `DecodeGraphs.run` when a step is decode-only and fits a bucket).

Why this module imports upward (kernels → attention): unlike its neighbours it is not a kernel
but a way of running the whole decode forward through the numba attention backend, so it needs
that backend and its metadata type (`minillm.attention.metadata`, the one shared by every
backend; nothing in `minillm.attention` imports it back). It lives here because chapter 10
teaches it with the kernels; the engine hook above would move it to the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.attention.metadata import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class DecodeInputs:
    """What one decode step of B sequences feeds the model: one new token per sequence."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64, where each token's K/V are written (< 0: nowhere)
    block_tables: torch.Tensor  # [B, W] int32, -1 padded
    seq_lens: torch.Tensor  # [B] int32, including the new token

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


def pick_bucket(batch_size: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds `batch_size` sequences."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    fitting = [b for b in sorted(buckets) if b >= batch_size]
    if not fitting:
        raise ValueError(f"batch_size {batch_size} exceeds the largest captured bucket {max(buckets)}; "
                         f"buckets are {tuple(sorted(buckets))}")
    return fitting[0]


def pad_decode_inputs(inputs: DecodeInputs, bucket: int, table_width: int, null_block: int) -> DecodeInputs:
    """`inputs` padded to `bucket` rows and `table_width` table columns (see the module docstring)."""
    b, width = inputs.block_tables.shape
    if b != inputs.batch_size or b > bucket:
        raise ValueError(f"{b} sequences do not fit a bucket of {bucket}")
    if width > table_width:
        raise ValueError(f"block tables of width {width} exceed the captured width {table_width}: capture with "
                         "max_blocks_per_seq >= ceil(max_model_len / block_size)")
    device = inputs.input_ids.device
    pad = bucket - b

    def rows(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype, device=device)])

    tables = torch.full((bucket, table_width), -1, dtype=torch.int32, device=device)
    tables[:b, :width] = inputs.block_tables
    tables[b:, 0] = null_block
    return DecodeInputs(rows(inputs.input_ids, 0), rows(inputs.positions, 0), rows(inputs.slot_mapping, -1),
                        tables, rows(inputs.seq_lens, 1))


def decode_metadata(inputs: DecodeInputs, block_size: int) -> AttentionMetadata:
    """The attention metadata of a decode-only step (every row one query), over `inputs`' own tensors."""
    b = inputs.batch_size
    return AttentionMetadata(slot_mapping=inputs.slot_mapping,
                             query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=inputs.input_ids.device),
                             seq_lens=inputs.seq_lens, block_tables=inputs.block_tables, num_decode=b,
                             block_size=block_size, num_tokens=b)


def decode_forward(model, k_pool: torch.Tensor, v_pool: torch.Tensor, inputs: DecodeInputs,
                   block_size: int) -> torch.Tensor:
    """One decode step on the numba kernels: logits [B, vocab]. The eager path, and what a graph records."""
    from minillm.attention.numba_paged import NumbaPagedAttention

    attention = NumbaPagedAttention(k_pool, v_pool, decode_metadata(inputs, block_size), model.config.sliding_windows)
    return model.compute_logits(model.forward(inputs.input_ids, inputs.positions, attention).hidden)


class DecodeGraphs:
    """One captured decode step per bucket; `run(inputs)` replays the right one. Needs CUDA."""

    def __init__(self, model, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int, null_block: int,
                 max_blocks_per_seq: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS, warmup_steps: int = 2) -> None:
        if not k_pool.is_cuda:
            raise RuntimeError("CUDA graphs need the model and its KV pool on a CUDA device")
        self.model, self.k_pool, self.v_pool = model, k_pool, v_pool
        self.block_size, self.null_block, self.table_width = block_size, null_block, max_blocks_per_seq
        self.buckets = tuple(sorted(buckets))
        self.static: dict[int, DecodeInputs] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bucket in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            device = k_pool.device
            one_token = DecodeInputs(torch.zeros(1, dtype=torch.long, device=device),
                                     torch.zeros(1, dtype=torch.long, device=device),
                                     torch.full((1,), -1, dtype=torch.long, device=device),
                                     torch.full((1, 1), null_block, dtype=torch.int32, device=device),
                                     torch.ones(1, dtype=torch.int32, device=device))
            static = pad_decode_inputs(one_token, bucket, self.table_width, null_block)  # all padding rows
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():  # compile numba's kernels, warm torch up
                for _ in range(warmup_steps):
                    decode_forward(model, k_pool, v_pool, static, block_size)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = decode_forward(model, k_pool, v_pool, static, block_size)
            pool = graph.pool()
            self.static[bucket], self.graphs[bucket] = static, graph

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits [B, vocab] of one decode step, by replaying the bucket's graph."""
        bucket = pick_bucket(inputs.batch_size, self.buckets)
        padded, static = pad_decode_inputs(inputs, bucket, self.table_width, self.null_block), self.static[bucket]
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
            getattr(static, name).copy_(getattr(padded, name))
        self.graphs[bucket].replay()
        return self.logits[bucket][: inputs.batch_size].clone()  # the buffer is overwritten by the next replay
