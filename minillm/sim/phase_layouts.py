"""Which parallelism each phase wants: goodput per GPU of every prefill layout x decode layout (chapter 13).

DistServe (Zhong et al., OSDI 2024) searches the parallelism of the prefill instances and of the
decode instances separately, because the phases want different things: a prefill is
compute-bound and its queue sets TTFT, so tensor parallelism (shorter prefills) and pipeline
parallelism (more prefills at once) trade latency against throughput; a decode step is bound by
reading the weights, so TP shortens TPOT while PP's virtual engines add batches without shortening
any. Splitwise (Patel et al., ISCA 2024) goes further and gives the phases different GPUs.

    from minillm.sim.phase_layouts import compare_phase_layouts, print_phase_grid
    layouts = (InstanceLayout(), InstanceLayout(tp=2), InstanceLayout(pp=2))
    rows = compare_phase_layouts(trace, name="azure-code", layouts=layouts)
    print_phase_grid(rows)

Each pairing is one prefill instance and one decode instance (`disagg.simulate_disaggregated` with
`prefill_layout` and `decode_layout`, both objectives checked on every request), and its goodput
(`goodput.goodput`, DistServe's measure) is divided by all the GPUs the pair uses, so a pair of
2 + 1 GPUs is compared fairly with 1 + 1. The instance counts are fixed at one each: DistServe
also searches the ratio (`compare_colocated_vs_pd`'s `ratios` does that for one GPU per instance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minillm.metrics import SLO
from minillm.sim.disagg import simulate_disaggregated
from minillm.sim.goodput import ATTAINMENT, DEFAULT_SLOS, goodput
from minillm.sim.hardware import A100_80GB_PRACTICAL, Hardware, get_hardware
from minillm.sim.instance_layout import InstanceLayout
from minillm.sim.model_shapes import ModelShape, get_model_shape
from minillm.sim.network import Link, get_link
from minillm.traces.trace import Trace


@dataclass(frozen=True)
class PhaseLayoutRow:
    """One pairing's goodput: `prefill` and `decode` are the layouts' names ("TP 1", "TP 2", "PP 2")."""

    trace: str
    prefill: str
    decode: str
    num_gpus: int
    goodput: float  # req/s, the pair together
    per_gpu: float
    probes: int  # simulations the search ran


def compare_phase_layouts(trace: Trace, *, name: str, layouts: Sequence[InstanceLayout],
                          hardware: Hardware | str = A100_80GB_PRACTICAL, model: str | ModelShape = "llama-7b",
                          link: str | Link = "NVLink3", slo: SLO | None = None, attainment: float = ATTAINMENT,
                          rel_tol: float = 0.03, start_rate: float = 1.0) -> list[PhaseLayoutRow]:
    """Goodput of one prefill instance + one decode instance for every (prefill, decode) pair of `layouts`,
    on `trace` with `slo` (default `DEFAULT_SLOS[name]`), the KV moving over `link`."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    shape = get_model_shape(model) if isinstance(model, str) else model
    lk = get_link(link) if isinstance(link, str) else link
    slo = slo or DEFAULT_SLOS.get(name)
    if slo is None:
        raise ValueError(f"no SLO given and no default for {name!r} (defaults: {', '.join(DEFAULT_SLOS)})")
    if len({layout.name for layout in layouts}) != len(layouts):
        raise ValueError(f"layouts must differ by name, got {[layout.name for layout in layouts]}")
    for layout in layouts:
        layout.check(shape)
    rows = []
    prefill_cache: dict = {}  # a prefill layout's searches probe many of the same rates: its side runs once per rate
    for prefill in layouts:
        for decode in layouts:
            found = goodput(lambda t, p=prefill, d=decode: simulate_disaggregated(
                t, hardware=hw, model=shape, link=lk, prefill_layout=p, decode_layout=d, prefill_cache=prefill_cache),
                trace, slo, attainment=attainment, rel_tol=rel_tol, start_rate=start_rate)
            rows.append(PhaseLayoutRow(name, prefill.name, decode.name, found.num_gpus, found.rate, found.per_gpu,
                                       len(found.probes)))
    return rows


def print_phase_grid(rows: Sequence[PhaseLayoutRow]) -> None:
    """Goodput per GPU as a grid: one line per prefill layout, one column per decode layout."""
    prefills = list(dict.fromkeys(r.prefill for r in rows))
    decodes = list(dict.fromkeys(r.decode for r in rows))
    cell = {(r.prefill, r.decode): r for r in rows}
    print(f"{rows[0].trace}: goodput per GPU (req/s), one prefill instance (rows) + one decode instance (columns)")
    print(f"{'prefill/decode':<16}" + "".join(f"{d:>16}" for d in decodes))
    for p in prefills:
        print(f"{p:<16}" + "".join(f"{cell[(p, d)].per_gpu:>9.2f} ({cell[(p, d)].num_gpus} GPU)" for d in decodes))


def best_pairing(rows: Sequence[PhaseLayoutRow]) -> PhaseLayoutRow:
    """The pairing with the most goodput per GPU (the first in `rows` on a tie)."""
    return max(rows, key=lambda r: r.per_gpu)
