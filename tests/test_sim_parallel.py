"""The simulator's network and parallelism model (minillm/sim/network.py, parallel.py; chapter 12).

The expected numbers are worked out by hand in the comments, from the presets' spec-sheet figures.
"""

import dataclasses

import pytest

from minillm.sim import A100_80GB, H100_SXM, H200, LLAMA_7B, LLAMA_70B, decode_step_time, prefill_time
from minillm.sim.cost_model import weight_bytes_read_per_step
from minillm.sim.expert_parallel import (
    MIXTRAL_8X7B,
    MIXTRAL_8X22B,
    ep_all_to_all_per_layer_s,
    ep_expert_bytes_per_device,
    even_routing,
    load_imbalance,
    moe_layer_time,
    moe_shape_from_hf_config,
    moe_weight_bytes_per_device,
    rank_loads,
)
from minillm.sim.network import (
    INFINIBAND_HDR,
    INFINIBAND_NDR,
    LINK_PRESETS,
    NVLINK3_A100,
    NVLINK4_H100,
    PCIE_GEN4_X16,
    PCIE_GEN5_X16,
    Link,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    get_link,
    reduce_scatter_time_s,
    send_recv_time_s,
)
from minillm.sim.parallel import (
    check_tp,
    compare_layouts,
    kv_heads_per_device,
    layer_params_per_device,
    layout_summary,
    memory_per_device,
    min_tp_to_fit,
    pipeline_bubble_fraction,
    pipeline_timeline,
    pp_decode,
    scaling_stops_at,
    stage_layers,
    tp_decode_scaling,
    tp_step_time,
)

# --- links and collectives ----------------------------------------------------------------------


def test_link_presets_are_the_spec_sheets_per_direction():
    # Spec sheets print both directions: NVLink3 600 GB/s, NVLink4 900 GB/s, PCIe4/5 x16 64/128 GB/s.
    assert NVLINK3_A100.bandwidth_bytes_per_s == 600e9 / 2
    assert NVLINK4_H100.bandwidth_bytes_per_s == 900e9 / 2
    assert PCIE_GEN4_X16.bandwidth_bytes_per_s == 64e9 / 2
    assert PCIE_GEN5_X16.bandwidth_bytes_per_s == 128e9 / 2
    # InfiniBand is quoted per direction in bits: 200 and 400 Gb/s.
    assert INFINIBAND_HDR.bandwidth_bytes_per_s == 200e9 / 8
    assert INFINIBAND_NDR.bandwidth_bytes_per_s == 400e9 / 8
    assert all(link.source for link in LINK_PRESETS.values())
    assert get_link("nvlink4") is NVLINK4_H100 and get_link("PCIe Gen5") is PCIE_GEN5_X16
    with pytest.raises(ValueError, match="ambiguous.*NVLink3"):
        get_link("nvlink")
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        Link("broken", 0.0, 1e-6)


def test_ring_all_reduce_by_hand():
    # 1 GB over 8 GPUs on NVLink4: 2*7 hops of 1 us, plus 2*7/8 * 1e9 B / 450e9 B/s = 3.8889 ms.
    assert all_reduce_time_s(1e9, 8, NVLINK4_H100) == pytest.approx(14e-6 + 1.75 * 1e9 / 450e9)
    assert all_reduce_time_s(1e9, 8, NVLINK4_H100) == pytest.approx(3.9029e-3, rel=1e-4)
    # A decode all-reduce of one 70B token (8192 x 2 bytes) is all latency: 14.06 us, 99.5 % alpha.
    small = all_reduce_time_s(8192 * 2, 8, NVLINK4_H100)
    assert small == pytest.approx(14.0637e-6, rel=1e-4)
    # Two GPUs move half the tensor each way once: 2 alpha + b / bw.
    assert all_reduce_time_s(64e6, 2, PCIE_GEN4_X16) == pytest.approx(2 * 2e-6 + 64e6 / 32e9)
    assert all_reduce_time_s(1e9, 1, NVLINK4_H100) == 0.0


