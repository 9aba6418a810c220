"""A worker in a spawned process, fed only pickled plans, samples what the in-process worker samples
(issue 15). One child process serves every case; it is always stopped, and the test counts processes.

Each case runs the same requests twice on the bundled model in float64: once with the engine's own
in-process worker, once with the engine's executor talking to the child through a pipe — the child
holds the model, the KV pool, the swap space and the input batch, and sees nothing but
`SchedulerOutput`s. Every pickled plan is checked for `Request` objects (there must be none).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys
from pathlib import Path

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.executor.uniproc import UniProcExecutor
from minillm.llm import BUNDLED_TARGET
from minillm.request import Request
from minillm.scheduler.output import SchedulerOutput

sys.path.insert(0, str(Path(__file__).parent))
import worker_child  # noqa: E402

REPLY_TIMEOUT_S = 120


class Pickled(pickle.Pickler):
    """A pickler that notes the type of every object it writes."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.types: set[type] = set()

    def reducer_override(self, obj):
        self.types.add(type(obj))
        return NotImplemented


def pickle_plan(plan: SchedulerOutput) -> bytes:
    import io

    buffer = io.BytesIO()
    pickler = Pickled(buffer)
    pickler.dump(plan)
    requests = [t for t in pickler.types if issubclass(t, Request)]
    assert not requests, f"a pickled plan holds {requests}"
    modules = {t.__module__.split(".")[0] for t in pickler.types}
    assert modules <= {"builtins", "enum", "minillm", "torch", "collections"}, modules  # enum: the classes themselves
    return buffer.getvalue()


