"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, stop conditions."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.request import Request
from minillm.sampling import filtered_probs, sample
from minillm.scheduler.output import new_request_data
from minillm.worker.input_batch import InputBatch


def _req(request_id: str = "r", **kw) -> Request:
    return Request(request_id, [1], SamplingParams(**kw), 0.0, default_seed=kw.get("seed") or 0)


def _sampler(requests: list[Request]):
    """The worker's view of `requests` (an input batch holding them), and a function sampling their rows."""
    batch = InputBatch(max_blocks_per_seq=4)
    for r in requests:
        batch.add(new_request_data(r))
    rows = batch.rows_of([r.request_id for r in requests])
    states = [batch.requests[r.request_id] for r in requests]
    return lambda logits: sample(logits, batch, rows, states)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs, order = filtered_probs(logits, [_req(temperature=1.0, top_k=2)])
    assert torch.allclose(probs[0][order[0].argsort()], torch.tensor([0.625, 0.375, 0, 0]))
    probs, order = filtered_probs(logits, [_req(temperature=1.0, top_p=0.8)])
    # 0.5 + 0.3 reaches 0.8: the smallest such set is the first two tokens.
    assert torch.allclose(probs[0][order[0].argsort()], torch.tensor([0.625, 0.375, 0, 0]))
    probs, order = filtered_probs(logits, [_req(temperature=1.0, top_p=0.81)])
    assert (probs[0] > 0).sum() == 3


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draw = _sampler([_req(temperature=0.7, seed=3)])
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[draw(logits)[0]] += 1
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(counts / 4000, expected, atol=0.025)


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req(f"r{i}", temperature=0.0, seed=i) for i in range(5)]
    assert _sampler(reqs)(logits) == logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM(make_tiny_hf_model("llama-gqa"), dtype="float64", device="cpu", max_num_seqs=8)


def test_seeded_output_does_not_depend_on_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.3, seed=s, ignore_eos=True) for s, m in [(1, 5), (2, 20)]]
    crowd = llm.generate([[9] * 20, [5, 6, 7], [11, 12]], [others[0], params, others[1]], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=40, seed=99, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_unseeded_sampling_is_reproducible_per_engine_seed():
    hf = make_tiny_hf_model("llama-gqa")
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    runs = [LLM(hf, dtype="float64", device="cpu", seed=s).generate([[5, 6]], params, use_tqdm=False)
            for s in (0, 0, 1)]
    ids = [r[0].outputs[0].token_ids for r in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"


def test_stop_strings_on_the_bundled_model():
    llm = LLM(max_num_seqs=2)
    prompt = "And the king said unto"
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert ", Go" in free.text  # " him, I will not go to the king of Babylon. And the king said unto him, Go, …"
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[", Go"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(", Go")]
    assert len(out.token_ids) < len(free.token_ids)
    kept = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=", Go",
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(", Go") + 4]


def test_a_stop_string_at_the_very_start_gives_empty_text():
    llm = LLM(max_num_seqs=1)
    free = llm.generate(["And the king said unto"], SamplingParams(max_tokens=4, temperature=0.0),
                        use_tqdm=False)[0].outputs[0]
    first_word = free.text.split()[0]  # " him," → "him"
    out = llm.generate(["And the king said unto"], SamplingParams(max_tokens=4, temperature=0.0, stop=[" " + first_word]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.finish_reason == "stop"
