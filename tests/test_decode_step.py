"""The compiled decode step (minillm/model/decode_step.py, kernels/cpu_decode_step.py): the same greedy
tokens as HF transformers and as the op-by-op forward, logits equal to float32 rounding, taken only
where it is supported, with the layers' weights shared rather than copied and its buffers reused;
its register-tiled matmuls equal to a float64 matmul to float32 rounding, and each row's outputs the
same bits whatever the rows beside it."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from minillm import LLM, SamplingParams
from minillm.llm import BUNDLED_TARGET
from minillm.model.decode_step import MAX_ROWS, MAX_VERIFY_ROWS, CompiledDecode

TEXTS = ["In the beginning God created", "And the king said unto",
         "Blessed are they that mourn: for they shall be comforted. Blessed are the meek", "Thus"]
NUM_TOKENS = 40  # crosses block boundaries (block_size 16) in every row


def count_compiled_calls(llm: LLM) -> list[int]:
    """Wrap the worker's compiled step: the returned list collects the batch size of each call."""
    compiled = llm.engine.executor.worker.compiled_decode
    sizes: list[int] = []
    run = compiled.run

    def counted(rows, starts, batch):
        sizes.append(len(rows))
        return run(rows, starts, batch)
    compiled.run = counted
    return sizes


def greedy_ids(llm: LLM, texts: list[str], **extra) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **extra)
    return [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=MAX_ROWS, max_model_len=256)


def test_compiled_decode_greedy_equals_hf_and_the_op_by_op_forward(llm):
    from transformers import AutoModelForCausalLM

    worker = llm.engine.executor.worker
    assert worker.compiled_decode is not None, worker.compiled_decode_off
    sizes = count_compiled_calls(llm)
    together = greedy_ids(llm, TEXTS)  # decode at 4, then fewer rows as they finish
    alone = [greedy_ids(llm, [t])[0] for t in TEXTS]  # batch 1
    assert set(sizes) == {len(TEXTS)} | {1} and len(sizes) >= (NUM_TOKENS - 1) * (1 + len(TEXTS))
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_TARGET, local_files_only=True).float().eval()
    for text, got_together, got_alone in zip(TEXTS, together, alone):
        want = hf_greedy(hf, llm.tokenizer(text).input_ids, NUM_TOKENS)
        assert got_alone == want and got_together == want, text
    compiled, worker.compiled_decode = worker.compiled_decode, None  # the op-by-op forward, same engine
    try:
        assert greedy_ids(llm, TEXTS) == together
    finally:
        worker.compiled_decode = compiled


def many_texts(n: int) -> list[str]:
    """n different prompts of 5-8 words, cut from TEXTS."""
    words = " ".join(TEXTS).split()
    return [" ".join(words[i : i + 5 + i % 4]) for i in range(n)]


MANY_ROWS = 12  # past the small tiles (1-5 rows): `matmul_rows`' 4 x 3 tiles, in blocks


