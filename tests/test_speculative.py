"""Speculative decoding (chapter 09): exact greedy outputs with n-gram and draft-model proposers,
the target's distribution under sampling (chi-square), stops inside an accepted run, metrics."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_tiny_hf_model, varied_prompts

from minillm import LLM, SamplingParams
from minillm.request import Request
from minillm.spec.config import SpeculativeConfig
from minillm.spec.ngram import NgramProposer
from minillm.spec.rejection import rejection_sample, target_probs

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_hf_model("llama-gqa", seed=0)
    other = make_tiny_hf_model("llama-gqa", seed=1)  # a different random model: few guesses accepted
    dirs = {}
    for name, model in (("same", target), ("other", other)):
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        dirs[name] = str(path)
    # Repetitive prompts give n-gram lookup something to find.
    prompts = [p + p[: len(p) // 2] for p in varied_prompts(5, target.config.vocab_size, seed=6, lo=4, hi=24)]
    expected = [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    return target, dirs, prompts, expected


def run(llm: LLM, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_ngram_greedy_equals_hf(models, k):
    target, _, prompts, expected = models
    llm = LLM(target, dtype="float64", max_num_seqs=4, max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    assert run(llm, prompts) == expected
    stats = llm.engine.metrics.spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.kv.allocator.num_in_use == 0


@pytest.mark.parametrize("runner", ["compiled", "worker"])
@pytest.mark.parametrize("draft, k", [("same", 3), ("same", 5), ("other", 1), ("other", 4)])
def test_draft_model_greedy_equals_hf(models, draft, k, runner, monkeypatch):
    """Both ways of running the draft: the compiled loop (what LLM picks for a plain Llama draft on a
    CPU) and the engine's own worker (any other draft)."""
    target, dirs, prompts, expected = models
    if runner == "worker":
        monkeypatch.setattr("minillm.spec.draft_kernel.supports", lambda model: False)
    llm = LLM(target, dtype="float64", max_num_seqs=4, max_model_len=128, block_size=4,
              speculative_config={"method": "draft_model", "model": dirs[draft], "num_speculative_tokens": k})
    proposer = llm.engine.proposer
    assert type(proposer).__name__ == {"compiled": "CompiledDraftProposer", "worker": "DraftModelProposer"}[runner]
    assert run(llm, prompts) == expected
    stats = llm.engine.metrics.spec_decode
    if draft == "same":  # the draft is the target: every guess is accepted
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
    assert llm.engine.kv.allocator.num_in_use == 0
    assert not proposer.states if runner == "compiled" else proposer.kv.allocator.num_in_use == 0


def test_compiled_draft_loop_computes_the_models_logits(models, monkeypatch):
    """`draft_decode` against HF transformers in float64: the logits after a prompt, and a greedy
    continuation fed back token by token, in one call and over several calls (catch-up, then guesses)."""
    import numpy as np

    from minillm.model.loader import load_model_dir
    from minillm.spec.draft_kernel import DraftWeights

    _, dirs, prompts, _ = models
    hf = make_tiny_hf_model("llama-gqa", seed=1)
    weights = DraftWeights.from_model(load_model_dir(dirs["other"], torch.float64, "cpu", 128))
    prompt = prompts[1]
    with torch.no_grad():
        want = hf.double()(torch.tensor([prompt])).logits[0, -1]
    k_cache, v_cache = weights.new_cache(64)
    guesses, logits = np.zeros(5, np.int64), np.zeros(want.shape[0])
    weights.decode(k_cache, v_cache, np.array(prompt), 0, 1, guesses, logits)
    torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-6, atol=1e-6)
    weights.decode(k_cache, v_cache, np.array(prompt[-1:]), len(prompt) - 1, 5, guesses, logits)  # re-feed the last
    assert guesses.tolist() == hf_greedy(hf, prompt, 5)
    # The proposer: a long prompt's K/V from the batched forward, the last token and the guesses from the loop.
    from minillm.spec import draft_compiled
    from minillm.spec.draft_compiled import CompiledDraftProposer

    BATCHED_CATCH_UP = 16  # (the tiny test model's positions end at 128: a short threshold keeps both paths in)
    monkeypatch.setattr(draft_compiled, "BATCHED_CATCH_UP", BATCHED_CATCH_UP)
    proposer = CompiledDraftProposer(load_model_dir(dirs["other"], torch.float64, "cpu", 128), 4, 128)
    long_prompt = (prompt * 4)[: BATCHED_CATCH_UP + 9]
    req = Request("long", long_prompt, SamplingParams(temperature=0.0), 0.0)
    assert proposer.propose([req], [4])[0] == [hf_greedy(hf, long_prompt, 4)]
    for token in prompt[: BATCHED_CATCH_UP + 2]:  # the target "accepted" a long run: a batched catch-up after a context
        req.append_token(token)
    proposer.after_verify(req)
    assert proposer.propose([req], [4])[0] == [hf_greedy(hf, req.all_token_ids, 4)]


def test_speculation_with_prefix_caching_and_preemption_stays_exact(models):
    target, dirs, prompts, expected = models
    shared = [prompts[0] + p for p in prompts]
    want = [hf_greedy(target, p, GREEDY.max_tokens) for p in shared]
    llm = LLM(target, dtype="float64", max_num_seqs=5, max_model_len=80, block_size=4, num_kv_blocks=24,
              enable_prefix_caching=True,
              speculative_config={"method": "draft_model", "model": dirs["same"], "num_speculative_tokens": 3})
    assert run(llm, shared) == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_stops_apply_inside_an_accepted_run(models):
    target, dirs, prompts, expected = models
    spec = {"method": "draft_model", "model": dirs["same"], "num_speculative_tokens": 4}
    llm = LLM(target, dtype="float64", max_num_seqs=4, max_model_len=128, speculative_config=spec)
    cut = run(llm, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert cut == [e[:6] for e in expected]  # max_tokens cuts a run of 5 at 6 tokens
    stop_id = expected[0][3]
    stopped = run(llm, prompts[:1], SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_id]))
    assert stopped[0] == expected[0][: expected[0].index(stop_id) + 1]


