"""Quantized KV at a fixed budget (minillm.kv.capacity, chapter 14): what fits and what it spares.

A small run of the simulated 7B/A100: 60 course requests with 4 GiB of KV, which the fp16 pool
cannot hold at once. Deterministic, about two seconds.
"""

from __future__ import annotations

import pytest

from minillm.kv.capacity import budget_hardware, peak_kv_tokens_unbounded, simulate_capacity
from minillm.sim.model_shapes import LLAMA_7B
from minillm.traces.course import sim_trace

BUDGET = 4 * 2**30
BLOCK = 16  # CAPACITY_ENGINE's block_size


@pytest.fixture(scope="module")
def trace():
    return sim_trace(60)


@pytest.fixture(scope="module")
def rows(trace):
    return {r.kv_cache_dtype: r for r in simulate_capacity(trace, "course 60", BUDGET, ("auto", "int8"))}


def test_bytes_per_token_follow_the_dtype(rows) -> None:
    layers, heads, d = LLAMA_7B.num_layers, LLAMA_7B.num_kv_heads, LLAMA_7B.head_dim
    assert rows["auto"].bytes_per_token == 2 * layers * heads * d * 2  # fp16 values
    assert rows["int8"].bytes_per_token == 2 * layers * heads * (d + 4)  # 1-byte codes + a float32 scale per head


def test_int8_fits_the_exact_ratio_of_tokens(rows) -> None:
    for r in rows.values():  # whole blocks of the budget, nothing more
        assert r.tokens_fit == BUDGET // (r.bytes_per_token * BLOCK) * BLOCK
    ratio = rows["int8"].tokens_fit / rows["auto"].tokens_fit
    expected = rows["auto"].bytes_per_token / rows["int8"].bytes_per_token  # 128 * 2 / (128 + 4) = 1.939...
    assert ratio >= 1.7
    assert ratio == pytest.approx(expected, abs=BLOCK / rows["auto"].tokens_fit)  # up to one block's rounding


def test_int8_preempts_no_more_on_a_memory_bound_trace(trace, rows) -> None:
    assert peak_kv_tokens_unbounded(trace) > rows["auto"].tokens_fit  # memory binds for fp16
    assert rows["auto"].num_preemptions > 0
    assert rows["int8"].num_preemptions <= rows["auto"].num_preemptions
    assert rows["int8"].p99_ttft_ms <= rows["auto"].p99_ttft_ms


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="budget_bytes must be a positive"):
        budget_hardware(0)
