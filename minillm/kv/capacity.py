"""What the bytes buy: quantized KV at a fixed memory budget, on the simulated 7B/A100 (chapter 14).

Section 1 of chapter 14 counts how many more tokens an 8-bit cache holds; this module runs the
consequence. The simulator (`minillm.sim.simulate`) sizes its paged pool by `kv_cache_dtype` and
charges KV reads by the dtype's bytes, so one call per dtype at the same budget gives the tokens
that fit, the preemptions and the tail latency that follow. Everything here is simulated, so the
same inputs give the same numbers on any machine.

    from minillm.kv.capacity import SIM_BUDGET_BYTES, capacity_traces, simulate_capacity, format_capacity
    rows = [row for name, trace in capacity_traces().items()
            for row in simulate_capacity(trace, name, SIM_BUDGET_BYTES)]
    print(format_capacity(rows))

The budget is a device holding the 7B model's weights plus `budget_bytes` of KV and nothing else
(the A100's speed, less of its memory): the whole 80 GB would hold every request of either trace at
once, and nothing would be learned about memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minillm.kv.quant import check_kv_cache_dtype
from minillm.sim.model_shapes import get_model_shape
from minillm.traces.course import SIM_HARDWARE, SIM_MAX_MODEL_LEN, SIM_MODEL, sim_trace, simulate_course
from minillm.traces.synthetic import Trace, azure_trace

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
# 8 GiB of KV: 16,384 fp16 tokens, four of Llama-2's 4,096-token contexts. About what a 24 GB card
# keeps for the cache after a 7B model's 13.5 GB of fp16 weights and its activations.
SIM_BUDGET_BYTES = 8 * 2**30
# Chapter 05-06's engine: continuous batching, 16-token pages, recompute on preemption.
CAPACITY_ENGINE: dict[str, Any] = {"batching": "continuous", "kv_layout": "paged", "block_size": 16,
                                   "max_num_seqs": 256}
# Azure conv at half its real rate: at the real rate the simulated A100 is short of compute even with
# all 80 GB (p99 TTFT ~10 s), which would hide what memory does.
AZURE_KIND, AZURE_DURATION_S, AZURE_SPEEDUP = "conv", 60.0, 0.5


@dataclass(frozen=True)
class CapacityRow:
    """One trace run at one budget with one `kv_cache_dtype`."""

    trace: str
    kv_cache_dtype: str
    bytes_per_token: int  # K and V, every layer, in the pool (codes + scales when quantized)
    tokens_fit: int  # the pool's slots: whole blocks of `block_size` in the budget
    num_preemptions: int
    p99_ttft_ms: float
    mean_tpot_ms: float
    output_throughput: float  # output tokens/s


def capacity_traces() -> dict[str, Trace]:
    """The course trace (200 ShareGPT-like requests at 4/s) and the first minute of Azure's chat
    trace at half speed (191 requests), clipped to Llama-2's 4,096-token context."""
    azure = azure_trace(AZURE_KIND, duration_s=AZURE_DURATION_S, speedup=AZURE_SPEEDUP,
                        max_model_len=SIM_MAX_MODEL_LEN)
    return {"course": sim_trace(), f"azure {AZURE_KIND} x{AZURE_SPEEDUP:g}": azure}


def budget_hardware(budget_bytes: int):
    """The course's A100, with memory for the 7B weights and exactly `budget_bytes` of KV."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    weights = get_model_shape(SIM_MODEL).weight_bytes(SIM_HARDWARE.dtype_bytes)
    return dataclasses.replace(SIM_HARDWARE, mem_capacity_bytes=float(weights + budget_bytes))


def simulate_capacity(trace: Trace, trace_name: str, budget_bytes: int = SIM_BUDGET_BYTES,
                      kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
                      engine_config: dict[str, Any] | None = None) -> list[CapacityRow]:
    """One row per dtype: `trace` through the simulated 7B/A100 with `budget_bytes` of KV memory."""
    hardware = budget_hardware(budget_bytes)
    rows = []
    for dtype in kv_cache_dtypes:
        check_kv_cache_dtype(dtype)
        config = {**(engine_config or CAPACITY_ENGINE), "kv_cache_dtype": dtype}
        result = simulate_course(config, trace, hardware=hardware, kv_fraction=1.0)
        engine_config_used = result.engine.config
        s = result.summary
        rows.append(CapacityRow(
            trace=trace_name, kv_cache_dtype=dtype,
            bytes_per_token=dataclasses.replace(get_model_shape(SIM_MODEL), kv_cache_dtype=dtype)
            .kv_bytes_per_token(SIM_HARDWARE.dtype_bytes),
            tokens_fit=engine_config_used.num_kv_blocks * engine_config_used.block_size,
            num_preemptions=s.num_preemptions, p99_ttft_ms=s.ttft.percentiles_ms[99],
            mean_tpot_ms=s.tpot.mean_ms, output_throughput=s.output_throughput))
    return rows


def peak_kv_tokens_unbounded(trace: Trace, engine_config: dict[str, Any] | None = None) -> int:
    """The most KV tokens `trace` holds at once on the whole A100 (fp16): what the budget must be
    below for memory to bind."""
    result = simulate_course(engine_config or CAPACITY_ENGINE, trace)
    return max(step.kv_used_tokens for step in result.steps)


def format_capacity(rows: list[CapacityRow]) -> str:
    """An aligned text table, one line per row."""
    head = (f"{'trace':<16} {'kv_cache_dtype':<15} {'bytes/token':>11} {'tokens fit':>10} {'preemptions':>11} "
            f"{'p99 TTFT (s)':>12} {'mean TPOT (ms)':>14} {'output tok/s':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.trace:<16} {r.kv_cache_dtype:<15} {r.bytes_per_token:>11,} {r.tokens_fit:>10,} "
                     f"{r.num_preemptions:>11} {r.p99_ttft_ms / 1000:>12.2f} {r.mean_tpot_ms:>14.1f} "
                     f"{r.output_throughput:>12.0f}")
    return "\n".join(lines)
