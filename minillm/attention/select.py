"""Which attention backend serves a step: "auto" resolved, a choice checked (chapters 04, 05 and 10).

The backends and their names are in `minillm.attention.registry`; each backend says itself what it
cannot run (`check`). "auto" is a fixed rule, not a benchmark run at start-up: "numba" on CUDA; on
a CPU "numba_cpu" for float32/float64 when numba is installed, else "torch". A timing taken under
a neighbour's load could pick a different backend from one run to the next, and fp32 sums in a
different order can flip a near-tie token, so a notebook's output would depend on the load. The
rule comes from `python bench/attention_backends.py`, which times both CPU backends on the decode
layer calls of the ladder's shapes and in the whole engine; re-run it on a new machine and change
the rule here if torch wins there.
"""

from __future__ import annotations

import importlib.util

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.attention.registry import backend_class, backend_names

CPU_KERNEL_DTYPES = (torch.float32, torch.float64)


def numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The backend `name` means on `device` for a model in `dtype` ("auto" resolved), checked."""
    if name not in backend_names():
        raise ValueError(f"attention_backend={name!r}; choose one of {backend_names()}")
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            name = "numba"
        else:
            name = "numba_cpu" if dtype in CPU_KERNEL_DTYPES and numba_installed() else "torch"
    backend_class(name).check(device, dtype)
    return name


def make_attention(backend: str, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                   sliding_windows: tuple[int | None, ...] = ()):
    """The per-step attention object the model calls once per layer (`backend` already resolved)."""
    return backend_class(backend)(k_pool, v_pool, meta, sliding_windows)
