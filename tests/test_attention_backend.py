"""The torch paged backend against a per-row reference: decode rows grouped by length, multi-token
rows after a cached context batched with an offset causal mask, sliding windows, and padded key
slots that never bring uninitialised memory (NaN) into a result."""

from __future__ import annotations

import math

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention.flat_pool import FlatPoolAttention, group_by_length
from minillm.kv.block_manager import BlockManager
from minillm.request import Request
from minillm.scheduler.base import SchedulerPlan
from minillm.scheduler.output import SchedulerOutputBuilder
from minillm.worker.model_runner import ModelRunner


def reference(q, k_pool, v_pool, table, ctx, n, bs, window):
    """Row-by-row attention of n queries at positions ctx-n … ctx-1 over that sequence's keys."""
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
    keys, values = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # [H_kv, ctx, D]
    group = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # [n, H_q, D]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_grouped_rows_equal_per_row_attention(block_size, window):
    torch.manual_seed(0)
    h_q, h_kv, d = 4, 2, 8
    # (cached tokens, new tokens): decodes of many lengths, fresh prompts, chunks after a cached prefix
    rows = [(9, 1), (1, 1), (33, 1), (16, 1), (15, 1), (17, 1), (0, 7), (0, 2), (12, 5), (3, 4), (20, 3),
            (block_size, block_size + 1)]
    kv = BlockManager(1, h_kv, d, 400, block_size, dtype=torch.float64, max_model_len=64)
    reqs, counts = [], []
    for i, (cached, n) in enumerate(rows):
        req = Request(f"r{i}", list(range(5, 5 + cached + n)), SamplingParams(), 0.0)
        assert kv.allocate(req, cached + n)
        req.num_computed_tokens = cached
        reqs.append(req)
        counts.append(n)
    decode = [i for i, (c, n) in enumerate(rows) if n == 1 and c > 0]
    order = decode + [i for i in range(len(rows)) if i not in decode]
    plan = SchedulerPlan([reqs[i] for i in order], [counts[i] for i in order])

    class Stub:
        device = torch.device("cpu")
        dtype = torch.float64

        class config:  # noqa: N801 - stands in for a ModelConfig
            sliding_windows = (window,)

    runner = ModelRunner(Stub(), kv.cache_spec, "torch")  # the torch backend builds length groups
    step = SchedulerOutputBuilder(kv).build(plan)
    runner.update_state(step)
    k_pool, v_pool = runner.k_pool, runner.v_pool
    k_pool.normal_()
    v_pool.normal_()
    k_pool[:, kv.null_block * block_size :] = 0
    v_pool[:, kv.null_block * block_size :] = 0
    inputs = runner.prepare(step)
    meta = inputs.meta
    assert len(meta.decode_groups) >= 2  # lengths 1 … 34 do not share one padded call
    total_q = sum(counts)
    q = torch.randn(total_q, h_q, d, dtype=torch.float64)
    k_new = torch.randn(total_q, h_kv, d, dtype=torch.float64)
    v_new = torch.randn(total_q, h_kv, d, dtype=torch.float64)

    out = FlatPoolAttention(k_pool, v_pool, meta, (window,))(0, q, k_new, v_new)
    start = 0
    for plan_index in inputs.order:
        req, n = plan.requests[plan_index], plan.num_new_tokens[plan_index]
        ctx = req.num_computed_tokens + n
        want = reference(q[start : start + n], k_pool[0], v_pool[0], kv.block_tables[req.request_id], ctx, n,
                         block_size, window)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-9, atol=1e-9)
        start += n


def test_length_groups_bound_the_padded_reads():
    lengths = [40, 38, 37, 30, 22, 20, 9, 9, 8, 3, 1, 1]
    groups = group_by_length(lengths, slack=1.25)
    assert groups == sorted(groups) and groups[0][0] == 0 and groups[-1][1] == len(lengths)
    for a, b in groups:
        assert (b - a) * lengths[a] <= 1.25 * sum(lengths[a:b]) or b - a == 1


def test_uninitialised_pool_memory_never_reaches_a_result():
    prompts = ["In the beginning God created", "And the earth was without form", "Blessed"]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    knobs = dict(max_num_seqs=3, block_size=16, num_kv_blocks=40, max_model_len=256)
    clean = [o.outputs[0].token_ids for o in LLM(**knobs).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(**knobs)
    kv, worker = llm.engine.kv, llm.engine.executor.worker
    real_slots = kv.null_block * kv.block_size  # every slot but the null block's: as if torch.empty
    worker.k_pool[:, :real_slots] = float("nan")
    worker.v_pool[:, :real_slots] = float("nan")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == clean  # tails of partial blocks and -1 padding read zeros, never NaN


def _doc_backend_module():
    """docs/engine.md's "Adding an attention backend" example, as a module of its own."""
    import re
    import sys
    import types
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    section = text[text.index("## Adding an attention backend"):]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("doc_attention_backend")
    exec(compile(source, "docs/engine.md", "exec"), module.__dict__)  # noqa: S102 - the doc's own example
    sys.modules[module.__name__] = module
    return module


def test_a_backend_is_one_file_and_one_registry_line(monkeypatch):
    """The docs' example backend, registered with one line, runs the real engine token-exact with HF
    (float64; chunked prefill with prefix caching, so rows with several new tokens after a cached
    context run too), and neither the worker nor the config names it anywhere else."""
    from conftest import hf_greedy, make_tiny_hf_model

    from minillm.attention import registry
    from minillm.traces.synthetic import make_trace

    module = _doc_backend_module()
    monkeypatch.setitem(registry.BACKENDS, "per_row", f"{module.__name__}:PerRowAttention")
    hf = make_tiny_hf_model("llama-gqa")
    trace = make_trace(6, seed=5, vocab_size=160, rate_per_s=float("inf"), prompt_len=("uniform", 2, 30),
                       output_len=("uniform", 4, 12), max_output_len=12, token_id_range=(3, 160))
    shared = list(range(10, 30))  # 5 full blocks of 4: cached after the first pass
    prompts = [r.prompt_token_ids for r in trace] + [shared]
    again = [shared + [7, 8, 9], shared[:9]]  # the second pass: a cached prefix, then new tokens
    refs = [hf_greedy(hf, p, 10) for p in prompts + again]
    llm = LLM(hf, dtype="float64", device="cpu", max_num_seqs=4, max_model_len=64, attention_backend="per_row",
              enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)
    assert llm.engine.executor.attention_backend == "per_row"
    assert llm.engine.executor.worker.backend is module.PerRowAttention
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = [o for batch in (prompts, again) for o in
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(o.metrics.num_cached_prompt_tokens > 0 for o in outs[-2:])  # (the second pass hit the cache)
    with pytest.raises(ValueError, match="per_row"):  # gone from the registry: refused by name, with the choices
        monkeypatch.delitem(registry.BACKENDS, "per_row")
        LLM(hf, dtype="float64", device="cpu", attention_backend="per_row")
