"""Quantized KV, simulated: K and V rounded through int8 or fp8 as they are written (chapter 14).

A quantized KV pool stores each token's K and V for each head as 8-bit codes plus a scale and
dequantizes them inside attention. Numerically that is the same as writing `dequantize(quantize(x))`
into a float pool: attention reads exactly the values the codes stand for. This module does the
latter, so that chapter 14's quality table can show what 8-bit KV costs on the torch path without an
8-bit pool (it saves no memory: the chapter counts the bytes by arithmetic). The engine knob that
really stores 8 bits is `kv_cache_dtype` (vLLM's name); where it exists, prefer its rows.

Granularity: one scale per token and KV head (the absolute maximum of its `head_dim` values maps to the
format's largest code), for int8 (127) and for fp8 e4m3 (448, torch's float8_e4m3fn). A head whose values
are all zero gets scale 1, so nothing is ever divided by zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.attention.flat_pool import FlatPoolAttention

SIMULATED_KV_DTYPES = {"int8": 127.0, "fp8_e4m3": 448.0}  # name -> largest code magnitude


def round_trip(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """`x` [tokens, heads, head_dim] quantized per (token, head) to `kv_dtype` and back, in x's dtype."""
    if kv_dtype not in SIMULATED_KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; choose one of {sorted(SIMULATED_KV_DTYPES)}")
    largest = SIMULATED_KV_DTYPES[kv_dtype]
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    if kv_dtype == "int8":
        codes = torch.round(x / scale).clamp_(-largest, largest)
    else:
        codes = (x / scale).to(torch.float8_e4m3fn).to(x.dtype)
    return codes * scale


def round_trip_backend(transform: Callable[[torch.Tensor], torch.Tensor]) -> type:
    """The torch backend with every K/V [tokens, heads, head_dim] written as `transform(K)`, `transform(V)`
    (exercise 14 plugs the learner's quantize-then-dequantize in here)."""

    class RoundTripAttention(FlatPoolAttention):
        def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return super().write(layer, transform(k), transform(v))

    return RoundTripAttention


def simulated_backend(kv_dtype: str) -> type:
    """The torch backend with every K/V written through `round_trip(…, kv_dtype)`."""
    if kv_dtype not in SIMULATED_KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; choose one of {sorted(SIMULATED_KV_DTYPES)}")
    return round_trip_backend(lambda x: round_trip(x, kv_dtype))


def simulate_kv_dtype(llm, kv_dtype: str) -> None:
    """Make `llm` (built with attention_backend="torch") write its K/V through `kv_dtype` from now on."""
    worker = llm.engine.executor.worker
    if worker.attention_backend != "torch" or worker.eviction is not None:
        raise ValueError("simulated KV quantization wraps the torch backend: build the LLM with "
                         "attention_backend='torch' and without kv_eviction")
    worker.backend = simulated_backend(kv_dtype)
