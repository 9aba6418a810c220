"""The simulator end to end: the real scheduler and KV manager on a simulated clock (chapters 02–08)."""

import dataclasses

import pytest

from minillm.config import BATCHING_MODES, EngineConfig
from minillm.model.config import ModelConfig
from minillm.request import Request, SamplingParams
from minillm.scheduler.base import SchedulerPlan
from minillm.sim import (
    A100_80GB,
    LLAMA_7B,
    LLAMA_70B,
    SimExecutor,
    kv_capacity_tokens,
    prefill_time,
    simulate,
    step_time,
    weight_bytes_read_per_step,
)
from minillm.traces.synthetic import make_trace, trace_from_prompts


@pytest.fixture(scope="module")
def trace64():
    """64 requests, all at t=0, short enough that max_num_seqs=1 runs ~8.7k steps in well under a second."""
    return make_trace(64, seed=0, vocab_size=32000, prompt_len=("uniform", 32, 256),
                      output_len=("uniform", 64, 192))


def decode_cost(context_len: int, batch: int = 1) -> float:
    return step_time(A100_80GB, LLAMA_7B, decode_context_lens=[context_len] * batch).time_s


# --- the executor alone ---------------------------------------------------------------------------


def test_executor_samples_caught_up_rows_and_costs_the_batch():
    params = SamplingParams(max_tokens=4)
    decoding = Request("dec", list(range(3, 13)), params, 0.0)  # 10-token prompt, 1 output token so far
    decoding.append_token(7)
    decoding.num_computed_tokens = 10
    prefilling = Request("pre", list(range(3, 33)), params, 0.0)  # whole 30-token prompt in this step
    chunked = Request("chunk", list(range(3, 53)), params, 0.0)  # tokens 16..31 of a 50-token prompt
    chunked.num_computed_tokens = 16
    batch = SchedulerPlan([decoding, prefilling, chunked], [1, 30, 16], num_padding_tokens=3)

    ex = SimExecutor(A100_80GB, LLAMA_7B, token_id=9)
    assert ex.step_duration_s() == 0.0  # nothing executed yet
    output = ex.execute(batch)
    assert output.sampled_token_ids == [[9], [9], []]  # the chunk does not reach its prompt's end: no token
    expected = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[30, 16], prefill_context=[0, 16],
                         decode_context_lens=[11], padding_tokens=3)
    assert ex.costs == [expected]
    assert ex.step_duration_s() == expected.time_s
    assert decoding.num_computed_tokens == 10  # the executor never touches the request's state


# --- hand-checkable timelines ---------------------------------------------------------------------


def test_ttft_is_queueing_plus_prefill_behind_one_running_request():
    # max_num_seqs=1: B waits for all of A (prefill, then 2 decodes), then prefills.
    trace = trace_from_prompts([[5] * 100, [6] * 200], max_tokens=[3, 2])
    res = simulate(trace, engine_config={"max_num_seqs": 1})
    a, b = res.requests
    p100, p200 = prefill_time(A100_80GB, LLAMA_7B, 100).time_s, prefill_time(A100_80GB, LLAMA_7B, 200).time_s
    assert a.ttft == pytest.approx(p100, rel=1e-12)
    assert b.queue_time == pytest.approx(p100 + decode_cost(101) + decode_cost(102), rel=1e-12)
    assert b.ttft == pytest.approx(p100 + decode_cost(101) + decode_cost(102) + p200, rel=1e-12)
    assert b.e2e_latency == pytest.approx(b.ttft + decode_cost(201), rel=1e-12)
    assert [c.num_tokens for c in res.costs] == [100, 1, 1, 200, 1]


