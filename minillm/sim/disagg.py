"""Prefill/decode disaggregation on the simulator: one request, two instances, a KV transfer between (chapter 13).

Colocated serving runs a request's prefill and its decode on the same engine: a long prompt's
prefill step holds up every decode in the batch (the interference chapter 08 chunks away).
Disaggregated serving (DistServe, Splitwise, Mooncake) sends the prompt to a *prefill instance*,
which computes it and the first token, moves the prompt's KV cache over a link to a *decode
instance*, and the decode instance generates the rest without ever computing the prompt:

    arrival ──► prefill instance (queue, prompt + token 1) ──► KV transfer: alpha + bytes / bandwidth
            ──► decode instance (queue, tokens 2 .. n, batched with other decodes) ──► finished

Both instances are the engine's own scheduler and KV manager on the roofline clock
(`minillm.sim.simulate`): the prefill instance serves each request with `max_tokens=1`; the decode
instance receives prompt + token 1 when the transfer ends and `max_tokens = n - 1`. Its executor
charges the step that takes a request in as that request's first decode step (the KV arrived: its
keys are read, nothing is recomputed) — see `DecodeInstanceExecutor`. The KV bytes of a prompt of
`L` tokens are `L * shape.kv_bytes_per_token(dtype_bytes)` (0.5 MiB per token for Llama-2-7B in
fp16), moved as one message over a `minillm.sim.network.Link` (NVLink inside a node, InfiniBand
between nodes); each prefill instance's link carries one prompt's KV at a time, first finished
first sent, so a slow link also queues. Layer-by-layer overlap with the prefill (Splitwise's
optimisation) is left out here, so the transfer is an upper bound; `minillm.sim.kv_streaming`
prices that overlap for one request.

Timing as vLLM's disaggregated proxy delivers it: the user gets token 1 when the decode instance
takes the request over, so TTFT = prefill queue + prefill + transfer + the wait on the decode side
(until the decode instance admits the request: a seat in its batch and blocks for the KV; zero
while it has room), and TPOT covers tokens 2 .. n on the decode instance. (The wait is counted
after the transfer, where a real connector waits for blocks first and then pulls: the same sum.) `num_prefill` and `num_decode` instances
(the prefill:decode ratio) take requests round-robin. `minillm.sim.goodput` turns runs of both
kinds into goodput (DistServe's definition) and the comparison tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import build_engine, make_kv_manager
from minillm.metrics import SLO, RequestMetrics, Summary, summarize
from minillm.request import SamplingParams
from minillm.scheduler.base import ModelRunnerOutput, SchedulerPlan
from minillm.sim.cost_model import step_time
from minillm.sim.executor import SimExecutor
from minillm.sim.hardware import Hardware, get_hardware
from minillm.sim.instance_layout import InstanceLayout, deal_to_virtual_engines
from minillm.sim.model_shapes import ModelShape, get_model_shape
from minillm.sim.network import Link, get_link
from minillm.sim.simulate import _fit_to_memory, _model, _non_eos_token, _run, kv_capacity_tokens, simulate
from minillm.traces.trace import Trace, TraceRequest

DEFAULT_ENGINE = {"max_num_seqs": 128}  # both kinds of instance, and the colocated engine


def _hw(hardware: str | Hardware) -> Hardware:
    return get_hardware(hardware) if isinstance(hardware, str) else hardware


def _shape(model: str | ModelShape) -> ModelShape:
    return get_model_shape(model) if isinstance(model, str) else model


def _link(link: str | Link) -> Link:
    return get_link(link) if isinstance(link, str) else link


# --- the transfer ------------------------------------------------------------------------------------


def kv_transfer_bytes(prompt_tokens: int, model: str | ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes of a prompt's KV cache: every layer's K and V for every prompt token."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    return prompt_tokens * _shape(model).kv_bytes_per_token(dtype_bytes)


def kv_transfer_time_s(prompt_tokens: int, model: str | ModelShape, link: str | Link, dtype_bytes: int = 2) -> float:
    """One message over `link`: alpha + KV bytes / bandwidth (Hockney's alpha-beta model)."""
    return _link(link).message_time_s(kv_transfer_bytes(prompt_tokens, model, dtype_bytes))


def break_even_kv_bytes_per_token(hardware: str | Hardware, model: str | ModelShape, link: str | Link, *,
                                  prompt_tokens: int = 1024, share: float = 1.0) -> float:
    """KV bytes per token at which moving a `prompt_tokens` prompt's KV over `link` takes `share` of the
    time the prefill instance needs to compute it (the simulator's prefill of that prompt alone).

    Below it the link hides behind the prefill (a fast link, a GQA model, fp8 KV); above it the
    transfer is as long as the work it hands over and disaggregation pays it in every TTFT."""
    if prompt_tokens < 1 or not share > 0:
        raise ValueError(f"prompt_tokens must be >= 1 and share > 0, got {prompt_tokens}, {share}")
    lk = _link(link)
    prefill_s = step_time(_hw(hardware), _shape(model), prefill_tokens=[prompt_tokens]).time_s
    budget_s = share * prefill_s - lk.latency_s
    return max(0.0, budget_s) * lk.bandwidth_bytes_per_s / prompt_tokens


# --- one instance ------------------------------------------------------------------------------------


class DecodeInstanceExecutor(SimExecutor):
    """A decode instance's model: a request's prompt arrives as KV, so the step that takes it in is
    its first decode step (reading prompt + token 1, writing one token), not a prefill.

    The engine's scheduler still admits the request as a prefill of its prompt (the KV manager
    allocates the blocks the transferred KV fills, as vLLM's KV connector does), and the sampled
    token is the request's token 2. Every other row is costed as `SimExecutor` costs it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded_tokens = 0  # prompt tokens whose KV arrived over the link
        self.recomputed_tokens = 0  # tokens computed again after a preemption (recompute mode) on this instance

    def execute(self, batch: SchedulerPlan) -> ModelRunnerOutput:
        sampled, prefill_tokens, decode_context_lens = [], [], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            if start + n != req.num_tokens:
                raise RuntimeError(f"a decode instance was asked for a chunk of {n} tokens after {start} of "
                                   f"{req.request_id}: run it without chunked prefill, with a budget that holds a prompt")
            if req.num_output_tokens == 0:  # taken in: the KV of all but the last token arrived (or, with
                self.loaded_tokens += n - 1  # prefix caching here, the first `start` were cached); that one is decoded
                decode_context_lens.append(start + n)
            elif n > 1:  # preempted here and recomputed (after any prefix-cache hit): that is real work
                prefill_tokens.append(n)
                self.recomputed_tokens += n
            else:
                decode_context_lens.append(start + n)
            sampled.append([self.token_id])
        cost = self.step_cost(prefill_tokens=prefill_tokens, decode_context_lens=decode_context_lens)
        self.costs.append(cost)
        self.draft_s.append(0.0)
        return ModelRunnerOutput(sampled)


def _engine_config(engine_config: EngineConfig | dict[str, Any] | None) -> EngineConfig:
    if isinstance(engine_config, EngineConfig):
        return engine_config
    return EngineConfig.from_kwargs({**DEFAULT_ENGINE, **(engine_config or {})})


def _run_decode_instance(trace: Trace, hw: Hardware, shape: ModelShape, config: EngineConfig,
                         kv_fraction: float, layout: InstanceLayout | None = None,
                         ) -> tuple[list[RequestMetrics], DecodeInstanceExecutor]:
    """`trace` (prompt = transferred KV + token 1) through an engine whose executor never prefills."""
    longest = max(r.prompt_len for r in trace)
    # whole prompts in one step: loading KV is not compute, so the token budget must not chunk or ration it
    # (whatever chunk policy the prefill instances use: SplitFuse needs chunking, so it goes too)
    config = dataclasses.replace(config, enable_chunked_prefill=False, chunk_policy="sarathi",
                                 max_num_batched_tokens=max(longest, 1) * config.max_num_seqs)
    shape_, model_config = _model(shape, trace, config)
    config = config.resolve(model_config.max_position_embeddings)
    capacity = kv_capacity_tokens(hw, shape_, kv_fraction) if layout is None else layout.kv_tokens_per_engine(
        hw, shape_, kv_fraction)
    config = _fit_to_memory(config, shape_, hw, capacity, kv_fraction)
    kv_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[hw.dtype_bytes]
    kv = make_kv_manager(config, model_config, dtype=kv_dtype, allocate_pool=False)
    executor = DecodeInstanceExecutor(hw, shape_, token_id=_non_eos_token(model_config), block_size=config.block_size,
                                      layout=layout)
    engine = build_engine(config, model_config, kv=kv, executor=executor, clock=SimClock())
    engine.expect_more_requests = False
    for r in trace:
        engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=r.request_id, arrival_time=r.arrival_time_s)
    _run(engine)
    return [engine.metrics.requests[r.request_id] for r in trace], executor


def _round_robin(requests: Sequence[TraceRequest], n: int) -> list[list[TraceRequest]]:
    return [list(requests[i::n]) for i in range(n)]


# --- a whole deployment ------------------------------------------------------------------------------


@dataclass
class ServingResult:
    """One simulated deployment on one trace: per-request metrics in trace order and their summary."""

    mode: str  # "colocated" or "disaggregated"
    num_gpus: int
    requests: list[RequestMetrics]
    summary: Summary
    transfer_s: list[float] = field(default_factory=list)  # per request (disaggregated), in trace order: on the wire
    handed_s: list[float] = field(default_factory=list)  # when each request's KV reached its decode instance
    transfer_bytes: int = 0
    loaded_tokens: int = 0  # prompt tokens decode instances took in as transferred KV
    recomputed_tokens: int = 0  # tokens a decode instance computed again after preempting (0 unless memory ran out)

    def attainment(self, slo: SLO) -> float:
        """Share of all requests that finished within both SLOs (DistServe's SLO attainment)."""
        return sum(meets(r, slo) for r in self.requests) / len(self.requests)


def meets(r: RequestMetrics, slo: SLO) -> bool:
    """Both latency SLOs met (a single-token output has no TPOT: it meets that one, as vLLM counts it)."""
    if r.finished_time is None or r.ttft is None:
        return False
    if slo.ttft_ms is not None and r.ttft > slo.ttft_ms / 1e3:
        return False
    return slo.tpot_ms is None or (r.tpot or 0.0) <= slo.tpot_ms / 1e3


def simulate_colocated(trace: Trace, *, hardware: str | Hardware = "A100-80GB-practical",
                       model: str | ModelShape = "llama-7b", num_gpus: int = 1,
                       engine_config: EngineConfig | dict[str, Any] | None = None, kv_fraction: float = 0.9,
                       slo: SLO | None = None, layout: InstanceLayout | None = None) -> ServingResult:
    """Ordinary engines (prefill and decode together) on `num_gpus` GPUs, requests round-robin: one per
    GPU, or with `layout` one per `layout.num_gpus` GPUs (each of its pp virtual engines served in turn)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    per = layout.num_gpus if layout is not None else 1
    if num_gpus % per:
        raise ValueError(f"num_gpus={num_gpus} is not a whole number of {layout.name} instances ({per} GPUs each)")
    config = _engine_config(engine_config)
    by_id: dict[str, RequestMetrics] = {}
    for instance in _round_robin(trace.requests, num_gpus // per):
        for part in (deal_to_virtual_engines(instance, layout) if layout is not None else [instance]):
            if part:
                res = simulate(Trace(part, trace.meta), hardware=hardware, model=model, engine_config=config,
                               kv_fraction=kv_fraction, layout=layout)
                by_id.update((m.request_id, m) for m in res.requests)
    requests = [by_id[r.request_id] for r in trace]
    return ServingResult("colocated", num_gpus, requests, summarize(requests, slo=slo))


def _requests_digest(trace: Trace) -> bytes:
    """A fingerprint of everything in `trace`'s requests the prefill side reads (ids, arrivals, priorities,
    prompt tokens, output lengths): a short key for `prefill_cache` in place of the tokens themselves."""
    digest = hashlib.blake2b(digest_size=20)
    for r in trace:
        digest.update(repr((r.request_id, r.arrival_time_s, r.priority, r.max_tokens, r.prompt_len)).encode())
        digest.update(array("q", r.prompt_token_ids).tobytes())
    return digest.digest()


def run_prefill_instances(trace: Trace, hw: Hardware, shape: ModelShape, config: EngineConfig, kv_fraction: float,
                          num_prefill: int = 1, layout: InstanceLayout | None = None) -> dict[str, RequestMetrics]:
    """The prefill side alone: each request's prompt and first token (`max_tokens=1`) on `num_prefill`
    instances of `layout`, requests round-robin (and over each instance's virtual engines)."""
    layout = layout or InstanceLayout()
    prefilled: dict[str, RequestMetrics] = {}
    for instance in _round_robin(trace.requests, num_prefill):
        for part in deal_to_virtual_engines(instance, layout):
            if part:
                first_only = Trace([dataclasses.replace(r, max_tokens=1) for r in part], trace.meta)
                res = simulate(first_only, hardware=hw, model=shape, engine_config=config,
                               kv_fraction=kv_fraction, layout=layout)
                prefilled.update((m.request_id, m) for m in res.requests)
    return prefilled


def run_decode_instances(trace: Trace, handed: dict[str, float], hw: Hardware, shape: ModelShape,
                         config: EngineConfig, kv_fraction: float, num_decode: int = 1,
                         layout: InstanceLayout | None = None) -> tuple[dict[str, RequestMetrics], int, int]:
    """The decode side alone: each request of more than one token arrives, prompt + token 1 as KV, at
    `handed[request_id]`, on `num_decode` instances of `layout` in order of arrival. Returns the metrics
    by id, the prompt tokens taken in as KV, and the tokens recomputed after preemption."""
    layout = layout or InstanceLayout()
    to_decode = sorted((r for r in trace if r.max_tokens > 1), key=lambda r: (handed[r.request_id], r.request_id))
    decoded: dict[str, RequestMetrics] = {}
    loaded = recomputed = 0
    for part in (ve for instance in _round_robin(to_decode, num_decode)
                 for ve in deal_to_virtual_engines(instance, layout)):
        if part:
            moved = Trace([dataclasses.replace(r, arrival_time_s=handed[r.request_id],
                                               prompt_token_ids=[*r.prompt_token_ids, 0], max_tokens=r.max_tokens - 1)
                           for r in part], trace.meta)
            metrics, executor = _run_decode_instance(moved, hw, shape, config, kv_fraction, layout)
            decoded.update((m.request_id, m) for m in metrics)
            loaded += executor.loaded_tokens
            recomputed += executor.recomputed_tokens
    return decoded, loaded, recomputed


def simulate_disaggregated(trace: Trace, *, hardware: str | Hardware = "A100-80GB-practical",
                           model: str | ModelShape = "llama-7b", link: str | Link = "NVLink3",
                           num_prefill: int = 1, num_decode: int = 1,
                           engine_config: EngineConfig | dict[str, Any] | None = None,
                           decode_engine_config: EngineConfig | dict[str, Any] | None = None,
                           kv_fraction: float = 0.9, slo: SLO | None = None,
                           transfer_bytes_per_token: float | None = None,
                           prefill_layout: InstanceLayout | None = None,
                           decode_layout: InstanceLayout | None = None,
                           prefill_cache: dict | None = None) -> ServingResult:
    """`num_prefill` prefill instances and `num_decode` decode instances joined by `link` (see the module
    docstring). `engine_config` is the prefill instances' (and by default the decode instances').
    `transfer_bytes_per_token`: bytes moved per prompt token (default the model's KV bytes per token;
    less for fp8 or compressed KV, more to see a bigger model's KV on this link): the transfer only.
    `prefill_layout`, `decode_layout`: each instance's TP x PP (`minillm.sim.instance_layout`; default
    one GPU). A sharded KV cache moves in parallel, one shard per GPU pair: over min(prefill GPUs,
    decode GPUs) links of `link` at once.
    `prefill_cache`: a dict (empty at first) in which to keep the prefill side's results and find them
    again. That side depends on the trace, the hardware, the model, the prefill instances and their config
    only, not on the link or the decode side, so a search that tries several links or decode layouts at
    the same rates (`goodput.compare_colocated_vs_pd`, `phase_layouts.compare_phase_layouts`) runs it
    once per rate. The key holds all of those inputs, so one dict may serve any calls; nothing changes
    in what is computed."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"num_prefill and num_decode must be >= 1, got {num_prefill}, {num_decode}")
    if transfer_bytes_per_token is not None and not transfer_bytes_per_token >= 0:
        raise ValueError(f"transfer_bytes_per_token must be >= 0 (None: the model's KV bytes), got {transfer_bytes_per_token!r}")
    hw, shape, lk = _hw(hardware), _shape(model), _link(link)
    prefill_layout, decode_layout = prefill_layout or InstanceLayout(), decode_layout or InstanceLayout()
    prefill_config = _engine_config(engine_config)
    decode_config = _engine_config(decode_engine_config if decode_engine_config is not None else engine_config)

    # 1. prefill instances (each of its virtual engines in turn, with PP): prompt + first token
    if prefill_cache is None:
        prefilled = run_prefill_instances(trace, hw, shape, prefill_config, kv_fraction, num_prefill, prefill_layout)
    else:
        key = (_requests_digest(trace), hw, shape, repr(prefill_config), kv_fraction, num_prefill, prefill_layout)
        if key not in prefill_cache:
            prefill_cache[key] = run_prefill_instances(trace, hw, shape, prefill_config, kv_fraction, num_prefill,
                                                       prefill_layout)
        prefilled = prefill_cache[key]  # (read only below: the same records may serve several runs)

    # 2. the transfer: each prefill instance's links send one prompt's KV at a time, in the order prefills end
    per_token = shape.kv_bytes_per_token(hw.dtype_bytes) if transfer_bytes_per_token is None else transfer_bytes_per_token
    parallel_links = min(prefill_layout.num_gpus, decode_layout.num_gpus)
    transfer: dict[str, float] = {}
    handed: dict[str, float] = {}
    for part in _round_robin(trace.requests, num_prefill):
        link_free = 0.0
        for r in sorted(part, key=lambda r: (prefilled[r.request_id].first_token_time, r.request_id)):
            transfer[r.request_id] = lk.message_time_s(r.prompt_len * per_token / parallel_links)
            start = max(prefilled[r.request_id].first_token_time, link_free)
            handed[r.request_id] = link_free = start + transfer[r.request_id]
    # 3. decode instances, in order of arrival there
    decoded, loaded, recomputed = run_decode_instances(trace, handed, hw, shape, decode_config, kv_fraction,
                                                       num_decode, decode_layout)

    # 4. one record per request, as the user saw it
    requests = []
    for r in trace:
        p = prefilled[r.request_id]
        d = decoded.get(r.request_id)
        # token 1 reaches the user once the decode instance admits the request (a seat in its batch and
        # blocks for the KV): its wait there is part of TTFT. A one-token request ends at the transfer.
        first = handed[r.request_id] if d is None else d.first_scheduled_time
        m = RequestMetrics(r.request_id, r.arrival_time_s, r.prompt_len, first_scheduled_time=p.first_scheduled_time,
                           first_token_time=first, token_times=[first], finished_time=first, finish_reason="length")
        if d is not None:
            m.token_times += d.token_times
            m.finished_time = d.finished_time
            m.num_preemptions = p.num_preemptions + d.num_preemptions
        requests.append(m)
    num_gpus = num_prefill * prefill_layout.num_gpus + num_decode * decode_layout.num_gpus
    return ServingResult("disaggregated", num_gpus, requests, summarize(requests, slo=slo),
                         transfer_s=[transfer[r.request_id] for r in trace], handed_s=[handed[r.request_id] for r in trace],
                         transfer_bytes=round(sum(r.prompt_len for r in trace) * per_token),
                         loaded_tokens=loaded, recomputed_tokens=recomputed)
