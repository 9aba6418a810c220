"""The simulator's cost model: hardware presets, model shapes, roofline step times (chapters 00, 01, 04)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from minillm.sim import (
    A100_80GB,
    H100_SXM,
    H200,
    LLAMA_7B,
    LLAMA_7B_GQA,
    LLAMA_70B,
    decode_step_time,
    from_hf_config,
    get_hardware,
    get_model_shape,
    max_batch_for_kv,
    measure_this_cpu,
    prefill_time,
    roofline,
    roofline_points,
    step_time,
)

GiB = 2**30


# --- hardware ---------------------------------------------------------------------------------


def test_ridge_points_of_presets():
    assert A100_80GB.ridge_point == pytest.approx(312e12 / 2.039e12)
    assert A100_80GB.ridge_point == pytest.approx(153, abs=1)
    assert H100_SXM.ridge_point == pytest.approx(295, abs=1)
    assert H200.ridge_point == pytest.approx(206, abs=1)  # same compute as H100, faster HBM: lower ridge


def test_get_hardware_by_name_and_error_lists_presets():
    assert get_hardware("a100-80gb") is A100_80GB
    with pytest.raises(ValueError, match="A100-80GB.*H100-SXM.*H200"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="llama-7b"):
        get_model_shape("gpt-5")


def test_roofline_is_the_lower_roof():
    assert roofline(A100_80GB, 1.0) == pytest.approx(2.039e12)  # memory roof
    assert roofline(A100_80GB, 1000.0) == 312e12  # compute roof
    assert roofline(A100_80GB, A100_80GB.ridge_point) == pytest.approx(312e12)
    intensities, flops = roofline_points(A100_80GB, 1.0, 1e4, num=50)
    assert intensities.shape == flops.shape == (50,)
    assert np.all(np.diff(flops) >= 0) and flops.max() == 312e12
    assert flops[0] == pytest.approx(2.039e12)


def test_measure_this_cpu_is_plausible():
    hw = measure_this_cpu(seconds_budget=1.0)
    assert 1e9 < hw.mem_bandwidth_bytes_per_s < 1e12
    assert 1e9 < hw.peak_flops < 1e13
    assert 0 < hw.step_overhead_s < 0.1
    assert hw.dtype_bytes == 4 and hw.mem_capacity_bytes > 0


def test_measure_read_bandwidth_is_plausible():
    from minillm.sim.hardware import measure_read_bandwidth

    for num_bytes in (2**20, 32 * 2**20):  # inside a typical L2/L3, and at a typical L3's size
        assert 1e8 < measure_read_bandwidth(num_bytes, budget_s=0.05) < 1e13


def _fake_cache(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_last_level_cache_bytes_reads_the_highest_data_level(tmp_path):
    from minillm.sim.hardware import last_level_cache_bytes

    # the layout of this course's 2-core AMD EPYC: L1d, L1i, L2, L3
    epyc = _fake_cache(tmp_path / "epyc", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "512K"),
                                           (3, "Unified", "32768K")])
    assert last_level_cache_bytes(epyc) == 32 * 2**20
    # no L3, sizes in M; an instruction cache at a higher level does not count
    small = _fake_cache(tmp_path / "small", [(1, "Data", "64K"), (2, "Unified", "1M"), (3, "Instruction", "8M")])
    assert last_level_cache_bytes(small) == 2**20
    assert last_level_cache_bytes(tmp_path / "absent") is None
    broken = _fake_cache(tmp_path / "broken", [(3, "Unified", "lots")])
    assert last_level_cache_bytes(broken) is None


def test_fit_step_overheads_recovers_a_line_and_never_goes_negative():
    from minillm.sim import Hardware
    from minillm.sim.cost_model import fit_step_overheads

    sizes = np.array([1] * 30 + [2] * 10 + [4] * 10 + [8] * 50)
    exact = fit_step_overheads(sizes, 0.5e-3 + 0.2e-3 * sizes)
    assert exact.fixed_s == pytest.approx(0.5e-3) and exact.per_request_s == pytest.approx(0.2e-3)
    assert exact.fixed_only_s == pytest.approx(np.median(0.5e-3 + 0.2e-3 * sizes)) and exact.clamped == ()

    # the roofline alone overshoots small batches: the line's intercept is negative -> through the origin
    origin = fit_step_overheads(sizes, -0.3e-3 + 0.5e-3 * sizes)
    assert origin.fixed_s == 0 and 0.4e-3 < origin.per_request_s < 0.5e-3
    assert "intercept came out -0.300 ms" in origin.clamped[0] and "origin" in origin.clamped[0]

    # a negative slope: no cost per request, the fixed cost alone
    falling = fit_step_overheads(sizes, 1e-3 - 0.1e-3 * sizes)
    assert falling.per_request_s == 0 and falling.fixed_s == falling.fixed_only_s == pytest.approx(0.4e-3)
    assert "slope came out -0.100 ms" in falling.clamped[0]

    # the roofline alone predicts every step slower than measured: every cost clamps at 0, and says so
    overshoot = fit_step_overheads(sizes, -0.2e-3 - 0.01e-3 * sizes)
    assert overshoot.fixed_only_s == overshoot.fixed_s == overshoot.per_request_s == 0
    assert "clamped at 0" in overshoot.clamped[0] and "both clamped at 0" in overshoot.clamped[1]

    single = fit_step_overheads([1] * 5, [0.1e-3, 0.2e-3, 0.3e-3, 0.4e-3, 0.5e-3])
    assert single.fixed_s == single.fixed_only_s == pytest.approx(0.3e-3) and single.per_request_s == 0
    assert "no slope" in single.clamped[0]

    rng = np.random.default_rng(0)
    for _ in range(200):  # whatever the measurements, the fit makes a valid Hardware
        n = rng.integers(1, 9, size=rng.integers(1, 40))
        fit = fit_step_overheads(n, rng.normal(0, 1e-3, n.size) + rng.normal(0, 1e-3) * n)
        assert min(fit.fixed_only_s, fit.fixed_s, fit.per_request_s) >= 0
        Hardware("cpu", 1e11, 1e10, 1e9, step_overhead_s=fit.fixed_s, per_request_overhead_s=fit.per_request_s)
    with pytest.raises(ValueError, match="one entry per step"):
        fit_step_overheads([1, 2], [0.1])


# --- model shapes -----------------------------------------------------------------------------


def test_parameter_counts_match_published_sizes():
    assert LLAMA_7B.num_params == pytest.approx(6.74e9, rel=0.01)
    assert LLAMA_70B.num_params == pytest.approx(68.98e9, rel=0.01)
    assert LLAMA_7B.weight_bytes(2) == pytest.approx(13.5e9, rel=0.01)  # "7B in FP16 is about 14 GB"


def test_kv_bytes_formula():
    # 2 (K, V) * 32 layers * 32 heads * 128 dims * 2 bytes = 0.5 MiB per token
    assert LLAMA_7B.kv_bytes_per_token(2) == GiB // 2048
    assert LLAMA_7B.kv_bytes(4096, 1, 2) == 2 * GiB
    # batch 16 x 2048 tokens is 16 GiB (not ~1 GB, as one seed text says)
    assert LLAMA_7B.kv_bytes(2048, 16, 2) == 16 * GiB
    assert LLAMA_7B.kv_bytes_per_token(2) == 4 * LLAMA_7B_GQA.kv_bytes_per_token(2)  # GQA: 32 -> 8 KV heads
    assert LLAMA_70B.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2


QWEN2_0_5B_CONFIG = {  # Qwen2.5-0.5B's config.json (the fields that matter)
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_from_hf_config_dict_and_path(tmp_path):
    shape = from_hf_config(QWEN2_0_5B_CONFIG)
    assert (shape.head_dim, shape.num_kv_heads, shape.tied_embeddings, shape.qkv_bias) == (64, 2, True, True)
    assert shape.num_params == 494_032_768  # the published count of Qwen2.5-0.5B
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_0_5B_CONFIG))
    assert dataclasses.replace(from_hf_config(tmp_path), name=shape.name) == shape
    llama = {k: v for k, v in QWEN2_0_5B_CONFIG.items() if k not in ("model_type", "num_key_value_heads")}
    assert from_hf_config(llama).num_kv_heads == 14  # no num_key_value_heads: plain MHA


# --- step cost --------------------------------------------------------------------------------


def test_7b_decode_batch1_on_a100_is_memory_bound_at_about_7ms():
    cost = decode_step_time(A100_80GB, LLAMA_7B, batch=1, context_len=512)
    assert cost.bound == "memory"
    # ~13.2 GB of streamed weights (the embedding table is not streamed) + 256 MiB of KV
    assert cost.bytes_moved == pytest.approx(13.5e9, rel=0.02)
    assert cost.time_s == pytest.approx(13.5e9 / 2.039e12, rel=0.03)  # 6.6 ms
    assert 6e-3 < cost.time_s < 7.5e-3


def test_7b_prefill_2048_on_a100_is_compute_bound():
    cost = prefill_time(A100_80GB, LLAMA_7B, 2048)
    assert cost.bound == "compute"
    # 2 * 6.48e9 layer params * 2048 tokens + causal attention 4 * (2048 * 2049 / 2) * 128 * 32 * 32
    # + one lm_head row 2 * 4096 * 32000: about 27.6 TFLOP, 89 ms at 312 TFLOP/s
    assert cost.flops == pytest.approx(2 * 6.48e9 * 2048 + 4 * 2048 * 2049 / 2 * 128 * 32 * 32, rel=0.01)
    assert cost.time_s == pytest.approx(cost.flops / 312e12)
    assert cost.time_s > 10 * cost.memory_time_s


def test_doubling_decode_batch_barely_raises_time_while_memory_bound():
    t8 = decode_step_time(A100_80GB, LLAMA_7B, 8, 512).time_s
    t16 = decode_step_time(A100_80GB, LLAMA_7B, 16, 512).time_s
    assert t16 / t8 < 1.2
    # past the ridge, time grows in step with the batch
    t512 = decode_step_time(A100_80GB, LLAMA_7B, 512, 1).time_s
    t1024 = decode_step_time(A100_80GB, LLAMA_7B, 1024, 1).time_s
    assert t1024 / t512 == pytest.approx(2, rel=0.05)


def first_compute_bound(cost_of) -> int:
    n = 1
    while cost_of(n).bound == "memory":
        n += 1
    return n


def test_compute_bound_crossover_is_near_the_ridge_point():
    # fp16: a decode step does 2 FLOPs per weight per sequence and reads 2 bytes per weight,
    # so its intensity is about the batch size; context 1 leaves the KV reads out of it
    decode_batch = first_compute_bound(lambda b: decode_step_time(A100_80GB, LLAMA_7B, b, 1))
    prefill_len = first_compute_bound(lambda n: prefill_time(A100_80GB, LLAMA_7B, n))
    for crossover in (decode_batch, prefill_len):
        assert crossover == pytest.approx(A100_80GB.ridge_point, rel=0.1)
    assert first_compute_bound(lambda b: decode_step_time(H100_SXM, LLAMA_7B, b, 1)) > 270


def test_long_context_decode_is_dominated_by_kv_reads():
    cost = decode_step_time(A100_80GB, LLAMA_7B, 32, 4096)
    assert cost.kv_read_bytes == 32 * 2 * GiB
    assert cost.kv_read_bytes > 4 * cost.weight_bytes and cost.bound == "memory"
    gqa = decode_step_time(A100_80GB, LLAMA_7B_GQA, 32, 4096)
    assert gqa.time_s < cost.time_s / 2.5


def test_padding_tokens_cost_like_real_tokens():
    real = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[1024])
    padded = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[1024], padding_tokens=1024)
    assert padded.linear_flops == 2 * real.linear_flops
    assert padded.kv_write_bytes == 2 * real.kv_write_bytes
    assert 1.8 < padded.time_s / real.time_s < 2.0
    assert padded.num_tokens == 2048


def test_chunked_prefill_splits_flops_exactly_but_rereads_weights():
    whole = prefill_time(A100_80GB, LLAMA_7B, 2048)
    first = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[1024])
    second = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[1024], prefill_context=[1024])
    assert first.linear_flops + second.linear_flops == whole.linear_flops
    assert first.attention_flops + second.attention_flops == whole.attention_flops
    assert second.attention_flops > 2 * first.attention_flops  # the second chunk also sees the first
    assert first.weight_bytes + second.weight_bytes == 2 * whole.weight_bytes


def test_mixed_step_and_lm_head_rows():
    mixed = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[100, 50], decode_context_lens=[10, 20, 30])
    assert mixed.num_tokens == 153
    assert mixed.lm_head_flops == 2 * 4096 * 32000 * 5  # one sampled row per sequence
    keys = (100 * 101 // 2) + (50 * 51 // 2) + 60
    assert mixed.attention_flops == 4 * 128 * 32 * 32 * keys


def test_empty_step_and_bad_arguments():
    assert step_time(A100_80GB, LLAMA_7B).time_s == 0.0
    with pytest.raises(ValueError):
        step_time(A100_80GB, LLAMA_7B, prefill_tokens=[10], prefill_context=[0, 0])
    with pytest.raises(ValueError):
        step_time(A100_80GB, LLAMA_7B, decode_context_lens=[0])


def test_step_overhead_is_added_once():
    slow = dataclasses.replace(A100_80GB, step_overhead_s=1e-3)
    base = decode_step_time(A100_80GB, LLAMA_7B, 4, 100)
    assert decode_step_time(slow, LLAMA_7B, 4, 100).time_s == pytest.approx(base.time_s + 1e-3)


def test_max_batch_for_kv():
    # (0.9 * 80e9 - 13.48e9 weight bytes) / 2 GiB per 4096-token sequence = 27.25
    assert max_batch_for_kv(A100_80GB, LLAMA_7B, 4096) == 27
    assert max_batch_for_kv(A100_80GB, LLAMA_7B_GQA, 4096) == 112  # GQA: 4x smaller KV, 4x the batch
    assert max_batch_for_kv(A100_80GB, LLAMA_70B, 4096) == 0  # 138 GB of weights: needs > 1 GPU
    assert max_batch_for_kv(H200, LLAMA_70B, 4096) == 0
    fp32_cpu = dataclasses.replace(A100_80GB, dtype_bytes=torch.float32.itemsize)
    assert max_batch_for_kv(fp32_cpu, LLAMA_7B, 4096) == 10


# --- efficiency factors (chapter 04, section 6) -------------------------------------------------


def test_efficiency_factors_scale_the_roofs_and_add_per_request_cost():
    from minillm.sim.hardware import Hardware

    slow = dataclasses.replace(A100_80GB, mfu=0.5, mbu=0.25, step_overhead_s=1e-3, per_request_overhead_s=2e-4)
    ideal_decode = decode_step_time(A100_80GB, LLAMA_7B, batch=4, context_len=100)
    decode = decode_step_time(slow, LLAMA_7B, batch=4, context_len=100)
    assert decode.memory_time_s == pytest.approx(4 * ideal_decode.memory_time_s)
    assert decode.compute_time_s == pytest.approx(2 * ideal_decode.compute_time_s)
    assert decode.overhead_s == pytest.approx(1e-3 + 4 * 2e-4)  # one fixed cost, four sequences
    assert decode.time_s == pytest.approx(4 * ideal_decode.memory_time_s + 1.8e-3)
    # a prefill of 2 prompts: two sequences, however many tokens
    assert step_time(slow, LLAMA_7B, prefill_tokens=[300, 5]).overhead_s == pytest.approx(1e-3 + 2 * 2e-4)
    assert A100_80GB.is_ideal and not slow.is_ideal
    for bad in (dict(mfu=0.0), dict(mbu=1.5), dict(per_request_overhead_s=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Hardware("x", 1e12, 1e12, 1e9, **bad)


def test_physical_floor_of_7b_on_a100_is_about_7_ms():
    # The seed's floor: ~14 GB of fp16 weights over 2 TB/s, once per decode step at batch 1.
    step = decode_step_time(A100_80GB, LLAMA_7B, batch=1, context_len=512)
    assert step.bound == "memory"
    assert 6e-3 < step.time_s < 7.5e-3


def test_practical_preset_is_the_fit_to_nemo_measurements():
    from minillm.sim.cost_model import batch_latency_s, fit_efficiency
    from minillm.sim.hardware import (
        A100_80GB_PRACTICAL,
        NEMO_LLAMA2_7B_A100_LATENCY_MS,
        NEMO_OUTPUT_TOKENS,
        NEMO_PROMPT_TOKENS,
    )

    fit = fit_efficiency(A100_80GB, LLAMA_7B, NEMO_LLAMA2_7B_A100_LATENCY_MS, NEMO_PROMPT_TOKENS, NEMO_OUTPUT_TOKENS)
    assert fit.max_relative_error < 0.01
    for knob in ("mfu", "mbu", "step_overhead_s", "per_request_overhead_s"):
        assert getattr(fit.hardware, knob) == pytest.approx(getattr(A100_80GB_PRACTICAL, knob)), knob
    for batch, measured_ms in NEMO_LLAMA2_7B_A100_LATENCY_MS.items():
        predicted_ms = 1e3 * batch_latency_s(A100_80GB_PRACTICAL, LLAMA_7B, batch, NEMO_PROMPT_TOKENS, NEMO_OUTPUT_TOKENS)
        assert predicted_ms == pytest.approx(measured_ms, rel=0.01)
    # the ideal roofline is far faster than the measured engine: the floor, not a prediction
    assert batch_latency_s(A100_80GB, LLAMA_7B, 1, 128, 20) < 0.6 * NEMO_LLAMA2_7B_A100_LATENCY_MS[1] / 1e3
    with pytest.raises(ValueError, match="batch"):
        batch_latency_s(A100_80GB, LLAMA_7B, 0, 128, 20)
    with pytest.raises(ValueError, match="measured_ms"):
        fit_efficiency(A100_80GB, LLAMA_7B, {}, 128, 20)
    assert get_hardware("a100-80gb-practical") is A100_80GB_PRACTICAL