def test_other_collectives_by_hand():
    # all-gather of a 1 GB result on 4 GPUs over PCIe Gen5: 3 alpha + 3/4 * 1e9 / 64e9 = 11.724 ms.
    assert all_gather_time_s(1e9, 4, PCIE_GEN5_X16) == pytest.approx(6e-6 + 0.75 * 1e9 / 64e9)
    assert reduce_scatter_time_s(1e9, 4, PCIE_GEN5_X16) == all_gather_time_s(1e9, 4, PCIE_GEN5_X16)
    # An all-reduce is a reduce-scatter then an all-gather.
    assert all_reduce_time_s(3e8, 4, NVLINK3_A100) == pytest.approx(2 * reduce_scatter_time_s(3e8, 4, NVLINK3_A100))
    # all-to-all on 2 GPUs: half of the send buffer crosses; NDR 50 GB/s.
    assert all_to_all_time_s(1e8, 2, INFINIBAND_NDR) == pytest.approx(3e-6 + 0.5 * 1e8 / 50e9)
    assert send_recv_time_s(1e6, INFINIBAND_HDR) == pytest.approx(3e-6 + 1e6 / 25e9)
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        all_reduce_time_s(1.0, 0, NVLINK4_H100)


# --- tensor parallel ----------------------------------------------------------------------------


def test_tp1_is_the_single_device_step():
    single = decode_step_time(H100_SXM, LLAMA_7B, 8, 1024)
    tp1 = tp_step_time(H100_SXM, LLAMA_7B, 1, NVLINK4_H100, decode_context_lens=[1024] * 8)
    assert tp1.comm_s == 0 and tp1.num_all_reduces == 0
    assert tp1.time_s == pytest.approx(single.time_s)
    assert tp1.weight_bytes_per_device == weight_bytes_read_per_step(LLAMA_7B, 2)
    assert layer_params_per_device(LLAMA_7B, 1) == LLAMA_7B.params_per_layer


def test_tp_counts_two_all_reduces_per_layer_of_hidden_activations():
    cost = tp_step_time(H100_SXM, LLAMA_70B, 4, NVLINK4_H100, decode_context_lens=[2048] * 16)
    assert cost.num_all_reduces == 2 * 80 + 1  # o_proj and down_proj per layer, plus the embedding
    assert cost.all_reduce_bytes == 16 * 8192 * 2  # 16 tokens x hidden x fp16
    per = all_reduce_time_s(16 * 8192 * 2, 4, NVLINK4_H100)
    logits = all_gather_time_s(16 * 32000 * 2, 4, NVLINK4_H100)
    assert cost.comm_s == pytest.approx(161 * per + logits)


def test_tp_with_a_free_network_scales_perfectly():
    # No latency and (almost) infinite bandwidth: what is left is the split of FLOPs and bytes.
    free = Link("free", 1e30, 0.0)
    rows = tp_decode_scaling(A100_80GB, LLAMA_7B, free, batch=1, context_len=1024, tp_degrees=(1, 2, 4, 8))
    norms_bytes = (32 * 2 * 4096 + 4096) * 2  # RMSNorm gains: every rank reads them whole
    for row in rows:  # batch 1 is memory-bound: time = bytes / 2.039 TB/s
        assert row.comm_s < 1e-20 and row.memory_s > row.compute_s
        expected = rows[0].time_s / row.tp + norms_bytes * (1 - 1 / row.tp) / 2.039e12
        assert row.time_s == pytest.approx(expected, rel=1e-9)


def test_tp_scaling_stops_when_communication_outweighs_compute():
    # 7B at batch 1 on A100s over PCIe Gen4: step time 6.74 -> 3.65 -> 2.50 ms at TP 1, 2, 4; at
    # TP 8 the 65 all-reduces (14 alpha = 28 us each) cost 1.86 ms, more than the 0.85 ms roofline.
    rows = tp_decode_scaling(A100_80GB, LLAMA_7B, PCIE_GEN4_X16, batch=1, context_len=1024)
    times = [r.time_s for r in rows]
    assert times[0] > times[1] > times[2] < times[3]
    assert scaling_stops_at(rows) == 4
    assert not rows[2].comm_bound and rows[3].comm_bound
    assert rows[3].comm_s == pytest.approx(65 * (14 * 2e-6 + 1.75 * 8192 / 32e9) + 7 * 2e-6 + 7 / 8 * 64000 / 32e9)
    # 70B on H100s over NVLink4 still gains at TP 8 (41 -> 7.4 ms a token), and TP 16 gains nothing.
    rows = tp_decode_scaling(H100_SXM, LLAMA_70B, NVLINK4_H100, batch=1, context_len=1024, tp_degrees=(1, 2, 4, 8, 16))
    assert scaling_stops_at(rows) == 8
    assert rows[0].time_s / rows[3].time_s == pytest.approx(5.55, abs=0.05)  # 8 GPUs, 5.5x faster
    assert rows[4].time_s > rows[3].time_s and rows[4].comm_bound


