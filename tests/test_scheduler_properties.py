"""Property tests (hypothesis): random traces and knobs through the real schedulers and KV managers.

The model is replaced by a stand-in executor (the scheduler and KV accounting are what is under
test), so hundreds of runs take seconds: every request finishes exactly once with exactly its
max_tokens, no KV slot leaks, no step exceeds its limits, and timestamps are ordered.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_kv_manager, make_scheduler
from minillm.model.config import ModelConfig
from minillm.request import SamplingParams
from minillm.scheduler.base import ModelRunnerOutput, SchedulerPlan

MODEL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=256, eos_token_ids=(2,))


class StandInExecutor:
    """Emits token 7 for every row that needs one; each step takes 1 ms of simulated time."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], list[int]]] = []

    def execute(self, batch: SchedulerPlan):
        self.batches.append(([r.request_id for r in batch.requests], list(batch.num_new_tokens)))
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens)
                if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self) -> float:
        return 0.001


requests_strategy = st.lists(
    st.tuples(st.integers(1, 40),  # prompt length
              st.integers(1, 30),  # max_tokens
              st.floats(0.0, 0.05)),  # arrival time (s)
    min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, batching=st.sampled_from(["static", "dynamic", "continuous"]),
       max_num_seqs=st.integers(1, 8), delay_ms=st.sampled_from([0.0, 2.0, 20.0]),
       online=st.booleans())
def test_every_request_finishes_once_and_kv_is_returned(requests, batching, max_num_seqs, delay_ms, online):
    config = EngineConfig(batching=batching, max_num_seqs=max_num_seqs, max_model_len=128,
                          max_num_batched_tokens=128, max_queue_delay_ms=delay_ms, static_batch_timeout_ms=delay_ms)
    executor = StandInExecutor()
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=executor,
                       clock=SimClock())
    engine.expect_more_requests = online  # online: static batches wait for company or their timeout
    submitted = {}
    for i, (prompt_len, max_tokens, arrival) in enumerate(requests):
        req = engine.add_request({"prompt_token_ids": [5] * prompt_len},
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 request_id=f"r{i}", arrival_time=arrival)
        submitted[req.request_id] = req

    finished: list[str] = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        before = engine.num_steps
        for update in engine.step():
            if update.finished:
                finished.append(update.request.request_id)
        if engine.num_steps == before:
            if engine.scheduler.next_wakeup(engine.clock.now()) is None and not engine._pending:
                engine.expect_more_requests = False  # online with nothing left to wait for: flush
            engine.wait_for_work()
    assert not engine.has_unfinished(), "the engine stalled with work left"

    # Every request finished exactly once, with exactly its max_tokens (the stand-in never emits EOS).
    assert sorted(finished) == sorted(submitted)
    for rid, req in submitted.items():
        assert req.output_token_ids == [7] * req.params.max_tokens, rid
        assert req.finish_reason == "length"
        assert req.num_computed_tokens == req.num_tokens - 1  # the last token was never fed back

    # No KV slot leaked.
    usage = engine.kv.usage()
    assert usage.used_tokens == 0
    if batching == "continuous":
        assert usage.reserved_tokens == 0 and engine.kv.num_free_blocks == engine.kv.allocator.num_blocks

    # Every step respected the limits; a request's tokens were computed in order, none twice.
    computed = {rid: 0 for rid in submitted}
    for ids, counts in executor.batches:
        assert len(ids) <= max_num_seqs
        assert len(set(ids)) == len(ids)
        if batching == "continuous":
            assert sum(counts) <= 128
        for rid, n in zip(ids, counts):
            computed[rid] += n
    for rid, req in submitted.items():
        assert computed[rid] == req.num_computed_tokens, rid
    for step in engine.metrics.steps:
        assert step.kv_used_tokens <= step.kv_reserved_tokens or batching != "continuous"
        assert step.kv_reserved_tokens <= step.kv_total_tokens or batching != "continuous"

    # Timestamps are ordered for every request.
    for rid, m in engine.metrics.requests.items():
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time, rid
        assert m.token_times == sorted(m.token_times)
        assert m.num_output_tokens == submitted[rid].params.max_tokens


