"""Tensor-parallel layers (minillm/distributed/linear.py, chapter 12) on real processes: 2 and 3 gloo
ranks on loopback (minillm/distributed/launch.py), every rank's output compared with one process
computing the whole layer in float64 with plain torch; every process stopped (counted)."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
import torch.nn.functional as F

from minillm.distributed import linear as tp
from minillm.distributed.launch import RankError, run_ranks

HIDDEN, INTERMEDIATE, HEAD_DIM, NUM_HEADS, VOCAB = 6, 12, 2, 6, 12
TIMEOUT_S = 60


def _draw(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _children() -> int:
    return len(psutil.Process().children(recursive=True))


# one process, plain torch: what every rank must reproduce


def _mlp(x, w: tp.MLPWeights) -> torch.Tensor:
    gate_up = x @ w.gate_up.T + w.gate_up_bias
    return (F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]) @ w.down.T + w.down_bias


def _attention(x, wq, wk, wv, wo, num_kv_heads: int) -> torch.Tensor:
    t, group = x.shape[0], NUM_HEADS // num_kv_heads
    q = (x @ wq.T).view(t, NUM_HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ wk.T).view(t, num_kv_heads, HEAD_DIM).transpose(0, 1).repeat_interleave(group, dim=0)
    v = (x @ wv.T).view(t, num_kv_heads, HEAD_DIM).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2) / HEAD_DIM ** 0.5).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1) @ wo.T


def _case(kv_options):
    mlp = tp.MLPWeights(_draw(2 * INTERMEDIATE, HIDDEN, seed=1), _draw(2 * INTERMEDIATE, seed=2),
                        _draw(HIDDEN, INTERMEDIATE, seed=3), _draw(HIDDEN, seed=4))
    attention = {kv: (_draw(NUM_HEADS * HEAD_DIM, HIDDEN, seed=10 + kv), _draw(kv * HEAD_DIM, HIDDEN, seed=20 + kv),
                      _draw(kv * HEAD_DIM, HIDDEN, seed=30 + kv), _draw(HIDDEN, NUM_HEADS * HEAD_DIM, seed=40 + kv))
                 for kv in kv_options}
    return _draw(5, HIDDEN, seed=0), mlp, attention, _draw(VOCAB, HIDDEN, seed=5), torch.tensor([0, 11, 5, 6, 3, 3, 8])


def _on_a_rank(rank: int, world_size: int, x, mlp, attention, table, ids) -> dict:
    state = tp.ParallelState.of()
    assert (state.rank, state.size) == (rank, world_size)
    out = {"mlp": tp.mlp_forward(x, tp.shard_mlp(mlp, rank, world_size), state)}
    # the same MLP from the layer classes: merged column-parallel gate_up, then row-parallel down
    gate_up = tp.ColumnParallelLinear(mlp.gate_up, mlp.gate_up_bias, state, part_sizes=[INTERMEDIATE] * 2)
    down = tp.RowParallelLinear(mlp.down, mlp.down_bias, state)
    gate, up = gate_up(x).chunk(2, dim=-1)
    out["layers"] = down(F.silu(gate) * up)
    out["held"] = gate_up.weight.numel() + down.weight.numel()
    for kv, weights in attention.items():
        out[f"attention kv={kv}"] = tp.attention_forward(x, tp.shard_attention(*weights, NUM_HEADS, kv, rank, world_size),
                                                         state)
    out["embedding"] = tp.VocabParallelEmbedding(table, state)(ids)
    return out


@pytest.mark.parametrize(("world_size", "kv_options"), [(2, (6, 2, 1)), (3, (6, 3, 1))])
def test_layers_on_several_ranks_equal_one_process(world_size: int, kv_options: tuple[int, ...]) -> None:
    x, mlp, attention, table, ids = _case(kv_options)
    expected = {"mlp": _mlp(x, mlp), "layers": _mlp(x, mlp), "embedding": table[ids]}
    expected.update({f"attention kv={kv}": _attention(x, *w, kv) for kv, w in attention.items()})
    before = _children()
    outputs = run_ranks(_on_a_rank, world_size, (x, mlp, attention, table, ids), timeout_s=TIMEOUT_S)
    assert _children() <= before  # every rank joined, none left running
    assert len(outputs) == world_size
    for rank, out in enumerate(outputs):
        # each rank held 1/world_size of the MLP's weights
        assert out["held"] == 3 * HIDDEN * INTERMEDIATE // world_size
        for name, want in expected.items():
            assert want.abs().max() > 0.1
            error = (out[name] - want).abs().max().item()
            assert out[name].shape == want.shape and error < 1e-12, (rank, name, error)


def test_one_process_is_size_one_and_needs_no_group() -> None:
    x, mlp, attention, table, ids = _case((2,))
    state = tp.ParallelState.of()  # torch.distributed not initialised here
    assert (state.rank, state.size) == (0, 1)
    assert torch.allclose(tp.mlp_forward(x, tp.shard_mlp(mlp, 0, 1), state), _mlp(x, mlp), rtol=0, atol=1e-12)
    assert torch.equal(tp.VocabParallelEmbedding(table, state)(ids), table[ids])


def test_merged_weights_are_sliced_part_by_part() -> None:
    merged = torch.arange(8.0).view(8, 1)  # gate rows 0..3, up rows 4..7
    assert tp.column_shard(merged, 1, 2, part_sizes=[4, 4]).flatten().tolist() == [2, 3, 6, 7]
    assert tp.column_shard(merged, 1, 2).flatten().tolist() == [4, 5, 6, 7]  # one part: a consecutive block
    down = torch.arange(12.0).view(2, 6)
    shard = tp.row_shard(down, 2, 3)
    assert shard.tolist() == [[4, 5], [10, 11]]
    assert shard.is_contiguous() and shard.untyped_storage().nbytes() == shard.numel() * 4  # not a view of down


def test_kv_heads_split_or_replicate() -> None:
    assert [tp.kv_heads_of_rank(8, 4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [tp.kv_heads_of_rank(8, 2, r, 4) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [tp.kv_heads_of_rank(8, 1, r, 4) for r in range(4)] == [range(0, 1)] * 4


@pytest.mark.parametrize(("call", "message"), [
    (lambda: tp.shard_mlp(tp.MLPWeights(torch.zeros(24, 4), None, torch.zeros(4, 12), None), 0, 5),
     "output features=12 cannot be split evenly over 5 rank"),
    (lambda: tp.row_shard(torch.zeros(4, 12), 2, 2), r"rank=2 must be in \[0, 2\)"),
    (lambda: tp.kv_heads_of_rank(6, 3, 0, 2), "num_kv_heads=3 cannot be split evenly over 2"),
    (lambda: tp.kv_heads_of_rank(6, 2, 0, 3), "tensor_parallel_size=3 is not a multiple of num_kv_heads=2"),
    (lambda: tp.kv_heads_of_rank(6, 6, 0, 4), "num_heads=6 cannot be split evenly over 4"),
    (lambda: tp.VocabParallelEmbedding(torch.zeros(10, 2), tp.ParallelState(0, 3)), "vocab_size=10"),
    (lambda: tp.column_shard(torch.zeros(8, 2), 0, 2, part_sizes=[4, 3]), "part_sizes \\[4, 3\\] add up to 7"),
])
def test_splits_that_do_not_divide_are_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_all_reduce_bytes_per_token() -> None:
    assert tp.all_reduce_bytes_per_token(4096, 2, num_layers=32) == 2 * 4096 * 2 * 32 == 524_288


# run_ranks: failures are reported, never hang, leave nothing behind


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 is broken")
    return rank


def _rank_1_never_answers(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_failing_rank_is_reported_by_number_and_stopped() -> None:
    before = _children()
    with pytest.raises(RankError, match="rank 1: ValueError: rank 1 is broken"):
        run_ranks(_raise_on_rank_1, 2, timeout_s=TIMEOUT_S)
    assert _children() <= before


def test_a_rank_that_never_answers_times_out_and_is_killed() -> None:
    before = _children()
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] did not answer within 3 s"):
        run_ranks(_rank_1_never_answers, 2, timeout_s=3)
    assert _children() <= before


def test_run_ranks_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_ranks(_raise_on_rank_1, 0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_ranks(_raise_on_rank_1, 2, timeout_s=0)
