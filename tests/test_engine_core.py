"""The engine core's contracts: one writer of request state, defects found in review (each test
here failed on the engine before the core rewrite), faults that leave nothing behind, and
per-step tensors on the model's device."""

from __future__ import annotations

import signal

import pytest
import torch
from test_scheduler_properties import MODEL
from torch._subclasses.fake_tensor import FakeTensorMode

from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_kv_manager, make_scheduler
from minillm.request import Request, RequestStatus
from minillm.sampling import filtered_probs, sampled_logprobs
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.continuous import ContinuousScheduler

TOY = MODEL  # the stand-in runs' tiny config (the scheduler only reads its limits)


class RecordingExecutor:
    """Token 7 for every row that needs one; remembers (planned ids, preempted ids, priorities)."""

    def __init__(self) -> None:
        self.plans: list[tuple[list[str], list[str]]] = []

    def execute(self, plan):
        self.plans.append(([r.request_id for r in plan.requests], [r.request_id for r in plan.preempted]))
        rows = [r for r, n in zip(plan.requests, plan.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(plan, rows, [7] * len(rows))

    def step_duration_s(self) -> float:
        return 0.001


def toy_engine(**knobs) -> tuple[LLMEngine, RecordingExecutor]:
    config = EngineConfig(**{"max_model_len": 128, "kv_watermark": 0.0, **knobs})
    resolved = config.resolve(TOY.max_position_embeddings)
    kv = make_kv_manager(resolved, TOY, allocate_pool=False)
    executor = RecordingExecutor()
    engine = LLMEngine(TOY, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=executor,
                       clock=SimClock())
    engine.expect_more_requests = False
    return engine, executor


def run(engine: LLMEngine, limit: int = 5_000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        before = engine.num_steps
        engine.step()
        if engine.num_steps == before and not engine.wait_for_work():
            raise RuntimeError("stuck")
    raise RuntimeError("did not finish")


# ---- point 4: scheduling defects -------------------------------------------------------------------
def test_priority_preemption_never_takes_a_high_priority_request_while_a_low_one_runs():
    # L (priority 9) is admitted first, H (priority 0) right after; the pool fills as both decode.
    # Before: the victim search skipped requests already planned this step, so H — planned after L —
    # was preempted while L kept running. Now the victim is the lowest-priority running request.
    engine, executor = toy_engine(block_size=4, num_kv_blocks=8, max_num_seqs=2, scheduling_policy="priority",
                                  max_model_len=32)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request([5] * 4, greedy, request_id="L", priority=9, arrival_time=0.0)
    engine.add_request([5] * 4, greedy, request_id="H", priority=0, arrival_time=0.0005)
    run(engine)
    victims = [v for _, preempted in executor.plans for v in preempted]
    assert victims and set(victims) == {"L"}, executor.plans


def test_a_preempted_low_priority_request_waits_behind_higher_priority_ones():
    # Before: _preempt did waiting.appendleft(victim), ahead of every waiting request.
    config = EngineConfig(scheduling_policy="priority").resolve(256)
    sched = ContinuousScheduler(config, make_kv_manager(config, TOY, allocate_pool=False))
    high = Request("high", [5] * 4, SamplingParams(), 1.0, priority=0)
    low = Request("low", [5] * 4, SamplingParams(), 0.0, priority=5)
    sched.add_request(high)
    low.status = RequestStatus.RUNNING
    sched.running.append(low)
    sched._preempt(low, plan=make_plan())
    assert [r.request_id for r in sched.waiting] == ["high", "low"]


def make_plan():
    from minillm.scheduler.base import SchedulerPlan

    return SchedulerPlan([], [])


def test_a_request_that_fills_the_whole_pool_runs_when_nothing_else_does():
    # Before: the watermark kept the only request out forever (100 % CPU, no progress).
    llm = LLM(max_num_seqs=1)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("livelock")))
    signal.alarm(120)
    try:
        out = llm.generate([{"prompt_token_ids": [5] * 2040}], SamplingParams(max_tokens=8, temperature=0.0),
                           use_tqdm=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(out[0].outputs[0].token_ids) == 8 or out[0].outputs[0].finish_reason == "stop"


def test_generate_raises_instead_of_spinning_when_nothing_can_progress():
    class NeverScheduler(ContinuousScheduler):
        def schedule(self, now, more_arrivals=True):
            return None

    llm = LLM(max_num_seqs=2, scheduler_factory=lambda config, kv: NeverScheduler(config, kv))
    with pytest.raises(RuntimeError, match="no request can make progress"):
        llm.generate(["In the beginning"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the stuck request was aborted, not left behind


def test_interrupted_generate_aborts_its_requests_and_the_next_one_is_exact():
    llm = LLM(max_num_seqs=4, num_kv_blocks=64, block_size=8, enable_prefix_caching=True, max_model_len=256)
    prompts = ["In the beginning God", "And the earth was", "Blessed are the meek", "The LORD is my"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(max_num_seqs=4).generate(prompts, greedy, use_tqdm=False)]
    executor = llm.engine.executor
    real_execute, calls = executor.execute, [0]

    def interrupted(plan):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real_execute(plan)

    executor.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.allocator.num_in_use == 0
    executor.execute = real_execute
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected


def test_stop_strings_need_a_tokenizer(tiny_hf_model):
    _, hf = tiny_hf_model
    llm = LLM(hf, dtype="float64")
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request([5, 6, 7], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished()


def test_generated_request_ids_never_collide_with_user_given_ones():
    engine, _ = toy_engine()
    engine.add_request([5, 6], request_id="0")
    generated = engine.add_request([5, 6])  # before: "0" again -> "request_id '0' is already in use"
    assert generated.request_id != "0"


def test_unseeded_request_reproduces_whatever_came_before():
    # Before: each unseeded request drew its seed from one shared stream, so the same request id
    # sampled differently when other requests had been added first.
    params = SamplingParams(max_tokens=12, temperature=1.0)
    outs = []
    for extra in (0, 3):
        llm = LLM(max_num_seqs=4, seed=3)
        for i in range(extra):
            llm.engine.add_request(f"Filler {i}", SamplingParams(max_tokens=2), request_id=f"f{i}")
        req = llm.engine.add_request("In the beginning", params, request_id="x")
        run(llm.engine)
        outs.append(list(req.output_token_ids))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("where", ["pending", "waiting", "running", "swapped"])
def test_abort_frees_everything_and_closes_metrics_in_any_state(where):
    engine, _ = toy_engine(block_size=4, num_kv_blocks=12, max_num_seqs=2, preemption_mode="swap", max_model_len=40)
    greedy = SamplingParams(max_tokens=34, temperature=0.0, ignore_eos=True)
    if where == "pending":
        engine.add_request([5] * 4, greedy, request_id="v", arrival_time=10.0)
    else:
        engine.add_request([6] * 4, greedy, request_id="w")
        engine.add_request([5] * 4, greedy, request_id="v")  # admitted last: the first victim
        if where != "waiting":  # "waiting": no step has run yet
            for _ in range(40):
                engine.step()
                state = engine.requests["v"].status
                if where == "running" and state is RequestStatus.RUNNING:
                    break
                if where == "swapped" and engine.kv.is_swapped(engine.requests["v"]):
                    break
            else:
                pytest.fail(f"never saw v {where}")
    engine.abort_request("v")
    assert "v" not in engine.requests and not engine.scheduler.has_request("v")
    assert not engine.kv.is_swapped(Request("v", [1], greedy, 0.0))
    assert "v" not in engine.kv.block_tables
    if where != "pending":
        assert engine.metrics.requests["v"].finish_reason == "abort"
        assert engine.metrics.requests["v"].finished_time is not None
    run(engine)
    assert engine.kv.allocator.num_in_use == 0 and engine.kv.swap_used_blocks == 0


# ---- point 6: device-correct per-step tensors ------------------------------------------------------
def test_sampling_builds_its_tensors_on_the_logits_device():
    # Fake CUDA tensors (no GPU needed): mixing a CPU tensor into an op raises a device mismatch.
    # Before: temperature, top-k, top-p and the rank tensor were built on the CPU.
    requests = [Request(str(i), [1], SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2), 0.0)
                for i in range(3)]
    with FakeTensorMode():
        logits = torch.empty(3, 64, device="cuda")
        probs, order = filtered_probs(logits, requests)
        assert probs.device.type == "cuda" and order.device.type == "cuda"
        logp = torch.log_softmax(logits, dim=-1)
        assert logp.device.type == "cuda"


def test_logprobs_and_cumulative_logprob_are_filled_when_asked():
    llm = LLM(max_num_seqs=2)
    out = llm.generate(["In the beginning"], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6 and all(len(d) >= 3 for d in out.logprobs)
    chosen = [d[t] for d, t in zip(out.logprobs, out.token_ids)]
    assert all(lp == max(d.values()) for lp, d in zip(chosen, out.logprobs))  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(chosen))
    plain = llm.generate(["In the beginning"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert plain[0].outputs[0].cumulative_logprob is None  # not asked for: not computed
    assert sampled_logprobs(torch.zeros(1, 4), [Request("r", [1], SamplingParams(), 0.0)], [0]) == [None]


def test_every_per_step_input_is_on_the_model_device():
    llm = LLM(max_num_seqs=4)
    engine = llm.engine
    for text in ["In the beginning", "And God said"]:
        engine.add_request(text, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    engine.add_request("Blessed are", SamplingParams(max_tokens=4, temperature=0.0))
    plan = engine.scheduler.schedule(engine.clock.now())
    executor = engine.executor
    executor.worker.model.device = torch.device("meta")  # where every step tensor must land
    try:
        ids, positions, meta, _ = executor.prepare(plan)
    finally:
        executor.worker.model.device = torch.device("cpu")
    tensors = [ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables]
    for g in meta.decode_groups + meta.prefill_groups:
        tensors += [t for t in (g.block_ids, g.seq_lens, g.query_index, g.query_lens, g.valid) if t is not None]
    assert all(t.device.type == "meta" for t in tensors)
    engine.scheduler.rollback(plan)


def test_requests_sample_with_a_generator_on_the_model_device():
    llm = LLM(max_num_seqs=2)
    req = llm.engine.add_request("In the beginning", SamplingParams(temperature=0.8))
    assert req.generator.device == llm.model.device
    llm.engine.abort_request(req.request_id)


# ---- point 7: outputs and metrics ------------------------------------------------------------------
def test_stop_strings_are_looked_for_in_new_text_only():
    llm = LLM(max_num_seqs=2)
    tokenizer = llm.tokenizer
    lengths = []
    real_decode = tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        lengths.append(len(ids))
        return real_decode(ids, *args, **kwargs)

    tokenizer.decode = counting_decode
    try:
        out = llm.generate(["In the beginning"], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True,
                                                               stop=["never appears in KJV text ###"]),
                           use_tqdm=False)[0].outputs[0]
    finally:
        tokenizer.decode = real_decode
    assert len(out.token_ids) == 80
    # Windows of a few tokens per new token; one full decode when the request finishes (its text).
    assert sum(1 for n in lengths if n > 8) == 1 and max(lengths) == 80
    reference = LLM(max_num_seqs=2).generate(["In the beginning"], SamplingParams(max_tokens=80, temperature=0.0,
                                                                                  ignore_eos=True), use_tqdm=False)
    text = reference[0].outputs[0].text
    stop = text[30:36]  # a stop string that does occur: cut exactly where a full decode would cut
    cut = llm.generate(["In the beginning"], SamplingParams(max_tokens=80, temperature=0.0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"


def test_request_output_metrics_carry_vllm_field_names():
    out = LLM(max_num_seqs=2).generate(["In the beginning"], SamplingParams(max_tokens=5, temperature=0.0),
                                       use_tqdm=False)[0]
    m = out.metrics
    for name in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
                 "time_in_queue"):
        assert getattr(m, name) is not None, name
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


def test_prefix_cache_hit_rate_is_hits_over_queried_tokens_of_every_admission():
    llm = LLM(max_num_seqs=2, block_size=4, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(10, 31))}  # 21 tokens: 5 full blocks can hit (20 tokens)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([prompt], greedy, use_tqdm=False)
    llm.generate([prompt], greedy, use_tqdm=False)
    summary = llm.engine.metrics.summary()
    assert summary.prefix_cache_hit_rate == pytest.approx(20 / (21 + 21))


def test_an_empty_stop_string_is_refused_as_vllm_does():
    for stop in ("", [""], ["ok", ""]):
        with pytest.raises(ValueError, match="stop cannot contain an empty string"):
            SamplingParams(stop=stop)
    with pytest.raises(ValueError, match="list of strings"):
        SamplingParams(stop=[3])


def test_step_says_whether_the_model_ran():
    llm = LLM(max_num_seqs=2, enable_chunked_prefill=True, max_num_batched_tokens=4)
    engine = llm.engine
    assert engine.step().model_ran is False  # nothing to run
    engine.add_request({"prompt_token_ids": list(range(5, 15))}, SamplingParams(max_tokens=1, temperature=0.0))
    first = engine.step()  # a 4-token chunk of a 10-token prompt: the model ran, nothing was sampled
    assert first.model_ran and first == []
    engine.step()
    last = engine.step()  # the last chunk samples the one token: done
    assert last.model_ran and [u.finished for u in last] == [True] and not engine.has_unfinished()
