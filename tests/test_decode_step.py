"""The compiled decode step (minillm/model/decode_step.py, kernels/cpu_decode_step.py): the same greedy
tokens as HF transformers and as the op-by-op forward, logits equal to float32 rounding, taken only
where it is supported, with the layers' weights shared rather than copied and its buffers reused."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from minillm import LLM, SamplingParams
from minillm.llm import BUNDLED_TARGET
from minillm.model.decode_step import MAX_ROWS, CompiledDecode

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
    """Prefill rows, more than MAX_ROWS rows, speculative rows: `rows_of` says no (None)."""
    from minillm.scheduler.output import SchedulerOutput

    compiled, batch = llm.engine.executor.worker.compiled_decode, llm.engine.executor.worker.input_batch

    def plan(n, decode=True, spec=None):
        return SchedulerOutput(new_requests=[], req_ids=[f"r{i}" for i in range(n)], num_scheduled_tokens=[1] * n,
                               num_computed_tokens=[5] * n, new_token_ids=[[7]] * n, is_decode=[decode] * n,
                               samples=[True] * n, spec_token_ids=spec or {})
    assert compiled.rows_of(plan(MAX_ROWS + 1), batch) is None
    assert compiled.rows_of(plan(1, decode=False), batch) is None
    assert compiled.rows_of(plan(1, spec={"r0": [3, 4]}), batch) is None
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
