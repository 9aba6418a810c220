"""The sampling parameters people send (chapter 11): penalties, logprobs and min_tokens against HF
transformers in float64 on the bundled model; min_p, n, stop_reason, output kinds, the engine
thread's inbox, chat templates and validation messages."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.detokenizer import IncrementalDetokenizer
from minillm.llm import BUNDLED_TARGET, DEFAULT_CHAT_TEMPLATE, chat_prompt_ids
from minillm.request import Request, RequestOutputKind
from minillm.sampling import apply_penalties, filtered_probs

PROMPT = "And it came to pass, when the LORD"
N = 20  # generated tokens per parity check


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(BUNDLED_TARGET), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def llm64():
    return LLM(BUNDLED_TARGET, dtype="float64", device="cpu", max_num_seqs=4, max_model_len=256)


def prompt_ids(llm) -> list[int]:
    return list(llm.tokenizer(PROMPT).input_ids)


def greedy(llm, **params):
    return llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **params),
                        use_tqdm=False)[0].outputs[0]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Next-token logits [vocab] after `ids`, a full forward (no cache): the plainest reference."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


@pytest.mark.slow
def test_repetition_penalty_matches_hf_generate(hf, llm64):
    ids = prompt_ids(llm64)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N, do_sample=False, repetition_penalty=1.3, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    plain = greedy(llm64).token_ids
    penalized = greedy(llm64, repetition_penalty=1.3).token_ids
    assert penalized == ref
    assert penalized != plain  # the penalty changed something, so the comparison means something


@pytest.mark.slow
@pytest.mark.parametrize("presence, frequency, repetition", [(1.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.5, 0.4, 1.2),
                                                             (-0.5, 0.0, 1.0)])
def test_presence_and_frequency_penalties_match_a_direct_computation_on_hf_logits(hf, llm64, presence, frequency,
                                                                                  repetition):
    """OpenAI's definitions: logit[t] -= frequency × count_t(output) + presence × [count_t(output) > 0],
    after HF's RepetitionPenaltyLogitsProcessor over prompt + output (vLLM's order)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = prompt_ids(llm64)
    out: list[int] = []
    rep = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    for _ in range(N):
        logits = hf_logits(hf, ids + out)
        if rep is not None:
            logits = rep(torch.tensor([ids + out]), logits[None].clone())[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double() \
            if out else torch.zeros_like(logits)
        logits = logits - frequency * counts - presence * (counts > 0).double()
        out.append(int(logits.argmax()))
    got = greedy(llm64, presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    assert got.token_ids == out
    assert got.token_ids != greedy(llm64).token_ids


@pytest.mark.slow
def test_logprobs_match_hf_log_softmax(hf, llm64):
    got = greedy(llm64, logprobs=5)
    ids = prompt_ids(llm64)
    total = 0.0
    for i, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        ref = torch.log_softmax(hf_logits(hf, ids + got.token_ids[:i]), -1)
        top_vals, top_ids = ref.topk(5)
        assert list(entry)[0] == token == int(top_ids[0])  # greedy: the sampled token, most likely
        assert set(entry) == set(top_ids.tolist())
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[tid] == pytest.approx(val, abs=1e-9)
        total += float(ref[token])
    assert got.cumulative_logprob == pytest.approx(total, abs=1e-8)


@pytest.mark.slow
def test_min_tokens_matches_hf_min_new_tokens(hf, llm64):
    """A stop token that greedy decoding emits early is forbidden until min_tokens came out."""
    plain = greedy(llm64).token_ids
    stop_id = plain[2]
    first = plain.index(stop_id)
    min_tokens = first + 6
    got = llm64.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[stop_id], min_tokens=min_tokens),
                         use_tqdm=False)[0].outputs[0]
    ids = prompt_ids(llm64)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N, do_sample=False, min_new_tokens=min_tokens, eos_token_id=stop_id,
                          pad_token_id=0)[0, len(ids):].tolist()
    if ref and ref[-1] == stop_id:
        assert got.finish_reason == "stop" and got.stop_reason == stop_id
    assert got.token_ids == ref
    assert stop_id not in got.token_ids[:min_tokens - 1]
    early = llm64.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) == first + 1 < len(got.token_ids)


