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
    local_expert = torch.arange(per_rank).repeat(ep).repeat_interleave(recv_counts.flatten())
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
