"""Expert parallelism: an MoE layer whose experts live on different processes (chapter 12).

With expert parallelism (EP) of size `ep`, rank r holds experts [r·E/ep, (r+1)·E/ep) whole (not
slices of every expert, as tensor parallelism would). Every rank routes its own tokens with the
full router (it is tiny), then:

    1. counts    all_to_all_single of the per-expert row counts: each rank learns how many rows
                 every other rank will send to each of its experts
    2. dispatch  all_to_all_single of the rows themselves, sorted by expert (`moe.dispatch`), so
                 the rows for rank r's experts are one contiguous slice of the send buffer
    3. compute   each local expert's MLP on the rows it received, from every rank
    4. combine   all_to_all_single back along the same splits, reversed; each rank weights the
                 returned rows by its routing weights and sums them into its tokens

The result on each rank equals `moe.sparse_moe` on that rank's tokens in one process. The step's
load per local expert comes back with it: the busiest rank sets the layer's pace.

In the engine (vLLM's `tensor_parallel_size=2, enable_expert_parallel=True`) attention is tensor-
parallel, so after it every rank holds the SAME hidden states for all T tokens. `ep_moe_layer` is
the per-layer call for that case: rank r takes its contiguous slice of the T tokens, runs the four
steps above on it, and an all-gather puts the T rows back together on every rank; the per-expert
counts are summed over ranks (all-reduce), so every rank reports the whole layer's histogram.
`ExpertParallelMoE` plugs it into `LlamaModel.moe_forward`; `shard_model_experts` swaps a loaded
model's experts for the rank's own (the loader reads only those: `minillm.model.loader.Placement.of_rank`).
How an engine calls them on every rank: `tests/test_ep_moe_layer.py` (`_engine_on_a_rank`, 2 gloo ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minillm.model.moe import MoEWeights, dispatch, expert_mlp, expert_ranges, route


@dataclass
class ExpertShard:
    """What one EP rank holds: the whole router, and its own experts' weights."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E / ep, 2·intermediate, hidden]
    down: torch.Tensor  # [E / ep, hidden, intermediate]
    experts: range  # which experts these are
    top_k: int
    renormalize: bool = True


def shard_experts(w: MoEWeights, ep_rank: int, ep_size: int) -> ExpertShard:
    """Rank `ep_rank`'s share of a layer's experts (contiguous ranges, as vLLM places them)."""
    ranges = expert_ranges(w.num_experts, ep_size)
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must be in [0, {ep_size})")
    own = ranges[ep_rank]
    return ExpertShard(router=w.router, gate_up=w.gate_up[own.start:own.stop].clone(),
                       down=w.down[own.start:own.stop].clone(), experts=own, top_k=w.top_k,
                       renormalize=w.renormalize)


@dataclass
class ExpertParallelOutput:
    hidden: torch.Tensor  # [T, hidden]: this rank's tokens through the MoE layer
    tokens_per_expert: torch.Tensor  # [E]: where this rank's tokens went (sum over ranks = the layer's histogram)
    local_expert_rows: torch.Tensor  # [E / ep]: rows this rank's experts computed, from all ranks


def expert_parallel_moe(hidden: torch.Tensor, shard: ExpertShard, group: dist.ProcessGroup | None = None) -> ExpertParallelOutput:
    """The MoE layer on this rank's tokens [T, hidden], experts spread over the group's ranks."""
    ep, num_experts = dist.get_world_size(group), shard.router.shape[0]
    per_rank = num_experts // ep
    if per_rank * ep != num_experts or len(shard.experts) != per_rank:
        raise ValueError(f"{num_experts} experts over {ep} ranks: each rank must hold {num_experts // ep or '?'} "
                         f"experts, this one holds {len(shard.experts)}")
    routing = route(hidden, shard.router, shard.top_k, shard.renormalize)
    d = dispatch(routing, num_experts)

    # 1. counts: rank s sends each rank r the row counts of r's experts (equal splits of per_rank)
    recv_counts = torch.empty_like(d.tokens_per_expert)
    dist.all_to_all_single(recv_counts, d.tokens_per_expert, group=group)
    recv_counts = recv_counts.view(ep, per_rank)  # [source rank, local expert]
    send_splits = d.tokens_per_expert.view(ep, per_rank).sum(dim=1).tolist()
    recv_splits = recv_counts.sum(dim=1).tolist()

    # 2. dispatch: the rows, sorted by expert, hence by destination rank
    received = hidden.new_empty((sum(recv_splits), hidden.shape[1]))
    dist.all_to_all_single(received, hidden.index_select(0, d.token_index), recv_splits, send_splits, group=group)

    # 3. compute: received rows are [source 0: expert 0's rows, expert 1's ..., source 1: ...]
    local_expert = torch.arange(per_rank, device=hidden.device).repeat(ep).repeat_interleave(recv_counts.flatten())
    results = torch.empty_like(received)
    for j in range(per_rank):
        rows = (local_expert == j).nonzero().squeeze(1)
        if rows.numel():
            results[rows] = expert_mlp(received.index_select(0, rows), shard.gate_up[j], shard.down[j])

    # 4. combine: each result goes back to where its row came from, in the order it was sent
    returned = hidden.new_empty((sum(send_splits), hidden.shape[1]))
    dist.all_to_all_single(returned, results, send_splits, recv_splits, group=group)
    out = torch.zeros_like(hidden)
    out.index_add_(0, d.token_index, returned * d.weights[:, None].to(returned.dtype))
    return ExpertParallelOutput(hidden=out, tokens_per_expert=d.tokens_per_expert,
                                local_expert_rows=recv_counts.sum(dim=0))