def test_tp_splits_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="64 query heads cannot be split over tensor parallel size 3"):
        check_tp(LLAMA_70B, 3)
    odd = dataclasses.replace(LLAMA_7B, name="odd", num_kv_heads=6, num_heads=24)
    with pytest.raises(ValueError, match="6 KV heads cannot be split or replicated over tensor parallel size 4"):
        check_tp(odd, 4)
    # 70B has 8 KV heads: TP 16 replicates them (1 per device), TP 4 splits them (2 per device).
    assert kv_heads_per_device(LLAMA_70B, 16) == 1 and kv_heads_per_device(LLAMA_70B, 4) == 2


# --- memory: which model fits where ------------------------------------------------------------


def test_70b_does_not_fit_one_a100_but_fits_tp2():
    # Llama-2-70B: 68.98 B parameters, 137.95 GB in fp16 > 80 GB (and > 72 GB at utilization 0.9).
    one = memory_per_device(A100_80GB, LLAMA_70B, tp=1)
    assert one.weight_bytes == pytest.approx(137.953e9, rel=1e-5)
    assert not one.fits and one.kv_tokens == 0
    # TP 2, per device: 80 layers x (8192*(4096 + 2*512) + 4096*8192 + 3*8192*14336 + 2*8192)
    # + half the embedding + half the lm_head + the final norm.
    layer = 8192 * (4096 + 2 * 512) + 4096 * 8192 + 3 * 8192 * 14336 + 2 * 8192
    params = 80 * layer + 2 * 16000 * 8192 + 8192
    two = memory_per_device(A100_80GB, LLAMA_70B, tp=2)
    assert two.weight_bytes == 2 * params == 68_977_967_104
    assert two.fits
    # KV per token on each device: 2 x 80 layers x 4 KV heads x 128 x 2 bytes = 163,840 B.
    assert two.kv_bytes_per_token == 2 * 80 * 4 * 128 * 2 == 163_840
    # Room for KV at 90 %: 72e9 - 68.978e9 = 3.02 GB -> 18,445 tokens: fits, but barely (a few
    # 4k-token requests). At 100 % utilization: 11.02 GB -> 67,273 tokens.
    assert two.kv_tokens == (72_000_000_000 - 68_977_967_104) // 163_840 == 18_445
    assert memory_per_device(A100_80GB, LLAMA_70B, tp=2, gpu_memory_utilization=1.0).kv_tokens == 67_273
    # 32 concurrent 4096-token requests need TP 4 on A100-80GB, TP 2 on H200 (141 GB).
    assert min_tp_to_fit(A100_80GB, LLAMA_70B, min_kv_tokens=32 * 4096) == 4
    assert min_tp_to_fit(H200, LLAMA_70B, min_kv_tokens=32 * 4096) == 2
    assert min_tp_to_fit(A100_80GB, LLAMA_7B) == 1


def test_tp2_halves_memory_per_device():
    one, two = (memory_per_device(A100_80GB, LLAMA_7B, tp=tp) for tp in (1, 2))
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    # Half of everything but the RMSNorm gains, which every rank keeps whole: 32 x 2 x 4096 + 4096.
    assert two.weight_bytes == one.weight_bytes / 2 + (32 * 2 * 4096 + 4096) * 2 / 2
    assert two.kv_tokens > 2 * one.kv_tokens  # the KV room more than doubles: weights shrank too


def test_pipeline_stages_split_layers_as_vllm_get_pp_indices():
    # vLLM gives the extra layers to the stages before the last, counting back from the second-to-last.
    assert stage_layers(4, 3) == [1, 2, 1]
    assert stage_layers(5, 3) == [2, 2, 1]
    assert stage_layers(32, 3) == [11, 11, 10]
    assert stage_layers(10, 4) == [2, 3, 3, 2]
    for num_layers in range(1, 25):
        for pp in range(1, num_layers + 1):
            counts = stage_layers(num_layers, pp)
            base, extra = divmod(num_layers, pp)
            assert sum(counts) == num_layers and len(counts) == pp
            assert counts[-1] == base  # the last stage (it also holds the lm_head) never takes an extra one
            # the stages holding one more are the `extra` ones just before the last
            assert [i for i, c in enumerate(counts) if c == base + 1] == list(range(pp - 1 - extra, pp - 1))


def test_the_simulator_splits_layers_as_the_engine_does():
    from minillm.distributed.layout import stage_layers as engine_stage_layers

    for num_layers, pp in ((4, 3), (80, 3), (7, 4), (32, 8)):
        assert stage_layers(num_layers, pp) == [len(engine_stage_layers(num_layers, pp, s)) for s in range(pp)]


