"""Hardware presets and the roofline: how fast a chip can compute and how fast it can feed itself.

Chapter 00 (tour) plots the roofline of this CPU next to the A100/H100/H200 presets; chapter 04
uses `measure_this_cpu()` to compare the simulator's predicted step time with measured CPU steps,
and `measure_read_bandwidth` with `last_level_cache_bytes` to show that the memory roof depends on
where the bytes live: a model whose weights fit in the CPU's cache is not fed at DRAM bandwidth.

The roofline model (Williams, Waterman & Patterson, 2009): a kernel doing `F` FLOPs while moving
`B` bytes has arithmetic intensity `I = F / B` (FLOP per byte). The chip cannot go faster than its
peak compute, nor than its memory can deliver operands, so

    attainable FLOP/s = min(peak_flops, I * mem_bandwidth)

The two lines meet at the *ridge point* `peak_flops / mem_bandwidth`. Work below the ridge is
memory-bound (decode: each weight read from HBM is used once per sequence in the batch); work
above it is compute-bound (prefill: each weight is used once per prompt token).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU) as the cost model sees it: two roofs, a capacity and fixed costs.

    The efficiency factors say how close to its spec sheet a real engine gets (chapter 04, section 6):

    * `mfu` (model FLOPs utilization): achieved FLOP/s ÷ peak FLOP/s in the compute-bound part
      of a step (prefill). Chowdhery et al. (2022, "PaLM", appendix B) defined MFU for training;
      serving uses it the same way for prefill.
    * `mbu` (model bandwidth utilization): achieved bytes/s ÷ peak bytes/s in the memory-bound
      part (decode): (weight bytes + KV bytes read) ÷ step time ÷ peak bandwidth. Defined by
      Databricks/MosaicML ("LLM Inference Performance Engineering: Best Practices", 2023).
    * `step_overhead_s`: fixed cost of one step (kernel launches, Python, scheduling);
      `per_request_overhead_s`: cost per sequence in the step (building its inputs and block
      table, sampling, stop checks, detokenization), the term chapter 04 measures on this CPU.

    Defaults (1, 1, 0, 0) are the ideal roofline: the physical floor no engine beats.
    """

    name: str
    peak_flops: float  # FLOP/s for `dtype_bytes`-wide operands (dense, no sparsity)
    mem_bandwidth_bytes_per_s: float
    mem_capacity_bytes: float
    step_overhead_s: float = 0.0  # fixed cost of one engine step: kernel launches, Python, scheduling
    dtype_bytes: int = 2  # width of weights and KV entries (bf16/fp16 = 2, fp32 = 4)
    host_link_bytes_per_s: float = 32e9  # device <-> host memory (PCIe), one direction: swap copies
    mfu: float = 1.0  # share of peak_flops reached in compute-bound work
    mbu: float = 1.0  # share of mem_bandwidth_bytes_per_s reached in memory-bound work
    per_request_overhead_s: float = 0.0  # cost of each sequence in a step, on top of step_overhead_s

    def __post_init__(self) -> None:
        for knob in ("mfu", "mbu"):
            value = getattr(self, knob)
            if not 0 < value <= 1:
                raise ValueError(f"Hardware {self.name!r}: {knob} must be in (0, 1] (a share of the peak), got {value!r}")
        for knob in ("step_overhead_s", "per_request_overhead_s"):
            if not getattr(self, knob) >= 0:
                raise ValueError(f"Hardware {self.name!r}: {knob} must be >= 0 seconds, got {getattr(self, knob)!r}")

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which work is compute-bound (ideal roofs)."""
        return self.peak_flops / self.mem_bandwidth_bytes_per_s

    @property
    def is_ideal(self) -> bool:
        """True for the physical floor: full efficiency, no overheads."""
        return self.mfu == 1 and self.mbu == 1 and self.step_overhead_s == 0 and self.per_request_overhead_s == 0


# Spec-sheet peaks: dense bf16/fp16 tensor-core FLOP/s (the sheets also print a 2x "with
# sparsity" figure, which ordinary inference never reaches) and HBM bandwidth. Capacities are the
# sheets' decimal gigabytes. Step overhead is 0: the presets are the ideal roofline; use
# `dataclasses.replace(hw, step_overhead_s=...)` to add launch/framework cost.
# A100: NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB column), https://www.nvidia.com/en-us/data-center/a100/
# Host links: PCIe Gen4 x16 for A100 (64 GB/s both directions = 32 one way), Gen5 x16 for H100/H200.
A100_80GB = Hardware("A100-80GB", 312e12, 2.039e12, 80e9, host_link_bytes_per_s=32e9)
# H100: NVIDIA H100 Tensor Core GPU datasheet (SXM column), https://www.nvidia.com/en-us/data-center/h100/
H100_SXM = Hardware("H100-SXM", 989e12, 3.35e12, 80e9, host_link_bytes_per_s=64e9)
# H200: NVIDIA H200 product page (SXM column; same compute die as H100, faster HBM3e),
# https://www.nvidia.com/en-us/data-center/h200/
H200 = Hardware("H200", 989e12, 4.8e12, 141e9, host_link_bytes_per_s=64e9)


# --- how close real engines get: published measurements and a preset fitted to them ----------
# NVIDIA NeMo Framework user guide, "Performance > Llama-2 > Inference performance"
# (https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html; NeMo serves
# through TensorRT-LLM): Llama-2-7B, one A100 80GB SXM4 (TP 1), 128 input and 20 output tokens,
# average end-to-end latency in ms by batch size. A measurement of a tuned engine, not ours.
NEMO_LLAMA2_7B_A100_LATENCY_MS: dict[int, float] = {1: 234.0, 2: 249.6, 4: 272.6, 8: 329.5}
NEMO_PROMPT_TOKENS, NEMO_OUTPUT_TOKENS = 128, 20

# The A100 with efficiency factors fitted to that table by `minillm.sim.cost_model.fit_efficiency`
# (tests/test_sim_cost.py refits and checks these values and the <= 1 % error): 61 % of peak
# bandwidth in decode, 0.9 ms per step, 0.1 ms per sequence. MFU is held at 0.5 (a common figure
# for prefill kernels): 128-token prompts are too short for the fit to pin it down. Four rows and
# three free numbers: a calibration, not a validation. An ideal 7B decode step at batch 1 (6.6 ms)
# becomes ~11.8 ms; the seeds' illustrative "in practice" figure is 20-30 ms.
A100_80GB_PRACTICAL = replace(A100_80GB, name="A100-80GB-practical", mfu=0.5, mbu=0.61,
                              step_overhead_s=0.9e-3, per_request_overhead_s=0.1e-3)

PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (A100_80GB, H100_SXM, H200, A100_80GB_PRACTICAL)}


def get_hardware(name: str) -> Hardware:
    """A preset by name (case-insensitive), e.g. `get_hardware("a100-80gb")`."""
    for key, hw in PRESETS.items():
        if key.lower() == name.lower():
            return hw
    raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)} (or measure_this_cpu())")


def roofline(hw: Hardware, arithmetic_intensity: float) -> float:
    """Attainable FLOP/s at the given intensity (FLOP/byte): the lower of the two roofs."""
    return min(hw.peak_flops, arithmetic_intensity * hw.mem_bandwidth_bytes_per_s)


def roofline_points(
    hw: Hardware, min_intensity: float = 0.1, max_intensity: float = 1e4, num: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """(intensities, attainable FLOP/s), log-spaced, ready for `plt.loglog(*roofline_points(hw))`."""
    intensities = np.logspace(np.log10(min_intensity), np.log10(max_intensity), num)
    attainable = np.minimum(hw.peak_flops, intensities * hw.mem_bandwidth_bytes_per_s)
    return intensities, attainable


# --- measuring this machine ---------------------------------------------------------------------
# On the 2-core development machine (2026-11) these measured ~25 GB/s copy bandwidth and
# ~135 GFLOP/s fp32 matmul on 2 threads (readings swing by ±50 % when other jobs share the cores).
# bf16/fp16 matmul on that CPU is ~0.3-1 GFLOP/s: measure and run in fp32 there.
# Reads on one thread (2026-12, 32 MiB L3): ~55-70 GB/s over 16 MB (the bundled target's weights),
# ~10-20 GB/s over 256 MiB, the lower figures while other jobs shared the machine.


def _best_time_s(fn: Callable[[], object], budget_s: float, min_reps: int = 2) -> float:
    """Best wall time of repeated `fn()` calls: the least-disturbed run is closest to the hardware."""
    deadline = time.perf_counter() + budget_s
    fn()  # warm-up: first-touch page faults, thread-pool start, kernel selection
    best = float("inf")
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        reps += 1
    return best


def measure_copy_bandwidth(budget_s: float = 0.5, num_bytes: int = 64 * 2**20) -> float:
    """Copy bandwidth in bytes/s, counting the bytes read plus the bytes written (as STREAM does).

    The buffers (64 MiB each by default) are larger than a typical last-level cache, so the copy
    really goes to DRAM.
    """
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_s = _best_time_s(lambda: dst.copy_(src), budget_s)
    return 2 * src.numel() * src.element_size() / best_s


def measure_read_bandwidth(num_bytes: int = 64 * 2**20, budget_s: float = 0.25) -> float:
    """Read bandwidth in bytes/s: a sum over a float32 buffer of `num_bytes`, each byte read once.

    Where the bytes come from depends on the buffer's size: once the warm-up call has touched it, a
    buffer that fits in a cache is read from that cache, and one several times the last-level cache
    comes from DRAM. Chapter 04 reads a buffer the size of a model's weights, which a decode step
    streams once; a sum does one add per float, as a matrix-vector product does one multiply-add per
    weight.
    """
    src = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)
    best_s = _best_time_s(lambda: src.sum(), budget_s)
    return src.numel() * src.element_size() / best_s


def last_level_cache_bytes(cache_dir: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Size of CPU 0's highest-level data cache (the L3 on most x86 servers), as Linux's sysfs
    reports it; None where the system does not say (not Linux, or a container that hides it).

    The last-level cache is shared by the cores of a die: a working set that fits in it, such as
    the bundled models' weights, can be read at several times DRAM bandwidth once warm (chapter 04).
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(Path(cache_dir).glob("index[0-9]*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            num_bytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, num_bytes)
    return None if best is None else best[1]


def measure_matmul_flops(
    budget_s: float = 0.8, dtype: torch.dtype = torch.float32, max_n: int = 1024
) -> float:
    """Matmul FLOP/s of an n x n x n product (2 n^3 FLOPs), with n = `max_n` where affordable.

    fp32/fp64 are timed at `max_n` directly: small products are dominated by thread start-up,
    badly so when other jobs share the cores. Half types can be 100-500x slower on a CPU (no native
    kernels), so for them a 128 x 128 probe picks the largest n that fits the budget.
    """
    n = max_n
    if dtype not in (torch.float32, torch.float64):
        probe = torch.ones(128, 128, dtype=dtype)
        probe_s = _best_time_s(lambda: probe @ probe, budget_s=0.0)
        while n > 128 and probe_s * (n / 128) ** 3 * 8 > budget_s:
            n //= 2
    a = torch.ones(n, n, dtype=dtype)
    b = torch.ones(n, n, dtype=dtype)
    best_s = _best_time_s(lambda: a @ b, budget_s)
    return 2 * n**3 / best_s


def measure_op_overhead_s(budget_s: float = 0.2) -> float:
    """Fixed cost of launching one tiny torch op (dispatch + Python), in seconds."""
    x = torch.zeros(16)
    ops = 200

    def loop() -> None:
        for _ in range(ops):
            x.add_(1.0)

    return _best_time_s(loop, budget_s) / ops


def _physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not POSIX: capacity unknown
        return 0.0


def measure_this_cpu(
    seconds_budget: float = 1.5, dtype: torch.dtype = torch.float32, ops_per_step: int = 200
) -> Hardware:
    """A `Hardware` for this machine, from a copy, a matmul and a tiny-op loop timed with torch.

    `step_overhead_s` is the measured per-op overhead times `ops_per_step`: a Llama layer runs about
    35 small ops (norms, projections, RoPE, attention, MLP, residuals), so the default 200 stands
    for a few-layer model plus embedding, lm_head and sampling. Calibrate it against measured steps.
    """
    copy_bw = measure_copy_bandwidth(budget_s=0.25 * seconds_budget)
    matmul_flops = measure_matmul_flops(budget_s=0.5 * seconds_budget, dtype=dtype)
    op_overhead_s = measure_op_overhead_s(budget_s=0.1 * seconds_budget)
    return Hardware(
        name=f"this-cpu ({torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')})",
        peak_flops=matmul_flops,
        mem_bandwidth_bytes_per_s=copy_bw,
        mem_capacity_bytes=_physical_memory_bytes(),
        step_overhead_s=op_overhead_s * ops_per_step,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        host_link_bytes_per_s=copy_bw,  # "swapping" on a CPU is a copy within the same memory
    )
