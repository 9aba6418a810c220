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


RESULTS_DIR = Path(__file__).resolve().parent / "results"  # git-ignored; the student release skips it


def results_path(name: str) -> Path:
    """Where a bench writes a file it keeps or hands to another process: bench/results/NAME."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / name