def test_pipeline_stages_split_memory():
    assert stage_layers(3, 2) == [2, 1]
    assert stage_layers(80, 3) == [27, 27, 26]
    with pytest.raises(ValueError, match="pipeline parallel size 5 must be between 1 and the number of layers \\(4\\)"):
        stage_layers(4, 5)
    # PP 2 on 70B: stage 0 holds 40 layers + the embedding, stage 1 40 layers + the final norm +
    # the lm_head (the fullest, by the norm's 8192); each device keeps the KV of its 40 layers.
    pp2 = memory_per_device(A100_80GB, LLAMA_70B, pp=2)
    layer = LLAMA_70B.params_per_layer
    assert pp2.weight_bytes == (40 * layer + 32000 * 8192 + 8192) * 2
    assert pp2.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2


# --- pipeline parallel ----------------------------------------------------------------------------


def test_bubble_formula():
    assert pipeline_bubble_fraction(4, 1) == 0.75  # one micro-batch: 3 of 4 beats idle
    assert pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline_bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert pipeline_bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        pipeline_bubble_fraction(2, 0)


def test_pipeline_timeline_is_fill_and_drain():
    # 3 stages, 2 micro-batches: stage s runs micro-batch j in beat s + j; 4 beats, each stage busy 2.
    assert pipeline_timeline(3, 2) == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 2), (2, 0, 2), (2, 1, 3)]
    for p, m in ((4, 1), (4, 4), (2, 8)):
        cells = pipeline_timeline(p, m)
        beats = max(beat for _, _, beat in cells) + 1
        assert beats == m + p - 1
        assert len({(s, beat) for s, _, beat in cells}) == p * m  # a stage does one thing per beat
        assert 1 - p * m / (p * beats) == pytest.approx(pipeline_bubble_fraction(p, m))
        # a micro-batch visits the stages in order, one beat apart
        assert all(beat == s + j for s, j, beat in cells)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        pipeline_timeline(2, 0)


def test_pp_does_not_cut_latency_but_micro_batches_fill_the_pipe():
    single = decode_step_time(H100_SXM, LLAMA_70B, 64, 1024).time_s
    one_stage = pp_decode(H100_SXM, LLAMA_70B, 1, NVLINK4_H100, batch=64, context_len=1024)
    assert one_stage.fill_drain_s == one_stage.steady_inter_token_s == pytest.approx(single)
    # 4 stages, one micro-batch: 4 beats of 20 layers each (+ lm_head on the slowest), plus hops.
    pp4 = pp_decode(H100_SXM, LLAMA_70B, 4, NVLINK4_H100, batch=64, context_len=1024)
    assert pp4.fill_drain_s > single
    assert pp4.send_s == pytest.approx(1e-6 + 64 * 8192 * 2 / 450e9)
    # With 4 micro-batches of 16 circulating, the pipe is full: more tokens per second than one batch of 64.
    pp4m4 = pp_decode(H100_SXM, LLAMA_70B, 4, NVLINK4_H100, batch=64, context_len=1024, num_microbatches=4)
    assert pp4m4.fill_drain_idle_fraction == pytest.approx(3 / 7)
    assert pp4m4.steady_idle_fraction < 0.01  # only the hop: every stage has a micro-batch every beat
    assert pp4m4.steady_tokens_per_s > 1.1 * pp4.steady_tokens_per_s
    # ... but a stage re-reads its weights per micro-batch: a beat is not 4x shorter.
    assert pp4m4.stage_s > 0.85 * pp4.stage_s
    with pytest.raises(ValueError, match="batch 64 must split evenly into num_microbatches=3"):
        pp_decode(H100_SXM, LLAMA_70B, 4, NVLINK4_H100, batch=64, context_len=1024, num_microbatches=3)


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 2), (4, 2), (4, 4), (8, 8), (8, 16)])
def test_each_idle_share_matches_the_tokens_per_second_beside_it(pp, m):
    """A stage computes micro/stage_s tokens per second while busy; so each regime's tokens/s must be
    its busy share times that (the steady idle column must not be the fill-and-drain bubble)."""
    cost = pp_decode(H100_SXM, LLAMA_70B, pp, INFINIBAND_NDR, batch=64, context_len=1024, num_microbatches=m)
    micro = 64 // m
    assert cost.steady_tokens_per_s == pytest.approx((1 - cost.steady_idle_fraction) * micro / cost.stage_s)
    assert cost.fill_drain_tokens_per_s == pytest.approx((1 - cost.fill_drain_idle_fraction) * micro / cost.beat_s)
    if m >= pp:  # steady: every stage has work every beat; fill and drain: the (p-1)/(m+p-1) bubble
        assert cost.steady_idle_fraction == pytest.approx(cost.send_s / cost.beat_s)
    else:
        assert cost.steady_idle_fraction > (pp - m) / pp
    assert cost.fill_drain_idle_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    if m > 1:  # steady decoding never pays the fill and the drain (with one micro-batch there is none to pay)
        assert cost.steady_tokens_per_s > cost.fill_drain_tokens_per_s
    else:
        assert cost.steady_tokens_per_s == pytest.approx(cost.fill_drain_tokens_per_s)