def test_seeded_sampling_under_speculation_ignores_the_batch():
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=11)
    llm = LLM(max_num_seqs=4, speculative_config=spec)
    alone = llm.generate(["In the beginning"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["In the beginning", "And God said", "Blessed are"],
                         [params, SamplingParams(max_tokens=24, temperature=1.0),
                          SamplingParams(max_tokens=24, temperature=0.5)], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowd and len(alone) == 24


def test_ngram_lookup_prefers_the_longest_and_latest_match():
    proposer = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert proposer.propose_one([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]  # latest match of (1, 2, 3)
    assert proposer.propose_one([5, 6, 4, 4, 6]) == [4, 4, 6]  # suffix (6,) seen at index 1
    assert proposer.propose_one([1, 2, 3]) == []


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1)])
def test_ngram_index_proposes_what_the_search_proposes(min_n, max_n):
    """The engine's incremental index (grown a few tokens at a time, as decoding grows a sequence)
    gives the guesses of `propose_one`'s backward search at every length."""
    import random

    from minillm.spec.ngram import NgramIndex

    proposer = NgramProposer(4, prompt_lookup_max=max_n, prompt_lookup_min=min_n)
    rng = random.Random(min_n * 10 + max_n)
    found = 0
    for _ in range(20):
        tokens = [rng.randrange(5) for _ in range(rng.randint(1, 6))]  # a small alphabet: many repeats
        index = NgramIndex(min_n, max_n)
        while len(tokens) < 120:
            index.extend(tokens)
            expected = proposer.propose_one(tokens)
            assert index.lookup(tokens, 4) == expected, tokens
            found += bool(expected)
            tokens += [rng.randrange(5) for _ in range(rng.randint(1, 5))]
    assert found > 100  # the comparison covered sequences where a match exists


def test_speculative_config_errors_name_what_is_accepted():
    with pytest.raises(ValueError, match="choose one of"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=">= 1"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative_config"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "k": 3})
    with pytest.raises(ValueError, match="batching='continuous'"):
        LLM(batching="static", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


# ---- the rejection sampler keeps the target's distribution ------------------------------------------
VOCAB = 6


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for counts against expected probabilities (bins with p > 0)."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def sampler_counts(sampler, num_samples: int = 20_000, seed: int = 7):
    torch.manual_seed(seed)
    logits = torch.randn(3, VOCAB, dtype=torch.float64) * 1.5  # target at the pending token and 2 guesses
    q = torch.softmax(torch.randn(2, VOCAB, dtype=torch.float64) * 1.5, dim=-1)  # the proposer's distributions
    req = Request("r", [1], SamplingParams(temperature=0.9, seed=seed), 0.0)
    p = target_probs(logits, req)
    first = torch.zeros(VOCAB, dtype=torch.float64)
    second_given_guess = torch.zeros(VOCAB, dtype=torch.float64)
    draw = torch.Generator().manual_seed(seed + 1)
    for _ in range(num_samples):
        guesses = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
        out = sampler(req, logits, guesses, q)
        first[out[0]] += 1
        if out[0] == guesses[0] and len(out) > 1:
            second_given_guess[out[1]] += 1
    return first, second_given_guess, p


def wrong_always_accept(req, logits, guesses, q):
    return list(guesses) + [int(torch.multinomial(target_probs(logits, req)[-1], 1, generator=req.generator))]


def wrong_resample_from_p(req, logits, guesses, q):
    p = target_probs(logits, req)
    out = []
    for i, d in enumerate(guesses):
        if float(torch.rand((), generator=req.generator)) < min(1.0, float(p[i, d] / q[i, d])):
            out.append(d)
            continue
        return out + [int(torch.multinomial(p[i], 1, generator=req.generator))]  # should be max(0, p - q)
    return out + [int(torch.multinomial(p[-1], 1, generator=req.generator))]


def test_rejection_sampling_emits_the_targets_distribution():
    first, second, p = sampler_counts(rejection_sample)
    assert first.sum() == 20_000
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.sum() > 2_000 and chi_square_p_value(second, p[1]) > 0.01


@pytest.mark.parametrize("wrong", [wrong_always_accept, wrong_resample_from_p])
def test_the_distribution_check_rejects_a_wrong_sampler(wrong):
    first, _, p = sampler_counts(wrong)
    assert chi_square_p_value(first, p[0]) < 0.01


def test_the_simulator_runs_speculative_steps():
    from minillm.sim import simulate
    from minillm.traces.synthetic import make_trace

    trace = make_trace(30, seed=1, vocab_size=32000, rate_per_s=20)
    plain = simulate(trace, engine_config={"max_num_seqs": 16})
    spec = simulate(trace, engine_config={"max_num_seqs": 16,
                                          "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert [r.num_output_tokens for r in spec.requests] == [r.max_tokens for r in trace]
    assert spec.engine.metrics.spec_decode.num_accepted_tokens > 0
    assert spec.summary.num_steps < plain.summary.num_steps  # verified guesses: fewer target steps


def test_logprobs_under_speculation_match_plain_decoding():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(max_num_seqs=2).generate(["In the beginning God"], params, use_tqdm=False)[0].outputs[0]
    spec = LLM(max_num_seqs=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).generate(
        ["In the beginning God"], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == 12
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert abs(spec.cumulative_logprob - plain.cumulative_logprob) < 1e-3