@settings(max_examples=40, deadline=None)
@given(requests=requests_strategy, num_slabs=st.integers(1, 4))
def test_continuous_never_runs_more_sequences_than_kv_slabs(requests, num_slabs):
    """With fewer slabs than max_num_seqs, the KV pool — not the knob — caps concurrency."""
    config = EngineConfig(batching="continuous", max_num_seqs=8, max_model_len=128).resolve(256)
    from minillm.kv.slab import SlabKVManager

    kv = SlabKVManager(1, 1, 8, num_slabs=num_slabs, slab_len=128, allocate_pool=False)
    executor = StandInExecutor()
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(config, kv), executor=executor,
                       clock=SimClock())
    engine.expect_more_requests = False
    for _i, (prompt_len, max_tokens, arrival) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5] * prompt_len},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=arrival)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        before = engine.num_steps
        engine.step()
        assert engine.scheduler.num_running <= num_slabs
        if engine.num_steps == before:
            engine.wait_for_work()
    assert not engine.has_unfinished()
    assert kv.num_free_slabs == num_slabs
    assert max(len(ids) for ids, _ in executor.batches) <= num_slabs


class QueueWatchingExecutor(StandInExecutor):
    """Also notes, for each step, the work queued when it was planned: decode tokens and the prompt
    tokens of running prefills and of the waiting requests that had a seat."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = None
        self.queued: list[tuple[int, int]] = []

    def execute(self, batch: SchedulerPlan):
        s = self.scheduler
        decodes = sum(1 for r in s.running if r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens)
        prompts = sum(r.num_tokens - r.num_computed_tokens for r in s.running) - decodes
        seats = s.config.max_num_seqs - len(s.running)
        prompts += sum(r.num_tokens - r.num_computed_tokens for r in list(s.waiting)[:max(seats, 0)])
        self.queued.append((decodes, prompts))
        return super().execute(batch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, policy=st.sampled_from(["sarathi", "splitfuse"]), target=st.integers(2, 48),
       max_num_seqs=st.integers(1, 8))
def test_chunk_policies_lose_nothing_and_size_steps_as_they_promise(requests, policy, target, max_num_seqs):
    """Chunked prefill under both chunk policies, a pool large enough that nobody is preempted: every
    request finishes once with its tokens computed once each; no step holds more than the budget;
    a step runs everything queued when it fits; otherwise a fixed budget fills the step, and SplitFuse
    (its defining property) runs steps near its target: the queued prompt tokens split evenly over the
    F passes they need, so at least target·(F-1)/F tokens, never below half of it."""
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=128, enable_chunked_prefill=True,
                          max_num_batched_tokens=target, chunk_policy=policy, block_size=4, num_kv_blocks=8 * 32)
    executor = QueueWatchingExecutor()
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=executor,
                       clock=SimClock())
    executor.scheduler = engine.scheduler
    engine.expect_more_requests = False
    submitted = {}
    for i, (prompt_len, max_tokens, arrival) in enumerate(requests):
        req = engine.add_request({"prompt_token_ids": [5] * prompt_len},
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 request_id=f"r{i}", arrival_time=arrival)
        submitted[req.request_id] = req
    finished = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        before = engine.num_steps
        finished += [u.request.request_id for u in engine.step() if u.finished]
        if engine.num_steps == before:
            engine.wait_for_work()
    assert not engine.has_unfinished(), "the engine stalled with work left"
    assert sorted(finished) == sorted(submitted)
    assert engine.scheduler.num_preemptions == 0

    computed = {rid: 0 for rid in submitted}
    for (ids, counts), (decodes, prompts) in zip(executor.batches, executor.queued, strict=True):
        assert len(set(ids)) == len(ids)
        for rid, n in zip(ids, counts):
            computed[rid] += n
        step = sum(counts)
        assert step <= target
        if decodes + prompts <= target:
            assert step == decodes + prompts  # everything queued fits: it all runs
        elif policy == "sarathi":
            assert step == target  # a fixed budget is filled
        elif decodes >= target:
            assert step == target  # decodes alone fill it
        else:
            passes = -(-prompts // (target - decodes))
            assert step * passes >= target * (passes - 1) and 2 * step >= target, (step, decodes, prompts)
            assert step - decodes <= -(-prompts // passes), (step, decodes, prompts)  # an equal share, no more
    for rid, req in submitted.items():
        assert computed[rid] == req.num_computed_tokens == req.num_tokens - 1, rid
        assert req.output_token_ids == [7] * req.params.max_tokens
    assert engine.kv.num_free_blocks == engine.kv.allocator.num_blocks


class PlanRecordingExecutor(StandInExecutor):
    """Also notes each step's preemptions and swap orders, so two engines' plans compare in full."""

    def execute(self, batch: SchedulerPlan):
        self.batches.append(([r.request_id for r in batch.preempted], list(batch.blocks_to_swap_out),
                             list(batch.blocks_to_swap_in)))
        return super().execute(batch)


def run_recording(requests, config: EngineConfig, steady: bool) -> tuple[list, list[bool]]:
    """Every plan the continuous scheduler makes for `requests` (and its KV usage after each step), with
    its steady-decode pass (`steady`) or without it; and, per step, whether that pass planned it."""
    executor = PlanRecordingExecutor()
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    scheduler = make_scheduler(resolved, kv)
    taken: list[bool] = []
    general = scheduler._schedule_steady_decode

    def spy():
        plan = general() if steady else None
        taken.append(plan is not None)
        return plan
    scheduler._schedule_steady_decode = spy
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=scheduler, executor=executor, clock=SimClock())
    engine.expect_more_requests = False
    for i, (prompt_len, max_tokens, arrival, priority) in enumerate(requests):
        engine.add_request({"prompt_token_ids": [5 + i % 3] * prompt_len},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           request_id=f"r{i}", arrival_time=arrival, priority=priority)
    usage = []
    assert engine.run_until_done(lambda _: usage.append(kv.usage()), max_iterations=10_000)
    return [executor.batches, usage, kv.allocator.ref_counts], taken


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.floats(0.0, 0.05), st.integers(0, 2)),
                         min_size=1, max_size=20),
       max_num_seqs=st.integers(1, 8), num_kv_blocks=st.integers(8, 40), chunked=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["recompute", "swap"]),
       prefix_caching=st.booleans())
def test_the_steady_decode_pass_plans_what_the_general_loop_plans(requests, max_num_seqs, num_kv_blocks, chunked,
                                                                  policy, mode, prefix_caching):
    """`ContinuousScheduler._schedule_steady_decode` plans a step where nothing waits and every running
    request decodes, in one pass. The same trace through an engine without that pass gives the same
    plans step for step — rows, new tokens, preemptions, swaps — and the same KV usage, on pools small
    enough (8 blocks of 16 for up to 8 requests of up to 70 tokens) that decodes run out of room and
    preempt."""
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=128, num_kv_blocks=num_kv_blocks,
                          enable_chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else None,
                          scheduling_policy=policy, preemption_mode=mode, enable_prefix_caching=prefix_caching)
    with_pass, taken = run_recording(requests, config, steady=True)
    without, _ = run_recording(requests, config, steady=False)
    assert with_pass == without


def test_the_steady_decode_pass_is_taken_and_falls_back_on_a_full_pool():
    """One request decoding alone: every step after the prefill is planned by the steady pass. Two
    requests on a pool too small for both: the pass gives up when a decode's KV does not fit, and the
    general loop preempts (the later request) as before."""
    alone = EngineConfig(max_num_seqs=4, max_model_len=128)
    _, taken = run_recording([(10, 12, 0.0, 0)], alone, steady=True)
    assert taken == [False] + [True] * 11  # the prefill, then 11 decode steps

    tight = EngineConfig(max_num_seqs=2, max_model_len=128, num_kv_blocks=8, kv_watermark=0.0)
    (batches, _, _), taken = run_recording([(60, 30, 0.0, 0), (60, 30, 0.0, 0)], tight, steady=True)
    preempted = [ids for ids, *_ in batches[0::2] if ids]  # (each step records its preemptions, then its rows)
    assert preempted and preempted[0] == ["r1"]
    assert True in taken and taken.count(False) >= 2
