"""Attention backends by name: one file per backend, one line here (chapters 04, 05, 10).

    "torch"      minillm.attention.flat_pool: gathers blocks, SDPA per length group (any device)
    "numba"      minillm.attention.numba_paged: chapter 10's numba.cuda kernels (GPU; on a CPU only
                 under numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1, which is how tests check them)
    "numba_cpu"  minillm.attention.cpu_paged: decode rows through the @njit CPU kernel, the rest torch

A backend is a class (vLLM's AttentionBackend and AttentionMetadataBuilder in one) with
`check(device, dtype)` (raise ValueError naming what it cannot do), `build_metadata(layout)` (the
step's `StepLayout` → what its attention reads, `minillm.attention.metadata`) and a constructor
`(k_pool, v_pool, metadata, sliding_windows)` giving the callable the model calls once per layer
(and, for a quantized pool, `kv_cache_dtype=`: "torch", "numba_cpu" and "numba" take it, chapter 14).
This module imports no backend (nor torch): `EngineConfig` checks names against it, and a backend
is imported when a worker uses it. "auto" is resolved in `minillm.attention.select`.
"""

from __future__ import annotations

import importlib

BACKENDS = {  # name -> "module:class"
    "torch": "minillm.attention.flat_pool:FlatPoolAttention",
    "numba": "minillm.attention.numba_paged:NumbaPagedAttention",
    "numba_cpu": "minillm.attention.cpu_paged:NumbaCpuAttention",
}


def backend_names() -> tuple[str, ...]:
    """What `attention_backend` accepts: "auto" and every registered name."""
    return ("auto", *BACKENDS)


def backend_class(name: str) -> type:
    """The class of backend `name` (not "auto"), imported now."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; choose one of {backend_names()}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