class RemoteWorker:
    """The driver's end of the pipe: `execute_model(plan)` pickles the plan and waits for the reply."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.plan_sizes: list[tuple[int, int, bool]] = []  # (bytes, rows, a steady decode step?)

    def call(self, message: tuple):
        self.conn.send_bytes(pickle.dumps(message))
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the worker did not answer {message[0]!r} within {REPLY_TIMEOUT_S} s")
        reply = pickle.loads(self.conn.recv_bytes())
        if reply[0] == "error":
            raise RuntimeError(f"worker: {reply[1]}")
        return reply[1]

    def execute_model(self, plan: SchedulerOutput):
        data = pickle_plan(plan)
        steady = all(plan.is_decode) and not plan.new_requests and not plan.block_updates and not plan.spec_token_ids
        self.plan_sizes.append((len(data), len(plan.req_ids), steady))
        return self.call(("plan", plan))


@pytest.fixture(scope="module")
def child():
    ctx = mp.get_context("spawn")
    before = set(mp.active_children())
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=worker_child.main, args=(child_end,), daemon=True)
    process.start()
    child_end.close()
    worker = RemoteWorker(parent_end)
    try:
        yield worker
        worker.call(("stop",))
        process.join(timeout=30)
    finally:
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        parent_end.close()
    assert not process.is_alive()
    assert set(mp.active_children()) <= before  # nothing left running


PROMPTS = ["In the beginning God created the heaven and the earth.",
           "In the beginning God created the heaven and",
           "And God said, Let there be light",
           "Blessed are the meek"]


def params_mix(max_tokens: int = 6) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.2, seed=11, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)]  # seed from the engine's


def run(llm: LLM, params: list[SamplingParams], arm=None, fail_at=(), abort_at: int | None = None):
    engine = llm.engine
    engine.expect_more_requests = False
    reqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    failures = 0
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step == abort_at:
            engine.abort_request("r1")
        if step in fail_at:
            arm()
        try:
            engine.step()
        except RuntimeError as err:
            assert "injected" in str(err)
            failures += 1
    assert not engine.has_unfinished()
    return {r.request_id: (list(r.output_token_ids), r.status.value, r.output_logprobs) for r in reqs}, failures


def both(child: RemoteWorker, knobs: dict, params: list[SamplingParams], **faults):
    """(in-process result, subprocess result, the in-process LLM, the subprocess LLM)."""
    local = LLM(dtype="float64", **knobs)
    want = run(local, params, arm=lambda: worker_child.arm_fault(local.engine.executor.worker), **faults)
    remote = LLM(dtype="float64", **knobs)
    engine = remote.engine
    child.call(("init", str(BUNDLED_TARGET), torch.float64, knobs.get("max_model_len"), engine.kv.cache_spec,
                engine.config.attention_backend))
    engine.executor = UniProcExecutor(child, engine.kv)
    got = run(remote, params, arm=lambda: child.call(("fail_next",)), **faults)
    return want, got, local, remote


PAGED = dict(max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=96)


def test_sampling_chunked_prefill_and_hash_prefix_cache(child):
    knobs = dict(PAGED, enable_prefix_caching=True, prefix_cache="hash", enable_chunked_prefill=True,
                 max_num_batched_tokens=10)
    want, got, local, remote = both(child, knobs, params_mix())
    assert got == want
    assert remote.engine.kv.num_hit_tokens > 0  # the shared prefix was found
    assert any(len(s.prefill_chunk_sizes) and max(s.prefill_chunk_sizes) == 10 for s in remote.engine.metrics.steps)
    assert want[0]["r2"][2] is not None  # logprobs came back


@pytest.mark.parametrize("mode, cache", [("recompute", "hash"), ("swap", "radix")])
def test_preemption_and_prefix_caches(child, mode, cache):
    knobs = dict(PAGED, num_kv_blocks=14, max_model_len=48, preemption_mode=mode, enable_prefix_caching=True, prefix_cache=cache)
    want, got, local, remote = both(child, knobs, params_mix(10))
    assert got == want
    assert remote.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert remote.engine.kv.num_swapped_in_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_proposers(child, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    greedy_and_seeded = params_mix()[:2] * 2
    want, got, local, remote = both(child, dict(PAGED, speculative_config=spec), greedy_and_seeded)
    assert got == want
    assert remote.engine.metrics.spec_decode.num_draft_tokens > 0


def test_abort_and_failed_forwards_roll_back_alike(child):
    knobs = dict(PAGED, num_kv_blocks=14, max_model_len=48, preemption_mode="swap", enable_chunked_prefill=True,
                 max_num_batched_tokens=16)
    want, got, local, remote = both(child, knobs, params_mix(8), fail_at=(1, 4), abort_at=3)
    assert got == want and want[1] == 2
    assert want[0]["r1"][1] == "abort"
    # The failures change nothing the others sample (logprobs may differ in the last bits: batch shapes do)
    clean = run(LLM(dtype="float64", **knobs), params_mix(8), abort_at=3)[0]
    assert {k: v[:2] for k, v in got[0].items() if k != "r1"} == {k: v[:2] for k, v in clean.items() if k != "r1"}


def test_padded_batching(child):
    want, got, local, remote = both(child, dict(batching="static", max_num_seqs=4, max_model_len=96), params_mix())
    assert got == want


def test_plans_pickle_small(child):
    child.plan_sizes.clear()
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4
    want, got, _, _ = both(child, PAGED, greedy)
    assert got == want
    sizes = [(n, rows) for n, rows, steady in child.plan_sizes if steady]
    assert len(sizes) > 10
    # a steady decode step carries, per row, an id, two counts, one token and two flags: no history
    assert max(n / rows for n, rows in sizes) < 120, sizes


def test_block_table_diffs_follow_growth_and_trims():
    """The plan sends a block-table row once, then only what changed; the worker's row follows."""
    import numpy as np

    from minillm.kv.block_manager import BlockManager
    from minillm.scheduler.base import SchedulerPlan
    from minillm.scheduler.output import SchedulerOutputBuilder
    from minillm.worker.input_batch import InputBatch

    kv = BlockManager(1, 1, 8, num_blocks=8, block_size=4, max_model_len=32)
    req = Request("a", list(range(10, 17)), SamplingParams(temperature=0.0), 0.0)
    assert kv.allocate(req, 7, num_lookahead_tokens=6)  # 13 slots: 4 blocks
    builder, batch = SchedulerOutputBuilder(kv), InputBatch(kv.max_blocks_per_seq)

    def step(n: int):
        plan = builder.build(SchedulerPlan([req], [n]))
        batch.update(plan)
        row = batch.block_table.table[batch.requests["a"].row]
        assert list(row[: len(kv.block_tables["a"]) + 1]) == [*kv.block_tables["a"], -1]
        return [(u.num_kept, u.new_block_ids) for u in plan.block_updates], plan

    first = list(kv.block_tables["a"])
    updates, plan = step(7)
    assert updates == [(0, first)] and sorted(plan.blocks_to_zero) == sorted(first)
    assert [d.req_id for d in plan.new_requests] == ["a"] and plan.new_token_ids == [list(range(10, 17))]
    req.num_computed_tokens = 9
    kv.trim(req, 9)  # two guesses accepted: 3 blocks
    req.all_token_ids += [1, 2]
    assert step(0)[0] == [(3, [])]
    assert step(0)[0] == []  # nothing changed: nothing sent
    req.all_token_ids += [3] * 6
    assert kv.allocate(req, 6)  # 15 tokens: a 4th block
    assert step(6)[0] == [(3, kv.block_tables["a"][3:])]
    assert np.array_equal(batch.token_ids[0, :15], [*range(10, 17), 0, 0, *[3] * 6]) and batch.num_tokens[0] == 15
