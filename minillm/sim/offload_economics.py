"""The prefix cache's offload tier, priced on simulated hardware (chapter 14).

A prefix hit saves the prefill compute of the tokens it covers. A hit the device pool had to give
up, but the host tier kept (`kv_offloading_size`, minillm.kv.offload), costs a copy over the
host link instead — and every block spilled on its way out costs one too. Whether the tier pays
is arithmetic: hit rate × recompute saved against transfer time. `offload_economics` replays one
trace three times through the real scheduler and KV manager on the simulator (no prefix cache;
the device cache alone; the device cache and a host tier), and reads both sides off the runs:
the prompt tokens each computed, the host hits, and the seconds the simulator charged its PCIe
link (`Hardware.host_link_bytes_per_s`; a copy is not overlapped with compute, so the transfer
side is an upper bound). The recompute side prices each host-hit token at the cost model's
compute time per token of a prefill as long as the trace's shared prefix. (The runs' busy time
moves with more than prefill: fewer tokens per step means more, smaller steps, each reading the
weights again — so the trade is read on the prefill side, and in TTFT.)

    from minillm.sim.offload_economics import offload_economics, format_offload_economics
    from minillm.traces.tenant import make_tenant_trace
    trace = make_tenant_trace(400, num_tenants=96, system_prompt_len=2048, question_len=64, output_len=64,
                              zipf_s=0.5, vocab_size=32000, rate_per_s=8)
    print(format_offload_economics(offload_economics(trace, host_gib=64)))

Everything is simulated, so the numbers are the same on every machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minillm.sim.cost_model import step_time
from minillm.sim.hardware import get_hardware
from minillm.sim.model_shapes import get_model_shape
from minillm.sim.simulate import simulate
from minillm.traces.synthetic import Trace


@dataclass(frozen=True)
class OffloadRun:
    """One replay of the trace: what its prefix cache saved and what its host link carried."""

    label: str
    prompt_tokens: int  # prompt tokens the trace brings
    prompt_tokens_computed: int  # prefill tokens the steps computed (recomputes after preemption included)
    hit_tokens: int  # prompt tokens found cached at admission, device or host
    host_hit_tokens: int  # of those, copied back in from the host tier
    blocks_out: int  # blocks spilled to the host tier
    blocks_in: int  # blocks copied back
    transfer_s: float  # seconds the simulator charged the host link (spills and copies in)
    busy_s: float  # simulated time the steps took, all together
    mean_ttft_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class OffloadEconomics:
    runs: list[OffloadRun]  # no prefix cache, device cache, device cache + host tier
    hardware: str
    model: str
    block_size: int
    host_gib: float
    device_kv_tokens: int  # the device pool, in tokens
    recompute_s_per_token: float  # the cost model's prefill compute per token of a shared prefix
    transfer_s_per_token: float  # one token's K/V over the host link, one way
    kv_cache_dtype: str = "auto"

    @property
    def recompute_saved_s(self) -> float:
        """Prefill compute the host hits spared, at `recompute_s_per_token`."""
        return self.runs[-1].host_hit_tokens * self.recompute_s_per_token

    @property
    def transfer_spent_s(self) -> float:
        return self.runs[-1].transfer_s

    @property
    def transfer_in_s(self) -> float:
        """The copies back in alone (what stays on a step's critical path if spills overlap compute)."""
        return self.runs[-1].blocks_in * self.block_size * self.transfer_s_per_token


def offload_economics(trace: Trace, *, hardware: str = "A100-80GB", model: str = "llama-7b",
                      host_gib: float = 64.0, kv_fraction: float = 0.9,
                      engine_config: dict[str, Any] | None = None) -> OffloadEconomics:
    """Replay `trace` without a prefix cache, with the device cache, and with a `host_gib` host tier."""
    if host_gib <= 0:
        raise ValueError(f"host_gib must be > 0 (the tier's size in GiB), got {host_gib!r}")
    base = {"max_num_seqs": 64, **(engine_config or {})}
    setups = [("no prefix cache", {}), ("device prefix cache", {"enable_prefix_caching": True}),
              (f"+ {host_gib:g} GiB host tier", {"enable_prefix_caching": True, "kv_offloading_size": host_gib})]
    runs, result = [], None
    for label, knobs in setups:
        result = simulate(trace, hardware=hardware, model=model, engine_config={**base, **knobs},
                          kv_fraction=kv_fraction)
        kv = result.engine.kv
        ttfts = [r.ttft for r in result.requests if r.ttft is not None]
        runs.append(OffloadRun(
            label, sum(len(r.prompt_token_ids) for r in trace), sum(s.num_prefill_tokens for s in result.steps),
            kv.num_hit_tokens, kv.num_host_hit_tokens, kv.num_offloaded_blocks, kv.num_onloaded_blocks,
            sum(c.swap_s for c in result.costs), sum(c.time_s for c in result.costs), sum(ttfts) / len(ttfts)))
    hw = get_hardware(hardware)
    shape = dataclasses.replace(get_model_shape(model), kv_cache_dtype=result.engine.config.kv_cache_dtype)
    block_size = result.engine.config.block_size
    prefix_len = max(1, int(trace.meta.get("system_prompt_len", block_size)) if trace.meta else block_size)
    recompute = step_time(hw, shape, prefill_tokens=[prefix_len], prefill_context=[0]).compute_time_s / prefix_len
    transfer = shape.kv_bytes_per_token(hw.dtype_bytes) / hw.host_link_bytes_per_s
    return OffloadEconomics(runs, hw.name, shape.name, block_size, host_gib,
                            result.engine.config.num_kv_blocks * block_size, recompute, transfer,
                            result.engine.config.kv_cache_dtype)


def format_offload_economics(econ: OffloadEconomics) -> str:
    """The three runs as a table, then both sides of the trade and what they say."""
    lines = [f"{econ.model} on {econ.hardware}: device pool {econ.device_kv_tokens} KV tokens, "
             f"block {econ.block_size}, KV {econ.kv_cache_dtype}",
             f"{'run':<26}{'hit rate':>9}{'host hits':>11}{'computed':>11}{'blocks out':>11}{'blocks in':>10}"
             f"{'link s':>9}{'busy s':>9}{'mean TTFT s':>12}"]
    for r in econ.runs:
        lines.append(f"{r.label:<26}{r.hit_rate:>9.1%}{r.host_hit_tokens:>11}{r.prompt_tokens_computed:>11}"
                     f"{r.blocks_out:>11}{r.blocks_in:>10}{r.transfer_s:>9.3f}{r.busy_s:>9.3f}{r.mean_ttft_s:>12.3f}")
    per_token = econ.recompute_s_per_token / econ.transfer_s_per_token
    lines.append(f"per token: recompute {econ.recompute_s_per_token * 1e6:.1f} us of prefill compute vs "
                 f"{econ.transfer_s_per_token * 1e6:.1f} us over the host link one way ({per_token:.1f}x)")
    saved, spent, spent_in = econ.recompute_saved_s, econ.transfer_spent_s, econ.transfer_in_s
    if not spent:
        lines.append("the host tier was never used on this trace (the device pool kept every prefix it needed)")
        return "\n".join(lines)
    lines.append(f"host hits spared {saved:.3f} s of prefill compute; the link carried {spent:.3f} s of copies "
                 f"out and in: the tier {_verdict(saved, spent)} on this trace as simulated ({saved / spent:.2f}x)")
    if not spent_in:
        lines.append(f"{econ.runs[-1].blocks_out} blocks went out and none came back: spills with no hit")
        return "\n".join(lines)
    lines.append(f"copies in alone took {spent_in:.3f} s: with spills overlapped with compute the tier "
                 f"{_verdict(saved, spent_in)} ({saved / spent_in:.2f}x); {econ.runs[-1].blocks_out} blocks went out "
                 f"for {econ.runs[-1].blocks_in} that came back")
    return "\n".join(lines)


def _verdict(saved: float, spent: float) -> str:
    return "pays" if saved > spent else "does not pay"
