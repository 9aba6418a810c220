"""Prefill/decode disaggregation and goodput on the simulator (minillm/sim/disagg.py, minillm/sim/goodput.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from minillm.metrics import SLO
from minillm.sim.disagg import (
    break_even_kv_bytes_per_token,
    kv_transfer_bytes,
    kv_transfer_time_s,
    simulate_colocated,
    simulate_disaggregated,
)
from minillm.sim.goodput import at_rate, attainment_curve, compare_colocated_vs_pd, goodput, mean_rate
from minillm.sim.network import INFINIBAND_HDR, NVLINK3_A100, Link
from minillm.traces.synthetic import make_trace
from minillm.traces.trace import Trace

HW = "A100-80GB-practical"
# a code-like trace: long prompts, short outputs (prefill-heavy: the decode steps of a colocated engine stall)
CODE_LIKE = make_trace(60, seed=1, vocab_size=32000, rate_per_s=4.0, prompt_len=("uniform", 1500, 3000),
                       output_len=("uniform", 16, 64), max_prompt_len=4096)
SLO_CODE = SLO(ttft_ms=2000, tpot_ms=40)
TEN_GBE = Link("10 Gb Ethernet", 1.25e9, 10e-6)


def test_kv_transfer_is_alpha_plus_bytes_over_beta() -> None:
    per_token = 2 * 32 * 32 * 128 * 2  # K and V, 32 layers, 32 KV heads, head_dim 128, fp16: Llama-2-7B
    assert kv_transfer_bytes(1000, "llama-7b") == 1000 * per_token == 1000 * 2**19
    assert kv_transfer_bytes(1000, "llama-7b-gqa") == 1000 * per_token // 4
    for link in (NVLINK3_A100, INFINIBAND_HDR, TEN_GBE):
        assert kv_transfer_time_s(1000, "llama-7b", link) == pytest.approx(
            link.latency_s + 1000 * per_token / link.bandwidth_bytes_per_s, rel=1e-12)
    assert kv_transfer_time_s(0, "llama-7b", INFINIBAND_HDR) == INFINIBAND_HDR.latency_s
    with pytest.raises(ValueError, match="prompt_tokens"):
        kv_transfer_bytes(-1, "llama-7b")


def test_break_even_bytes_make_the_transfer_as_long_as_the_prefill() -> None:
    from minillm.sim.cost_model import prefill_time
    from minillm.sim.hardware import get_hardware
    from minillm.sim.model_shapes import get_model_shape

    prefill_s = prefill_time(get_hardware(HW), get_model_shape("llama-7b"), 1024).time_s
    for link in (NVLINK3_A100, INFINIBAND_HDR):
        for share in (0.1, 1.0):
            b = break_even_kv_bytes_per_token(HW, "llama-7b", link, prompt_tokens=1024, share=share)
            assert link.message_time_s(1024 * b) == pytest.approx(share * prefill_s, rel=1e-9)
    # NVLink's 12x bandwidth moves 12x the bytes in the same time (alpha aside)
    ratio = (break_even_kv_bytes_per_token(HW, "llama-7b", NVLINK3_A100)
             / break_even_kv_bytes_per_token(HW, "llama-7b", INFINIBAND_HDR))
    assert 11.9 < ratio < 12.1


def test_disaggregated_run_moves_every_prompt_and_recomputes_none() -> None:
    trace = at_rate(CODE_LIKE, 2.0)
    res = simulate_disaggregated(trace, hardware=HW, link=INFINIBAND_HDR)
    alone = simulate_disaggregated(at_rate(CODE_LIKE, 0.01), hardware=HW, link=INFINIBAND_HDR)
    assert res.loaded_tokens == sum(r.prompt_len for r in trace if r.max_tokens > 1)
    assert res.recomputed_tokens == 0
    assert any(m.first_token_time > h + 1e-9 for m, h in zip(res.requests, res.handed_s))  # a decode step was running
    assert res.transfer_bytes == sum(r.prompt_len for r in trace) * 2**19
    for r, m, xfer, handed, m_alone in zip(trace, res.requests, res.transfer_s, res.handed_s, alone.requests):
        assert m.num_output_tokens == r.max_tokens  # token 1 from the prefill side, the rest decoded
        assert xfer == pytest.approx(INFINIBAND_HDR.message_time_s(r.prompt_len * 2**19))
        assert m.first_token_time >= handed  # TTFT pays the transfer, and any wait on the decode side
        if r.max_tokens == 1:
            assert m.first_token_time == handed
        assert m.ttft >= m_alone.ttft - 1e-12  # queueing only adds
        assert all(b >= a for a, b in zip(m.token_times, m.token_times[1:]))


def test_one_request_pays_a_prefill_a_transfer_and_decode_steps_only() -> None:
    from minillm.sim.cost_model import decode_step_time, prefill_time
    from minillm.sim.hardware import get_hardware
    from minillm.sim.model_shapes import get_model_shape

    hw, shape = get_hardware(HW), get_model_shape("llama-7b")
    one = make_trace(1, seed=3, vocab_size=32000, prompt_len=2000, output_len=4, max_prompt_len=4096)
    m = simulate_disaggregated(one, hardware=HW, link=INFINIBAND_HDR).requests[0]
    wire = INFINIBAND_HDR.message_time_s(2000 * 2**19)
    assert m.ttft == pytest.approx(prefill_time(hw, shape, 2000).time_s + wire, rel=1e-9)
    # the decode instance takes the KV in with a decode step (reading 2001 keys), never a prefill of 2000 tokens
    steps = [decode_step_time(hw, shape, 1, 2001 + i).time_s for i in range(3)]
    assert [b - a for a, b in zip(m.token_times, m.token_times[1:])] == pytest.approx(steps, rel=1e-9)
    colocated = simulate_colocated(one, hardware=HW).requests[0]
    assert colocated.ttft == pytest.approx(prefill_time(hw, shape, 2000).time_s, rel=1e-9)


def test_a_slow_link_queues_transfers_one_at_a_time() -> None:
    burst = make_trace(6, seed=2, vocab_size=32000, prompt_len=1000, output_len=4)  # all at t=0
    res = simulate_disaggregated(burst, hardware=HW, link=TEN_GBE)
    handed = sorted(res.handed_s)
    wire = TEN_GBE.message_time_s(1000 * 2**19)  # 0.42 s a prompt, far longer than its prefill
    assert all(b - a >= wire - 1e-9 for a, b in zip(handed, handed[1:]))


def test_at_rate_keeps_the_shape_of_the_arrivals() -> None:
    fast = at_rate(CODE_LIKE, 8.0)
    assert mean_rate(fast) == pytest.approx(8.0)
    gaps = [b.arrival_time_s - a.arrival_time_s for a, b in zip(CODE_LIKE, CODE_LIKE.requests[1:])]
    fast_gaps = [b.arrival_time_s - a.arrival_time_s for a, b in zip(fast, fast.requests[1:])]
    scale = mean_rate(CODE_LIKE) / 8.0
    assert all(math.isclose(f, g * scale, rel_tol=1e-9, abs_tol=1e-12) for f, g in zip(fast_gaps, gaps))
    with pytest.raises(ValueError, match="rate_per_s"):
        at_rate(CODE_LIKE, 0)


def test_attainment_falls_as_the_rate_rises() -> None:
    curve = attainment_curve(lambda t: simulate_colocated(t, hardware=HW), CODE_LIKE, [0.5, 1, 2, 4, 8], SLO_CODE)
    shares = [s for _, s in curve]
    assert shares[0] == 1.0 and shares[-1] < 0.5
    assert all(b <= a for a, b in zip(shares, shares[1:])), curve


def test_disaggregation_wins_on_a_prefill_heavy_trace_and_a_slow_link_loses() -> None:
    rows = compare_colocated_vs_pd(CODE_LIKE, hardware=HW, links=(NVLINK3_A100, INFINIBAND_HDR, TEN_GBE),
                                   slo=SLO_CODE, rel_tol=0.1, chunked_budgets=(512,))
    assert [(r.mode, r.link, r.num_gpus) for r in rows] == [
        ("colocated", "-", 1), ("chunked 512", "-", 1), ("PD 1:1", NVLINK3_A100.name, 2),
        ("PD 1:1", INFINIBAND_HDR.name, 2), ("PD 1:1", TEN_GBE.name, 2)]
    colocated, chunked = rows[0].per_gpu, rows[1].per_gpu
    per_gpu = {r.link: r.per_gpu for r in rows[2:]}
    assert colocated > 0
    # colocated, every 2000-token prefill stalls the running decodes past the 40 ms TPOT: PD 1:1 serves more per GPU
    assert per_gpu[NVLINK3_A100.name] > 1.5 * colocated
    # ... and so does chapter 08's cure on one GPU: 512-token chunks keep every step short
    assert chunked > 1.5 * colocated
    # slower links never help, and 10 GbE (0.8 s per prompt's KV, one at a time) loses to colocated
    assert per_gpu[NVLINK3_A100.name] >= per_gpu[INFINIBAND_HDR.name] >= per_gpu[TEN_GBE.name]
    assert per_gpu[TEN_GBE.name] < colocated
    # the rows report the runs at their goodput: the KV transfer grows as the link slows
    transfer = [r.transfer_mean_ms for r in rows[2:]]
    assert rows[0].transfer_mean_ms == 0 and transfer == sorted(transfer) and transfer[0] > 0


def test_prefill_instances_may_use_splitfuse_and_the_decode_side_prefix_caching() -> None:
    """The decode instance never chunks (it computes no prompt), whatever chunk policy the prefill instances
    use; a prompt prefix it caches is neither loaded nor recomputed there."""
    trace = at_rate(CODE_LIKE, 2.0)
    split = simulate_disaggregated(trace, hardware=HW, engine_config={
        "enable_chunked_prefill": True, "max_num_batched_tokens": 512, "chunk_policy": "splitfuse"})
    assert split.recomputed_tokens == 0 and split.loaded_tokens == sum(r.prompt_len for r in trace)
    shared = make_trace(8, seed=4, vocab_size=32000, rate_per_s=4.0, prompt_len=1000, output_len=8)
    same_prefix = Trace([dataclasses.replace(r, prompt_token_ids=shared[0].prompt_token_ids[:960]
                                             + r.prompt_token_ids[960:]) for r in shared], shared.meta)
    cached = simulate_disaggregated(same_prefix, hardware=HW, decode_engine_config={"enable_prefix_caching": True})
    assert cached.recomputed_tokens == 0
    assert 1000 < cached.loaded_tokens < 8 * 1000 - 6 * 960  # the first prompt whole, the others mostly cached


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="num_prefill and num_decode"):
        simulate_disaggregated(CODE_LIKE, num_prefill=0)
    with pytest.raises(ValueError, match="transfer_bytes_per_token must be >= 0"):
        simulate_disaggregated(CODE_LIKE, transfer_bytes_per_token=-1.0)
    with pytest.raises(ValueError, match="num_gpus"):
        simulate_colocated(CODE_LIKE, num_gpus=0)
    with pytest.raises(ValueError, match="unknown or ambiguous link"):
        simulate_disaggregated(CODE_LIKE, link="carrier pigeon")
    with pytest.raises(ValueError, match="attainment"):
        goodput(lambda t: simulate_colocated(t), CODE_LIKE, SLO_CODE, attainment=1.5)
    for bad in ({"rel_tol": 0.0}, {"start_rate": 0.0}, {"start_rate": 2e4}):
        with pytest.raises(ValueError, match="rel_tol > 0 and 0 < min_rate <= start_rate <= max_rate"):
            goodput(lambda t: simulate_colocated(t), CODE_LIKE, SLO_CODE, **bad)


def test_ttft_counts_the_wait_for_room_on_the_decode_side() -> None:
    """A decode instance whose batch is full admits a new request only when a seat frees: the user's
    first token waits for that too (prefill queue + prefill + transfer + decode-side wait)."""
    trace = make_trace(6, seed=1, vocab_size=32000, rate_per_s=1000.0, prompt_len=200, output_len=50,
                       max_prompt_len=4096)
    roomy = simulate_disaggregated(trace, hardware=HW, decode_engine_config={"max_num_seqs": 8})
    tight = simulate_disaggregated(trace, hardware=HW, decode_engine_config={"max_num_seqs": 2})
    assert roomy.handed_s == tight.handed_s  # the same prefills and transfers
    waited = [t.ttft - r.ttft for r, t in zip(roomy.requests, tight.requests)]
    assert max(waited) > 0.1  # the last ones wait for two requests' 50 tokens each to finish first
    assert sorted(waited)[:2] == pytest.approx([0.0, 0.0], abs=1e-9)  # the first two find seats at once


def test_a_prefill_cache_runs_the_prefill_side_once_and_changes_nothing(monkeypatch) -> None:
    """`prefill_cache` keeps the prefill side's results by everything that side reads: another link or
    decode side at the same rate finds them again; another rate, prefill engine or prompt does not."""
    import minillm.sim.disagg as disagg

    calls = []
    real = disagg.run_prefill_instances
    monkeypatch.setattr(disagg, "run_prefill_instances", lambda *a, **k: calls.append(1) or real(*a, **k))
    trace, cache = at_rate(CODE_LIKE, 2.0), {}
    fresh = [simulate_disaggregated(trace, hardware=HW, link=link) for link in (NVLINK3_A100, TEN_GBE)]
    assert len(calls) == 2
    cached = [simulate_disaggregated(trace, hardware=HW, link=link, prefill_cache=cache)
              for link in (NVLINK3_A100, TEN_GBE)]
    assert len(calls) == 3 and len(cache) == 1  # one run served both links
    for a, b in zip(fresh, cached):
        assert a.handed_s == b.handed_s and a.transfer_s == b.transfer_s
        assert [(m.ttft, m.token_times) for m in a.requests] == [(m.ttft, m.token_times) for m in b.requests]
    simulate_disaggregated(trace, hardware=HW, decode_engine_config={"max_num_seqs": 2}, prefill_cache=cache)
    assert len(calls) == 3  # another decode side: the same prefills
    simulate_disaggregated(at_rate(CODE_LIKE, 3.0), hardware=HW, prefill_cache=cache)
    simulate_disaggregated(trace, hardware=HW, engine_config={"max_num_seqs": 4}, prefill_cache=cache)
    other_prompt = Trace([dataclasses.replace(trace[0], prompt_token_ids=[7] * trace[0].prompt_len),
                          *trace.requests[1:]], trace.meta)
    simulate_disaggregated(other_prompt, hardware=HW, prefill_cache=cache)
    assert len(calls) == 6 and len(cache) == 4  # a new rate, prefill config and prompt each run it again
