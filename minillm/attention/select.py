"""Which attention backend serves a step, and building it (chapters 04, 05 and 10).

    "torch"      minillm.attention.flat_pool: gathers blocks, SDPA per length group (any device)
    "numba"      minillm.attention.numba_paged: chapter 10's numba.cuda kernels (GPU; on a CPU only
                 under numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1, which is how tests check them)
    "numba_cpu"  minillm.attention.cpu_paged: decode rows through the @njit CPU kernel, the rest torch
    "auto"       "numba" on CUDA; on a CPU "numba_cpu" for float32/float64 when numba is installed,
                 else "torch"

"auto" is a fixed rule, not a benchmark run at start-up: a timing taken under a neighbour's load
could pick a different backend from one run to the next, and fp32 sums in a different order can
flip a near-tie token, so a notebook's output would depend on the load. The rule comes from
`python bench/attention_backends.py`, which times both CPU backends on the decode layer calls of
the ladder's shapes and in the whole engine; re-run it on a new machine and change the rule here
if torch wins there.
"""

from __future__ import annotations

import importlib.util

import torch

from minillm.attention.flat_pool import AttentionMetadata, FlatPoolAttention
from minillm.config import ATTENTION_BACKENDS as BACKENDS

CPU_KERNEL_DTYPES = (torch.float32, torch.float64)


def numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The backend `name` means on `device` for a model in `dtype` ("auto" resolved)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; choose one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "numba_cpu" and (on_cuda or dtype not in CPU_KERNEL_DTYPES):
        raise ValueError(f"attention_backend='numba_cpu' runs on a CPU in float32 or float64, not on "
                         f"{torch.device(device)} in {dtype}: use 'torch' or 'auto'")
    if name != "auto":
        return name
    if on_cuda:
        return "numba"
    return "numba_cpu" if dtype in CPU_KERNEL_DTYPES and numba_installed() else "torch"


def make_attention(backend: str, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                   sliding_windows: tuple[int | None, ...] = ()):
    """The per-step attention object the model calls once per layer (`backend` already resolved)."""
    if backend == "numba_cpu":
        from minillm.attention.cpu_paged import NumbaCpuAttention

        return NumbaCpuAttention(k_pool, v_pool, meta, sliding_windows)
    if backend == "numba":
        from minillm.attention.numba_paged import NumbaPagedAttention

        return NumbaPagedAttention(k_pool, v_pool, meta, sliding_windows)
    return FlatPoolAttention(k_pool, v_pool, meta, sliding_windows)
