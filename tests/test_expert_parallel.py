"""Expert parallelism on real processes (minillm/distributed/moe.py, chapter 12): 2 gloo ranks on
loopback, each holding 2 of the bundled MoE model's 4 experts, exchange tokens with all_to_all_single
and must get what one process computes with all 4 experts."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from pathlib import Path

import psutil
import pytest
import torch

from minillm.distributed.moe import shard_experts
from minillm.model.loader import read_safetensors
from minillm.model.moe import moe_weights_from_state

MOE_DIR = Path(__file__).resolve().parents[1] / "models" / "minillm-moe"
TOKENS_PER_RANK = (5, 11)  # uneven on purpose: the all-to-all splits differ per rank
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, results) -> None:
    try:
        import torch.distributed as dist

        from minillm.distributed.moe import expert_parallel_moe
        from minillm.model.moe import sparse_moe

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            full = moe_weights_from_state(read_safetensors(MOE_DIR), 0, 4, 2, dtype=torch.float64)
            shard = shard_experts(full, rank, world_size)
            gen = torch.Generator().manual_seed(100 + rank)
            hidden = torch.randn(TOKENS_PER_RANK[rank], 64, generator=gen, dtype=torch.float64) * 2.0
            ep = expert_parallel_moe(hidden, shard)
            alone = sparse_moe(hidden, full)  # the one-process reference on the same tokens
            results.put((rank, (ep.hidden - alone.hidden).abs().max().item(), alone.hidden.abs().max().item(),
                         ep.tokens_per_expert.tolist(), alone.tokens_per_expert.tolist(),
                         ep.local_expert_rows.tolist(), list(shard.experts)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def test_two_rank_expert_parallel_equals_one_process() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    children_before = len(psutil.Process().children(recursive=True))
    port = _free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, results), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            try:
                item = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"no result from the ranks within {TIMEOUT_S} s")
            assert item[1] != "error", item[2]
            got[item[0]] = item[1:]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    assert len(psutil.Process().children(recursive=True)) <= children_before  # nothing left running

    histogram = [0, 0, 0, 0]
    computed = {}
    for rank in (0, 1):
        max_diff, scale, ep_hist, alone_hist, local_rows, experts = got[rank]
        assert scale > 0.1 and max_diff < 1e-12, (rank, max_diff)
        assert ep_hist == alone_hist and sum(ep_hist) == 2 * TOKENS_PER_RANK[rank]
        histogram = [a + b for a, b in zip(histogram, ep_hist)]
        computed.update(zip(experts, local_rows))
    assert got[0][5] != [0, 0] and got[1][5] != [0, 0]  # both ranks did expert work
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
