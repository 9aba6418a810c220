"""Run a trace through the real engine on simulated hardware: `simulate(trace, ...)` (chapters 02–08).

    from minillm.sim import simulate
    from minillm.traces.synthetic import make_trace
    trace = make_trace(200, seed=0, vocab_size=32000, rate_per_s=8)
    res = simulate(trace, hardware="A100-80GB", model="llama-7b", engine_config={"max_num_seqs": 64})
    print(res.summary)            # vllm-bench-serve-style table: TTFT, TPOT, throughput, ...

The scheduler and the KV manager are the engine's own, so their decisions (who runs, who waits,
who is preempted) are exactly what the real engine would decide. Only the model is replaced:
`SimExecutor` emits dummy tokens and charges each step the roofline time of the batch, and a
`SimClock` jumps from step to step and from idle gaps to the next arrival. No tensors are
allocated (the KV manager keeps only its accounting), and no wall time is measured, so the
same inputs always give the same numbers, on any machine.

The KV pool is sized like vLLM's: a fraction (`kv_fraction`, vLLM's gpu_memory_utilization) of
device memory, minus the weights, divided by the KV bytes of one token. Slabs and padded batches
reserve `max_model_len` slots per request, so that pool caps how many requests run at once
(`result.engine.config.max_num_seqs` shows the cap in force).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, build_engine, make_kv_manager
from minillm.metrics import SLO, RequestMetrics, StepRecord, Summary
from minillm.model.config import ModelConfig
from minillm.request import SamplingParams
from minillm.sim.cost_model import StepCost
from minillm.sim.executor import SimExecutor
from minillm.sim.hardware import Hardware, get_hardware
from minillm.sim.instance_layout import InstanceLayout
from minillm.sim.model_shapes import ModelShape, from_hf_config, get_model_shape
from minillm.sim.spec_cost import SimSpeculation
from minillm.traces.synthetic import Trace


@dataclass
class SimResult:
    summary: Summary
    steps: list[StepRecord]  # one per engine step, as the real engine records them
    requests: list[RequestMetrics]  # in trace order
    costs: list[StepCost]  # the cost model's breakdown of each step (aligned with `steps`)
    kv_capacity_tokens: int  # KV slots device memory holds after the weights (before rounding to rows)
    engine: LLMEngine = field(repr=False)  # for inspection: its config (max_num_seqs as memory allows), kv, clock


def simulate(
    trace: Trace,
    *,
    hardware: str | Hardware = "A100-80GB",
    model: str | Path | ModelShape | ModelConfig = "llama-7b",
    engine_config: EngineConfig | dict[str, Any] | None = None,
    dtype_bytes: int | None = None,
    kv_fraction: float = 0.9,
    slo: SLO | None = None,
    speculation: SimSpeculation | None = None,
    layout: InstanceLayout | None = None,
) -> SimResult:
    """Replay `trace` through the engine on simulated `hardware` running `model`.

    hardware: a preset name ("A100-80GB", "H100-SXM", "H200") or a `Hardware` (e.g. measure_this_cpu()).
    model: a shape preset name ("llama-7b", "llama-7b-gqa", "llama-70b"), an HF model directory,
        a `ModelShape`, or a `ModelConfig`.
    engine_config: the engine's knobs (an `EngineConfig` or a dict of them); default `EngineConfig()`.
        It is copied, never modified.
    dtype_bytes: width of weights and KV entries; default the hardware's (2 for the presets).
    kv_fraction: share of device memory the engine may use for weights + KV.
    slo: passed to the summary to compute goodput.
    speculation: speculative decoding (chapter 09): k guesses per row accepted with probability α,
        drafted by a draft model's shape (its passes are charged) or n-gram lookup (free).
    layout: the engine on several GPUs (TP x PP, `minillm.sim.instance_layout`, chapter 13): steps
        are priced by the layout, and the KV pool is one virtual engine's share (with PP this engine
        is one of pp virtual engines; `disagg.simulate_colocated` runs them all).
    """
    if len(trace) == 0:
        raise ValueError("the trace is empty: nothing to simulate")
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if dtype_bytes is not None and dtype_bytes != hw.dtype_bytes:
        hw = dataclasses.replace(hw, dtype_bytes=dtype_bytes)
    if isinstance(engine_config, dict):
        config = EngineConfig.from_kwargs(engine_config)
    else:
        config = engine_config if engine_config is not None else EngineConfig()
    shape, model_config = _model(model, trace, config)
    # the pool's bytes per token follow kv_cache_dtype: capacity, KV reads and writes, swap and transfer time
    shape = dataclasses.replace(shape, kv_cache_dtype=config.kv_cache_dtype)
    config = config.resolve(model_config.max_position_embeddings)  # a filled-in copy

    if layout is None:
        capacity_tokens = kv_capacity_tokens(hw, shape, kv_fraction)
    else:
        capacity_tokens = layout.kv_tokens_per_engine(hw, shape, kv_fraction)
    config = _fit_to_memory(config, shape, hw, capacity_tokens, kv_fraction)
    # Accounting only (no tensors), in the hardware's KV width: the swap space (GiB) holds as many blocks as it would.
    kv_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[hw.dtype_bytes]
    kv = make_kv_manager(config, model_config, dtype=kv_dtype, allocate_pool=False)
    token_id = _non_eos_token(model_config)
    executor = SimExecutor(hw, shape, token_id=token_id, block_size=config.block_size,
                           draft_shape=speculation.draft_shape if speculation else None, layout=layout)
    proposer = speculation.proposer(token_id, shape.vocab_size, model_config.eos_token_ids) if speculation else None
    engine = build_engine(config, model_config, kv=kv, executor=executor, clock=SimClock(), proposer=proposer)
    engine.expect_more_requests = False  # the trace is all there is: a static batch need not wait to fill
    for r in trace:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request({"prompt_token_ids": r.prompt_token_ids}, params, request_id=r.request_id,
                           arrival_time=r.arrival_time_s, priority=r.priority)
    _run(engine)

    metrics = engine.metrics
    return SimResult(summary=metrics.summary(slo=slo), steps=metrics.steps,
                     requests=[metrics.requests[r.request_id] for r in trace], costs=executor.costs,
                     kv_capacity_tokens=capacity_tokens, engine=engine)


def _run(engine: LLMEngine) -> None:
    """Step until every request has finished; jump the clock over idle gaps."""
    if not engine.run_until_done():
        now = engine.clock.now()
        stuck = list(engine.requests.values())
        raise RuntimeError(
            f"the simulation is stuck at t={now!r}s with {len(stuck)} unfinished request(s) "
            f"(e.g. {stuck[0]!r}): the scheduler plans nothing and its next wakeup is "
            f"{engine.scheduler.next_wakeup(now)!r}; is the KV pool ({engine.kv.usage().total_tokens} "
            f"tokens) or max_num_batched_tokens too small, or does the scheduler's timer fire late?")


def _model(model: str | Path | ModelShape | ModelConfig, trace: Trace,
           config: EngineConfig) -> tuple[ModelShape, ModelConfig]:
    """The shape the cost model needs and the `ModelConfig` the engine needs."""
    if isinstance(model, ModelConfig):
        shape = ModelShape(model.model_type, model.num_layers, model.hidden_size, model.num_heads,
                           model.num_kv_heads, model.head_dim, model.intermediate_size, model.vocab_size,
                           tied_embeddings=model.tie_word_embeddings, qkv_bias=model.qkv_bias)
        return shape, model  # a real model keeps its real context limit
    if isinstance(model, ModelShape):
        shape = model
    elif Path(model).is_dir():
        shape = from_hf_config(model)
    else:
        shape = get_model_shape(str(model))
    # A shape has no context limit of its own: make room for the longest request of the trace.
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    model_config = ModelConfig(
        model_type="llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=max(longest, config.max_model_len or 0),
        tie_word_embeddings=shape.tied_embeddings, qkv_bias=shape.qkv_bias)
    return shape, model_config


def kv_capacity_tokens(hw: Hardware, shape: ModelShape, kv_fraction: float = 0.9) -> int:
    """KV slots left in `kv_fraction` of device memory once the weights are loaded (may be <= 0)."""
    free_bytes = hw.mem_capacity_bytes * kv_fraction - shape.weight_bytes(hw.dtype_bytes)
    return int(free_bytes // shape.kv_bytes_per_token(hw.dtype_bytes))


def _fit_to_memory(config: EngineConfig, shape: ModelShape, hw: Hardware, capacity_tokens: int,
                   kv_fraction: float) -> EngineConfig:
    """The config with as many rows as device memory holds.

    Slabs and padded rectangles (static/dynamic) both reserve up to `max_model_len` slots per
    running request, so memory allows `capacity // max_model_len` requests at once; `max_num_seqs`
    bounds it further. A slab pool is one slab per row. A paged pool gets every block that fits.
    """
    rows = capacity_tokens // config.max_model_len
    if rows < 1:
        warnings.warn(
            f"{shape.name} ({shape.weight_bytes(hw.dtype_bytes) / 1e9:.1f} GB of weights) leaves room for "
            f"{max(capacity_tokens, 0)} KV tokens in {kv_fraction:.0%} of {hw.name}'s "
            f"{hw.mem_capacity_bytes / 1e9:.0f} GB, less than one {config.max_model_len}-token request: "
            f"simulating one anyway", stacklevel=3)
    if config.batching == "continuous" and config.kv_layout == "paged":
        # Pages: memory bounds the number of blocks, not the number of rows.
        min_blocks = -(-config.max_model_len // config.block_size)
        return dataclasses.replace(config, num_kv_blocks=max(capacity_tokens // config.block_size, min_blocks))
    return dataclasses.replace(config, max_num_seqs=min(config.max_num_seqs, max(rows, 1)))


def _non_eos_token(model_config: ModelConfig) -> int:
    """A token id the simulated model can emit without looking like end-of-sequence."""
    eos = set(model_config.eos_token_ids)
    return next(t for t in range(model_config.vocab_size) if t not in eos)
