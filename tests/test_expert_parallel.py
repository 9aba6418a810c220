"""Expert parallelism on real processes (minillm/distributed/moe.py, chapter 12): 2 gloo ranks on
loopback, each holding 2 of the bundled MoE model's 4 experts, exchange tokens with all_to_all_single
and must get what one process computes with all 4 experts."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from minillm.distributed.launch import run_ranks
from minillm.distributed.moe import shard_experts
from minillm.model.loader import read_safetensors
from minillm.model.moe import moe_weights_from_state

MOE_DIR = Path(__file__).resolve().parents[1] / "models" / "minillm-moe"
TOKENS_PER_RANK = (5, 11)  # uneven on purpose: the all-to-all splits differ per rank
TIMEOUT_S = 120


def _on_a_rank(rank: int, world_size: int) -> tuple:
    from minillm.distributed.moe import expert_parallel_moe
    from minillm.model.moe import sparse_moe

    full = moe_weights_from_state(read_safetensors(MOE_DIR), 0, 4, 2, dtype=torch.float64)
    shard = shard_experts(full, rank, world_size)
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(TOKENS_PER_RANK[rank], 64, generator=gen, dtype=torch.float64) * 2.0
    ep = expert_parallel_moe(hidden, shard)
    alone = sparse_moe(hidden, full)  # the one-process reference on the same tokens
    return ((ep.hidden - alone.hidden).abs().max().item(), alone.hidden.abs().max().item(),
            ep.tokens_per_expert.tolist(), alone.tokens_per_expert.tolist(),
            ep.local_expert_rows.tolist(), list(shard.experts))


def test_two_rank_expert_parallel_equals_one_process() -> None:
    children_before = len(psutil.Process().children(recursive=True))
    got = run_ranks(_on_a_rank, 2, timeout_s=TIMEOUT_S)  # forked gloo ranks, joined (or killed) on return
    assert len(psutil.Process().children(recursive=True)) <= children_before  # nothing left running

    histogram = [0, 0, 0, 0]
    computed = {}
    for rank in (0, 1):
        max_diff, scale, ep_hist, alone_hist, local_rows, experts = got[rank]
        assert scale > 0.1 and max_diff < 1e-12, (rank, max_diff)
        assert ep_hist == alone_hist and sum(ep_hist) == 2 * TOKENS_PER_RANK[rank]
        histogram = [a + b for a, b in zip(histogram, ep_hist)]
        computed.update(zip(experts, local_rows))
    assert got[0][4] != [0, 0] and got[1][4] != [0, 0]  # both ranks did expert work (rows per local expert)
    # Every routed row was computed exactly once, by the rank that owns its expert.
    assert [computed[e] for e in range(4)] == histogram


def test_shard_experts_refuses_splits_that_do_not_divide() -> None:
    full = moe_weights_from_state(read_safetensors(MOE_DIR), 0, 4, 2)
    shard = shard_experts(full, 1, 2)
    assert shard.experts == range(2, 4) and torch.equal(shard.gate_up, full.gate_up[2:4])
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3"):
        shard_experts(full, 0, 3)
    with pytest.raises(ValueError, match="ep_rank=2 must be in \\[0, 2\\)"):
        shard_experts(full, 2, 2)
