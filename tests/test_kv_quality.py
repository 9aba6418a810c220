"""Chapter 14's quality harness (minillm.kv.quality) and its simulated 8-bit KV (minillm.kv.simulated_quant)."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM
from minillm.kv.quality import QualityRow, format_table, measure_quality, random_control_model
from minillm.kv.simulated_quant import round_trip, simulate_kv_dtype


def test_int8_round_trip_error_is_half_a_step_per_element():
    torch.manual_seed(0)
    x = torch.randn(50, 4, 32, dtype=torch.float64) * torch.rand(50, 4, 1, dtype=torch.float64) * 10
    x[3, 1] = 0.0  # a head of zeros: scale 1, no division by zero
    back = round_trip(x, "int8")
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 + 1e-12)
    assert torch.equal(back[3, 1], torch.zeros(32, dtype=torch.float64))
    assert (back - x).abs().max() > 0  # it does round


def test_fp8_round_trip_keeps_three_mantissa_bits():
    torch.manual_seed(1)
    x = torch.randn(40, 2, 16, dtype=torch.float32)
    back = round_trip(x, "fp8_e4m3")
    scale = x.abs().amax(dim=-1, keepdim=True) / 448
    assert torch.all((back - x).abs() <= x.abs() / 16 + scale * 2.0**-9 * 1.01)
    with pytest.raises(ValueError, match="choose one of"):
        round_trip(x, "int4")


@pytest.fixture(scope="module")
def control():
    return random_control_model()


def test_harness_rows_against_the_reference(control):
    make = lambda **k: LLM(control, dtype="float64", max_num_seqs=4, max_model_len=128, **k)  # noqa: E731
    texts = [[(i * 53 + 7 * j) % 4000 + 6 for i in range(80)] for j in range(2)]
    rows = [QualityRow("exact", {"attention_backend": "torch"}),
            QualityRow("exact again", {"attention_backend": "torch"}),
            QualityRow("int8 (simulated)", {"attention_backend": "torch"}, simulated_kv_dtype="int8"),
            QualityRow("streaming 12", {"kv_eviction": {"policy": "streaming", "budget_tokens": 12}})]
    exact, again, int8, streaming = measure_quality(rows, texts, make_llm=make, prompt_tokens=8, num_greedy_tokens=40)
    assert exact.max_logprob_diff == 0 and exact.greedy_agreement == 1.0 and exact.first_divergence == 40
    assert again.max_logprob_diff == 0 and again.greedy == exact.greedy  # the same engine twice: bit for bit
    assert exact.tokens_scored == 2 * 72
    assert 0 < int8.max_logprob_diff < streaming.max_logprob_diff
    assert streaming.greedy_agreement < 1.0
    table = format_table([exact, int8, streaming], "control")
    assert table.splitlines()[0] == "control" and "int8 (simulated)" in table and len(table.splitlines()) == 6


def test_harness_refuses_what_it_cannot_score(control):
    make = lambda **k: LLM(control, dtype="float64", max_num_seqs=2, max_model_len=64, **k)  # noqa: E731
    with pytest.raises(ValueError, match="equally long"):
        measure_quality([QualityRow("exact")], [[1, 2, 3]], make_llm=make, prompt_tokens=8)
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        simulate_kv_dtype(make(attention_backend="numba_cpu"), "int8")
    with pytest.raises(ValueError, match="unknown engine option"):  # rows pass their knobs to LLM as they are
        measure_quality([QualityRow("x", {"kv_cache_dtipe": "int8"})], [[7] * 20], make_llm=make, prompt_tokens=8)
