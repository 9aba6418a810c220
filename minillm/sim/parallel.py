"""Tensor, pipeline and expert parallelism in the simulator: time, memory and traffic (chapter 12).

Four ways to put one model (or copies of it) on several devices, and what each costs
(`minillm.sim.network` prices the messages):

* **Tensor parallel (TP, Megatron-LM):** every layer's matrices are split across `tp` devices —
  q/k/v and gate/up by columns (each device owns some heads and some of the MLP), o and down by
  rows — so each device reads 1/tp of the weights and does 1/tp of the FLOPs, then the partial
  outputs are summed by an all-reduce after o_proj and after down_proj: 2 per layer, of
  `tokens x hidden` activations, plus one for the vocab-parallel embedding and a gather of the
  logits. Decode is memory-bound, so TP cuts per-token latency — until the all-reduces, whose
  latency does not shrink with tp, cost more than the matmuls they separate.
* **Pipeline parallel (PP):** layers split into `pp` stages as vLLM's `get_pp_indices` splits them
  (`minillm.distributed.layout.stage_layer_counts`: 4 layers on 3 stages are 1 + 2 + 1, the extra
  layers going to the stages before the last); a micro-batch's hidden states go from stage to stage
  with send/recv. One request's latency does not improve (it still crosses every layer, plus the
  hops). Two regimes, which `PipelineCost` keeps apart: one batch pushed through once in `m`
  micro-batches (fill and drain, GPipe: each stage idle (p-1)/(m+p-1) of the time), and steady
  decoding, where `m` micro-batches circulate for ever (vLLM's virtual engines: with m >= p every
  stage works every beat). With one stage there is nothing to overlap, and micro-batches are refused.
* **Expert parallel (EP):** an MoE layer's experts on different devices, two all-to-alls per
  layer: see `minillm.sim.expert_parallel`.
* **Data parallel (DP):** whole replicas, each serving its own requests: more throughput, the
  same latencies and the same memory per device (`layout_summary(..., dp=)`).

Memory per device: weights (split by TP and PP) plus the KV cache of the device's layers and KV
heads (KV heads are replicated when tp exceeds them). `memory_per_device` says which model fits
where. What is left out: compute/communication overlap, algorithm switching in NCCL, activation
memory, and the engine overheads of more processes; the presets' roofs are ideal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.distributed.layout import stage_layer_counts
from minillm.sim.cost_model import StepCost, step_time
from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape
from minillm.sim.network import Link, all_gather_time_s, all_reduce_time_s, send_recv_time_s

# --- how a model splits ---------------------------------------------------------------------------


def kv_heads_per_device(shape: ModelShape, tp: int) -> int:
    """KV heads each TP rank holds: kv/tp, or 1 (replicated) when there are fewer KV heads than ranks."""
    check_tp(shape, tp)
    return max(1, shape.num_kv_heads // tp)


def check_tp(shape: ModelShape, tp: int) -> None:
    """The splits vLLM accepts: query heads divisible by tp; KV heads divisible by tp or dividing it."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if shape.num_heads % tp:
        raise ValueError(f"{shape.name}: {shape.num_heads} query heads cannot be split over tensor parallel size {tp}")
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"{shape.name}: {kv} KV heads cannot be split or replicated over tensor parallel size {tp}")


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as the engine (and vLLM) splits them: 3 on 2 [2, 1], 4 on 3 [1, 2, 1]."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline parallel size {pp} must be between 1 and the number of layers ({num_layers})")
    return stage_layer_counts(num_layers, pp)


def layer_params_per_device(shape: ModelShape, tp: int) -> int:
    """One decoder layer's parameters on one TP rank (norms are replicated, KV heads perhaps too)."""
    kv_out = kv_heads_per_device(shape, tp) * shape.head_dim
    q_out = shape.num_heads * shape.head_dim // tp
    attention = shape.hidden_size * (q_out + 2 * kv_out) + q_out * shape.hidden_size
    if shape.qkv_bias:
        attention += q_out + 2 * kv_out
    mlp = 3 * shape.hidden_size * math.ceil(shape.intermediate_size / tp)
    return attention + mlp + 2 * shape.hidden_size