def _req(**kw) -> Request:
    return Request("r", [1], SamplingParams(**kw), 0.0)


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs, order = filtered_probs(logits, [_req(min_p=0.35)])
    # 0.35 × 0.5 = 0.175: 0.15 and 0.05 are dropped.
    assert torch.allclose(probs[0][order[0].argsort()], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs, order = filtered_probs(logits, [_req(min_p=0.0)])
    assert (probs > 0).sum() == 4


def test_penalties_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_penalties(logits, prompt_ids=[1], output_ids=[3, 3, 2], params=params)
    # token 0 unseen; 1 (prompt only): -1 × 2; 2 (once in output): 0.5/2 - 0.25 - 0.5; 3 (twice): 3/2 - 0.5 - 0.5
    assert out.tolist() == pytest.approx([2.0, -2.0, -0.5, 0.5])
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # the input is not changed


def test_n_samples_are_the_children_with_seed_plus_index():
    llm = LLM(max_num_seqs=4, max_model_len=128)
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    out = llm.generate(["In the beginning"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        alone = llm.generate(["In the beginning"], SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i,
                                                                  ignore_eos=True), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == c.token_ids


def test_stop_reason_names_the_stop_string_or_token():
    llm = LLM(max_num_seqs=2, max_model_len=128)
    full = llm.generate(["In the beginning"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[12:17]
    cut = llm.generate(["In the beginning"], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.stop_reason == stop and cut.text == full.text[: full.text.find(stop)]
    tok = llm.generate(["In the beginning"], SamplingParams(max_tokens=30, temperature=0.0,
                                                            stop_token_ids=[full.token_ids[4]]),
                       use_tqdm=False)[0].outputs[0]
    assert tok.stop_reason == full.token_ids[4] and tok.finish_reason == "stop"
    # vLLM's rule: the stop token is among the tokens, its text is not in the output (unless asked for).
    assert tok.token_ids == full.token_ids[:5] and tok.text == llm.tokenizer.decode(full.token_ids[:4])
    kept = llm.generate(["In the beginning"], SamplingParams(max_tokens=30, temperature=0.0, include_stop_str_in_output=True,
                                                             stop_token_ids=[full.token_ids[4]]),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(full.token_ids[:5])


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_and_the_stop_string_hold_back(kind):
    """DELTA pieces add up to the final text, never showing the start of a stop string that later
    cuts; CUMULATIVE grows; FINAL_ONLY sends one output."""
    llm = LLM(max_num_seqs=2, max_model_len=128)
    full = llm.generate(["In the beginning"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[25:33]
    outs = []
    engine = llm.engine
    engine.add_request("In the beginning", SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                                          output_kind=kind), sink=outs.append)
    while engine.has_unfinished():
        engine.step()
    expected = full[: full.find(stop)]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert texts == [expected] and len(outs) == 1
    elif kind is RequestOutputKind.DELTA:
        assert "".join(texts) == expected and len(outs) > 5
        shown = ""
        for t in texts[:-1]:
            shown += t
            assert expected.startswith(shown)  # never a character the stop string later cut away
    else:
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == expected


def test_engine_thread_takes_commands_and_blocks_when_idle():
    llm = LLM(max_num_seqs=2, max_model_len=128)
    engine = llm.engine
    stop = threading.Event()
    drains = []
    real_drain = engine._drain_inbox

    def counting_drain(*a, **kw):
        drains.append(time.monotonic())
        return real_drain(*a, **kw)

    engine._drain_inbox = counting_drain
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        done = threading.Event()
        outs = []

        def sink(o):
            outs.append(o)
            if o.finished:
                done.set()

        engine.submit_add("In the beginning", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True,
                                                             output_kind=RequestOutputKind.DELTA), "a", sink)
        engine.submit_add([5, 6, 7], SamplingParams(max_tokens=10_000), "too-long", outs.append)
        assert done.wait(60)
        # The engine thread owns the engine: a direct call from another thread is refused, not raced.
        with pytest.raises(RuntimeError, match="use submit_add / submit_abort / call_soon"):
            llm.generate(["In the beginning"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RuntimeError, match="runs this engine"):
            engine.step()
        refused = [o for o in outs if o.request_id == "too-long"]
        assert refused and refused[0].finished and "max_model_len=128" in refused[0].error
        assert sum(len(o.outputs[0].token_ids) for o in outs if o.request_id == "a") == 50
        steps = engine.num_steps
        drains.clear()
        time.sleep(1.2)  # idle: the loop sleeps on the inbox (0.5 s timeouts), it does not spin
        assert engine.num_steps == steps and len(drains) <= 4
        # An abort from another thread, mid-generation.
        outs.clear()
        engine.submit_add("In the beginning", SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True,
                                                             output_kind=RequestOutputKind.DELTA), "b", outs.append)
        deadline = time.monotonic() + 30
        while not outs and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.submit_abort("b")
        deadline = time.monotonic() + 30
        while not (outs and outs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert outs[-1].outputs[0].finish_reason == "abort"
        assert sum(len(o.outputs[0].token_ids) for o in outs) < 120
        assert engine.kv.usage().reserved_tokens == 0 and not engine.requests
    finally:
        stop.set()
        engine.call_soon(lambda: None)
        thread.join(10)
    assert not thread.is_alive() and engine.owner_thread is None
    assert llm.generate(["In"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # offline again


def test_chat_template_default_for_a_tokenizer_without_one():
    llm = LLM(max_num_seqs=1, max_model_len=128)
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]
    own = chat_prompt_ids(tok, messages)
    assert tok.decode(own) == "<s><|system|>\nBe brief.</s>\n<|user|>\nWho?</s>\n<|assistant|>\n"
    assert own.count(tok.bos_token_id) == 1
    assert chat_prompt_ids(tok, messages, chat_template=DEFAULT_CHAT_TEMPLATE) == own
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        chat_prompt_ids(tok, ["hello"])


def test_skip_special_tokens():
    llm = LLM(max_num_seqs=1, max_model_len=128)
    tok = llm.tokenizer
    ids = tok("<|user|>\nhi</s>", add_special_tokens=False).input_ids
    for skip, expect_special in ((True, False), (False, True)):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for t in ids:
            d.append(t)
        assert ("<|user|>" in d.text) == expect_special and "hi" in d.text


def test_decode_stream_gives_the_python_windows_text():
    """The Rust DecodeStream path and the Python window give the same text, token by token: random
    ids (special ones included, bytes split across tokens) and a real sentence, both skip settings."""
    import random

    tok = LLM(max_num_seqs=1, max_model_len=128).tokenizer
    rng = random.Random(0)
    sentence = tok("In the beginning God created the heaven and the earth. \u00e9\u4e2d\U0001f600",
                   add_special_tokens=False).input_ids
    for ids in ([rng.randrange(tok.vocab_size) for _ in range(600)], sentence):
        for skip in (True, False):
            fast, slow = IncrementalDetokenizer(tok, skip), IncrementalDetokenizer(tok, skip)
            slow._stream = None  # the Python window
            assert fast._stream is not None
            for t in ids:
                fast.append(t)
                slow.append(t)
                assert fast.text == slow.text
            assert fast.text == tok.decode(ids, skip_special_tokens=skip)


def test_decode_stream_falls_back_where_it_raises():
    """A byte-fallback tokenizer (Llama-2 / Mistral style) fed bytes that are not valid UTF-8 makes
    tokenizers' DecodeStream raise mid-stream; the detokenizer carries on with the Python window
    and gives the window's text, token by token."""
    import random

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    for w in ["\u2581", "\u2581a", "a", "b", "\u00bb", "\u2581\u00bb", "\u4e2d"]:
        vocab[w] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    rng = random.Random(0)
    fell_back = 0
    for _ in range(300):
        ids = [rng.choice([rng.randrange(0x80, 0x100), rng.randrange(256, len(vocab))]) for _ in range(12)]
        fast, slow = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        slow._stream = None
        assert fast._stream is not None
        for t in ids:
            fast.append(t)
            slow.append(t)
            assert fast.text == slow.text
        fell_back += fast._stream is None
    assert fell_back > 0  # the case really happened


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 (1 means none), got 0.0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be an integer in [0, max_tokens=10], got 20"),
    (dict(logprobs=21), "logprobs must be None or an integer in [0, 20], got 21"),
    (dict(prompt_logprobs=1), "prompt_logprobs is not supported"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
])
def test_bad_sampling_params_name_the_field_and_the_range(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_get_metrics_has_vllm_names():
    llm = LLM(max_num_seqs=2, max_model_len=128, disable_log_stats=False)
    llm.generate(["In the beginning", "And God"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert metrics[("vllm:generation_tokens", None)].value == 10
    assert metrics[("vllm:request_success", "length")].value == 2
    assert metrics[("vllm:time_to_first_token_seconds", None)].count == 2
    assert metrics[("vllm:inter_token_latency_seconds", None)].count == 8
    assert metrics[("vllm:num_requests_running", None)].value == 0
    assert type(metrics[("vllm:e2e_request_latency_seconds", None)]).__name__ == "Histogram"


def test_an_offline_llm_feeds_no_prometheus_series_unless_asked():
    """vLLM's LLM default (disable_log_stats=True): no observer runs per step, generate works, and
    get_metrics says which knob turns them on; the engine's own records are still kept."""
    llm = LLM(max_num_seqs=2, max_model_len=128)
    assert llm.prometheus is None and llm.engine.metrics.observers == []
    assert llm.engine.metrics.request_observers == []
    out = llm.generate(["In the beginning"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert len(llm.engine.metrics.steps) == 5  # prefill + 4 decode steps, recorded as before
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()
    prometheus = llm.attach_prometheus()  # what the server does: from now on the series count
    assert llm.attach_prometheus() is prometheus
    llm.generate(["And God"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert metrics[("vllm:generation_tokens", None)].value == 3
    assert metrics[("vllm:request_success", "length")].value == 1


def test_prompt_forms_text_ids_and_dict():
    llm = LLM(max_num_seqs=4, max_model_len=128)
    ids = list(llm.tokenizer("In the beginning").input_ids)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["In the beginning", ids, {"prompt": "In the beginning"}, {"prompt_token_ids": ids}], params,
                        use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    with pytest.raises(ValueError, match="'prompt_token_ids' \\(a list of ints\\) or 'prompt' \\(a string\\)"):
        llm.generate([{"text": "x"}], params, use_tqdm=False)