def test_one_stage_refuses_micro_batches():
    """With PP 1 there is no stage to overlap: cutting the batch would only re-read the weights (the
    playground's TP 8 at batch 32 went from 8.1 to 30.3 ms per token with 4 micro-batches)."""
    with pytest.raises(ValueError, match="num_microbatches=4 with pipeline_parallel_size=1"):
        pp_decode(H100_SXM, LLAMA_70B, 1, NVLINK4_H100, batch=32, context_len=1024, num_microbatches=4, tp=8)
    with pytest.raises(ValueError, match="micro-batches need pipeline_parallel_size > 1"):
        layout_summary(H100_SXM, LLAMA_70B, tp=8, tp_link=NVLINK4_H100, num_seqs=32, num_microbatches=4)
    # the default is one micro-batch per stage: one, for TP 8
    tp8 = layout_summary(H100_SXM, LLAMA_70B, tp=8, tp_link=NVLINK4_H100, num_seqs=32)
    assert tp8.num_microbatches == 1
    assert tp8.tpot_s == pytest.approx(tp_step_time(H100_SXM, LLAMA_70B, 8, NVLINK4_H100,
                                                    decode_context_lens=[1024] * 32).time_s)
    assert 1e3 * tp8.tpot_s == pytest.approx(8.1, abs=0.05)


# --- expert parallel -------------------------------------------------------------------------------


def test_mixtral_parameter_counts():
    # Mistral AI's announcement: 46.7 B parameters in total, 12.9 B used per token.
    assert MIXTRAL_8X7B.num_params == pytest.approx(46.7e9, rel=2e-3)
    assert MIXTRAL_8X7B.active_params == pytest.approx(12.9e9, rel=2e-3)


def test_bundled_moe_shape_counts_its_parameters():
    from pathlib import Path

    moe = moe_shape_from_hf_config(Path(__file__).resolve().parents[1] / "models" / "minillm-moe")
    assert (moe.num_experts, moe.top_k, moe.shape.tied_embeddings) == (4, 2, True)
    # transformers counts 484,160 parameters (models/README.md): embedding 4096 x 64, per layer
    # attention 64 x (64 + 2 x 32) + 64 x 64, 4 experts of 3 x 64 x 128, router 4 x 64, 2 norms.
    assert moe.num_params == 4096 * 64 + 2 * (64 * 128 + 64 * 64 + 4 * 3 * 64 * 128 + 4 * 64 + 2 * 64) + 64 == 484_160
    assert moe.active_params == 484_160 - 2 * 2 * 3 * 64 * 128
    with pytest.raises(ValueError, match="no num_local_experts"):
        moe_shape_from_hf_config(Path(__file__).resolve().parents[1] / "models" / "minillm-target")


def test_ep_all_to_all_and_expert_memory_by_hand():
    # 256 tokens per device, top-2, hidden 4096, fp16: 4 MiB sent per all-to-all; over 2 ranks
    # half of it crosses NVLink4: 1 us + 2,097,152 B / 450 GB/s = 5.66 us; dispatch + combine.
    per_layer = ep_all_to_all_per_layer_s(MIXTRAL_8X7B, 256, 2, NVLINK4_H100)
    assert per_layer == pytest.approx(2 * (1e-6 + 0.5 * 256 * 2 * 4096 * 2 / 450e9))
    assert ep_all_to_all_per_layer_s(MIXTRAL_8X7B, 256, 1, NVLINK4_H100) == 0.0
    # Experts per device: 32 layers x 4 experts x 3 x 4096 x 14336 x 2 bytes = 45.1 GB at EP 2.
    assert ep_expert_bytes_per_device(MIXTRAL_8X7B, 2) == 32 * 4 * 3 * 4096 * 14336 * 2
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over expert parallel size 3"):
        ep_expert_bytes_per_device(MIXTRAL_8X7B, 3)