# --- tensor parallel: one step ------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelStepCost:
    """One engine step on one of `tp` devices (they all take the same time)."""

    tp: int
    compute_s: float  # this device's FLOPs at its roof
    memory_s: float  # this device's bytes at its roof
    comm_s: float  # all-reduces + the logits gather; not overlapped with compute
    overhead_s: float
    num_all_reduces: int
    all_reduce_bytes: float  # size of each all-reduce (tokens x hidden x dtype)
    weight_bytes_per_device: float

    @property
    def roofline_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def time_s(self) -> float:
        return self.roofline_s + self.comm_s + self.overhead_s

    @property
    def comm_bound(self) -> bool:
        """True when the device spends longer communicating than computing."""
        return self.comm_s > self.roofline_s


def tp_step_time(
    hw: Hardware,
    shape: ModelShape,
    tp: int,
    link: Link,
    *,
    prefill_tokens: Sequence[int] = (),
    prefill_context: Sequence[int] | None = None,
    decode_context_lens: Sequence[int] = (),
    whole: StepCost | None = None,
) -> ParallelStepCost:
    """One step (the same arguments as `cost_model.step_time`) with the model split over `tp` devices.
    `whole`: that step's `step_time` on one device, if the caller has it already (the simulator prices
    every step twice otherwise); it must be the cost of these very arguments on `hw` and `shape`."""
    check_tp(shape, tp)
    if whole is None:
        whole = step_time(hw, shape, prefill_tokens=prefill_tokens, prefill_context=prefill_context,
                          decode_context_lens=decode_context_lens)
    b = hw.dtype_bytes
    # every FLOP is split: heads (attention), columns/rows (linears), vocabulary (lm_head)
    compute_s = whole.compute_time_s / tp
    weights = (shape.num_layers * layer_params_per_device(shape, tp) + shape.hidden_size
               + math.ceil(shape.vocab_size / tp) * shape.hidden_size) * b
    kv_share = kv_heads_per_device(shape, tp) / shape.num_kv_heads
    kv_bytes = (whole.kv_read_bytes + whole.kv_write_bytes) * kv_share
    memory_s = (weights + kv_bytes) / (hw.mem_bandwidth_bytes_per_s * hw.mbu)
    rows_with_logits = len(prefill_tokens) + len(decode_context_lens)
    activation_bytes = whole.num_tokens * shape.hidden_size * b
    num_all_reduces = 2 * shape.num_layers + 1 if tp > 1 else 0  # o_proj and down_proj per layer; embedding
    comm_s = num_all_reduces * all_reduce_time_s(activation_bytes, tp, link)
    comm_s += all_gather_time_s(rows_with_logits * shape.vocab_size * b, tp, link)
    return ParallelStepCost(tp=tp, compute_s=compute_s, memory_s=memory_s, comm_s=comm_s,
                            overhead_s=whole.overhead_s, num_all_reduces=num_all_reduces,
                            all_reduce_bytes=activation_bytes if tp > 1 else 0.0,
                            weight_bytes_per_device=weights)


def tp_decode_scaling(
    hw: Hardware, shape: ModelShape, link: Link, *, batch: int = 1, context_len: int = 1024,
    tp_degrees: Sequence[int] = (1, 2, 4, 8),
) -> list[ParallelStepCost]:
    """A decode step of `batch` sequences at each TP degree: per-token latency is each row's time_s."""
    return [tp_step_time(hw, shape, tp, link, decode_context_lens=[context_len] * batch) for tp in tp_degrees]


def scaling_stops_at(rows: Sequence[ParallelStepCost]) -> int:
    """The TP degree with the shortest step: beyond it, more devices make the step slower."""
    return min(rows, key=lambda r: r.time_s).tp


# --- pipeline parallel --------------------------------------------------------------------------


def pipeline_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Share of a fill-and-drain pipeline's time each stage sits idle: (p - 1) / (m + p - 1)."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages and num_microbatches must be >= 1, got {num_stages} and {num_microbatches}")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def pipeline_timeline(num_stages: int, num_microbatches: int) -> list[tuple[int, int, int]]:
    """A fill-and-drain (GPipe) schedule as (stage, micro-batch, beat) triples: micro-batch j runs on
    stage s in beat s + j, every stage's work taking one beat. m + p - 1 beats in all, of which each
    stage is busy m: the idle share is `pipeline_bubble_fraction` (chapter 12 draws it)."""
    pipeline_bubble_fraction(num_stages, num_microbatches)  # the same checks
    return [(s, j, s + j) for s in range(num_stages) for j in range(num_microbatches)]


