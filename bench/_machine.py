"""Describe the machine a benchmark ran on, so its ratios can be read in context."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (elsewhere: what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def describe_machine() -> str:
    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}; {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
            f"{gpu}; load average {load:.1f}")


def describe_memory(weights_bytes: int) -> str:
    """Where a decode step's weights come from right now: reads of a buffer their size against reads of
    one far larger than any cache. On a shared VM this changes from hour to hour (a neighbour's working
    set can take the last-level cache), and with it what a speculative verify step costs next to a plain
    one: with the weights in cache a step's arithmetic sets its time, from DRAM their reads do."""
    from minillm.sim.hardware import last_level_cache_bytes, measure_read_bandwidth

    small, large = measure_read_bandwidth(weights_bytes), measure_read_bandwidth(256 * 2**20)
    llc = last_level_cache_bytes()
    where = "served from cache" if small > 1.5 * large else "streamed from DRAM (no faster than 256 MiB)"
    return (f"reads of {weights_bytes / 1e6:.1f} MB (the weights' size) {small / 1e9:.0f} GB/s, of 256 MiB "
            f"{large / 1e9:.0f} GB/s; last-level cache {f'{llc / 2**20:.0f} MiB' if llc else 'unknown'}: "
            f"the weights are {where}")


RESULTS_DIR = Path(__file__).resolve().parent / "results"  # git-ignored; the student release skips it


def results_path(name: str) -> Path:
    """Where a bench writes a file it keeps or hands to another process: bench/results/NAME."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / name
