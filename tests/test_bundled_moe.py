"""The bundled MoE model (models/minillm-moe, built by tools/train_bundled_moe.py) and minillm's
sparse MoE block (minillm/model/moe.py), both for chapter 12's expert parallelism.

Loads only what is committed; never trains. The block is checked against transformers' own
`MixtralSparseMoeBlock` in float64 on the bundled weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from minillm.model.loader import read_safetensors  # noqa: E402
from minillm.model.moe import (  # noqa: E402
    MIXTRAL_EXPERT_NAMES,
    MoEWeights,
    dispatch,
    expert_ranges,
    moe_weights_from_state,
    route,
    sparse_moe,
    unfuse_experts,
)

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
MOE_DIR = MODELS_DIR / "minillm-moe"
PROMPTS = ["The", "And the king said unto", "In the beginning", "Thou shalt not", "And it came to pass"]


@pytest.fixture(scope="module")
def hf_moe():
    model = AutoModelForCausalLM.from_pretrained(MOE_DIR, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(MOE_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def hf_moe64():
    return AutoModelForCausalLM.from_pretrained(
        MOE_DIR, local_files_only=True, dtype=torch.float64, experts_implementation="eager"
    ).eval()


def test_files_config_and_shared_tokenizer(hf_moe) -> None:
    model, tokenizer = hf_moe
    names = {p.name for p in MOE_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in MOE_DIR.iterdir()) < 4 * 1024 * 1024
    c = model.config
    assert type(model).__name__ == "MixtralForCausalLM"
    # Splittable by TP 2 and 4 (query heads), TP 2 (KV heads), EP 2 and 4 (experts).
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.num_local_experts, c.num_experts_per_tok, c.sliding_window) == (4, 2, None)
    assert (MODELS_DIR / "minillm-target" / "tokenizer.json").read_bytes() == (MOE_DIR / "tokenizer.json").read_bytes()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)


def test_moe_learned_the_corpus(hf_moe) -> None:
    model, tokenizer = hf_moe
    ids = tokenizer("And God said, Let there be light: and there was light.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    uniform = torch.log(torch.tensor(4096.0)).item()  # 8.32 nats: what an untrained model scores
    assert loss < uniform - 2.5, loss


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_continuation_is_english_words(hf_moe, prompt: str) -> None:
    model, tokenizer = hf_moe
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    pieces = text.split()
    words = [w for w in (re.sub(r"[^A-Za-z]", "", p) for p in pieces) if w]
    assert len(pieces) >= 8 and len(words) >= 0.9 * len(pieces), text
    # A model this small loops ("and the LORD, and the LORD"), but not on a single token.
    assert len({w.lower() for w in words}) >= 3, f"degenerate repetition: {text!r}"


def test_router_load_histogram_uses_every_expert(hf_moe) -> None:
    model, tokenizer = hf_moe
    c = model.config
    counts = torch.zeros(c.num_hidden_layers, c.num_local_experts, dtype=torch.long)
    num_tokens = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        num_tokens += ids.shape[1]
        with torch.no_grad():
            router_logits = model(input_ids=ids, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            counts[layer] += torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4)
    assert counts.sum(dim=1).tolist() == [2 * num_tokens] * c.num_hidden_layers
    assert (counts > 0).all(), counts
    # The load-balancing loss did its job: no expert takes more than half of the routed slots.
    assert (counts.max(dim=1).values <= num_tokens).all(), counts


def _hf_block_and_ours(hf_model, layer: int, spelling: str) -> tuple[torch.nn.Module, MoEWeights]:
    c, dtype = hf_model.config, hf_model.dtype
    state = read_safetensors(MOE_DIR) if spelling == "disk" else hf_model.state_dict()
    weights = moe_weights_from_state(state, layer, c.num_local_experts, c.num_experts_per_tok, dtype=dtype)
    return hf_model.model.layers[layer].mlp, weights


# transformers' default experts implementation (grouped_mm, torch._grouped_mm) refuses float64, so
# the float64 reference is its "eager" loop over experts (a float64 Mixtral must be loaded with
# experts_implementation="eager"); grouped_mm is compared in float32, where it sums differently.
@pytest.mark.parametrize(("dtype", "experts_implementation", "atol"),
                         [(torch.float64, "eager", 1e-12), (torch.float32, "grouped_mm", 1e-5)],
                         ids=["float64-eager", "float32-grouped_mm"])
@pytest.mark.parametrize("layer", [0, 1])
def test_sparse_moe_equals_hf_block(hf_moe, hf_moe64, layer: int, dtype, experts_implementation, atol) -> None:
    hf_model = hf_moe64 if dtype == torch.float64 else hf_moe[0]
    block, weights = _hf_block_and_ours(hf_model, layer, "disk")
    gen = torch.Generator().manual_seed(layer)
    # Scale like post-norm activations (RMS-normed, times the learned gains) so routing is not trivial.
    hidden = (torch.randn(3, 17, 64, generator=gen, dtype=torch.float64) * 2.0).to(dtype)
    previous = hf_model.config._experts_implementation
    hf_model.config._experts_implementation = experts_implementation
    try:
        with torch.no_grad():
            expected = block(hidden.clone())
    finally:
        hf_model.config._experts_implementation = previous
    ours = sparse_moe(hidden.view(-1, 64), weights)
    assert ours.hidden.dtype == dtype
    torch.testing.assert_close(ours.hidden.view(3, 17, 64), expected, rtol=0, atol=atol)
    assert expected.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    # The histogram equals the HF router's own choice, counted.
    _, _, hf_indices = block.gate(hidden.view(-1, 64))
    assert ours.tokens_per_expert.tolist() == torch.bincount(hf_indices.flatten(), minlength=4).tolist()
    assert ours.tokens_per_expert.sum().item() == 3 * 17 * 2
    assert (ours.tokens_per_expert > 0).all()


def test_in_memory_weights_equal_disk_weights(hf_moe64) -> None:
    _, disk = _hf_block_and_ours(hf_moe64, 1, "disk")
    _, memory = _hf_block_and_ours(hf_moe64, 1, "memory")
    for name in ("router", "gate_up", "down"):
        assert torch.equal(getattr(disk, name), getattr(memory, name)), name
    # The names the loader reads (Mixtral's ExpertNames): every MoE tensor of the file, nothing else; the
    # in-memory spelling, unfused, is the file's.
    state, n = read_safetensors(MOE_DIR), MIXTRAL_EXPERT_NAMES
    names = {f"model.layers.{i}.{t.format(e=e)}" for i in (0, 1) for e in range(4) for t in (n.gate, n.up, n.down)}
    names |= {f"model.layers.{i}.{n.router}" for i in (0, 1)}
    assert {k for k in state if "block_sparse_moe" in k} == names
    assert {k for k in unfuse_experts(hf_moe64.state_dict(), n) if "block_sparse_moe" in k} == names


def test_dispatch_groups_rows_by_expert() -> None:
    logits_to_ids = torch.tensor([[0, 2], [2, 1], [0, 1]])
    routing = route(torch.eye(3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64), top_k=2)
    routing.expert_ids = logits_to_ids
    routing.weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    d = dispatch(routing, num_experts=4)
    assert d.tokens_per_expert.tolist() == [2, 2, 2, 0]
    assert d.offsets.tolist() == [0, 2, 4, 6, 6]
    assert d.token_index.tolist() == [0, 2, 1, 2, 0, 1]  # expert 0: tokens 0, 2; expert 1: 1, 2; expert 2: 0, 1
    assert d.weights.tolist() == pytest.approx([0.6, 0.5, 0.3, 0.5, 0.4, 0.7])


def test_expert_parallel_shares_add_up(hf_moe64) -> None:
    _, weights = _hf_block_and_ours(hf_moe64, 0, "disk")
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2.0
    full = sparse_moe(hidden, weights)
    for ep_size in (2, 4):
        shares = [sparse_moe(hidden, weights, experts=r) for r in expert_ranges(4, ep_size)]
        torch.testing.assert_close(sum(s.hidden for s in shares), full.hidden, rtol=0, atol=1e-12)
        assert not torch.equal(shares[0].hidden, full.hidden)  # a rank alone computes only its share
    assert expert_ranges(4, 2) == [range(0, 2), range(2, 4)]


def test_bad_configurations_are_refused(hf_moe64) -> None:
    _, w = _hf_block_and_ours(hf_moe64, 0, "disk")
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3"):
        expert_ranges(4, 3)
    with pytest.raises(ValueError, match="top_k=5"):
        MoEWeights(router=w.router, gate_up=w.gate_up, down=w.down, top_k=5)
    with pytest.raises(ValueError, match="router has 4 experts"):
        MoEWeights(router=w.router, gate_up=w.gate_up[:3], down=w.down, top_k=2)
    with pytest.raises(ValueError, match="contiguous range"):
        sparse_moe(torch.zeros(2, 64, dtype=torch.float64), w, experts=range(0, 4, 2))
    with pytest.raises(KeyError, match="no MoE weights for layer 5"):
        moe_weights_from_state(read_safetensors(MOE_DIR), 5, 4, 2)


class _MiniMoE(torch.nn.Module):
    """minillm's sparse_moe in place of transformers' block, keeping each call's load histogram."""

    def __init__(self, weights: MoEWeights) -> None:
        super().__init__()
        self.weights = weights
        self.histograms: list[list[int]] = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = sparse_moe(hidden.reshape(-1, hidden.shape[-1]), self.weights)
        self.histograms.append(out.tokens_per_expert.tolist())
        return out.hidden.view(hidden.shape)


def test_greedy_tokens_equal_hf_with_minillm_moe_blocks_float64(hf_moe, hf_moe64) -> None:
    """The whole model, HF attention + minillm's MoE blocks, generates HF's tokens in float64."""
    tokenizer = hf_moe[1]
    patched = AutoModelForCausalLM.from_pretrained(
        MOE_DIR, local_files_only=True, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    state = read_safetensors(MOE_DIR)
    blocks = []
    for i, layer in enumerate(patched.model.layers):
        layer.mlp = _MiniMoE(moe_weights_from_state(state, i, 4, 2, dtype=torch.float64))
        blocks.append(layer.mlp)
    for prompt in PROMPTS[1:3]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf_moe64.generate(ids, max_new_tokens=16, do_sample=False)
            ours = patched.generate(ids, max_new_tokens=16, do_sample=False)
        assert ours.tolist() == expected.tolist(), prompt
    # One histogram per forward (prefill, then one per decode step): 2 slots per token.
    first = blocks[0].histograms
    assert len(first) == 2 * 16 and sum(first[1]) == 2  # a decode step routes its 1 token to 2 experts
