"""One serving instance spread over several GPUs: its TP x PP layout on the simulator (chapter 13).

Chapter 12 priced one step of a model split by tensor parallelism (TP) and pipeline parallelism
(PP). Chapter 13 asks which split each *phase* wants (DistServe searches it per phase, Splitwise
even picks different hardware): a prefill instance and a decode instance may be laid out
differently. This module turns a layout into what the engine simulation needs:

* **TP t:** one engine. A step costs `parallel.tp_step_time` (each GPU does 1/t of the FLOPs and
  reads 1/t of the weights, plus 2 all-reduces per layer over `tp_link`), and the KV pool is what
  one GPU has left after its share of the weights, counted in whole tokens (each GPU keeps its KV
  heads' share of every token).
* **PP p:** p *virtual engines* (vLLM's name), one batch each in flight, the requests dealt to them
  in turn. A virtual engine's step crosses every stage in order, each taking as long as the
  slowest (`stage_layers`, the engine's split), plus p - 1 hops of the step's hidden states over
  `pp_link`; while it does, the other virtual engines' batches occupy the other stages. So one
  request is no faster than on one GPU, but p batches progress at once. Each GPU holds the KV of
  its stage's layers for every token of the instance; the pool is shared out evenly among the
  virtual engines, as vLLM's cache engines do.

What it leaves out: stage contention when the virtual engines' batches differ in size (each is
costed as if the others were like it) and any overlap of messages with compute (chapter 12's
caveats). `InstanceLayout.step_cost` is what `SimExecutor` charges when given a layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.sim.cost_model import StepCost, step_time
from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape
from minillm.sim.network import NVLINK3_A100, Link, send_recv_time_s
from minillm.sim.parallel import check_tp, memory_per_device, stage_layers, tp_step_time


@dataclass(frozen=True)
class InstanceLayout:
    """TP x PP of one instance (a prefill or a decode instance, or a colocated engine)."""

    tp: int = 1
    pp: int = 1
    tp_link: Link = NVLINK3_A100
    pp_link: Link = NVLINK3_A100

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"an instance needs tp >= 1 and pp >= 1, got tp={self.tp}, pp={self.pp}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        parts = [f"TP {self.tp}"] if self.tp > 1 or self.pp == 1 else []
        return " x ".join(parts + ([f"PP {self.pp}"] if self.pp > 1 else []))

    @property
    def num_virtual_engines(self) -> int:
        return self.pp

    def check(self, shape: ModelShape) -> None:
        """Refuse a layout the model cannot be split into (heads for TP, layers for PP)."""
        check_tp(shape, self.tp)
        stage_layers(shape.num_layers, self.pp)

    def kv_tokens_per_engine(self, hw: Hardware, shape: ModelShape, kv_fraction: float = 0.9) -> int:
        """KV room of one (virtual) engine, in tokens: the fullest GPU's room, shared by the pp virtual engines."""
        self.check(shape)
        memory = memory_per_device(hw, shape, tp=self.tp, pp=self.pp, gpu_memory_utilization=kv_fraction)
        return memory.kv_tokens // self.pp

    def step_cost(self, hw: Hardware, shape: ModelShape, *, prefill_tokens: Sequence[int] = (),
                  prefill_context: Sequence[int] | None = None, decode_context_lens: Sequence[int] = (),
                  padding_tokens: int = 0) -> StepCost:
        """One (virtual) engine's step, as a `StepCost` whose `time_s` is the layout's: the slowest stage's
        time on every stage (TP inside each), the lm_head once, p - 1 hops, the step's fixed overhead once."""
        whole = step_time(hw, shape, prefill_tokens=prefill_tokens, prefill_context=prefill_context,
                          decode_context_lens=decode_context_lens, padding_tokens=padding_tokens)
        if self.num_gpus == 1:
            return whole
        if padding_tokens:
            raise ValueError(f"{self.name}: padded batches (static/dynamic batching) are costed on one GPU only; "
                             "use continuous batching with a multi-GPU layout")
        padded = _stage_padded(shape, self.pp)
        split = tp_step_time(hw, padded, self.tp, self.tp_link, prefill_tokens=prefill_tokens,
                             prefill_context=prefill_context, decode_context_lens=decode_context_lens,
                             whole=whole if padded is shape else None)  # (equal stages: the same step)
        hops_s = (self.pp - 1) * send_recv_time_s(whole.num_tokens * shape.hidden_size * hw.dtype_bytes, self.pp_link)
        return dataclasses.replace(whole, compute_time_s=split.compute_s, memory_time_s=split.memory_s,
                                   overhead_s=split.overhead_s + split.comm_s + hops_s)


@functools.lru_cache(maxsize=64)
def _stage_padded(shape: ModelShape, pp: int) -> ModelShape:
    """`shape` with pp times the largest stage's layers (every stage runs as long as the slowest): `shape`
    itself when the layers split evenly. Kept, since the simulator asks for it at every step."""
    num_layers = pp * max(stage_layers(shape.num_layers, pp))
    return shape if num_layers == shape.num_layers else dataclasses.replace(shape, num_layers=num_layers)


def deal_to_virtual_engines(requests: Sequence, layout: InstanceLayout) -> list[list]:
    """The instance's requests dealt in turn to its pp virtual engines (one list for TP alone)."""
    n = layout.num_virtual_engines
    return [list(requests[i::n]) for i in range(n)]
