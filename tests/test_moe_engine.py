"""The engine runs the bundled Mixtral (models/minillm-moe): greedy tokens and their logprobs equal
HF transformers' in float64 in every engine mode, and each step records its per-expert load
(chapter 12; minillm/model/moe.py is the block, minillm/model/llama.py calls it).

The float64 reference is HF loaded with `experts_implementation="eager"` (its loop over experts):
transformers' default, grouped_mm (`torch._grouped_mm`), refuses float64. The float32 check uses
HF's default.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.model.config import ModelConfig  # noqa: E402
from minillm.model.loader import load_model_dir  # noqa: E402

MOE_DIR = Path(__file__).resolve().parents[1] / "models" / "minillm-moe"
SHARED = "And God said, Let there be light: and there was light. And God saw the light,"
TEXT_PROMPTS = ["The", "And the king said unto", SHARED + " that it was good", SHARED + " and God divided",
                "Thou shalt not"]
MAX_TOKENS = 12
TOP_K = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MOE_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Text prompts (two share a 20-token prefix) and two of random token ids (odd routing)."""
    g = torch.Generator().manual_seed(5)
    text = [tokenizer(p).input_ids for p in TEXT_PROMPTS]
    return text + [[0] + torch.randint(6, 4096, (n,), generator=g).tolist() for n in (9, 17)]


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and the logprob of each (log-softmax of its raw logits)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=2, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def reference64(prompts):
    hf = AutoModelForCausalLM.from_pretrained(MOE_DIR, local_files_only=True, dtype=torch.float64,
                                              experts_implementation="eager").eval()
    return hf, [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


class ForwardSpy:
    """Wraps the model's forward: per call, (tokens in, rows out) — to check the step records."""

    def __init__(self, model) -> None:
        self.model, self.inner, self.calls = model, model.forward, []
        model.forward = self

    def __call__(self, input_ids, positions, attention, output_rows=None):
        out = self.inner(input_ids, positions, attention, output_rows)  # the hidden states and what it measured
        self.calls.append((input_ids.shape[0], out.hidden.shape[0], out.expert_load))
        return out


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


MODES = {
    "static": dict(batching="static", max_num_seqs=3),
    "continuous-slab": dict(kv_layout="slab", max_num_seqs=4),
    "paged": dict(kv_layout="paged", block_size=4, max_num_seqs=4),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4),
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4, max_num_seqs=2),
    "preempted": dict(block_size=1, num_kv_blocks=40, max_model_len=40, max_num_seqs=7, kv_watermark=0.0),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_equals_hf_float64_and_records_expert_load(reference64, prompts, mode: str) -> None:
    _, refs = reference64
    llm = LLM(model=str(MOE_DIR), dtype="float64", device="cpu", **MODES[mode])
    assert not llm.model.fused_ops and llm.model.layers[0].moe is not None
    spy = ForwardSpy(llm.model)
    outs = _generate(llm, prompts)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, refs)):
        assert out.token_ids == tokens, (mode, i)
        ours = [entry[t] for entry, t in zip(out.logprobs, out.token_ids)]
        # float64 up to rms_norm's and the router softmax's float32 (HF's too): 1e-6, as tests/test_parity.py
        assert ours == pytest.approx(logprobs, abs=1e-6, rel=0), (mode, i)
    steps = llm.engine.metrics.steps
    if mode == "prefix-cached":
        assert sum(s.num_prefix_hit_tokens for s in steps) >= 16  # the shared prefix was reused
    if mode == "preempted":
        assert sum(s.num_preemptions for s in steps) > 0
    if mode == "chunked":
        assert any(len(s.prefill_chunk_sizes) and max(s.prefill_chunk_sizes) < 8 for s in steps)
    # One forward per step; every layer's histogram counts each computed token top_k times, except the
    # last layer's, whose MoE runs only on the rows whose logits are sampled (LlamaModel.forward).
    assert len(spy.calls) == len(steps) > 0
    for record, (tokens_in, rows_out, load) in zip(steps, spy.calls):
        assert record.expert_load == load and len(load) == 2 and all(len(row) == 4 for row in load)
        assert tokens_in == record.num_computed_tokens  # (padding rows included, static batching)
        assert sum(load[0]) == TOP_K * record.num_computed_tokens
        assert sum(load[1]) == TOP_K * rows_out
    assert all(n > 0 for n in [sum(s.expert_load[0][e] for s in steps) for e in range(4)])  # all experts used