def test_arrival_mid_step_joins_at_the_next_step_in_a_mixed_batch():
    p100 = prefill_time(A100_80GB, LLAMA_7B, 100).time_s
    arrival_b = p100 + 0.5 * decode_cost(101)  # B arrives while A's first decode step runs
    trace = trace_from_prompts([[5] * 100, [6] * 200], max_tokens=[5, 2], arrivals=[0.0, arrival_b])
    res = simulate(trace, engine_config={"max_num_seqs": 2})
    _, b = res.requests
    mixed = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[200], decode_context_lens=[102])
    assert b.queue_time == pytest.approx(p100 + decode_cost(101) - arrival_b, rel=1e-9)
    assert b.ttft == pytest.approx(p100 + decode_cost(101) + mixed.time_s - arrival_b, rel=1e-9)
    assert res.costs[2] == mixed


def test_idle_gap_is_skipped_and_a_lone_request_pays_only_its_own_prefill():
    trace = trace_from_prompts([[5] * 100, [6] * 200], max_tokens=[2, 2], arrivals=[0.0, 10.0])
    res = simulate(trace)
    _, b = res.requests
    assert b.queue_time == 0.0
    assert b.ttft == pytest.approx(prefill_time(A100_80GB, LLAMA_7B, 200).time_s, rel=1e-12)
    assert res.summary.duration_s == pytest.approx(10.0 + b.e2e_latency, rel=1e-12)
    assert len(res.steps) == 4  # the 10 s gap costs no steps


# --- the seeds' 7B / A100 numbers -----------------------------------------------------------------


def test_single_request_decode_step_is_weights_over_bandwidth():
    res = simulate(make_trace(1, seed=1, vocab_size=32000, prompt_len=128, output_len=32))
    decode_steps = res.costs[1:]
    assert len(decode_steps) == 31 and all(c.bound == "memory" for c in decode_steps)
    weights_s = weight_bytes_read_per_step(LLAMA_7B, 2) / A100_80GB.mem_bandwidth_bytes_per_s
    for c in decode_steps:  # the KV of ~150 tokens adds ~0.6 % to 13.2 GB of weights
        assert c.time_s == pytest.approx(weights_s, rel=0.01)
    assert 6.0e-3 < decode_steps[0].time_s < 7.0e-3
    assert res.summary.tpot.mean_ms == pytest.approx(1000 * weights_s, rel=0.01)


def test_continuous_batching_multiplies_throughput_because_decode_is_memory_bound(trace64):
    throughput = {n: simulate(trace64, engine_config={"max_num_seqs": n}).summary.output_throughput
                  for n in (1, 4, 32)}
    assert throughput[1] < throughput[4] < throughput[32]
    assert throughput[32] > 8 * throughput[1]  # measured ~18.6x
    # ...because a 32-wide decode step costs little more than a 1-wide one
    assert decode_cost(300, batch=32) < 1.5 * decode_cost(300, batch=1)


# --- bookkeeping ----------------------------------------------------------------------------------


def test_every_output_token_is_produced_and_kv_returns_to_empty(trace64):
    res = simulate(trace64, engine_config={"max_num_seqs": 16})
    s = res.summary
    assert s.completed == len(trace64)
    assert s.total_output_tokens == trace64.total_output_tokens
    assert s.total_input_tokens == trace64.total_prompt_tokens
    assert [r.num_output_tokens for r in res.requests] == [r.max_tokens for r in trace64]
    usage = res.engine.kv.usage()
    assert usage.used_tokens == usage.reserved_tokens == 0
    assert res.engine.kv.num_free_blocks == res.engine.kv.allocator.num_blocks  # paged by default
    # the clock moved only by step costs (every request arrives at t=0: no idle gaps)
    assert len(res.costs) == len(res.steps) == s.num_steps
    assert sum(c.time_s for c in res.costs) == pytest.approx(s.duration_s, rel=1e-12)
    assert [st.duration_s for st in res.steps] == pytest.approx([c.time_s for c in res.costs], rel=1e-9)
    assert max(st.num_seqs for st in res.steps) == 16


