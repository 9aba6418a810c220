"""A quantized KV cache through every engine mode (chapter 14; issue 30, item 2).

With `kv_cache_dtype="int8"` or `"fp8_e4m3"` the outputs are no longer HF's (the cache is lossy by
design), so the demand is the next strongest one: every path that stores and reads K/V — static and
dynamic batching's rectangle, slabs, pages with the torch and the numba CPU backend, prefix
caching, chunked prefill, preemption by recompute and by swap, speculative rows — sees the same
quantized numbers, so on a float64 tiny model they all generate the continuous/torch run's greedy
tokens exactly. That the quantization really happens is checked too (the pool holds bytes; the
logprobs move away from `"auto"`'s, by little). `"auto"` parity with HF stays with the existing
parity tests. Tiny model, 10-12 short requests per run, ~25 runs: 2-3 minutes on 2 shared cores.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.traces.synthetic import make_trace

QUANTIZED = ["int8", "fp8_e4m3"]


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama-gqa")


@pytest.fixture(scope="module")
def shared_prefix_trace():
    return make_trace(12, seed=11, vocab_size=160, rate_per_s=float("inf"), prompt_len=("uniform", 1, 20),
                      output_len=("uniform", 4, 20), max_output_len=20, token_id_range=(3, 160),
                      shared_prefix_len=21, num_prefixes=2)


@pytest.fixture(scope="module")
def storm_trace():
    """Short prompts, long outputs in a pool of 48 one-token blocks: preemption after preemption."""
    return make_trace(10, seed=3, vocab_size=160, prompt_len=("uniform", 2, 8), output_len=("uniform", 16, 36),
                      max_output_len=36, token_id_range=(3, 160))


def run(hf, trace, logprobs: int | None = None, **knobs):
    llm = LLM(hf, dtype="float64", device="cpu", **{"max_model_len": 96, **knobs})
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
              for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(hf, shared_prefix_trace):
    """Per dtype: continuous batching, paged, torch backend."""
    return {d: [o.token_ids for o in run(hf, shared_prefix_trace, kv_cache_dtype=d, attention_backend="torch",
                                         max_num_seqs=8)[1]] for d in QUANTIZED}


MODES = {
    "static": dict(batching="static", max_num_seqs=4, attention_backend="torch"),
    "dynamic": dict(batching="dynamic", max_num_seqs=4, max_queue_delay_ms=0, attention_backend="torch"),
    "slab": dict(kv_layout="slab", max_num_seqs=4, attention_backend="torch"),
    "paged-numba_cpu": dict(block_size=4, max_num_seqs=8, attention_backend="numba_cpu"),
    "prefix-cache": dict(block_size=5, max_num_seqs=8, enable_prefix_caching=True, attention_backend="numba_cpu"),
    "chunked": dict(block_size=4, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=16,
                    attention_backend="numba_cpu"),
    "ngram-spec": dict(block_size=4, max_num_seqs=8, attention_backend="torch",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_every_mode_reads_the_same_quantized_kv(hf, shared_prefix_trace, reference, kv_cache_dtype, mode):
    llm, outs = run(hf, shared_prefix_trace, kv_cache_dtype=kv_cache_dtype, **MODES[mode])
    assert [o.token_ids for o in outs] == reference[kv_cache_dtype]
    if mode == "prefix-cache":
        assert llm.engine.metrics.summary().prefix_cache_hit_rate > 0.3
    if mode == "chunked":
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.metrics.steps)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_preemption_by_recompute_and_by_swap_keeps_the_tokens(hf, storm_trace, kv_cache_dtype, preemption_mode):
    """Swap copies the pool's bytes out and back (the int8 scales ride in the same rows); recompute
    writes the same codes again."""
    _, calm = run(hf, storm_trace, kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, attention_backend="numba_cpu")
    llm, stormy = run(hf, storm_trace, kv_cache_dtype=kv_cache_dtype, max_model_len=48, block_size=1,
                      num_kv_blocks=48, max_num_seqs=8, kv_watermark=0.0, preemption_mode=preemption_mode,
                      attention_backend="numba_cpu")
    assert [o.token_ids for o in stormy] == [o.token_ids for o in calm]
    assert llm.engine.scheduler.num_preemptions > len(storm_trace)
    if preemption_mode == "swap":
        assert llm.engine.kv.num_swapped_out_tokens > 0 and not llm.engine.kv.swapped
        steps = llm.engine.metrics.steps  # swapping never recomputes
        assert sum(s.num_prefill_tokens for s in steps) == sum(r.prompt_len for r in storm_trace)


def test_the_pool_holds_bytes_and_the_logprobs_move_a_little(hf, storm_trace):
    exact_llm, exact = run(hf, storm_trace, logprobs=0, max_num_seqs=8)
    assert exact_llm.engine.executor.worker.k_pool.dtype == torch.float64
    for kv_cache_dtype, row_bytes in (("int8", 16 + 4), ("fp8_e4m3", 16)):  # head_dim 16
        llm, outs = run(hf, storm_trace, logprobs=0, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
        pool = llm.engine.executor.worker.k_pool
        assert pool.dtype == torch.uint8 and pool.shape[-1] == row_bytes
        first = [(o.logprobs[0], e.logprobs[0]) for o, e in zip(outs, exact)]  # the first token: same context
        diffs = [abs(next(iter(a.values())) - next(iter(b.values()))) for a, b in first]
        assert 0 < max(diffs) < 0.5, diffs


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_tensor_parallel_2_splits_the_quantized_pool_by_heads():
    """TP 2 on the bundled model in float64 (2 spawned ranks, each holding its 2 KV heads' rows —
    codes and scales — of every token), with chunked prefill, prefix caching and swap preemption
    happening: the one-process engine's tokens. ~30 s, most of it the ranks' start."""
    from test_distributed_engine import KNOBS, PROMPTS, bounded, tokens

    knobs = dict(KNOBS, preemption_mode="swap", kv_cache_dtype="int8")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM(dtype="float64", **knobs).generate(PROMPTS, greedy, use_tqdm=False)
    llm = LLM(dtype="float64", tensor_parallel_size=2, **knobs)
    try:
        got = bounded(lambda: llm.generate(PROMPTS, greedy, use_tqdm=False))
        assert tokens(got) == tokens(want)
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.num_hit_tokens > 0
        assert engine.kv.num_swapped_in_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_prefill_decode_pair_moves_the_quantized_bytes(kv_cache_dtype):
    """A prefill and a decode instance in one process (two LLMs, a gloo pair over loopback): the decode
    side computes no prompt token, its text equals a plain engine's, and the bytes moved are the
    quantized blocks' (codes and scales), not float32 blocks. ~20 s."""
    from fastapi.testclient import TestClient

    from minillm.kv_transfer import parse_kv_transfer_config
    from minillm.router.launch import free_port
    from minillm.server.app import create_app

    port = free_port()
    knobs = dict(max_model_len=128, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    halves = {role: LLM(**knobs, kv_transfer_config=parse_kv_transfer_config(
        {"kv_connector": "TorchDistConnector", "kv_role": role, "kv_port": port,
         "kv_connector_extra_config": {"connect_timeout_s": 60}})) for role in ("kv_producer", "kv_consumer")}
    prompt = "In the beginning God created the heaven and the earth. And the earth was without form, and void"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    plain = LLM(**knobs).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    try:
        with TestClient(create_app(halves["kv_producer"])) as producer, \
                TestClient(create_app(halves["kv_consumer"])) as consumer:
            r = producer.post("/v1/completions", json=dict(body, kv_transfer_params={"do_remote_decode": True,
                                                                                     "transfer_id": "q-1"}))
            assert r.status_code == 200, r.text
            r = consumer.post("/v1/completions", json=dict(body, kv_transfer_params={"do_remote_prefill": True,
                                                                                     "transfer_id": "q-1"}))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == plain[0].outputs[0].text
        stats = halves["kv_consumer"].engine.kv_connector.stats
        spec = halves["kv_consumer"].engine.kv.cache_spec
        num_prompt_tokens = len(plain[0].prompt_token_ids)
        assert stats.prompt_tokens_computed == 0 and stats.ok == 1
        assert stats.blocks == -(-num_prompt_tokens // spec.block_size)
        assert stats.bytes == stats.blocks * spec.block_bytes
        float32_block = 2 * 4 * spec.block_size * 4 * 32 * 4  # K and V, 4 layers, 4 KV heads, head_dim 32, 4 bytes
        assert spec.block_bytes == float32_block * (36 if kv_cache_dtype == "int8" else 32) // 128
    finally:
        for llm in halves.values():
            llm.shutdown()


def test_a_sliding_window_model_reads_the_same_quantized_window_on_both_cpu_backends(shared_prefix_trace):
    """Mistral's window (24) over an int8 pool: the numba CPU kernel decodes only the window's blocks."""
    mistral = make_tiny_hf_model("mistral-window")
    outs = {backend: [o.token_ids for o in run(mistral, shared_prefix_trace, kv_cache_dtype="int8", block_size=4,
                                               max_num_seqs=8, attention_backend=backend)[1]]
            for backend in ("torch", "numba_cpu")}
    assert outs["numba_cpu"] == outs["torch"]
    assert max(r.prompt_len + r.max_tokens for r in shared_prefix_trace) > 24  # the window really cuts