def test_a_step_of_many_rows_runs_the_tiled_matmuls_with_hfs_greedy_tokens(llm):
    """MANY_ROWS requests: their decode steps run compiled with `matmul_rows` (then fewer rows, with the
    smaller tiles, as they finish); every request's greedy tokens are HF's and the op-by-op forward's,
    and its logprobs the op-by-op forward's to float32 rounding."""
    from transformers import AutoModelForCausalLM

    worker = llm.engine.executor.worker
    texts = many_texts(MANY_ROWS)
    sizes = count_compiled_calls(llm)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        compiled_out = llm.generate(texts, params, use_tqdm=False)
    finally:
        del worker.compiled_decode.run  # (count_compiled_calls' wrapper)
    assert sizes.count(len(texts)) == NUM_TOKENS - 1
    compiled, worker.compiled_decode = worker.compiled_decode, None
    try:
        plain_out = llm.generate(texts, params, use_tqdm=False)
    finally:
        worker.compiled_decode = compiled
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_TARGET, local_files_only=True).float().eval()
    for text, a, b in zip(texts, compiled_out, plain_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(hf, llm.tokenizer(text).input_ids,
                                                                              NUM_TOKENS), text
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            got, want = torch.tensor([step_a[k] for k in step_b]), torch.tensor(list(step_b.values()))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
@pytest.mark.parametrize(("n_in", "n_out"), [(256, 301), (688, 256), (16, 2), (8, 1)])
def test_matmul_rows_equals_a_float64_matmul(rows, n_in, n_out):
    """Every shape: fewer rows than a tile, rows and outputs that do not divide into tiles (the last tile
    moved back), several output blocks (301 outputs of 256 inputs: three), a single output."""
    from minillm.kernels.cpu_decode_step import matmul_rows

    g = torch.Generator().manual_seed(rows * n_out)
    x, w_t = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    out = torch.full((rows, n_out), float("nan"))
    matmul_rows(x.numpy(), w_t.numpy(), out.numpy())
    torch.testing.assert_close(out.double(), x.double() @ w_t.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n_in", "n_out"), [(256, 301), (688, 256), (256, 12), (64, 13), (256, 9)])
def test_dot_rows_gives_every_row_the_same_bits_whatever_the_rows(n_in, n_out):
    """The tiles (1 x 8, 2 x 4, 3 x 3, 5 x 2, and `matmul_rows` for four rows and past five) sum every output in
    one order: a row computed alone has the bits it has among 2 ... 33 rows (8 outputs or more), which is
    what lets a verify step's rows equal plain decoding's."""
    from minillm.kernels.cpu_decode_step import dot_rows

    g = torch.Generator().manual_seed(n_out)
    x, w_t = torch.randn(33, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    lone = torch.empty(33, n_out)
    for b in range(33):
        dot_rows(x[b : b + 1].numpy(), w_t.numpy(), lone[b : b + 1].numpy())
    torch.testing.assert_close(lone.double(), x.double() @ w_t.double().T, rtol=1e-5, atol=1e-4)
    for rows in [*range(2, 13), 16, 31, 33]:
        out = torch.full((rows, n_out), float("nan"))
        dot_rows(x[:rows].numpy(), w_t.numpy(), out.numpy())
        assert torch.equal(out, lone[:rows]), f"{rows} rows: a row's bits differ from the same row alone"


def test_compiled_logits_equal_the_op_by_op_forward_to_float32_rounding(llm):
    """Sampled-token logprobs (log_softmax of the logits) at every step, both ways."""
    worker = llm.engine.executor.worker
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    compiled_out = llm.generate(TEXTS[:2], params, use_tqdm=False)
    compiled, worker.compiled_decode = worker.compiled_decode, None
    try:
        plain_out = llm.generate(TEXTS[:2], params, use_tqdm=False)
    finally:
        worker.compiled_decode = compiled
    for a, b in zip(compiled_out, plain_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            got, want = torch.tensor([step_a[k] for k in step_b]), torch.tensor(list(step_b.values()))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_buffers_are_made_once_per_batch_size_and_reused(llm):
    compiled = llm.engine.executor.worker.compiled_decode
    greedy_ids(llm, TEXTS[:1])
    logits = compiled.buffers[1].logits_tensor
    greedy_ids(llm, TEXTS[1:2])
    assert compiled.buffers[1].logits_tensor is logits  # the same memory, step after step
    assert set(compiled.buffers) <= set(range(1, MAX_ROWS + 1))


def test_layer_weights_are_views_of_the_stacked_weights_not_copies(llm):
    model = llm.model
    fresh = LLM(max_num_seqs=1, max_model_len=64, attention_backend="torch").model  # not stacked: no compiled step
    assert fresh.__dict__.get("_stacked_weights") is None
    for kind, stacked in model._stacked_weights.items():
        base = torch.from_numpy(stacked)
        for i, layer in enumerate(model.layers):
            weight = getattr(layer, kind).weight
            assert weight.data_ptr() == base[i].data_ptr() and weight.stride() == (1, weight.shape[0])
            assert torch.equal(weight, getattr(fresh.layers[i], kind).weight)


@pytest.mark.parametrize(("knobs", "why"), [
    ({"dtype": "float64"}, "float32 only"),
    ({"attention_backend": "torch"}, "not 'numba_cpu'"),
    ({"kv_cache_dtype": "int8"}, "no float32 paged KV pool"),  # a quantized pool (chapter 14) stores bytes
])
def test_not_taken_where_not_supported(knobs, why):
    worker = LLM(max_num_seqs=2, max_model_len=64, **knobs).engine.executor.worker
    assert worker.compiled_decode is None and why in worker.compiled_decode_off


def test_steps_it_cannot_run_go_the_op_by_op_way(llm):
    """Prefill rows, more than MAX_ROWS rows, verify rows whose 1+k tokens add up to more than
    MAX_VERIFY_ROWS, a row that is not one pending token and its guesses: `rows_of` says no (None)."""
    from minillm.scheduler.output import SchedulerOutput

    compiled, batch = llm.engine.executor.worker.compiled_decode, llm.engine.executor.worker.input_batch

    def plan(n, decode=True, spec=None, width=1, start=5):
        return SchedulerOutput(new_requests=[], req_ids=[f"r{i}" for i in range(n)], num_scheduled_tokens=[width] * n,
                               num_computed_tokens=[start] * n, new_token_ids=[[7]] * n, is_decode=[decode] * n,
                               samples=[True] * n, spec_token_ids=spec or {})
    assert compiled.rows_of(plan(MAX_ROWS + 1), batch) is None
    assert compiled.rows_of(plan(1, decode=False), batch) is None
    four = [3, 4, 5, 6]
    assert compiled.rows_of(plan(2, False, {"r0": four, "r1": four}, width=5), batch) is None  # 10 rows
    assert compiled.rows_of(plan(1, False, {"r0": list(range(MAX_VERIFY_ROWS))}, width=MAX_VERIFY_ROWS + 1),
                            batch) is None
    assert compiled.rows_of(plan(1, False, {"r0": four}, width=6), batch) is None  # two pending tokens
    assert compiled.rows_of(plan(1, False, {"r0": four}, width=5, start=0), batch) is None  # no context
    assert CompiledDecode.supported(llm.model, None, "numba_cpu") == "no float32 paged KV pool"


def test_compute_logits_runs_compiled_and_hands_back_a_copy(llm):
    """`executor.compute_logits` (the draft model's passes, chapter 04's look inside a step) takes the
    compiled step for a decode plan: logits equal the op-by-op forward's, in a tensor of their own."""
    engine = llm.engine
    worker = engine.executor.worker
    for text in TEXTS[:2]:
        engine.add_request(text, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    plan = engine.scheduler.schedule(engine.clock.now())
    sizes, compiled = count_compiled_calls(llm), worker.compiled_decode
    try:
        got, ids = engine.executor.compute_logits(plan)
        assert sizes == [2] and ids == [r.request_id for r in plan.requests]
        assert got.data_ptr() != compiled.buffers[2].logits_tensor.data_ptr()
        worker.compiled_decode = None
        want, _ = engine.executor.compute_logits(plan)  # the same step again, op by op
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        worker.compiled_decode = compiled
        del compiled.run  # (count_compiled_calls' wrapper)
        for rid in list(engine.requests):
            engine.abort_request(rid)


def record_compiled_calls(llm: LLM) -> list[tuple[list[int], list[list[int]], torch.Tensor]]:
    """Wrap the worker's compiled step: per call, each row's position, each row's tokens up to and
    including its own (what its logits depend on), and a copy of the logits."""
    compiled = llm.engine.executor.worker.compiled_decode
    calls = []
    run = compiled.run

    def recorded(rows, starts, batch):
        contexts = [batch.token_ids[r, : s + 1].tolist() for r, s in zip(rows, starts)]
        logits, logits_np = run(rows, starts, batch)
        calls.append((starts.tolist(), contexts, logits.clone()))
        return logits, logits_np
    compiled.run = recorded
    return calls


def record_forward_tokens(llm: LLM) -> list[int]:
    """Wrap the model's op-by-op forward: the returned list collects each call's number of tokens."""
    model, tokens = llm.model, []
    forward = model.forward

    def counted(input_ids, *args, **kwargs):
        tokens.append(len(input_ids))
        return forward(input_ids, *args, **kwargs)
    model.forward = counted
    return tokens


def spec_llm(method: str, k: int) -> LLM:
    return LLM(max_num_seqs=1, max_model_len=256, speculative_config={"method": method, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def code_like(llm):
    """A prompt, the target's own continuation, the prompt again (chapter 09's code-like prompts: the
    answer copies its context, so n-gram lookup finds guesses); and plain decoding's greedy tokens after
    it, each compiled step's logits by position and the tokens they saw (batch 1)."""
    ids = llm.tokenizer(TEXTS[2]).input_ids
    prompt = ids + greedy_ids(llm, [{"prompt_token_ids": ids}])[0] + ids
    compiled = llm.engine.executor.worker.compiled_decode
    had = compiled.__dict__.get("run")
    calls = record_compiled_calls(llm)
    try:
        tokens = greedy_ids(llm, [{"prompt_token_ids": prompt}])[0]
    finally:
        if had is None:
            del compiled.run
        else:
            compiled.run = had
    by_position = {starts[0]: (contexts[0], logits[0]) for starts, contexts, logits in calls}
    return prompt, tokens, by_position


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_verify_step_at_batch_1_runs_compiled_and_computes_plain_decodings_logits(code_like, method):
    """k = 4 guesses: every verify step is one compiled call of 1+k rows (the op-by-op forward runs the
    prefill only); the greedy tokens are plain decoding's; every row whose tokens so far are plain
    decoding's (the pending token's, and each accepted guess's) has plain decoding's logits at that
    position, bit for bit."""
    prompt, want, plain = code_like
    spec = spec_llm(method, 4)
    assert spec.engine.executor.worker.compiled_decode is not None
    calls, forward_tokens = record_compiled_calls(spec), record_forward_tokens(spec)
    assert greedy_ids(spec, [{"prompt_token_ids": prompt}])[0] == want
    assert sum(forward_tokens) == len(prompt)  # the prefill; every later step ran compiled
    assert max(len(starts) for starts, _, _ in calls) == 5
    compared = 0
    for starts, contexts, logits in calls:
        assert starts == list(range(starts[0], starts[0] + len(starts)))  # one request's positions, in order
        for row, (position, context) in enumerate(zip(starts, contexts)):
            seen, plain_logits = plain.get(position, (None, None))
            if context == seen:
                assert torch.equal(logits[row], plain_logits), (position, row)
                compared += 1
    assert compared > len(calls)  # guess rows, not only the pending tokens' rows
    stats = spec.engine.metrics.spec_decode
    assert stats.num_accepted_tokens > 0


def test_a_verify_step_of_more_than_max_verify_rows_falls_back_to_the_op_by_op_forward(code_like):
    """k = MAX_VERIFY_ROWS guesses at batch 1 (1+k rows): those verify steps run op by op, the same tokens
    come out."""
    prompt, want, _ = code_like
    spec = spec_llm("ngram", MAX_VERIFY_ROWS)
    sizes, forward_tokens = count_compiled_calls(spec), record_forward_tokens(spec)
    assert greedy_ids(spec, [{"prompt_token_ids": prompt}])[0] == want
    assert MAX_VERIFY_ROWS + 1 in forward_tokens  # a full verify step, op by op
    assert all(size <= MAX_VERIFY_ROWS for size in sizes)
