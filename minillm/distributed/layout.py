"""Who holds what when one model runs on several ranks: the layout of TP × PP (chapter 12).

`world_size = tensor_parallel_size × pipeline_parallel_size` processes. As in vLLM, the ranks of
one pipeline stage are consecutive: global rank = stage · tp + tp_rank, so stage s's tensor-parallel
group is ranks [s·tp, (s+1)·tp), and rank r of a stage sends its hidden states to rank r of the next.

- Layers split into stages as vLLM splits them: num_layers // pp each, and the remainder given one
  by one to the stages before the last (3 layers on 2 stages: 2 + 1; 5 on 3: 2 + 2 + 1) — the last
  stage also holds the final norm and the lm_head.
- Each tensor-parallel rank holds num_heads / tp query heads and the KV heads they read: its
  num_kv_heads / tp of them, or, with fewer KV heads than ranks, the one KV head its query heads
  share (replicated on tp / num_kv_heads ranks) — `minillm.distributed.linear.kv_heads_of_rank`.

`check_parallel_config` refuses, naming the number, a world the model cannot split.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.distributed.linear import kv_heads_of_rank
from minillm.model.config import ModelConfig


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's `get_pp_indices`: num_layers // pp each, and the remainder
    one each to the stages before the last, counting back from the second-to-last (4 on 3: [1, 2, 1];
    5 on 3: [2, 2, 1]). The simulator (`minillm.sim.parallel.stage_layers`) uses this same rule."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp} must be at least 1")
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than the model's {num_layers} layers")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    return counts


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global layer indices stage `stage` holds."""
    counts = stage_layer_counts(num_layers, pp)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def check_parallel_config(model: ModelConfig, tp: int, pp: int) -> None:
    """Raise a ValueError naming the number when the model cannot be split over tp × pp ranks."""
    if model.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {model.num_heads} attention heads "
                         f"(num_attention_heads={model.num_heads}): choose a divisor of it")
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} neither divides nor is a multiple of the model's {kv} KV heads "
                         f"(num_key_value_heads={kv})")
    if not model.is_moe and model.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP's intermediate_size="
                         f"{model.intermediate_size}")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than the model's {model.num_layers} layers "
                         f"(num_hidden_layers={model.num_layers})")


@dataclass(frozen=True)
class RankLayout:
    """One rank's place: its stage, its rank in the stage's TP group, and what it holds."""

    rank: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def samples(self) -> bool:
        """The rank that holds the whole logits and samples: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def tp_group_ranks(self, stage: int | None = None) -> list[int]:
        stage = self.stage if stage is None else stage
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    @property
    def prev_rank(self) -> int | None:
        """The rank this one receives hidden states from (its peer in the previous stage)."""
        return None if self.is_first_stage else self.rank - self.tp

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.rank + self.tp

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp, self.stage)

    def kv_heads(self, model: ModelConfig) -> range:
        return kv_heads_of_rank(model.num_heads, model.num_kv_heads, self.tp_rank, self.tp)

    def q_heads(self, model: ModelConfig) -> range:
        per = model.num_heads // self.tp
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)


def output_rank(tp: int, pp: int) -> int:
    """The global rank that samples and answers the driver: TP rank 0 of the last stage."""
    return (pp - 1) * tp