# ---- the engine's per-layer call (tokens replicated by tensor-parallel attention) -----------------
def check_expert_parallel(config, ep_size: int) -> None:
    """Refuse, before any process starts, what expert parallelism cannot split (a `ModelConfig`)."""
    if not getattr(config, "num_experts", 0):
        raise ValueError(f"enable_expert_parallel=True needs a mixture-of-experts model (Mixtral); "
                         f"model_type {config.model_type!r} has no experts")
    expert_ranges(config.num_experts, ep_size)  # raises, naming both numbers, unless ep_size divides them


def token_slices(num_tokens: int, ep_size: int) -> list[range]:
    """Rank r's share of T replicated tokens: contiguous, the first ranks one longer when uneven."""
    base, extra = divmod(num_tokens, ep_size)
    starts = [r * base + min(r, extra) for r in range(ep_size + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(ep_size)]


def ep_moe_layer(hidden: torch.Tensor, shard: ExpertShard, group: dist.ProcessGroup | None = None) -> ExpertParallelOutput:
    """One MoE layer under expert parallelism, for hidden states [T, hidden] that are the same on every
    rank of `group`. Returns, on every rank, the layer's output for all T tokens (equal to
    `moe.sparse_moe(hidden, full_weights)`) and the layer's per-expert histogram over all T tokens.

    Collectives, all on `group` and called by every rank in the same order: 3 all_to_all_single
    (counts, dispatch, combine), 1 all_gather (the token slices back), 1 all_reduce (the histogram).
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = token_slices(hidden.shape[0], ep)
    own = slices[rank]
    part = expert_parallel_moe(hidden[own.start:own.stop], shard, group)
    width = len(slices[0])  # the longest slice: all_gather wants equal shapes, so shorter ones are padded
    padded = part.hidden.new_zeros((width, hidden.shape[1]))
    padded[: len(own)] = part.hidden
    gathered = [torch.empty_like(padded) for _ in range(ep)]
    dist.all_gather(gathered, padded, group=group)
    out = torch.cat([g[: len(sl)] for g, sl in zip(gathered, slices)])
    counts = part.tokens_per_expert.clone()
    dist.all_reduce(counts, group=group)
    return ExpertParallelOutput(hidden=out, tokens_per_expert=counts, local_expert_rows=part.local_expert_rows)


class ExpertParallelMoE:
    """`LlamaModel.moe_forward` under expert parallelism: (layer, x, the layer's ExpertShard) → output.
    Keeps the last call's rows per local expert, per layer (`local_expert_rows`), for the chapter."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.local_expert_rows: dict[int, list[int]] = {}

    def __call__(self, layer: int, x: torch.Tensor, shard: ExpertShard) -> ExpertParallelOutput:
        out = ep_moe_layer(x, shard, self.group)
        self.local_expert_rows[layer] = out.local_expert_rows.tolist()
        return out


def shard_model_experts(model, group: dist.ProcessGroup | None = None,
                        shards: list[ExpertShard] | None = None) -> ExpertParallelMoE:
    """Make a loaded MoE `LlamaModel` expert-parallel on `group`: each layer keeps only this rank's
    experts (`shards`, or sliced from the weights it holds), and its
    forward calls `ep_moe_layer`. Every rank of the group must do the same, then run the same forwards."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    moe_layers = [lw for lw in model.layers if lw.moe is not None]
    if not moe_layers:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {model.config.model_type!r} has none")
    if shards is not None and len(shards) != len(moe_layers):
        raise ValueError(f"{len(shards)} expert shards for {len(moe_layers)} MoE layers")
    for i, lw in enumerate(moe_layers):
        if shards is not None:
            lw.moe = shards[i]
        elif not isinstance(lw.moe, ExpertShard):  # (one loaded for an expert-parallel rank already is)
            lw.moe = shard_experts(lw.moe, rank, ep)
        if lw.moe.experts != expert_ranges(lw.moe.router.shape[0], ep)[rank]:
            raise ValueError(f"EP rank {rank} of {ep} must hold experts {expert_ranges(lw.moe.router.shape[0], ep)[rank]}, "
                             f"this layer's shard holds {lw.moe.experts}")
    model.moe_forward = ExpertParallelMoE(group)
    return model.moe_forward
