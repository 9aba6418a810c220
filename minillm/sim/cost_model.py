"""A roofline cost model of one engine step: FLOPs and bytes in, predicted seconds out.

Chapter 00 uses it to show why decode is memory-bound and prefill compute-bound; chapter 04
compares its predictions with measured CPU steps, and the simulator (`minillm.sim`) advances its
clock by it, so chapters can show 7B-on-A100 numbers on a laptop, deterministically.

One step runs a batch of *query tokens* through the model: new prompt tokens of prefilling
sequences (a whole prompt, or one chunk of it with chunked prefill) and one token per decoding
sequence. Its time is

    time = max(flops / (peak_flops * mfu), bytes / (mem_bandwidth * mbu))
           + step_overhead + per_request_overhead * sequences in the step

With the presets' defaults (mfu = mbu = 1, no overheads) this is the physical floor; the factors
and where their values come from are documented on `Hardware` (minillm.sim.hardware), and
`fit_efficiency` fits them to published end-to-end latencies (chapter 04 shows the result).

FLOPs (a multiply-add counts as 2):
  * linear layers: 2 * num_layer_params per query token (every token meets every weight once);
  * lm_head: 2 * hidden * vocab per row that needs logits: one per sequence in the step
    (a prefill only samples after its last token, as vLLM computes logits for it alone);
  * attention: per layer and head, q.k^T over `ctx` keys is 2 * ctx * head_dim, and the weighted
    sum of values another 2 * ctx * head_dim, so 4 * ctx * head_dim * num_heads * num_layers
    per query token. A causal prefill's i-th token sees only the tokens before it: about half of
    a full square.
Bytes:
  * weights: every layer's weights and the lm_head are read from memory once per step, however
    many tokens the batch holds (this is what batching amortizes); the embedding table is not
    streamed, only the looked-up rows;
  * KV read: attention reads each sequence's cached K and V once (per layer);
  * KV write: each query token's new K and V are stored.
Activations are left out: they are small next to weights at decode, and prefill is compute-bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape


@dataclass(frozen=True)
class StepCost:
    """What one step costs, split so a chapter can show where the time goes."""

    linear_flops: float
    lm_head_flops: float
    attention_flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    compute_time_s: float
    memory_time_s: float
    overhead_s: float  # fixed per-step cost plus the per-sequence cost of this step's sequences
    num_tokens: int  # query tokens in the step, padding included
    swap_s: float = 0.0  # KV copies to/from host memory (swap preemption), at the host link's bandwidth

    @property
    def flops(self) -> float:
        return self.linear_flops + self.lm_head_flops + self.attention_flops

    @property
    def bytes_moved(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def time_s(self) -> float:
        # compute and memory traffic overlap; the slower of the two sets the pace
        return max(self.compute_time_s, self.memory_time_s) + self.overhead_s + self.swap_s

    @property
    def bound(self) -> str:
        """Which roof limits this step: "compute" or "memory"."""
        return "compute" if self.compute_time_s >= self.memory_time_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved: compare with `Hardware.ridge_point`."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


def weight_bytes_read_per_step(shape: ModelShape, dtype_bytes: int) -> int:
    """Weights streamed from memory once per step: all layers, final norm and lm_head."""
    return (shape.num_layer_params + shape.embedding_params) * dtype_bytes


def _causal_keys_seen(new_tokens: int, cached_tokens: int) -> int:
    """Sum over the new tokens of how many keys each attends to.

    The i-th new token (i = 0 .. n-1) sees the `cached_tokens` before the chunk and i + 1 tokens
    of the chunk itself (including itself): n * cached + n (n + 1) / 2.
    """
    n = new_tokens
    return n * cached_tokens + n * (n + 1) // 2


def step_time(
    hw: Hardware,
    shape: ModelShape,
    *,
    prefill_tokens: Sequence[int] = (),
    prefill_context: Sequence[int] | None = None,
    decode_context_lens: Sequence[int] = (),
    padding_tokens: int = 0,
) -> StepCost:
    """Predicted cost of one step.

    prefill_tokens: new prompt tokens of each prefilling sequence in this step.
    prefill_context: tokens already in the KV cache before those (earlier chunks of a chunked
        prefill, or a prefix-cache hit); default all zeros.
    decode_context_lens: context length of each decoding sequence, including its new token.
    padding_tokens: rows that fill a padded batch. They run through every linear layer and write
        K/V like real tokens but yield nothing: the waste chapters 02-03 measure. (If attention
        also runs over pads, pass the padded lengths as prefill_tokens/decode_context_lens.)
    """
    if prefill_context is None:
        prefill_context = [0] * len(prefill_tokens)
    if len(prefill_context) != len(prefill_tokens):
        raise ValueError("prefill_context needs one entry per prefill_tokens entry")
    if min(prefill_tokens, default=1) < 1 or min(decode_context_lens, default=1) < 1:
        raise ValueError("every prefill chunk and decode context must hold at least one token")
    if min(prefill_context, default=0) < 0 or padding_tokens < 0:
        raise ValueError("prefill_context and padding_tokens must be >= 0")

    num_tokens = sum(prefill_tokens) + len(decode_context_lens) + padding_tokens
    if num_tokens == 0:  # nothing scheduled: the step does not run
        return StepCost(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0)
    b = hw.dtype_bytes

    # FLOPs -----------------------------------------------------------------------------------
    linear_flops = 2 * shape.num_layer_params * num_tokens
    rows_with_logits = len(prefill_tokens) + len(decode_context_lens)
    lm_head_flops = 2 * shape.hidden_size * shape.vocab_size * rows_with_logits
    # keys seen, summed over all query tokens: causal within a prefill chunk, full for a decode
    keys_seen = sum(_causal_keys_seen(n, c) for n, c in zip(prefill_tokens, prefill_context))
    keys_seen += sum(decode_context_lens)
    attention_flops = 4 * shape.head_dim * shape.num_heads * shape.num_layers * keys_seen

    # Bytes -----------------------------------------------------------------------------------
    weight_bytes = weight_bytes_read_per_step(shape, b)
    # each sequence's K/V (cached + new) is read once, whatever the number of its query tokens
    kv_tokens_read = sum(n + c for n, c in zip(prefill_tokens, prefill_context)) + sum(decode_context_lens)
    kv_read_bytes = shape.kv_bytes_per_token(b) * kv_tokens_read
    kv_write_bytes = shape.kv_bytes_per_token(b) * num_tokens

    flops = linear_flops + lm_head_flops + attention_flops
    bytes_moved = weight_bytes + kv_read_bytes + kv_write_bytes
    return StepCost(
        linear_flops=linear_flops,
        lm_head_flops=lm_head_flops,
        attention_flops=attention_flops,
        weight_bytes=weight_bytes,
        kv_read_bytes=kv_read_bytes,
        kv_write_bytes=kv_write_bytes,
        compute_time_s=flops / (hw.peak_flops * hw.mfu),
        memory_time_s=bytes_moved / (hw.mem_bandwidth_bytes_per_s * hw.mbu),
        overhead_s=hw.step_overhead_s + hw.per_request_overhead_s * rows_with_logits,
        num_tokens=num_tokens,
    )


def decode_step_time(hw: Hardware, shape: ModelShape, batch: int, context_len: int) -> StepCost:
    """One decode step of `batch` sequences, each `context_len` tokens long (new token included)."""
    return step_time(hw, shape, decode_context_lens=[context_len] * batch)


def prefill_time(hw: Hardware, shape: ModelShape, prompt_len: int) -> StepCost:
    """Prefill of one `prompt_len`-token prompt in a single step (its TTFT on an idle engine)."""
    return step_time(hw, shape, prefill_tokens=[prompt_len])


def max_batch_for_kv(hw: Hardware, shape: ModelShape, seq_len: int, kv_fraction: float = 0.9) -> int:
    """How many `seq_len`-token sequences fit in the KV cache.

    The engine may use `kv_fraction` of device memory (vLLM's gpu_memory_utilization); the
    weights take their share first and the KV cache gets the rest (activations ignored).
    """
    free_bytes = hw.mem_capacity_bytes * kv_fraction - shape.weight_bytes(hw.dtype_bytes)
    per_seq_bytes = shape.kv_bytes(seq_len, 1, hw.dtype_bytes)
    return max(0, int(free_bytes // per_seq_bytes))


# --- end-to-end latency of a static batch, and fitting the efficiency factors to it -------------


def batch_latency_s(hw: Hardware, shape: ModelShape, batch: int, prompt_tokens: int, output_tokens: int) -> float:
    """End-to-end time of `batch` equal requests served together: one prefill step of every prompt
    (it yields the first token), then `output_tokens - 1` decode steps. This is what offline
    benchmarks such as NeMo's report as "average latency" for a batch."""
    if batch < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("batch, prompt_tokens and output_tokens must all be >= 1")
    total = step_time(hw, shape, prefill_tokens=[prompt_tokens] * batch).time_s
    for i in range(1, output_tokens):
        total += decode_step_time(hw, shape, batch, prompt_tokens + i).time_s
    return total


@dataclass(frozen=True)
class EfficiencyFit:
    """The factors `fit_efficiency` found, and how well they reproduce the measurements."""

    hardware: Hardware  # the input hardware with the fitted factors
    predicted_ms: dict[int, float]  # batch size -> predicted latency
    measured_ms: dict[int, float]

    @property
    def max_relative_error(self) -> float:
        return max(abs(self.predicted_ms[b] / self.measured_ms[b] - 1) for b in self.measured_ms)


def fit_efficiency(
    hw: Hardware,
    shape: ModelShape,
    measured_ms: dict[int, float],
    prompt_tokens: int,
    output_tokens: int,
    *,
    mfu: float = 0.5,
    mbu_grid: Sequence[float] = tuple(np.round(np.arange(0.30, 1.0001, 0.01), 2)),
    step_overhead_ms_grid: Sequence[float] = tuple(np.round(np.arange(0.0, 2.0001, 0.1), 1)),
    per_request_ms_grid: Sequence[float] = tuple(np.round(np.arange(0.0, 2.0001, 0.05), 2)),
) -> EfficiencyFit:
    """Grid-search `mbu`, `step_overhead_s` and `per_request_overhead_s` (at a fixed `mfu`) so that
    `batch_latency_s` matches published end-to-end latencies by batch size, minimizing the largest
    relative error. `hw` should be an ideal preset (its factors are replaced)."""
    if not measured_ms:
        raise ValueError("measured_ms is empty: give {batch size: latency in ms}")
    ideal = dataclasses.replace(hw, mfu=1.0, mbu=1.0, step_overhead_s=0.0, per_request_overhead_s=0.0)
    batches = sorted(measured_ms)
    # Every step's compute and memory time at the ideal roofs; factors only rescale and add.
    rows = []  # (batch index, compute s, memory s, sequences) per step
    for j, b in enumerate(batches):
        steps = [step_time(ideal, shape, prefill_tokens=[prompt_tokens] * b)]
        steps += [decode_step_time(ideal, shape, b, prompt_tokens + i) for i in range(1, output_tokens)]
        rows += [(j, c.compute_time_s, c.memory_time_s, b) for c in steps]
    index, compute, memory, seqs = (np.array(col) for col in zip(*rows))
    measured = np.array([measured_ms[b] for b in batches]) / 1e3
    best = (np.inf, None)
    for mbu in mbu_grid:
        roof = np.maximum(compute / mfu, memory / mbu)
        roof_per_batch = np.bincount(index, roof, minlength=len(batches))
        steps_per_batch = np.bincount(index, minlength=len(batches))
        seq_steps = np.bincount(index, seqs, minlength=len(batches))
        for so in step_overhead_ms_grid:
            for pr in per_request_ms_grid:
                predicted = roof_per_batch + steps_per_batch * so / 1e3 + seq_steps * pr / 1e3
                err = float(np.max(np.abs(predicted / measured - 1)))
                if err < best[0]:
                    best = (err, (mbu, so, pr))
    mbu, so, pr = best[1]
    fitted = dataclasses.replace(hw, name=f"{hw.name}-fitted", mfu=float(mfu), mbu=float(mbu),
                                 step_overhead_s=float(so) / 1e3, per_request_overhead_s=float(pr) / 1e3)
    predicted_ms = {b: 1e3 * batch_latency_s(fitted, shape, b, prompt_tokens, output_tokens) for b in batches}
    return EfficiencyFit(fitted, predicted_ms, dict(measured_ms))


# --- calibrating the overheads on measured steps (chapter 04, section 6) ------------------------


@dataclass(frozen=True)
class OverheadFit:
    """Two calibrations of an engine's own cost per step, both >= 0, so each makes a valid `Hardware`.

    `fixed_only_s` is a fixed cost per step alone; `fixed_s` + `per_request_s` x sequences is a
    fixed cost plus a cost per sequence in the step. `clamped` says, worded from the numbers, where
    a raw fit came out negative and what was used instead (empty when nothing was clamped).
    """

    fixed_only_s: float
    fixed_s: float
    per_request_s: float
    clamped: tuple[str, ...] = ()


def fit_step_overheads(num_seqs: Sequence[int], unexplained_s: Sequence[float]) -> OverheadFit:
    """Fit what a roofline leaves unexplained (measured minus predicted step time, seconds, one per
    step with `num_seqs` sequences) as a fixed cost, and as a fixed cost plus a cost per sequence.

    Fixed cost only: the median unexplained time. Fixed + per sequence: a straight line through the
    median at each batch size, weighted by how many steps had that size (a least-squares line through
    every step would chase the steps other programs slowed down). A negative result means the
    roofline alone already predicts slower steps than measured, e.g. its bandwidth is DRAM's while
    the weights are read from a cache; no cost is negative, so the fit falls back instead: a median
    below 0 becomes 0, a line with a negative intercept is refitted through the origin, and one with
    a negative slope (or a single batch size) becomes the fixed cost alone.
    """
    sizes = np.asarray(num_seqs, dtype=float)
    unexplained = np.asarray(unexplained_s, dtype=float)
    if sizes.shape != unexplained.shape or sizes.size == 0:
        raise ValueError("num_seqs and unexplained_s need one entry per step, and at least one step")
    clamped = []
    median = float(np.median(unexplained))
    fixed_only = max(median, 0.0)
    if median < 0:
        clamped.append(f"fixed only: the median step took {-1e3 * median:.2f} ms less than the roofline alone "
                       "predicts; the fixed cost is clamped at 0")
    levels, counts = np.unique(sizes, return_counts=True)
    if levels.size < 2:
        clamped.append(f"fixed + per request: every step had {levels[0]:.0f} sequences, no slope to fit; "
                       "the fixed cost alone")
        return OverheadFit(fixed_only, fixed_only, 0.0, tuple(clamped))
    medians = np.array([np.median(unexplained[sizes == n]) for n in levels])
    per_request, fixed = np.polyfit(levels, medians, 1, w=np.sqrt(counts))
    if fixed < 0:
        through_origin = float(np.sum(counts * levels * medians) / np.sum(counts * levels**2))
        clamped.append(f"fixed + per request: the line's intercept came out {1e3 * fixed:+.3f} ms; refitted through "
                       f"the origin" + ("" if through_origin >= 0 else ", whose slope is negative too: both clamped at 0"))
        return OverheadFit(fixed_only, 0.0, max(through_origin, 0.0), tuple(clamped))
    if per_request < 0:
        clamped.append(f"fixed + per request: the line's slope came out {1e3 * per_request:+.3f} ms per request; "
                       "no cost per request, the fixed cost alone")
        return OverheadFit(fixed_only, fixed_only, 0.0, tuple(clamped))
    return OverheadFit(fixed_only, float(fixed), float(per_request), tuple(clamped))