def test_mixtral_8x22b_and_moe_memory_per_device():
    # Mistral AI: 141 B parameters, 39 B active.
    assert MIXTRAL_8X22B.num_params == pytest.approx(141e9, rel=5e-3)
    assert MIXTRAL_8X22B.active_params == pytest.approx(39e9, rel=5e-3)
    # One device holds everything.
    assert moe_weight_bytes_per_device(MIXTRAL_8X7B, 1) == MIXTRAL_8X7B.num_params * 2
    # 8x7B on 4 devices with EP: per layer q/o 4096 x 1024 each, k/v 4096 x 256 each (2 of the 8 KV
    # heads), 2 norms, the router 8 x 4096; 2 whole experts of 3 x 4096 x 14336; a quarter of the
    # embedding and of the lm_head; the final norm.
    layer = 2 * 4096 * 1024 + 2 * 4096 * 256 + 2 * 4096 + 8 * 4096 + 2 * 3 * 4096 * 14336
    params = 32 * layer + 2 * 8000 * 4096 + 4096
    assert moe_weight_bytes_per_device(MIXTRAL_8X7B, 4) == 2 * params
    # Which fits where (fp16, 90 % of 80 GB = 72 GB for weights and KV): 8x7B needs 2 H100s,
    # 8x22B 4 (70.3 GB each: fits, with 1.7 GB left for KV), and 8 to leave room for a real cache.
    fits = {m.shape.name: [n for n in (1, 2, 4, 8) if moe_weight_bytes_per_device(m, n) < 0.9 * H100_SXM.mem_capacity_bytes]
            for m in (MIXTRAL_8X7B, MIXTRAL_8X22B)}
    assert fits == {"mixtral-8x7b": [2, 4, 8], "mixtral-8x22b": [4, 8]}
    with pytest.raises(ValueError, match="48 query heads cannot be split over tensor parallel size 32"):
        moe_weight_bytes_per_device(MIXTRAL_8X22B, 32)
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over expert parallel size 16"):
        moe_weight_bytes_per_device(MIXTRAL_8X7B, 16)


def test_moe_layer_sliced_vs_whole_experts_by_hand():
    expert_bytes = 3 * 4096 * 14336 * 2  # one Mixtral 8x7B expert in fp16: 352 MB
    ar = all_reduce_time_s(4096 * 2, 8, NVLINK4_H100)  # one token's hidden vector over 8 devices
    # One decode token picks 2 of 8 experts. Sliced (TP 8): every device reads 1/8 of both.
    one_token = [1, 0, 0, 1, 0, 0, 0, 0]
    tp = moe_layer_time(H100_SXM, MIXTRAL_8X7B, 8, NVLINK4_H100, one_token, expert_parallel=False)
    assert tp.weight_bytes == 2 * expert_bytes / 8 and tp.rows == 2 / 8
    assert tp.memory_s == pytest.approx(2 * expert_bytes / 8 / 3.35e12)
    assert tp.time_s == pytest.approx(tp.memory_s + ar)
    # Whole (EP 8): devices 0 and 3 each read one whole expert: the layer takes 4x the memory time.
    ep = moe_layer_time(H100_SXM, MIXTRAL_8X7B, 8, NVLINK4_H100, one_token, expert_parallel=True)
    assert ep.weight_bytes == expert_bytes and ep.rows == 1
    assert ep.memory_s == pytest.approx(4 * tp.memory_s) and ep.comm_s == tp.comm_s
    # Even routing of 64 tokens hits every expert: the same bytes and rows per device either way.
    even = even_routing(MIXTRAL_8X7B, 64)
    assert even == [16.0] * 8
    a, b = (moe_layer_time(H100_SXM, MIXTRAL_8X7B, 8, NVLINK4_H100, even, expert_parallel=ep) for ep in (False, True))
    assert a.time_s == pytest.approx(b.time_s) and a.weight_bytes == b.weight_bytes == expert_bytes
    # A compute-bound prefill with skewed routing on 2 devices: the busiest EP rank computes
    # 3/4 of the rows instead of half, 1.5x the FLOPs.
    skewed = [1536, 1536, 1536, 1536, 512, 512, 512, 512]  # 4096 tokens x top 2
    a, b = (moe_layer_time(H100_SXM, MIXTRAL_8X7B, 2, NVLINK4_H100, skewed, expert_parallel=ep) for ep in (False, True))
    assert (a.rows, b.rows) == (4096, 6144)
    assert a.compute_s == pytest.approx(2 * 4096 * (3 * 4096 * 14336) / 989e12)
    assert b.compute_s == pytest.approx(1.5 * a.compute_s) and b.compute_s > b.memory_s
    with pytest.raises(ValueError, match="tokens_per_expert has 4 entries, the model 8 experts"):
        moe_layer_time(H100_SXM, MIXTRAL_8X7B, 2, NVLINK4_H100, [1, 1, 1, 1], expert_parallel=True)
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over expert parallel size 3"):
        moe_layer_time(H100_SXM, MIXTRAL_8X7B, 3, NVLINK4_H100, even, expert_parallel=True)


