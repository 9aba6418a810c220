"""The public API: vLLM-shaped `LLM.generate`, and clear errors for bad input that lose nothing."""

from __future__ import annotations

import pytest
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig


@pytest.fixture(scope="module")
def llm():
    return LLM(make_tiny_hf_model("llama-gqa"), dtype="float64", device="cpu", max_model_len=64)


def test_generate_returns_outputs_in_prompt_order(llm):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, [9, 10], {"prompt_token_ids": list(range(3, 30))}]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [9, 10], list(range(3, 30))]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 2]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens must be an integer >= 1, got -1"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_k=-3), "top_k must be -1 or 0 (no limit) or a positive integer"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_too_long_prompt_names_both_numbers_and_loses_nothing(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    too_long = {"prompt_token_ids": [5] * 60}
    with pytest.raises(ValueError) as err:
        llm.generate([good, too_long], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    assert "60 tokens and max_tokens=10" in str(err.value) and "max_model_len=64" in str(err.value)
    assert not llm.engine.has_unfinished()  # the good prompt was not left half-submitted
    out = llm.generate([good], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # the engine still works


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ([], "prompt_token_ids is empty"),
    ({"text": "hi"}, "a dict prompt needs 'prompt_token_ids'"),
    ({"prompt_token_ids": [5, 100000]}, "outside the vocabulary [0, 160)"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError) as err:
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert message in str(err.value)


def test_text_prompt_without_tokenizer_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="no tokenizer: pass token ids"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[5], [6]], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("knobs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (dict(batching="paged"), "batching='paged'; choose one of ('static', 'dynamic', 'continuous')"),
    (dict(max_num_batchd_tokens=5), "unknown engine option(s) ['max_num_batchd_tokens']"),
    (dict(max_queue_delay_ms=-1), "max_queue_delay_ms must be >= 0"),
])
def test_bad_engine_knobs_fail_at_construction(knobs, message):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_kwargs(knobs)
    assert message in str(err.value)


def test_knobs_that_conflict_with_the_model(llm):
    hf = make_tiny_hf_model("llama-gqa")
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=512"):
        LLM(hf, dtype="float64", device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is smaller than max_model_len=64"):
        LLM(hf, dtype="float64", device="cpu", max_model_len=64, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLM(hf, dtype="float8")


def test_engine_accepts_requests_while_running(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request([5, 6, 7], params)
    engine.step()
    engine.step()
    second = engine.add_request([8, 9], params)
    while engine.has_unfinished():
        engine.step()
    assert first.num_output_tokens == 6 and second.num_output_tokens == 6
    alone = llm.generate([[8, 9]], params, use_tqdm=False)[0]
    assert second.output_token_ids == alone.outputs[0].token_ids


def test_abort_frees_the_request(llm):
    engine = llm.engine
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.abort_request(req.request_id)
    assert req.finish_reason == "abort" and not engine.has_unfinished()
    assert engine.kv.usage().used_tokens == 0


def test_a_custom_scheduler_runs_inside_the_real_engine():
    """The hook the exercises use: a learner's scheduler, built from the engine's config and KV."""
    from minillm.scheduler.continuous import ContinuousScheduler

    built = []

    def factory(config, kv):
        built.append((config.max_num_seqs, kv))
        return ContinuousScheduler(config, kv)

    llm = LLM(make_tiny_hf_model("llama-gqa"), dtype="float64", device="cpu", max_num_seqs=3,
              scheduler_factory=factory)
    assert built and built[0][0] == 3 and llm.engine.kv is built[0][1]
    outs = llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
