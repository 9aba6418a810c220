"""Goodput, DistServe's way, of colocated and disaggregated serving on the simulator (chapter 13).

    from minillm.sim.goodput import compare_colocated_vs_pd, print_goodput_table, goodput_traces
    traces = goodput_traces(200)                       # Azure conv + code (real), and a synthetic one
    rows = compare_colocated_vs_pd(traces["azure-conv"], hardware="A100-80GB-practical")
    print_goodput_table(rows)

    python -m minillm.sim.goodput     # the chapter's table: 7B on A100 and H100, NVLink and InfiniBand

**Goodput** (Zhong et al., "DistServe", OSDI 2024): the highest request rate at which at least
`attainment` (X, here 90 % as in DistServe) of the requests meet BOTH a TTFT SLO and a TPOT SLO,
per GPU, so a 2-GPU disaggregated pair is compared fairly with one colocated GPU. It differs from
chapter 04's goodput (requests per second that met the SLOs in one run): this one asks how much
traffic a deployment can take before it breaks its promises.

The rate is varied on one fixed set of requests: arrivals are stretched or squeezed (`at_rate`), so a
real trace keeps its burstiness and its lengths at every rate. The search doubles the rate until X
is missed, then bisects (in log scale) to `rel_tol`; it assumes attainment falls as the rate rises,
which queueing makes true up to noise (`attainment_curve` shows the curve it searched).

SLOs are ours (the chapter's defaults, `DEFAULT_SLOS`), chosen for a 7B model: an idle A100 prefills
a 1000-token prompt in ~90 ms and decodes a step in ~15 ms, so TTFT <= 1 s and TPOT <= 50 ms leave
room for queueing and for batching, and a 2000-token code prompt gets TTFT <= 2 s.

Published results, for comparison (their setups, not ours: larger models, tensor parallelism,
their own schedulers and placement search):

* DistServe (Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized
  Large Language Model Serving", OSDI 2024, arXiv:2401.09670) defines goodput as the maximum request
  rate that can be served within both TTFT and TPOT constraints on each GPU, and reports serving
  7.4x more requests or a 12.6x tighter SLO than state-of-the-art systems while keeping > 90 % of
  requests within the constraints (the abstract; the first arXiv version and the Hao AI Lab post,
  https://hao-ai-lab.github.io/summary/distserve, said 4.48x and 10.2x). DistServe also searches the
  parallelism and the prefill:decode ratio per workload; here the ratio is a knob (`ratios`).
* Splitwise (Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
  ISCA 2024, arXiv:2311.18677) splits the phases onto separate machines, moves the KV state over
  the cluster's back-plane interconnect (InfiniBand), and reports up to 1.4x higher throughput at
  20 % lower cost, or 2.35x more throughput under the same power and cost budgets, than current
  designs. Its traces are the ones in data/traces/ (coding and conversation, lengths only: it sent
  prompts of the traced lengths and forced the traced output lengths, as `azure_trace` does); its
  baseline is mixed batching, as the colocated engine here (chunked prefill off).
* vLLM's documentation of its disaggregated prefilling (https://docs.vllm.ai/en/latest/features/disagg_prefill/)
  gives two reasons for it, tuning TTFT and ITL separately and controlling tail ITL, notes that chunked
  prefill with a proper chunk size can achieve the same goal but that the right size is hard to find
  in practice, and says that disaggregated prefill does not improve throughput. `chunked_budgets`
  puts that alternative in the table: a colocated GPU with chunked prefill.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minillm.metrics import SLO
from minillm.sim.disagg import ServingResult, meets, simulate_colocated, simulate_disaggregated
from minillm.sim.hardware import A100_80GB_PRACTICAL, H100_SXM, Hardware
from minillm.sim.model_shapes import ModelShape
from minillm.sim.network import Link, get_link
from minillm.traces.trace import Trace

ATTAINMENT = 0.9  # DistServe's X: at least 90 % of requests within both SLOs
DEFAULT_SLOS = {"azure-conv": SLO(ttft_ms=1000, tpot_ms=50), "azure-code": SLO(ttft_ms=2000, tpot_ms=50),
                "synthetic": SLO(ttft_ms=1000, tpot_ms=50)}
# The A100 preset's efficiency factors (fitted to NVIDIA's NeMo latencies, minillm.sim.hardware) applied to
# the H100's roofs: an assumption (no such fit for the H100 here), so both GPUs run equally far from peak.
H100_PRACTICAL = dataclasses.replace(H100_SXM, name="H100-SXM-practical", mfu=A100_80GB_PRACTICAL.mfu,
                                     mbu=A100_80GB_PRACTICAL.mbu, step_overhead_s=A100_80GB_PRACTICAL.step_overhead_s,
                                     per_request_overhead_s=A100_80GB_PRACTICAL.per_request_overhead_s)


def mean_rate(trace: Trace) -> float:
    """Requests per second over the trace's span (first to last arrival)."""
    span = trace.requests[-1].arrival_time_s - trace.requests[0].arrival_time_s
    if len(trace) < 2 or not span > 0:
        raise ValueError("the trace needs at least two requests arriving at different times to have a rate")
    return (len(trace) - 1) / span