def test_rank_loads_and_imbalance():
    # The bundled MoE's layer-0 histogram (models/README.md) on 2 ranks: experts 0-1 and 2-3.
    assert rank_loads([18, 11, 5, 12], 2) == [29, 17]
    assert load_imbalance([18, 11, 5, 12], 2) == pytest.approx(29 / 23)
    assert load_imbalance([5, 5, 5, 5], 4) == 1.0
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over expert parallel size 3"):
        rank_loads([1, 2, 3, 4], 3)


# --- a whole layout (the playground's numbers) ------------------------------------------------------


def test_layout_summary_ttft_and_tpot_per_kind_of_parallelism():
    def summary(tp, pp, **kw):
        return layout_summary(H100_SXM, LLAMA_70B, tp=tp, pp=pp, tp_link=NVLINK4_H100, num_seqs=64, **kw)

    single = summary(1, 1)
    assert single.ttft_s == pytest.approx(prefill_time(H100_SXM, LLAMA_70B, 512).time_s)
    assert single.tpot_s == pytest.approx(decode_step_time(H100_SXM, LLAMA_70B, 64, 1024).time_s)
    assert not single.fits  # 138 GB of weights on an 80 GB H100
    tp8, pp8, tp4pp2 = summary(8, 1), summary(1, 8), summary(4, 2)
    assert tp8.num_devices == pp8.num_devices == tp4pp2.num_devices == 8
    assert tp8.fits and pp8.fits and tp4pp2.fits
    # TP shortens both latencies (4.3x TTFT, 5.4x TPOT on 8 GPUs); PP shortens neither much: each
    # token still crosses all 80 layers, and each stage re-reads its weights per micro-batch.
    assert single.ttft_s / tp8.ttft_s == pytest.approx(4.34, abs=0.05)
    assert single.tpot_s / tp8.tpot_s == pytest.approx(5.35, abs=0.05)
    assert pp8.ttft_s >= single.ttft_s
    assert pp8.tpot_s > 0.85 * single.tpot_s
    assert tp8.tpot_s < tp4pp2.tpot_s < pp8.tpot_s
    # Decode is weight-bound, so cutting one batch of 64 into 8 micro-batches gains little (+13 %):
    # every micro-batch re-reads the stage's weights. PP's throughput comes from keeping 8 full
    # batches in flight (vLLM's virtual engines; the KV room PP frees pays for them): 8x the tokens/s
    # at the same TPOT.
    one = pp_decode(H100_SXM, LLAMA_70B, 8, NVLINK4_H100, batch=64, context_len=1024, num_microbatches=1)
    assert pp8.throughput_tokens_per_s / one.steady_tokens_per_s == pytest.approx(1.13, abs=0.01)
    eight = pp_decode(H100_SXM, LLAMA_70B, 8, NVLINK4_H100, batch=8 * 64, context_len=1024, num_microbatches=8)
    assert eight.steady_inter_token_s == pytest.approx(one.steady_inter_token_s)
    assert eight.steady_tokens_per_s == pytest.approx(8 * one.steady_tokens_per_s)
    assert memory_per_device(H100_SXM, LLAMA_70B, pp=8).kv_tokens > 8 * 64 * 1024  # and their KV fits