@dataclass(frozen=True)
class PipelineCost:
    """A decode step of `batch` sequences cut into `num_microbatches` micro-batches over `pp` stages.

    Two regimes, each named for what it is (chapter 12 prints both):

    * **fill and drain** (`fill_drain_*`): the batch crosses the pipeline once (GPipe; one batch's
      prefill, or training). The last micro-batch leaves after m + p - 1 beats, each stage busy m.
    * **steady decoding** (`steady_*`): the m micro-batches circulate for ever, each coming back to
      stage 0 for its next token (vLLM's virtual engines, one per stage). A micro-batch's next
      token comes after max(m, p) beats; each stage works m beats of them, so with m >= p no stage
      waits for work, only for the hop to the next stage.
    """

    pp: int
    num_microbatches: int
    stage_s: float  # the slowest stage's time for one micro-batch (most layers, plus the lm_head)
    send_s: float  # hidden states of one micro-batch to the next stage
    batch: int

    @property
    def beat_s(self) -> float:
        """The pipeline's clock: a stage's work on one micro-batch plus handing it on."""
        return self.stage_s + (self.send_s if self.pp > 1 else 0.0)

    # --- one batch, once through -------------------------------------------------------------------

    @property
    def fill_drain_s(self) -> float:
        """Fill and drain (GPipe): the last micro-batch leaves stage p after m + p - 1 beats."""
        return (self.num_microbatches + self.pp - 1) * self.beat_s

    @property
    def fill_drain_idle_fraction(self) -> float:
        """Share of the fill-and-drain span each stage sits idle: (p - 1) / (m + p - 1)."""
        return pipeline_bubble_fraction(self.pp, self.num_microbatches)

    @property
    def fill_drain_tokens_per_s(self) -> float:
        """One token for each sequence of the batch, per fill-and-drain span."""
        return self.batch / self.fill_drain_s

    # --- steady decoding (virtual engines) -----------------------------------------------------------

    @property
    def steady_inter_token_s(self) -> float:
        """Time between two tokens of one sequence: its micro-batch is back at stage 1 after max(m, p) beats."""
        return max(self.num_microbatches, self.pp) * self.beat_s

    @property
    def steady_tokens_per_s(self) -> float:
        return self.batch / self.steady_inter_token_s

    @property
    def steady_idle_fraction(self) -> float:
        """Share of the time a stage is not computing in steady decoding: 1 - m x stage / (max(m, p) x beat).
        With m >= p that is only the hop; with fewer micro-batches than stages, (p - m) / p more."""
        return 1 - self.num_microbatches * self.stage_s / (max(self.num_microbatches, self.pp) * self.beat_s)


def check_microbatches(pp: int, batch: int, num_microbatches: int) -> None:
    """The micro-batch rule: at least one, dividing the batch; and with one stage exactly one (nothing overlaps)."""
    if num_microbatches < 1 or batch % num_microbatches:
        raise ValueError(f"batch {batch} must split evenly into num_microbatches={num_microbatches} micro-batches")
    if pp == 1 and num_microbatches != 1:
        raise ValueError(f"num_microbatches={num_microbatches} with pipeline_parallel_size=1: one stage has no other "
                         "stage to overlap with, so cutting its batch only re-reads the weights; use "
                         "num_microbatches=1 (micro-batches need pipeline_parallel_size > 1)")


def pp_decode(
    hw: Hardware, shape: ModelShape, pp: int, link: Link, *, batch: int, context_len: int,
    num_microbatches: int = 1, tp: int = 1, tp_link: Link | None = None,
) -> PipelineCost:
    """Decode with `pp` stages (each optionally `tp`-way tensor parallel over `tp_link`).

    Each micro-batch re-reads its stage's weights, so cutting a memory-bound decode batch into
    micro-batches costs weight traffic: a stage is idle less, but each beat is not m times shorter.
    With `pp=1` only `num_microbatches=1` is accepted (`check_microbatches`).
    """
    check_microbatches(pp, batch, num_microbatches)
    micro = batch // num_microbatches
    stage_shape = dataclasses.replace(shape, num_layers=max(stage_layers(shape.num_layers, pp)))
    stage = tp_step_time(hw, stage_shape, tp, tp_link or link, decode_context_lens=[context_len] * micro)
    send_s = send_recv_time_s(micro * shape.hidden_size * hw.dtype_bytes, link)
    return PipelineCost(pp=pp, num_microbatches=num_microbatches, stage_s=stage.time_s, send_s=send_s, batch=batch)