def at_rate(trace: Trace, rate_per_s: float) -> Trace:
    """The same requests with every gap scaled so the mean rate is `rate_per_s` (burstiness kept)."""
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"rate_per_s must be a positive number, got {rate_per_s!r}")
    scale = mean_rate(trace) / rate_per_s
    t0 = trace.requests[0].arrival_time_s
    requests = [dataclasses.replace(r, arrival_time_s=(r.arrival_time_s - t0) * scale) for r in trace]
    return Trace(requests, {**trace.meta, "rate_per_s": rate_per_s})


Runner = Callable[[Trace], ServingResult]


@dataclass(frozen=True)
class Goodput:
    """Where the search ended: the highest rate probed that met the target, and what it saw."""

    rate: float  # requests/s for the whole deployment (0: not even the lowest rate probed)
    num_gpus: int
    attainment: float  # at `rate`
    probes: tuple[tuple[float, float], ...]  # (rate, attainment) in the order probed
    result: ServingResult | None  # the run at `rate`

    @property
    def per_gpu(self) -> float:
        return self.rate / self.num_gpus


def attainment_at(run: Runner, trace: Trace, rate: float, slo: SLO) -> tuple[float, ServingResult]:
    result = run(at_rate(trace, rate))
    return sum(meets(r, slo) for r in result.requests) / len(result.requests), result