def test_layout_summary_takes_the_total_and_data_parallel_splits_it():
    one = layout_summary(H100_SXM, LLAMA_7B, tp=1, tp_link=NVLINK4_H100, num_seqs=32)
    four = layout_summary(H100_SXM, LLAMA_7B, tp=1, tp_link=NVLINK4_H100, num_seqs=4 * 32, dp=4)
    assert (four.num_devices, four.dp, four.seqs_per_replica) == (4, 4, 32)
    assert four.throughput_tokens_per_s == pytest.approx(4 * one.throughput_tokens_per_s)
    assert (four.ttft_s, four.tpot_s, four.weight_bytes_per_device, four.kv_tokens_per_device) == (
        one.ttft_s, one.tpot_s, one.weight_bytes_per_device, one.kv_tokens_per_device)
    # At equal work (128 sequences on 4 devices) TP 4 reads each weight once per step where 4
    # replicas read them 4 times: more tokens per second (18,953 against 14,100) and a shorter TPOT.
    tp4 = layout_summary(H100_SXM, LLAMA_7B, tp=4, tp_link=NVLINK4_H100, num_seqs=128)
    assert tp4.tpot_s < four.tpot_s
    assert tp4.throughput_tokens_per_s == pytest.approx(18953, rel=1e-3)
    assert four.throughput_tokens_per_s == pytest.approx(14100, rel=1e-3)
    with pytest.raises(ValueError, match="data parallel size must be >= 1, got 0"):
        layout_summary(H100_SXM, LLAMA_7B, tp_link=NVLINK4_H100, dp=0)
    with pytest.raises(ValueError, match="num_seqs=30 .* must be >= 1 and split evenly over data parallel size 4"):
        layout_summary(H100_SXM, LLAMA_7B, tp_link=NVLINK4_H100, num_seqs=30, dp=4)


CHAPTER_12_LAYOUTS = {"TP 8": dict(tp=8), "PP 8": dict(pp=8), "TP 4 x PP 2": dict(tp=4, pp=2),
                      "TP 2 x DP 4": dict(tp=2, dp=4), "TP 4 x DP 2": dict(tp=4, dp=2)}


def test_compare_layouts_at_equal_work_ranks_tp8_first_for_70b():
    """Chapter 12's table: 64 sequences in all on 8 H100s. Weight-bound decode: replicas and micro-batches
    both multiply the weight reads, so the one layout that reads each weight once per step wins."""
    rows = compare_layouts(H100_SXM, LLAMA_70B, CHAPTER_12_LAYOUTS, num_seqs=64, num_devices=8,
                           tp_link=NVLINK4_H100, pp_link=INFINIBAND_NDR)
    assert all(r.num_seqs == 64 and r.num_devices == 8 and r.holds(1024) for r in rows.values())
    ranked = sorted(rows, key=lambda n: -rows[n].throughput_tokens_per_s)
    assert ranked == ["TP 8", "TP 4 x DP 2", "TP 4 x PP 2", "TP 2 x DP 4", "PP 8"]
    assert rows["TP 8"].throughput_tokens_per_s == pytest.approx(7227, rel=1e-3)
    assert rows["TP 2 x DP 4"].throughput_tokens_per_s == pytest.approx(2945, rel=1e-3)
    assert min(rows, key=lambda n: rows[n].ttft_s) == "TP 8"
    with pytest.raises(ValueError, match="layout 'TP 4' uses 4 devices, not 8"):
        compare_layouts(H100_SXM, LLAMA_70B, {"TP 4": dict(tp=4)}, num_seqs=64, num_devices=8, tp_link=NVLINK4_H100)
    # Each row says which decode regime it prices: steady decoding (as served) for the throughput, and
    # beside it one trip of the same sequences (fill and drain). Without PP the two are one and the same;
    # with PP the trip pays the (p - 1) / (m + p - 1) bubble: PP 8 at 8 micro-batches 1,490 -> 794 tokens/s.
    for r in rows.values():
        if r.pp == 1:
            assert r.num_microbatches == 1 and r.steady_idle_fraction == r.fill_drain_idle_fraction == 0
            assert r.fill_drain_tokens_per_s == pytest.approx(r.throughput_tokens_per_s)
        else:
            assert r.num_microbatches == r.pp and r.steady_idle_fraction < 0.01
            assert r.fill_drain_idle_fraction == pytest.approx((r.pp - 1) / (2 * r.pp - 1))
            assert r.fill_drain_tokens_per_s < 0.7 * r.throughput_tokens_per_s
    assert rows["PP 8"].throughput_tokens_per_s == pytest.approx(1490, rel=1e-3)
    assert rows["PP 8"].fill_drain_tokens_per_s == pytest.approx(794, rel=1e-3)
    # TP 2 x DP 4 holds 18,445 KV tokens per device: 16 sequences of 1,024, not 32 of them
    with pytest.raises(ValueError, match="layout 'TP 2 x DP 4': a device holds 18,445 KV tokens, fewer than its "
                                         "replica's 32 sequences x 1024 tokens"):
        compare_layouts(H100_SXM, LLAMA_70B, {"TP 2 x DP 4": dict(tp=2, dp=4)}, num_seqs=128, num_devices=8,
                        tp_link=NVLINK4_H100)
