"""Parallelism per phase and layer-wise KV streaming on the simulator (chapter 13).

minillm/sim/instance_layout.py (an instance's TP x PP), phase_layouts.py (goodput per GPU of prefill
layout x decode layout), kv_streaming.py (layer i's KV sent during layer i + 1's prefill).
"""

import dataclasses

import pytest

from minillm.metrics import SLO
from minillm.sim import A100_80GB, LLAMA_7B, decode_step_time, prefill_time
from minillm.sim.disagg import simulate_colocated, simulate_disaggregated
from minillm.sim.goodput import at_rate
from minillm.sim.hardware import A100_80GB_PRACTICAL
from minillm.sim.instance_layout import InstanceLayout, deal_to_virtual_engines
from minillm.sim.kv_streaming import stream_kv_by_layer
from minillm.sim.network import INFINIBAND_HDR, NVLINK3_A100, Link
from minillm.sim.parallel import memory_per_device, tp_step_time
from minillm.sim.phase_layouts import best_pairing, compare_phase_layouts
from minillm.traces.synthetic import make_trace

# --- one instance on several GPUs --------------------------------------------------------------------


def test_one_gpu_layout_is_the_plain_cost_model():
    one = InstanceLayout()
    assert one.name == "TP 1" and one.num_gpus == 1
    got = one.step_cost(A100_80GB, LLAMA_7B, decode_context_lens=[512] * 8)
    assert got == decode_step_time(A100_80GB, LLAMA_7B, 8, 512)
    assert one.kv_tokens_per_engine(A100_80GB, LLAMA_7B) == memory_per_device(A100_80GB, LLAMA_7B).kv_tokens


def test_tp_step_is_chapter_12s_and_pp_step_crosses_every_stage():
    tp2, pp2 = InstanceLayout(tp=2), InstanceLayout(pp=2)
    assert (tp2.name, pp2.name, InstanceLayout(tp=2, pp=2).name) == ("TP 2", "PP 2", "TP 2 x PP 2")
    tp = tp2.step_cost(A100_80GB, LLAMA_7B, prefill_tokens=[1024])
    assert tp.time_s == pytest.approx(tp_step_time(A100_80GB, LLAMA_7B, 2, NVLINK3_A100, prefill_tokens=[1024]).time_s)
    # PP 2: 16 + 16 layers one after the other: the one-GPU time plus one hop of 1024 hidden vectors
    pp = pp2.step_cost(A100_80GB, LLAMA_7B, prefill_tokens=[1024])
    one = prefill_time(A100_80GB, LLAMA_7B, 1024).time_s
    assert pp.time_s == pytest.approx(one + NVLINK3_A100.message_time_s(1024 * 4096 * 2))
    assert tp.time_s < 0.6 * one < pp.time_s  # TP shortens a prefill, PP does not
    # uneven stages: 32 layers on 3 stages are 11, 11, 10, so a step costs 3 x 11 layers
    pp3 = InstanceLayout(pp=3).step_cost(A100_80GB, LLAMA_7B, decode_context_lens=[100])
    padded = dataclasses.replace(LLAMA_7B, num_layers=33)
    assert pp3.time_s == pytest.approx(decode_step_time(A100_80GB, padded, 1, 100).time_s
                                       + 2 * NVLINK3_A100.message_time_s(4096 * 2))


def test_pp_shares_its_kv_among_virtual_engines_and_deals_requests_in_turn():
    pp2 = InstanceLayout(pp=2)
    per_device = memory_per_device(A100_80GB, LLAMA_7B, pp=2).kv_tokens
    assert pp2.kv_tokens_per_engine(A100_80GB, LLAMA_7B) == per_device // 2
    assert deal_to_virtual_engines(list("abcde"), pp2) == [["a", "c", "e"], ["b", "d"]]
    with pytest.raises(ValueError, match="tp >= 1 and pp >= 1"):
        InstanceLayout(pp=0)
    with pytest.raises(ValueError, match="32 query heads cannot be split over tensor parallel size 3"):
        InstanceLayout(tp=3).check(LLAMA_7B)
    with pytest.raises(ValueError, match="padded batches"):
        InstanceLayout(tp=2).step_cost(A100_80GB, LLAMA_7B, prefill_tokens=[8], padding_tokens=4)


TRACE = make_trace(24, seed=2, vocab_size=32000, rate_per_s=4.0, prompt_len=("uniform", 800, 1600),
                   output_len=("uniform", 8, 40), max_prompt_len=4096)