def goodput(run: Runner, trace: Trace, slo: SLO, *, attainment: float = ATTAINMENT, start_rate: float = 1.0,
            rel_tol: float = 0.03, min_rate: float = 1e-3, max_rate: float = 1e4) -> Goodput:
    """The highest rate (within `rel_tol`) at which `run` keeps `attainment` of `trace`'s requests within `slo`."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment!r}")
    if slo.ttft_ms is None and slo.tpot_ms is None:
        raise ValueError("goodput needs a TTFT or a TPOT SLO (or both)")
    if not rel_tol > 0 or not 0 < min_rate <= start_rate <= max_rate:  # (rel_tol 0 would bisect forever)
        raise ValueError(f"goodput needs rel_tol > 0 and 0 < min_rate <= start_rate <= max_rate, got rel_tol={rel_tol!r}, "
                         f"min_rate={min_rate!r}, start_rate={start_rate!r}, max_rate={max_rate!r}")
    probes: list[tuple[float, float]] = []
    results: dict[float, ServingResult] = {}

    def ok(rate: float) -> bool:
        share, result = attainment_at(run, trace, rate, slo)
        probes.append((rate, share))
        results[rate] = result
        return share >= attainment

    lo, hi = None, None
    rate = start_rate
    if ok(rate):
        lo = rate
        while hi is None:
            rate *= 2
            if rate > max_rate:
                raise ValueError(f"still within the SLOs at {rate / 2:g} req/s: raise max_rate or tighten the SLOs")
            if ok(rate):
                lo = rate
            else:
                hi = rate
    else:
        hi = rate
        while lo is None:
            rate /= 2
            if rate < min_rate:
                num_gpus = results[hi].num_gpus
                return Goodput(0.0, num_gpus, 0.0, tuple(probes), None)
            if ok(rate):
                lo = rate
            else:
                hi = rate
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    share = dict(probes)[lo]
    return Goodput(lo, results[lo].num_gpus, share, tuple(probes), results[lo])


def attainment_curve(run: Runner, trace: Trace, rates: Sequence[float], slo: SLO) -> list[tuple[float, float]]:
    """(rate, share of requests within both SLOs) at each rate: the curve goodput reads its answer off."""
    return [(rate, attainment_at(run, trace, rate, slo)[0]) for rate in rates]


# --- the comparison ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoodputRow:
    trace: str
    hardware: str
    mode: str  # "colocated", "chunked 512" (colocated, chunked prefill at that budget), "PD 1:1" ...
    link: str  # "-" for colocated
    num_gpus: int
    goodput: float  # req/s, the whole deployment
    per_gpu: float
    ttft_p90_ms: float  # at the goodput rate
    tpot_p90_ms: float
    transfer_mean_ms: float  # KV transfer per request (0 colocated)
    probes: int  # simulations the search ran


def _p90(values: Sequence[float]) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]


def _row(name: str, hw: Hardware, mode: str, link: str, found: Goodput) -> GoodputRow:
    res = found.result
    ttft = [1e3 * r.ttft for r in res.requests if r.ttft is not None] if res else []
    tpot = [1e3 * r.tpot for r in res.requests if r.tpot is not None] if res else []
    transfer = 1e3 * sum(res.transfer_s) / len(res.transfer_s) if res and res.transfer_s else 0.0
    return GoodputRow(name, hw.name, mode, link, found.num_gpus, found.rate, found.per_gpu, _p90(ttft), _p90(tpot),
                      transfer, len(found.probes))


def compare_colocated_vs_pd(trace: Trace, *, name: str = "trace", hardware: Hardware | str = A100_80GB_PRACTICAL,
                            model: str | ModelShape = "llama-7b",
                            links: Sequence[str | Link] = ("NVLink3", "InfiniBand HDR"),
                            ratios: Sequence[tuple[int, int]] = ((1, 1),), slo: SLO | None = None,
                            attainment: float = ATTAINMENT, rel_tol: float = 0.03,
                            engine_config: dict | None = None, chunked_budgets: Sequence[int] = ()) -> list[GoodputRow]:
    """Goodput of one colocated GPU and of PD deployments (`ratios` = (prefill, decode) instances, one GPU
    each) over each of `links`, on `trace` with `slo` (default: `DEFAULT_SLOS[name]`). `chunked_budgets`
    adds a colocated GPU with chunked prefill at each token budget (chapter 08's cure for the same stall)."""
    from minillm.sim.hardware import get_hardware

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    slo = slo or DEFAULT_SLOS.get(name)
    if slo is None:
        raise ValueError(f"no SLO given and no default for {name!r} (defaults: {', '.join(DEFAULT_SLOS)})")
    rows = []
    colocated = goodput(lambda t: simulate_colocated(t, hardware=hw, model=model, engine_config=engine_config),
                        trace, slo, attainment=attainment, rel_tol=rel_tol)
    rows.append(_row(name, hw, "colocated", "-", colocated))
    for budget in chunked_budgets:
        chunked = {**(engine_config or {}), "enable_chunked_prefill": True, "max_num_batched_tokens": budget}
        found = goodput(lambda t, c=chunked: simulate_colocated(t, hardware=hw, model=model, engine_config=c),
                        trace, slo, attainment=attainment, rel_tol=rel_tol, start_rate=colocated.rate or 1.0)
        rows.append(_row(name, hw, f"chunked {budget}", "-", found))
    prefill_cache: dict = {}  # the links' searches probe the same rates: the prefill side runs once per rate
    for prefill, decode in ratios:
        for link in links:
            lk = get_link(link) if isinstance(link, str) else link
            found = goodput(lambda t, lk=lk, p=prefill, d=decode: simulate_disaggregated(
                t, hardware=hw, model=model, link=lk, num_prefill=p, num_decode=d, engine_config=engine_config,
                prefill_cache=prefill_cache),
                trace, slo, attainment=attainment, rel_tol=rel_tol, start_rate=colocated.rate or 1.0)
            rows.append(_row(name, hw, f"PD {prefill}:{decode}", lk.name, found))
    return rows


def kv_bytes_sweep(trace: Trace, bytes_per_token: Sequence[float], *, name: str = "trace",
                   hardware: Hardware | str = A100_80GB_PRACTICAL, model: str | ModelShape = "llama-7b",
                   link: str | Link = "InfiniBand HDR", slo: SLO | None = None, attainment: float = ATTAINMENT,
                   rel_tol: float = 0.03) -> list[tuple[float, float]]:
    """(bytes moved per prompt token, PD 1:1 goodput per GPU over `link`) for each value: where the link
    starts to matter. The model's own KV bytes per token (0.5 MiB for Llama-2-7B in fp16, a quarter with
    GQA-8, half again in fp8) is one point on this axis; compare with the colocated goodput per GPU."""
    from minillm.sim.hardware import get_hardware

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    slo = slo or DEFAULT_SLOS.get(name)
    if slo is None:
        raise ValueError(f"no SLO given and no default for {name!r} (defaults: {', '.join(DEFAULT_SLOS)})")
    out, prefill_cache = [], {}  # only the transfer differs between the values: the prefill side is shared
    for b in bytes_per_token:
        found = goodput(lambda t, b=b: simulate_disaggregated(t, hardware=hw, model=model, link=link,
                                                              transfer_bytes_per_token=b, prefill_cache=prefill_cache),
                        trace, slo, attainment=attainment, rel_tol=rel_tol)
        out.append((float(b), found.per_gpu))
    return out


def print_goodput_table(rows: Sequence[GoodputRow], *, slo: SLO | None = None, attainment: float = ATTAINMENT) -> None:
    """One line per deployment; the per-GPU ratio is against the colocated row of the same trace and GPU."""
    if slo is not None:
        print(f"goodput: highest rate with >= {attainment:.0%} of requests within TTFT <= {slo.ttft_ms:g} ms "
              f"and TPOT <= {slo.tpot_ms:g} ms")
    width = max([12, *(len(r.mode) for r in rows)])  # room for "chunked 2048"
    head = (f"{'trace':<11} {'GPU':<20} {'deployment':<{width}} {'KV link':<26} {'GPUs':>4} {'req/s':>7} {'per GPU':>8} "
            f"{'x coloc':>7} {'p90 TTFT ms':>11} {'p90 TPOT ms':>11} {'KV xfer ms':>10}")
    print(head)
    print("-" * len(head))
    base = {(r.trace, r.hardware): r.per_gpu for r in rows if r.mode == "colocated"}
    for r in rows:
        ref = base.get((r.trace, r.hardware))
        times = f"{r.per_gpu / ref:7.2f}" if ref else f"{'-':>7}"
        print(f"{r.trace:<11} {r.hardware:<20} {r.mode:<{width}} {r.link:<26} {r.num_gpus:>4} {r.goodput:>7.2f} "
              f"{r.per_gpu:>8.2f} {times} {r.ttft_p90_ms:>11.0f} {r.tpot_p90_ms:>11.1f} {r.transfer_mean_ms:>10.2f}")


def goodput_traces(num_requests: int = 200, *, start_s: float = 600.0, seed: int = 0) -> dict[str, Trace]:
    """The chapter's three traces of `num_requests` each: Azure conv and code from `start_s` into their hour
    (real arrivals and lengths, Splitwise's traces; prompts cut to fit Llama-2's 4,096 tokens as the other
    chapters cut them, `meta["clipped_prompts"]` says how many), and a synthetic one for contrast (Poisson
    arrivals, lengths uniform around the conv trace's medians: no bursts, no long tail)."""
    from minillm.traces.synthetic import azure_trace, make_trace

    return {
        "azure-conv": azure_trace("conv", start_s=start_s, max_requests=num_requests, seed=seed, max_model_len=4096),
        "azure-code": azure_trace("code", start_s=start_s, max_requests=num_requests, seed=seed, max_model_len=4096),
        "synthetic": make_trace(num_requests, seed=seed, vocab_size=32000, rate_per_s=5.0,
                                prompt_len=("uniform", 512, 1536), output_len=("uniform", 64, 192),
                                max_prompt_len=4096),
    }


def main() -> None:  # pragma: no cover - the chapter's table, printed
    traces = goodput_traces()
    for name, trace in traces.items():
        rows = []
        for hw in (A100_80GB_PRACTICAL, H100_PRACTICAL):
            links = ("NVLink3", "InfiniBand HDR") if hw is A100_80GB_PRACTICAL else ("NVLink4", "InfiniBand NDR")
            rows += compare_colocated_vs_pd(trace, name=name, hardware=hw, chunked_budgets=(512,), links=links)
            # the other instance ratios (docs/simulator.md's "PD 2:1" and "PD 1:2" columns), over NVLink only
            rows += [row for row in compare_colocated_vs_pd(trace, name=name, hardware=hw, links=links[:1],
                                                            ratios=((2, 1), (1, 2)))
                     if row.mode.startswith("PD")]
        print_goodput_table(rows, slo=DEFAULT_SLOS[name])
        print()


if __name__ == "__main__":  # pragma: no cover
    main()
