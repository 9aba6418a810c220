"""minillm's own forward equals HF transformers: logits to 1e-6, greedy tokens exactly (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, varied_prompts

from minillm import LLM, SamplingParams
from minillm.model.loader import load_hf_model
from minillm.single_sequence import full_logits, incremental_logits

NUM_TOKENS = 32


def test_logits_match_hf_prefill_and_decode(tiny_hf_model):
    name, hf = tiny_hf_model
    model = load_hf_model(hf)
    tokens = varied_prompts(1, hf.config.vocab_size, seed=5, lo=48, hi=48)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    full = full_logits(model, tokens)
    incremental = incremental_logits(model, tokens, prefill_len=7)
    assert (full - ref).abs().max().item() < 1e-6, name
    assert (incremental - ref).abs().max().item() < 1e-6, name
    assert ref.abs().max().item() > 1.0  # the comparison is not trivially between near-zero logits


@pytest.mark.parametrize("backend", ["torch", "numba_cpu"])  # both CPU attention backends
def test_greedy_tokens_match_hf_generate(tiny_hf_model, backend):
    name, hf = tiny_hf_model
    prompts = varied_prompts(8, hf.config.vocab_size, seed=2)
    llm = LLM(hf, dtype="float64", device="cpu", max_num_seqs=3, attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == NUM_TOKENS
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS), (name, len(prompt))


def test_stops_at_eos_like_hf(tiny_hf_model):
    """Without ignore_eos both stop at the EOS token (kept in token_ids, as HF and vLLM do)."""
    name, hf = tiny_hf_model
    prompts = varied_prompts(8, hf.config.vocab_size, seed=3)
    llm = LLM(hf, dtype="float64", device="cpu", max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf, prompt, NUM_TOKENS, stop_at_eos=True)
        assert out.outputs[0].token_ids == ref, name
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] == 2 else "length")


def test_bundled_models_match_hf_in_float64():
    """The trained target and draft: same greedy text as HF generate, logits to 1e-6."""
    from transformers import AutoModelForCausalLM

    from minillm.llm import BUNDLED_DRAFT, BUNDLED_TARGET

    texts = ["The", "And the king said unto", "In the beginning", "Blessed are they",
             "And it came to pass, when the people heard", "Thus saith the LORD of hosts; Behold,",
             "A soft answer turneth away wrath: but", "Now the serpent was more subtil than any beast of the field"]
    for model_dir in (BUNDLED_TARGET, BUNDLED_DRAFT):
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
        llm = LLM(model_dir, dtype="float64", device="cpu", max_num_seqs=4)
        prompts = [llm.tokenizer(t).input_ids for t in texts]
        assert len({len(p) for p in prompts}) >= 6
        outs = llm.generate(texts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.prompt_token_ids == prompt
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS), (model_dir.name, prompt)
        sequence = prompts[-1] + outs[-1].outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([sequence])).logits[0]
        assert (full_logits(llm.model, sequence) - ref).abs().max().item() < 1e-6
        assert (incremental_logits(llm.model, sequence, 5) - ref).abs().max().item() < 1e-6