def test_simulation_is_deterministic_and_leaves_the_config_untouched(trace64):
    config = EngineConfig(max_num_seqs=8)
    first = simulate(trace64, engine_config=config)
    second = simulate(trace64, engine_config=config)
    assert config.max_model_len is None and config.max_num_batched_tokens is None
    assert repr(first.summary.to_dict()) == repr(second.summary.to_dict())
    assert [st.duration_s for st in first.steps] == [st.duration_s for st in second.steps]
    assert [r.token_times for r in first.requests] == [r.token_times for r in second.requests]


def test_kv_pool_is_sized_from_memory_and_bounded_by_max_num_seqs():
    # (0.9 * 80 GB - 13.5 GB of weights) / 0.5 MiB per token = 111,624 tokens
    capacity = int((0.9 * 80e9 - LLAMA_7B.weight_bytes(2)) // (2 * 32 * 32 * 128 * 2))
    assert kv_capacity_tokens(A100_80GB, LLAMA_7B) == capacity == 111_624
    trace = make_trace(4, seed=2, vocab_size=32000, prompt_len=64, output_len=8)
    res = simulate(trace, engine_config={"max_num_seqs": 256, "max_model_len": 2048, "kv_layout": "slab"})
    assert res.kv_capacity_tokens == capacity
    assert res.engine.kv.num_slabs == res.engine.config.max_num_seqs == capacity // 2048 == 54
    small = simulate(trace, engine_config={"max_num_seqs": 2, "max_model_len": 2048, "kv_layout": "slab"})
    assert small.engine.kv.num_slabs == 2
    # Pages: memory bounds the blocks, not the rows.
    paged = simulate(trace, engine_config={"max_num_seqs": 256, "max_model_len": 2048})
    assert paged.engine.kv.allocator.num_blocks == capacity // 16
    assert paged.engine.config.max_num_seqs == 256


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_memory_bounds_the_batch(batching):
    # 1024-token rows on an A100 cut to 40 GB: (36 - 13.5) GB / 0.5 MiB = 42.9k tokens = 41 rows
    hw = dataclasses.replace(A100_80GB, mem_capacity_bytes=40e9)
    trace = make_trace(60, seed=3, vocab_size=32000, prompt_len=64, output_len=16)
    res = simulate(trace, hardware=hw, engine_config={"batching": batching, "max_num_seqs": 64,
                                                       "max_model_len": 1024, "kv_layout": "slab"})
    assert res.engine.config.max_num_seqs == 41
    assert max(st.num_seqs for st in res.steps) == 41
    assert res.summary.completed == 60


def test_model_too_big_for_the_device_warns_and_runs_one_request_at_a_time():
    trace = make_trace(3, seed=4, vocab_size=32000, prompt_len=16, output_len=4)
    with pytest.warns(UserWarning, match="less than one"):
        res = simulate(trace, model=LLAMA_70B, engine_config={"kv_layout": "slab"})  # 138 GB on an 80 GB card
    assert res.engine.kv.num_slabs == 1
    assert res.summary.completed == 3


def test_step_overhead_adds_exactly_once_per_step(trace64):
    base = simulate(trace64, engine_config={"max_num_seqs": 8})
    slow = simulate(trace64, hardware=dataclasses.replace(A100_80GB, step_overhead_s=1e-3),
                    engine_config={"max_num_seqs": 8})
    assert slow.summary.num_steps == base.summary.num_steps
    assert slow.summary.duration_s - base.summary.duration_s == pytest.approx(1e-3 * base.summary.num_steps)


def test_a_model_config_keeps_its_own_context_limit():
    cfg = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=112,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, eos_token_id=0))
    ok = trace_from_prompts([[3] * 20, [4] * 30], max_tokens=8)
    res = simulate(ok, model=cfg, engine_config={"max_num_seqs": 2, "kv_layout": "slab"})
    assert res.summary.total_output_tokens == 16
    assert res.engine.executor.token_id == 1  # 0 is this model's EOS
    assert res.engine.kv.slab_len == 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        simulate(trace_from_prompts([[3] * 60], max_tokens=8), model=cfg)