# --- memory per device ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
    """The fullest device of a TP x PP layout: its weights, and how much KV cache is left for it."""

    weight_bytes: float
    kv_bytes_per_token: float  # this device's layers and KV heads
    budget_bytes: float  # capacity x gpu_memory_utilization

    @property
    def kv_budget_bytes(self) -> float:
        return self.budget_bytes - self.weight_bytes

    @property
    def fits(self) -> bool:
        """The weights fit with room to spare for at least some KV cache."""
        return self.kv_budget_bytes > 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache (over all sequences) the device has room for."""
        return max(0, int(self.kv_budget_bytes // self.kv_bytes_per_token))


def memory_per_device(
    hw: Hardware, shape: ModelShape, *, tp: int = 1, pp: int = 1, gpu_memory_utilization: float = 0.9
) -> DeviceMemory:
    """Weights and KV room on the fullest device: stage 0 holds the embedding, the last stage the
    final norm and lm_head (one tensor with a tied embedding when there is one stage); both are
    split over the vocabulary by TP."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    layers = stage_layers(shape.num_layers, pp)
    vocab_rows = math.ceil(shape.vocab_size / tp) * shape.hidden_size
    per_stage = []
    for s, n in enumerate(layers):
        params = n * layer_params_per_device(shape, tp)
        if s == 0:
            params += vocab_rows  # embedding
        if s == pp - 1:
            params += shape.hidden_size  # final norm
            if not (shape.tied_embeddings and pp == 1):
                params += vocab_rows  # lm_head
        per_stage.append(params)
    b = hw.dtype_bytes
    kv_per_token = 2 * max(layers) * kv_heads_per_device(shape, tp) * shape.head_dim * b
    return DeviceMemory(weight_bytes=max(per_stage) * b, kv_bytes_per_token=kv_per_token,
                        budget_bytes=hw.mem_capacity_bytes * gpu_memory_utilization)


def min_tp_to_fit(
    hw: Hardware, shape: ModelShape, *, min_kv_tokens: int = 0, max_tp: int = 8,
    gpu_memory_utilization: float = 0.9,
) -> int | None:
    """The smallest TP degree (1, 2, 4, ...) whose devices hold the weights and `min_kv_tokens` of KV."""
    tp = 1
    while tp <= max_tp:
        try:
            mem = memory_per_device(hw, shape, tp=tp, gpu_memory_utilization=gpu_memory_utilization)
        except ValueError:  # this degree does not split the model
            mem = None
        if mem is not None and mem.fits and mem.kv_tokens >= min_kv_tokens:
            return tp
        tp *= 2
    return None


# --- one layout, every number a playground shows -------------------------------------------------


@dataclass(frozen=True)
class LayoutSummary:
    """What a TP x PP layout times `dp` replicas gives one model on one kind of device, serving
    `num_seqs` sequences in all (chapter 12). Replicas share nothing: each decodes `seqs_per_replica`
    of them, so TTFT, TPOT and memory per device are one replica's, and the throughput counts every
    sequence of every replica. Decode is in the steady state (`PipelineCost.steady_*`), as a serving
    engine runs it; the `fill_drain_*` fields say what the same sequences would give crossing the
    pipeline once (one batch, the bubble), so that a table can print both, each labelled."""

    tp: int
    pp: int
    dp: int
    num_devices: int
    num_seqs: int  # sequences decoding at once, all replicas together
    num_microbatches: int  # per replica (virtual engines); 1 without PP
    ttft_s: float  # one prompt's prefill on an idle replica (crosses every stage once)
    tpot_s: float  # time between two tokens of one sequence, in steady decoding
    throughput_tokens_per_s: float  # decode tokens per second, all sequences of all replicas together
    steady_idle_fraction: float  # share of time a stage does not compute while decoding (0 without PP)
    fill_drain_tokens_per_s: float  # one batch once through instead (all replicas): not how decode runs
    fill_drain_idle_fraction: float  # the bubble of that one trip, (pp - 1) / (m + pp - 1)
    weight_bytes_per_device: float
    kv_tokens_per_device: int  # KV room of one device, in tokens of its layers and heads
    fits: bool  # the weights fit with some room for KV

    @property
    def seqs_per_replica(self) -> int:
        return self.num_seqs // self.dp

    def holds(self, context_len: int) -> bool:
        """Each device has room for the KV of its replica's sequences at `context_len` tokens."""
        return self.fits and self.kv_tokens_per_device >= self.seqs_per_replica * context_len


