"""Qwen3 and Qwen3-MoE, added through the registry (minillm/model/qwen3.py, qwen3_moe.py): token-exact
with HF transformers in float64, on tiny random configs made here, in every batching mode (static,
dynamic, continuous on slabs and on pages with both CPU attention backends, chunked + prefix-cached,
preempted), and on real processes: tensor parallel 2, pipeline parallel 2 with 3 layers on 2 stages
(2 + 1), and for the MoE expert parallel 2.

The configs exercise what Qwen3 changes: an RMSNorm over each query and key head before RoPE (its
weights drawn at random, not left at 1), no q/k/v bias, and head_dim 16 where hidden ÷ heads is 8;
Qwen3-MoE's router with its top-k renormalised (norm_topk_prob=True) and not (False, HF's default),
and each step's expert load (returned by the forward, recorded per step).
The multi-process tests share the xdist group of tests/test_distributed_engine.py (one at a time).
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, varied_prompts

from minillm import LLM, SamplingParams
from minillm.model.loader import load_hf_model
from minillm.single_sequence import full_logits, incremental_logits

MAX_TOKENS = 12
TINY = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
FAMILIES = {"qwen3": dict(), "qwen3_moe": dict(MOE, norm_topk_prob=True),
            "qwen3_moe-unnormalised": dict(MOE, norm_topk_prob=False)}
MODES = {
    "static": dict(batching="static", max_num_seqs=3),
    "dynamic": dict(batching="dynamic", max_num_seqs=3),
    "continuous-slab": dict(kv_layout="slab", max_num_seqs=4),
    "paged-torch": dict(block_size=4, max_num_seqs=4, attention_backend="torch"),
    "paged-numba_cpu": dict(block_size=4, max_num_seqs=4, attention_backend="numba_cpu"),
    "chunked-prefix-cached": dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4,
                                  enable_prefix_caching=True, max_num_seqs=3),
    "preempted": dict(block_size=1, num_kv_blocks=40, max_model_len=40, max_num_seqs=6, kv_watermark=0.0),
}
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2-uneven": dict(pipeline_parallel_size=2),
           "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}
PARALLEL_CASES = [("qwen3", "tp2"), ("qwen3", "pp2-uneven"), ("qwen3_moe", "ep2"), ("qwen3_moe", "pp2-uneven"),
                  ("qwen3_moe-unnormalised", "tp2")]


def make_hf_model(family: str, seed: int = 0):
    """A random HF Qwen3 model in float64, every weight drawn wide enough that logits are far from ties."""
    import transformers

    config_cls, model_cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[family.split("-")[0]]
    torch.manual_seed(seed)
    config = config_cls(**TINY, **FAMILIES[family])
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # (an MoE's experts one by one, in float64 as asked)
    model = model_cls(config).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
            else:  # the norms (q_norm and k_norm among them): random, so that a wrong one shows
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def prompts() -> list[list[int]]:
    shared = varied_prompts(1, TINY["vocab_size"], seed=9, lo=10, hi=10)[0]  # a prefix the cache can share
    tails = varied_prompts(5, TINY["vocab_size"], seed=4, lo=1, hi=25)
    return [shared + t for t in tails[:3]] + tails[3:]


_cache: dict = {}


def reference(family: str):
    """(HF model, its greedy tokens per prompt), made once per family."""
    if family not in _cache:
        hf = make_hf_model(family)
        _cache[family] = hf, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts()]
    return _cache[family]


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_hf(family: str) -> None:
    hf, _ = reference(family)
    model = load_hf_model(hf)
    assert type(model).__name__ == {"qwen3": "Qwen3Model", "qwen3_moe": "Qwen3MoeModel"}[family.split("-")[0]]
    assert model.config.head_dim == 16 and model.config.qk_norm and not model.config.qkv_bias
    tokens = prompts()[0]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert want.abs().max().item() > 1.0  # not trivially between near-zero logits
    assert (full_logits(model, tokens) - want).abs().max().item() < 1e-6
    assert (incremental_logits(model, tokens, prefill_len=5) - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_hf_in_every_batching_mode(family: str, mode: str) -> None:
    hf, want = reference(family)
    llm = LLM(hf, dtype="float64", device="cpu", **MODES[mode])
    assert generate(llm) == want
    steps = llm.engine.metrics.steps
    if mode == "chunked-prefix-cached":
        assert sum(s.num_prefix_hit_tokens for s in steps) > 0  # the shared prefix was found in the cache
        assert any(len(s.prefill_chunk_sizes) > 0 and max(s.prefill_chunk_sizes) < 8 for s in steps)
    if mode == "preempted":
        assert sum(s.num_preemptions for s in steps) > 0
    if family.startswith("qwen3_moe") and mode != "static":  # (static batching computes pad rows too)
        # Layer 0 routes every computed token to top_k experts: the forward's measure, in the step records.
        assert all(sum(s.expert_load[0]) == 2 * s.num_computed_tokens and len(s.expert_load) == 3 for s in steps)
    elif not family.startswith("qwen3_moe"):
        assert all(s.expert_load is None for s in steps)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's HF model saved as a model directory (ranks read their shards from it)."""
    def save(family: str):
        path = tmp_path_factory.mktemp(family)
        reference(family)[0].save_pretrained(path)
        return path
    return save


def test_qwen3_moe_with_dense_layers_is_refused() -> None:
    from minillm.model.config import ModelConfig

    cfg = make_hf_model("qwen3_moe").config.to_dict()
    with pytest.raises(ValueError, match=r"layers \[1\] have a dense MLP \(mlp_only_layers=\[1\]"):
        ModelConfig.from_hf_dict({**cfg, "mlp_only_layers": [1]})
    assert ModelConfig.from_hf_dict(cfg).moe_renormalize and ModelConfig.from_hf_dict(cfg).intermediate_size == 24


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize(("family", "layout"), PARALLEL_CASES, ids=[f"{f}-{lay}" for f, lay in PARALLEL_CASES])
def test_parallel_layouts_equal_hf(family: str, layout: str, saved) -> None:
    _, want = reference(family)
    knobs = dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True,
                 max_num_seqs=3)
    llm = LLM(str(saved(family)), dtype="float64", device="cpu", **LAYOUTS[layout], **knobs)
    try:
        assert generate(llm) == want
    finally:
        llm.shutdown()