def test_prefill_histogram_equals_hf_router(reference64, prompts) -> None:
    """A one-prompt prefill's layer-0 load is HF's router choice counted; the last layer's, the last token's."""
    hf, _ = reference64
    prompt = prompts[2]
    llm = LLM(model=str(MOE_DIR), dtype="float64", device="cpu")
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    (record,) = llm.engine.metrics.steps
    with torch.no_grad():
        router_logits = hf(input_ids=torch.tensor([prompt]), output_router_logits=True).router_logits
    chosen = [logits.topk(TOP_K, dim=-1).indices for logits in router_logits]
    assert record.expert_load[0] == torch.bincount(chosen[0].flatten(), minlength=4).tolist()
    assert record.expert_load[1] == torch.bincount(chosen[1][-1], minlength=4).tolist()
    assert sum(record.expert_load[0]) == TOP_K * len(prompt) and max(record.expert_load[0]) < len(prompt)


def test_float32_greedy_equals_hf(prompts) -> None:
    """float32 (HF's default grouped_mm experts vs minillm's loop): the same greedy tokens; the
    smallest top-1/top-2 logit margin met is printed (a near-tie could flip a token in float32)."""
    hf = AutoModelForCausalLM.from_pretrained(MOE_DIR, local_files_only=True).eval()
    llm = LLM(model=str(MOE_DIR), dtype="float32", device="cpu", block_size=4)
    assert llm.model.fused_ops  # the one forward with the fused CPU ops, its MoE block included
    outs = _generate(llm, prompts)
    margins = []
    for out, prompt in zip(outs, prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
        margins += [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in ref.logits)]
    print(f"float32: {len(margins)} tokens equal; smallest HF logit margin {min(margins):.4f}")


def test_engine_reports_no_expert_load_for_dense_models() -> None:
    llm = LLM(model=str(MOE_DIR.parent / "minillm-draft"), dtype="float32", device="cpu")
    llm.generate(["The"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert not hasattr(llm.model, "expert_load") and all(s.expert_load is None for s in llm.engine.metrics.steps)


def _config(**changes) -> dict:
    return {**json.loads((MOE_DIR / "config.json").read_text()), **changes}


def test_mixtral_config_is_read_and_other_moe_types_are_refused() -> None:
    c = ModelConfig.from_hf_dict(_config())
    assert (c.model_type, c.is_moe, c.num_experts, c.num_experts_per_tok, c.intermediate_size) == ("mixtral", True, 4, 2, 128)
    assert not ModelConfig.from_hf_dict({**_config(model_type="mistral"), "num_local_experts": 0}).is_moe
    with pytest.raises(ValueError, match="'qwen2_moe': a mixture-of-experts family minillm does not run; of MoE "
                                         "families minillm runs mixtral"):
        ModelConfig.from_hf_dict(_config(model_type="qwen2_moe"))
    with pytest.raises(ValueError, match="'llama': a mixture-of-experts family"):
        ModelConfig.from_hf_dict(_config(model_type="llama"))  # a llama config that names experts
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict(_config(num_experts_per_tok=5))


def test_loader_checks_expert_shapes(tmp_path) -> None:
    copy = tmp_path / "moe"
    shutil.copytree(MOE_DIR, copy)
    (copy / "config.json").write_text(json.dumps(_config(intermediate_size=96)))
    with pytest.raises(ValueError, match=r"'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape \(128, 64\), "
                                         r"the config implies \(96, 64\)"):
        load_model_dir(copy)
    (copy / "config.json").write_text(json.dumps(_config(num_local_experts=8)))
    with pytest.raises(ValueError, match=r"'model.layers.0.block_sparse_moe.gate.weight' has shape \(4, 64\), "
                                         r"the config implies \(8, 64\)"):
        load_model_dir(copy)


def test_in_memory_hf_mixtral_loads_like_the_directory(reference64) -> None:
    hf, _ = reference64
    from minillm.model.loader import load_hf_model

    memory, disk = load_hf_model(hf), load_model_dir(MOE_DIR, torch.float64)
    for a, b in zip(memory.layers, disk.layers):
        assert a.gate_up is None and a.down is None
        for name in ("router", "gate_up", "down"):
            assert torch.equal(getattr(a.moe, name), getattr(b.moe, name)), name
    assert memory.num_params == disk.num_params == sum(p.numel() for p in hf.parameters())