def layout_summary(
    hw: Hardware, shape: ModelShape, *, tp: int = 1, pp: int = 1, dp: int = 1, tp_link: Link,
    pp_link: Link | None = None, num_seqs: int = 1, prompt_len: int = 512, context_len: int = 1024,
    num_microbatches: int | None = None, gpu_memory_utilization: float = 0.9,
) -> LayoutSummary:
    """TTFT, TPOT, decode throughput and memory per device of `dp` replicas of `tp` x `pp` devices
    decoding `num_seqs` sequences in all (`num_seqs / dp` per replica: the total is what a fair
    comparison holds fixed, so it is what this takes).

    Tensor parallelism shortens both TTFT and TPOT (each step is split); pipeline parallelism
    shortens neither (a token still crosses every layer, plus the hops). A replica's sequences are
    cut into `num_microbatches` (default: one per stage, vLLM's virtual engines) that circulate and
    keep every stage busy; in weight-bound decode that gains little, as each micro-batch re-reads
    the stage's weights. With `pp=1` only one micro-batch is accepted. `pp_link` joins the stages
    (often InfiniBand between nodes).
    """
    if dp < 1:
        raise ValueError(f"data parallel size must be >= 1, got {dp}")
    if num_seqs < 1 or num_seqs % dp:
        raise ValueError(f"num_seqs={num_seqs} (sequences in all) must be >= 1 and split evenly over "
                         f"data parallel size {dp}")
    batch = num_seqs // dp
    pp_link = pp_link or tp_link
    if num_microbatches is None:
        num_microbatches = pp if batch % pp == 0 else 1
    stage_shape = dataclasses.replace(shape, num_layers=max(stage_layers(shape.num_layers, pp)))
    prefill = tp_step_time(hw, stage_shape, tp, tp_link, prefill_tokens=[prompt_len])
    hop_s = send_recv_time_s(prompt_len * shape.hidden_size * hw.dtype_bytes, pp_link)
    decode = pp_decode(hw, shape, pp, pp_link, batch=batch, context_len=context_len,
                       num_microbatches=num_microbatches, tp=tp, tp_link=tp_link)
    memory = memory_per_device(hw, shape, tp=tp, pp=pp, gpu_memory_utilization=gpu_memory_utilization)
    return LayoutSummary(
        tp=tp, pp=pp, dp=dp, num_devices=tp * pp * dp, num_seqs=num_seqs, num_microbatches=num_microbatches,
        ttft_s=pp * prefill.time_s + (pp - 1) * hop_s,
        tpot_s=decode.steady_inter_token_s,
        throughput_tokens_per_s=dp * decode.steady_tokens_per_s,
        steady_idle_fraction=decode.steady_idle_fraction,
        fill_drain_tokens_per_s=dp * decode.fill_drain_tokens_per_s,
        fill_drain_idle_fraction=decode.fill_drain_idle_fraction,
        weight_bytes_per_device=memory.weight_bytes,
        kv_tokens_per_device=memory.kv_tokens,
        fits=memory.fits,
    )


def compare_layouts(
    hw: Hardware, shape: ModelShape, layouts: dict[str, dict[str, int]], *, num_seqs: int, num_devices: int,
    context_len: int = 1024, **knobs: object,
) -> dict[str, LayoutSummary]:
    """`layout_summary` of each layout (name -> dict(tp=, pp=, dp=)) at equal work: the same `num_seqs`
    sequences in all, on the same `num_devices` devices of the same kind (so the same memory for
    weights and KV), each at `context_len`. A layout on another number of devices, or one whose
    devices cannot hold its share of the KV, is refused with its name: its row would not be comparable."""
    rows = {}
    for name, layout in layouts.items():
        s = layout_summary(hw, shape, num_seqs=num_seqs, context_len=context_len, **layout, **knobs)  # type: ignore[arg-type]
        if s.num_devices != num_devices:
            raise ValueError(f"layout {name!r} uses {s.num_devices} devices, not {num_devices}: not the same hardware")
        if not s.holds(context_len):
            raise ValueError(f"layout {name!r}: a device holds {s.kv_tokens_per_device:,} KV tokens, fewer than its "
                             f"replica's {s.seqs_per_replica} sequences x {context_len} tokens: not the same work")
        rows[name] = s
    return rows