def test_layouts_change_who_is_fast_in_a_colocated_and_a_disaggregated_run():
    burst = at_rate(TRACE, 200.0)
    one = simulate_colocated(burst, hardware=A100_80GB_PRACTICAL)
    tp2 = simulate_colocated(burst, hardware=A100_80GB_PRACTICAL, num_gpus=2, layout=InstanceLayout(tp=2))
    assert tp2.num_gpus == 2
    assert tp2.summary.ttft.median_ms < one.summary.ttft.median_ms
    with pytest.raises(ValueError, match="num_gpus=3 is not a whole number of TP 2 instances"):
        simulate_colocated(burst, num_gpus=3, layout=InstanceLayout(tp=2))
    pd = simulate_disaggregated(burst, hardware=A100_80GB_PRACTICAL, prefill_layout=InstanceLayout(pp=2),
                                decode_layout=InstanceLayout(tp=2))
    assert pd.num_gpus == 4
    # the KV leaves the prefill instance's 2 GPUs at once: half the bytes per link
    r = burst.requests[0]
    assert pd.transfer_s[0] == pytest.approx(NVLINK3_A100.message_time_s(r.prompt_len * 2**19 / 2))
    assert all(m.num_output_tokens == q.max_tokens for m, q in zip(pd.requests, burst))


def test_compare_phase_layouts_prices_every_pairing_per_gpu():
    layouts = (InstanceLayout(), InstanceLayout(tp=2))
    rows = compare_phase_layouts(TRACE, name="t", layouts=layouts, hardware=A100_80GB_PRACTICAL,
                                 slo=SLO(ttft_ms=400, tpot_ms=50),
                                 rel_tol=0.1)
    assert [(r.prefill, r.decode, r.num_gpus) for r in rows] == [
        ("TP 1", "TP 1", 2), ("TP 1", "TP 2", 3), ("TP 2", "TP 1", 3), ("TP 2", "TP 2", 4)]
    assert all(r.per_gpu == pytest.approx(r.goodput / r.num_gpus) and r.goodput > 0 for r in rows)
    # a tight TTFT on long prompts: the prefill side is the bottleneck, so doubling the decode GPUs buys
    # nothing and costs a GPU, while TP 2 on the prefill side raises the pair's rate
    cell = {(r.prefill, r.decode): r for r in rows}
    assert cell[("TP 1", "TP 2")].per_gpu < cell[("TP 1", "TP 1")].per_gpu
    assert cell[("TP 2", "TP 1")].goodput > cell[("TP 1", "TP 1")].goodput
    assert best_pairing(rows) in rows
    with pytest.raises(ValueError, match="layouts must differ by name"):
        compare_phase_layouts(TRACE, name="azure-code", layouts=(InstanceLayout(), InstanceLayout()))


# --- layer-wise KV streaming -----------------------------------------------------------------------


def test_streaming_leaves_only_the_last_layer_when_the_link_keeps_up():
    # 7B, 2048-token prompt, InfiniBand HDR: 1 GiB of KV, 43 ms in one piece; 1.34 ms a layer, under a
    # layer's 5.6 ms of prefill, so only the last layer's message is left after the prefill
    prefill_s = prefill_time(A100_80GB_PRACTICAL, LLAMA_7B, 2048).time_s
    kv = 2048 * LLAMA_7B.kv_bytes_per_token(2)
    s = stream_kv_by_layer(prefill_s, 32, kv, INFINIBAND_HDR)
    assert s.after_s == pytest.approx(INFINIBAND_HDR.message_time_s(kv))
    assert s.streamed_s == pytest.approx(INFINIBAND_HDR.message_time_s(kv / 32))
    assert s.ttft_after_s - s.ttft_streamed_s == pytest.approx(s.after_s - s.streamed_s)
    assert s.hidden_share > 0.96


def test_streaming_falls_behind_on_a_slow_link_and_costs_alpha_per_layer():
    slow = Link("slow", 1e9, 0.0)  # 1 GB/s: 100 ms for 100 MB, over a 10 ms prefill
    s = stream_kv_by_layer(0.010, 10, 100e6, slow)
    # layer 0 starts at 1 ms; then the link is busy for 10 x 10 ms: arrives at 101 ms, 91 ms after the prefill
    assert s.streamed_s == pytest.approx(0.091)
    assert s.after_s == pytest.approx(0.100)
    # tiny layers on a link with a large alpha: ten messages cost more than one
    chatty = Link("chatty", 1e12, 1e-3)
    worse = stream_kv_by_layer(1e-6, 10, 1000.0, chatty)
    assert worse.streamed_s > worse.after_s and worse.hidden_share < 0
    with pytest.raises(ValueError, match="num_layers >= 1"):
        stream_kv_by_layer(0.01, 0, 10.0, slow)
