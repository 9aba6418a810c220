"""Expert parallelism as the engine will call it (minillm/distributed/moe.py: `ep_moe_layer`,
`shard_model_experts`; the loader reading an EP rank's experts): 2 gloo ranks (run_ranks,
forked, on loopback) hold 2 of the bundled Mixtral's 4 experts each, receive the SAME hidden states
(as tensor-parallel attention leaves them) and must return what one process computes with all 4,
in float64 — for one MoE layer, and for the whole engine with every layer's MoE made expert-parallel.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from minillm.distributed.launch import run_ranks
from minillm.distributed.layout import RankLayout
from minillm.distributed.moe import check_expert_parallel, shard_experts, token_slices
from minillm.model.checkpoint import SafetensorsCheckpoint, StateDictCheckpoint
from minillm.model.loader import Placement, load_model_dir, load_weights, read_safetensors
from minillm.model.moe import moe_weights_from_state

MOE_DIR = Path(__file__).resolve().parents[1] / "models" / "minillm-moe"
TIMEOUT_S = 120
NUM_TOKENS = (1, 3, 30)  # 1: rank 1 has no token of its own (a one-row decode step); 3, 30: uneven slices


def read_expert_shards(config, rank: int, world_size: int, dtype=torch.float32) -> list:
    """The rank's experts of every layer, as the engine's loader reads them for an expert-parallel rank."""
    placement = Placement.of_rank(config, RankLayout(rank, world_size, 1), expert_parallel=True)
    with SafetensorsCheckpoint(MOE_DIR) as checkpoint:
        return [lw.moe for lw in load_weights(checkpoint, config, placement, dtype).layers]


def _layer_on_a_rank(rank: int, world_size: int) -> list[dict]:
    import torch.distributed as dist

    from minillm.distributed.moe import ep_moe_layer
    from minillm.model.moe import sparse_moe

    model = load_model_dir(MOE_DIR, torch.float64)
    shards = read_expert_shards(model.config, rank, world_size, torch.float64)
    results = []
    for layer in (0, 1):
        full = model.layers[layer].moe
        sliced = shard_experts(full, rank, world_size)
        same_shard = all(torch.equal(getattr(shards[layer], n), getattr(sliced, n)) for n in ("router", "gate_up", "down"))
        for t in NUM_TOKENS:
            hidden = torch.randn(t, 64, generator=torch.Generator().manual_seed(10 * layer + t), dtype=torch.float64) * 2
            ep = ep_moe_layer(hidden, shards[layer], dist.group.WORLD)
            alone = sparse_moe(hidden, full)
            results.append(dict(layer=layer, t=t, same_shard=same_shard, experts=list(shards[layer].experts),
                                max_diff=(ep.hidden - alone.hidden).abs().max().item(),
                                exact=torch.equal(ep.hidden, alone.hidden), scale=alone.hidden.abs().max().item(),
                                counts=ep.tokens_per_expert.tolist(), alone_counts=alone.tokens_per_expert.tolist(),
                                local_rows=ep.local_expert_rows.tolist()))
    return results


def test_ep_layer_equals_the_single_process_block_float64() -> None:
    children = len(psutil.Process().children(recursive=True))
    ranks = run_ranks(_layer_on_a_rank, 2, timeout_s=TIMEOUT_S)
    assert len(psutil.Process().children(recursive=True)) <= children  # every rank joined
    assert [r["experts"] for r in (ranks[0][0], ranks[1][0])] == [[0, 1], [2, 3]]
    exact = 0
    for r0, r1 in zip(*ranks):
        for r in (r0, r1):
            assert r["same_shard"]  # read_expert_shards read exactly the rank's slice of the file
            assert r["scale"] > 0.05 and r["max_diff"] <= 1e-12, r
            assert r["counts"] == r["alone_counts"] and sum(r["counts"]) == 2 * r["t"]  # the whole layer's histogram
            exact += r["exact"]
        # Every routed row was computed once, by the rank that owns its expert.
        assert r0["local_rows"] + r1["local_rows"] == r0["counts"], (r0, r1)
    print(f"EP layer vs one process: {exact} of {2 * len(ranks[0])} rank-results bit-identical, all within 1e-12")


def _engine_on_a_rank(rank: int, world_size: int, prompts: list[list[int]], knobs: dict, from_file: bool) -> dict:
    """The whole engine on each rank, every MoE layer expert-parallel. Each rank runs its own (identical,
    deterministic) scheduler here: a stand-in for the multi-process executor broadcasting one plan."""
    import torch.distributed as dist

    from minillm import LLM, SamplingParams
    from minillm.distributed.moe import shard_model_experts

    llm = LLM(model=str(MOE_DIR), dtype="float64", device="cpu", **knobs)
    # The rank's experts read from the file, or sliced from the whole model the LLM loaded.
    shards = read_expert_shards(llm.model.config, rank, world_size, torch.float64) if from_file else None
    hook = shard_model_experts(llm.model, dist.group.WORLD, shards)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return dict(tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[[e[t] for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
                loads=[s.expert_load for s in llm.engine.metrics.steps], experts_held=llm.model.layers[0].moe.gate_up.shape[0],
                local_rows=hook.local_expert_rows)


@pytest.mark.parametrize(("knobs", "from_file"), [
    (dict(block_size=4), True),
    (dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True), False),
], ids=["paged-shards-from-file", "chunked-prefix-sliced"])
def test_engine_with_expert_parallel_layers_equals_one_process(knobs: dict, from_file: bool) -> None:
    from minillm import LLM, SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(6, 4096, (9,), generator=g).tolist()
    prompts = [[0] + shared + torch.randint(6, 4096, (n,), generator=g).tolist() for n in (1, 6, 13)] + [[0, 1060, 264]]
    one = LLM(model=str(MOE_DIR), dtype="float64", device="cpu", **knobs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = one.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ranks = run_ranks(_engine_on_a_rank, 2, (prompts, knobs, from_file), timeout_s=TIMEOUT_S)
    for r in ranks:
        assert r["experts_held"] == 2
        assert r["tokens"] == [o.outputs[0].token_ids for o in outs]
        for ours, theirs in zip(r["logprobs"], outs):
            ref = [e[t] for e, t in zip(theirs.outputs[0].logprobs, theirs.outputs[0].token_ids)]
            assert ours == pytest.approx(ref, abs=1e-12, rel=0)
        assert r["loads"] == [s.expert_load for s in one.engine.metrics.steps]  # the same histogram, every step
    assert ranks[0]["local_rows"][0] != [0, 0] and ranks[1]["local_rows"][0] != [0, 0]  # both ranks computed


def test_token_slices_and_refusals() -> None:
    assert token_slices(5, 2) == [range(0, 3), range(3, 5)]
    assert token_slices(1, 2) == [range(0, 1), range(1, 1)]
    assert token_slices(0, 2) == [range(0, 0), range(0, 0)]
    config = load_model_dir(MOE_DIR).config
    full = moe_weights_from_state(read_safetensors(MOE_DIR), 0, 4, 2)
    assert torch.equal(read_expert_shards(config, 1, 4)[0].gate_up, full.gate_up[1:2])
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 8"):
        check_expert_parallel(config, 8)
    check_expert_parallel(config, 4)
    dense = load_model_dir(MOE_DIR.parent / "minillm-draft").config
    with pytest.raises(ValueError, match="needs a mixture-of-experts model \\(Mixtral\\); model_type 'llama' has no experts"):
        check_expert_parallel(dense, 2)


def test_an_expert_parallel_rank_reads_only_its_experts() -> None:
    state = read_safetensors(MOE_DIR)
    others = {n: t for n, t in state.items() if not any(f".experts.{e}." in n for e in (0, 1))}  # experts 2, 3 only
    config = load_model_dir(MOE_DIR).config
    placement = Placement.of_rank(config, RankLayout(1, 2, 1), expert_parallel=True)
    layers = load_weights(StateDictCheckpoint(others), config, placement, torch.float64).layers
    assert [lw.moe.experts for lw in layers] == [range(2, 4)] * 2
    assert torch.equal(layers[1].moe.down, moe_weights_from_state(state, 1, 4, 2, torch.float64).down[2:])
    with pytest.raises(KeyError, match="experts.0.w1.weight"):  # one process needs every expert
        load_weights(StateDictCheckpoint(others), config, Placement.whole(config), torch.float64)
