"""The numba @njit CPU paged-decode kernel (kernels/cpu_decode_attention.py) and its backend.

The kernel against chapter 10's torch reference (float32 and float64, GQA groups, block sizes, -1
padded tables, sliding windows); the `numba_cpu` backend against the torch backend on a mixed step;
`attention_backend="auto"`'s rule; and greedy tokens equal to HF float64 on both CPU backends in the
modes the parity files do not cover (chunked prefill, n-gram speculation, slab KV). The parity files
(test_parity.py, test_paged_parity.py) run their engine tests on both backends too.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy, make_tiny_hf_model
from minillm.kernels.decode_attention import paged_attention_decode_reference

from minillm import LLM, SamplingParams
from minillm.attention.cpu_paged import NumbaCpuAttention
from minillm.attention.flat_pool import FlatPoolAttention
from minillm.attention.select import resolve_backend
from minillm.kernels import paged_attention_decode_cpu
from minillm.kv.block_manager import BlockManager
from minillm.request import Request
from minillm.scheduler.base import SchedulerPlan
from minillm.scheduler.output import SchedulerOutputBuilder
from minillm.traces.synthetic import make_trace
from minillm.worker.model_runner import ModelRunner


def paged_case(lens, h_q, h_kv, d, block_size, dtype, seed=0):
    """Random pools with each sequence's blocks scattered over them, tables padded with -1."""
    g = torch.Generator().manual_seed(seed)
    blocks_of = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_of) + 3
    key_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=g, dtype=dtype)
    value_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=g, dtype=dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(blocks_of) + 2), -1, dtype=torch.int32)
    for b, nb in enumerate(blocks_of):
        tables[b, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    query = torch.randn(len(lens), h_q, d, generator=g, dtype=dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("h_q, h_kv, d, block_size", [(4, 4, 8, 4), (8, 4, 32, 16), (8, 2, 16, 1), (6, 1, 24, 5)])
def test_kernel_matches_chapter_10_reference(dtype, h_q, h_kv, d, block_size):
    lens = [1, 2, block_size, block_size + 1, 17, 64, 3 * block_size - 1, 40]
    query, kc, vc, tables, seq_lens = paged_case(lens, h_q, h_kv, d, block_size, dtype)
    scale = 1 / math.sqrt(d)
    got = paged_attention_decode_cpu(query, kc, vc, tables, seq_lens, scale)
    want = paged_attention_decode_reference(query, kc, vc, tables, seq_lens, scale)
    # the reference computes in float32 whatever the input (as the CUDA kernel does); float64 exactness
    # is checked against float64 sums below (sliding window, mixed step: 1e-12)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert got.dtype == dtype and want.abs().max() > 0.1


@pytest.mark.parametrize("window", [1, 3, 16])
def test_kernel_sliding_window_reads_only_the_last_keys(window):
    lens = [1, 5, 16, 33]
    query, kc, vc, tables, seq_lens = paged_case(lens, 4, 2, 8, 4, torch.float64, seed=1)
    got = paged_attention_decode_cpu(query, kc, vc, tables, seq_lens, 0.3, window=window)
    for b, n in enumerate(lens):
        # the reference over a sequence made of its last `window` keys only
        first = max(0, n - window)
        slots = torch.tensor([int(tables[b, p // 4]) * 4 + p % 4 for p in range(first, n)])
        k = kc.reshape(-1, 2, 8)[slots].repeat_interleave(2, 1)  # [w, H_q, D]
        v = vc.reshape(-1, 2, 8)[slots].repeat_interleave(2, 1)
        scores = torch.einsum("hd,nhd->hn", query[b], k) * 0.3
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-12)


def test_kernel_refuses_what_it_cannot_run():
    query, kc, vc, tables, seq_lens = paged_case([3], 4, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="float32 or float64"):
        paged_attention_decode_cpu(query.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, seq_lens, 0.3)
    with pytest.raises(ValueError, match="3 query heads"):
        paged_attention_decode_cpu(query[:, :3], kc, vc, tables, seq_lens, 0.3)


def runners_for_step(rows: list[tuple[int, int]], window: int | None, backends: tuple[str, ...]):
    """One step of rows (cached tokens, new tokens) in a 1-layer float64 pool with random K/V: the
    plan, and a worker per backend with its state applied (the first one's pools hold the K/V)."""
    h_kv, d, block_size = 2, 8, 4
    kv = BlockManager(1, h_kv, d, 200, block_size, dtype=torch.float64, max_model_len=64)
    reqs, counts = [], []
    for i, (cached, n) in enumerate(rows):
        req = Request(f"r{i}", list(range(5, 5 + cached + n)), SamplingParams(), 0.0)
        assert kv.allocate(req, cached + n)
        req.num_computed_tokens = cached
        reqs.append(req)
        counts.append(n)

    class Stub:
        device, dtype = torch.device("cpu"), torch.float64

        class config:  # noqa: N801 - stands in for a ModelConfig
            sliding_windows = (window,)

    plan = SchedulerOutputBuilder(kv).build(SchedulerPlan(reqs, counts))
    runners = [ModelRunner(Stub(), kv.cache_spec, backend) for backend in backends]  # the worker holds the pools
    for runner in runners:
        runner.update_state(plan)
    runners[0].k_pool.normal_()
    runners[0].v_pool.normal_()
    return plan, runners


def random_qkv(total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(total, h, 8, dtype=torch.float64) for h in (4, 2, 2))


@pytest.mark.parametrize("window", [None, 5])
def test_backend_equals_torch_backend_on_a_mixed_step(window):
    """Decode rows of many lengths, fresh prompts and chunks after a cached context in one step."""
    torch.manual_seed(0)
    rows = [(9, 1), (1, 1), (33, 1), (16, 1), (0, 7), (12, 5), (3, 4)]  # (cached tokens, new tokens)
    plan, (runner,) = runners_for_step(rows, window, ("numba_cpu",))
    meta = runner.prepare(plan).meta
    assert meta.num_decode == 4 and meta.prefill_groups
    q, k, v = random_qkv(sum(n for _, n in rows))
    pools = runner.k_pool.clone(), runner.v_pool.clone()
    want = FlatPoolAttention(*pools, meta, (window,))(0, q, k, v)
    got = NumbaCpuAttention(runner.k_pool, runner.v_pool, meta, (window,))(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(runner.k_pool, pools[0], rtol=0, atol=0)  # both wrote the step's K/V alike


@pytest.mark.parametrize("window", [None, 5])
def test_verify_step_runs_as_decode_rows_in_one_kernel_call(window):
    """A speculative step (decode rows and rows of 1 + k tokens after a cached context) is served by
    the kernel alone, one row per query token, and equals the torch backend's offset-causal SDPA."""
    torch.manual_seed(1)
    rows = [(9, 1), (21, 5), (3, 3), (14, 2)]  # (cached tokens, new tokens): 1 + k after a context
    plan, (runner, torch_runner) = runners_for_step(rows, window, ("numba_cpu", "torch"))
    total = sum(n for _, n in rows)
    meta = runner.prepare(plan).meta
    assert meta.num_decode == total and not meta.prefill_groups  # every query a kernel row
    torch_meta = torch_runner.prepare(plan).meta  # the same step as the torch backend sees it
    assert torch_meta.prefill_groups
    q, k, v = random_qkv(total)
    pools = runner.k_pool.clone(), runner.v_pool.clone()
    want = FlatPoolAttention(*pools, torch_meta, (window,))(0, q, k, v)
    got = NumbaCpuAttention(runner.k_pool, runner.v_pool, meta, (window,))(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_auto_rule_and_errors():
    assert resolve_backend("auto", "cpu", torch.float32) == "numba_cpu"
    assert resolve_backend("auto", "cpu", torch.float64) == "numba_cpu"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"  # the kernel takes fp32/fp64 only
    assert resolve_backend("auto", "cuda", torch.float32) == "numba"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="numba_cpu.*float32 or float64"):
        resolve_backend("numba_cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="choose one of"):
        LLM(attention_backend="numba-cpu")
    assert LLM(max_num_seqs=2).engine.executor.attention_backend == "numba_cpu"


@pytest.fixture(scope="module")
def parity_case():
    hf = make_tiny_hf_model("llama-gqa")
    trace = make_trace(8, seed=4, vocab_size=160, rate_per_s=float("inf"), prompt_len=("uniform", 2, 30),
                       output_len=("uniform", 4, 20), max_output_len=20, token_id_range=(3, 160))
    return hf, trace, [hf_greedy(hf, r.prompt_token_ids, r.max_tokens) for r in trace]


@pytest.mark.parametrize("backend", ["torch", "numba_cpu"])
@pytest.mark.parametrize("knobs", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    dict(kv_layout="slab"),
], ids=["chunked", "ngram", "slab"])
def test_greedy_equals_hf_float64_on_both_cpu_backends(parity_case, knobs, backend):
    hf, trace, refs = parity_case
    llm = LLM(hf, dtype="float64", device="cpu", max_num_seqs=4, max_model_len=64, attention_backend=backend,
              **knobs)
    assert llm.engine.executor.attention_backend == backend
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
