"""FlashAttention's I/O argument, run: HBM bytes each attention kernel moves, measured (chapter 10).

io_model.py counts the bytes on paper. Here the two prefill kernels run on numba's CUDA simulator
with every array access traced (minillm.kernels.trace), on one fresh prompt of `seq_len` tokens:

- prefill_attention (kernels/varlen_attention.py): one thread per (query, head), each reading its
  own keys and values: K and V come from HBM once per query and per query head;
- flash_attention (kernels/tiled_attention.py): one thread block per tile of `block_m` queries and
  the query heads of one KV head; K and V come from HBM once per tile, through shared memory.

What is counted: for every global array, the distinct elements each simulated thread read or wrote,
summed over threads (a number a thread reads twice is counted once; two threads reading it count
twice: sharing between threads goes through shared memory or not at all). `expected_elements` is
the same count from the kernels' loop bounds, by arithmetic; the test checks the two agree.
Needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported).
"""

from __future__ import annotations

import torch

from minillm.kernels.scenarios import paged_scenario


def _prompt(seq_len: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    s = paged_scenario([seq_len], block_size=block_size, num_blocks=-(-seq_len // block_size) + 1,
                       kv_heads=kv_heads, q_heads=q_heads, head_dim=head_dim, seed=seed)
    query = torch.randn(seq_len, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    query_start_loc = torch.tensor([0, seq_len], dtype=torch.int32)
    return [query, s.key_cache, s.value_cache, s.block_tables, query_start_loc, s.seq_lens, s.scale]


def expected_elements(seq_len: int, q_heads: int, kv_heads: int, head_dim: int, block_m: int) -> dict[str, dict]:
    """K (= V) elements read and Q, O elements moved by each kernel on one causal prompt, by arithmetic."""
    n, d = seq_len, head_dim
    group = q_heads // kv_heads
    untiled_keys = sum(p + 1 for p in range(n)) * d * q_heads  # query p reads keys 0..p, per query head
    tiles = range(0, n, block_m)
    tiled_keys = sum(min(t + block_m, n) for t in tiles) * d * kv_heads  # a tile loads keys 0..its last row
    qo = n * q_heads * d
    return {"prefill_attention": {"query": qo, "key_cache": untiled_keys, "value_cache": untiled_keys, "out": qo},
            "flash_attention": {"query": qo, "key_cache": tiled_keys, "value_cache": tiled_keys, "out": qo},
            "group": {"query heads per KV head": group}}


def measure_attention_io(seq_len: int = 32, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                         block_size: int = 4, block_m: int = 8, block_n: int = 8, seed: int = 0) -> dict:
    """{kernel: {array: {"read": bytes, "written": bytes}}} for a prompt of `seq_len` tokens, measured
    on the simulator; both outputs are checked against the reference first (a kernel that reads
    less by being wrong proves nothing)."""
    from minillm.kernels import tiled_attention as fa
    from minillm.kernels import varlen_attention as va
    from minillm.kernels._launch import THREADS
    from minillm.kernels.trace import trace_launch

    args = _prompt(seq_len, q_heads, kv_heads, head_dim, block_size, seed)
    want = fa.flash_attention_reference(*args)
    launches = {"prefill_attention": (va.kernel, -(-seq_len * q_heads // THREADS), THREADS),
                "flash_attention": (fa.kernel_for(block_m, block_n), *fa.launch_shape(args[4], q_heads, kv_heads,
                                                                                       block_m))}
    measured = {}
    for name, (kernel, grid, block) in launches.items():
        out = torch.full_like(args[0], float("nan"))
        trace = trace_launch(kernel, grid, block, [*args, out])
        err = (out - want).abs().max().item()
        if not err < 1e-4:
            raise AssertionError(f"{name} differs from the reference by {err:.3g}: its byte count would mean nothing")
        measured[name] = trace.hbm_bytes()
    return measured


def io_report(seq_len: int = 32, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 8, block_size: int = 4,
              block_m: int = 8, block_n: int = 8) -> list[str]:
    """The measured table as lines of text (what chapter 10 prints)."""
    measured = measure_attention_io(seq_len, q_heads, kv_heads, head_dim, block_size, block_m, block_n)
    lines = [f"one prompt of {seq_len} tokens, {q_heads} query heads / {kv_heads} KV heads, head_dim {head_dim}, "
             f"float32; bytes each simulated thread read or wrote (distinct elements per thread)",
             f"{'kernel':<30}{'Q read':>9}{'K+V read':>10}{'O written':>11}{'metadata':>10}{'total':>9}"]
    totals = {}
    for name, arrays in measured.items():
        kv = arrays["key_cache"]["read"] + arrays["value_cache"]["read"]
        meta = sum(arrays[a]["read"] for a in ("block_tables", "query_start_loc", "seq_lens"))
        total = sum(m["read"] + m["written"] for m in arrays.values())
        totals[name] = (kv, total)
        label = name + (" (untiled)" if name == "prefill_attention" else f" ({block_m}x{block_n} tiles)")
        lines.append(f"{label:<30}{arrays['query']['read']:>9,}{kv:>10,}{arrays['out']['written']:>11,}"
                     f"{meta:>10,}{total:>9,}")
    ratio = totals["prefill_attention"][0] / totals["flash_attention"][0]
    lines.append(f"K+V bytes, untiled / tiled: {ratio:.1f}x (a tile of {block_m} rows x {q_heads // kv_heads} query "
                 f"heads shares each load: at most {block_m * q_heads // kv_heads}x; causal tiles load up to their "
                 f"last row); all bytes: {totals['prefill_attention'][1] / totals['flash_attention'][1]:.1f}x")
    return lines