def test_bad_inputs_are_rejected_with_the_choices():
    trace = trace_from_prompts([[3] * 4], max_tokens=2)
    with pytest.raises(ValueError, match="A100-80GB"):
        simulate(trace, hardware="tpu-v9")
    with pytest.raises(ValueError, match="llama-7b"):
        simulate(trace, model="gpt-5")
    with pytest.raises(ValueError, match="unknown engine option"):
        simulate(trace, engine_config={"max_seqs": 4})
    with pytest.raises(ValueError, match="empty"):
        simulate(trace_from_prompts([], max_tokens=[]))


@pytest.mark.parametrize("batching", BATCHING_MODES)
def test_every_batching_mode_finishes_the_trace(batching, trace64):
    try:
        res = simulate(trace64, engine_config={"batching": batching, "max_num_seqs": 8})
    except NotImplementedError as e:
        pytest.skip(str(e))
    assert res.summary.total_output_tokens == trace64.total_output_tokens
    assert res.engine.kv.usage().used_tokens == 0
    assert max(st.num_seqs for st in res.steps) <= 8


def test_static_batch_is_costed_as_its_padded_rectangle():
    # Both arrive at t=0; the batch is [100 pads + 100 tokens, 200 tokens], then decodes together
    # until A's third token; B finished after its second but its row is still computed.
    trace = trace_from_prompts([[5] * 100, [6] * 200], max_tokens=[3, 2])
    res = simulate(trace, engine_config={"batching": "static", "max_num_seqs": 2})
    a, b = res.requests
    prefill = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[200, 200]).time_s
    assert a.ttft == b.ttft == pytest.approx(prefill, rel=1e-12)
    assert b.e2e_latency == pytest.approx(prefill + decode_cost(201, batch=2), rel=1e-12)
    assert a.e2e_latency == pytest.approx(prefill + decode_cost(201, batch=2) + decode_cost(202, batch=2), rel=1e-12)
    assert [st.num_padding_tokens for st in res.steps] == [100, 0, 1]
    assert res.summary.padding_waste == pytest.approx(101 / 404)


def test_static_batching_loses_to_continuous_on_mixed_lengths(trace64):
    summaries = {mode: simulate(trace64, engine_config={"batching": mode, "max_num_seqs": 16}).summary
                 for mode in ("static", "dynamic", "continuous")}
    assert summaries["static"].padding_waste > 0.2
    assert summaries["continuous"].padding_waste == 0
    assert summaries["continuous"].output_throughput > 1.3 * summaries["static"].output_throughput


def test_dynamic_batch_fires_when_the_oldest_has_waited_max_queue_delay():
    trace = trace_from_prompts([[5] * 100, [6] * 200], max_tokens=[2, 2], arrivals=[0.0, 0.004])
    res = simulate(trace, engine_config={"batching": "dynamic", "max_num_seqs": 4, "max_queue_delay_ms": 10.0})
    a, b = res.requests
    prefill = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[200, 200]).time_s
    assert a.queue_time == pytest.approx(0.010) and b.queue_time == pytest.approx(0.006)
    assert a.ttft == pytest.approx(0.010 + prefill, rel=1e-12)
    assert len(res.steps) == 2  # one batch of both: prefill, then one decode


def test_dynamic_batching_on_a_poisson_trace_finishes():
    trace = make_trace(200, seed=0, vocab_size=32000, rate_per_s=8, prompt_len=("uniform", 32, 256),
                       output_len=("uniform", 8, 32))
    res = simulate(trace, engine_config={"batching": "dynamic", "max_num_seqs": 64, "max_queue_delay_ms": 10.0})
    assert res.summary.total_output_tokens == trace.total_output_tokens
