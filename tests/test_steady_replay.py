"""A steady decode step replays its plan (issue 29): while the same requests each decode one token, the
scheduler hands out the same `SchedulerPlan`, the builder updates the `SchedulerOutput` it made for it in
place, and the compiled decode keeps its rows. These tests check that the replay happens, that it ends
when the batch changes or a step fails, and that it changes no token."""

from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # 40 tokens cross two 16-slot blocks
PROMPTS = [list(range(10, 30)), list(range(40, 53))]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_model_len=256)


def recorded(engine):
    """Wrap the builder: every (scheduler plan, output) pair it returns, in order."""
    plans = engine.executor.plans
    seen = []

    def build(batch):
        out = type(plans).build(plans, batch)
        seen.append((batch, out, list(out.num_computed_tokens), [list(t) for t in out.new_token_ids],
                     list(out.blocks_to_zero), [(u.req_id, u.num_kept, list(u.new_block_ids))
                                                for u in out.block_updates]))
        return out
    plans.build = build
    return seen


def reference(llm, prompts, joins_at=None):
    """The same requests with every plan built whole (no replay): the tokens to match."""
    plans = llm.engine.executor.plans
    plans.build = plans._build
    try:
        return run(llm, prompts, joins_at)
    finally:
        del plans.build


def run(llm, prompts, joins_at=None):
    """Add the first prompt, step; the second joins after `joins_at` steps (or at once). Token ids per request."""
    engine = llm.engine
    reqs = [engine.add_request(prompts[0], GREEDY)]
    steps = 0
    while engine.has_unfinished() or len(reqs) < len(prompts):
        if len(reqs) < len(prompts) and (joins_at is None or steps == joins_at):
            reqs.append(engine.add_request(prompts[1], GREEDY))
        engine.step()
        steps += 1
    return [list(r.output_token_ids) for r in reqs]


def test_a_steady_decode_step_replays_its_plan_and_its_output(llm):
    expected = reference(llm, PROMPTS[:1])
    seen = recorded(llm.engine)
    try:
        tokens = run(llm, PROMPTS[:1])
    finally:
        del llm.engine.executor.plans.build
    assert tokens == expected
    steady = [s for s in seen if s[0].steady]
    assert len(seen) == 40 and len(steady) == 39  # the prefill, then 39 decode steps, all steady
    assert all(s[0] is steady[0][0] and s[1] is steady[0][1] for s in steady)  # one plan, one output: replayed
    starts = [s[2][0] for s in steady]
    assert starts == list(range(20, 59))  # where each step's token goes, advanced in place
    assert [s[3][0] for s in steady] == [[t] for t in tokens[0][:39]]  # each step computes the token sampled before
    grown = [s for s in steady if s[5]]  # the steps whose row crossed into a new block (slots 32 and 48)
    assert [s[2][0] for s in grown] == [32, 48] and all(s[4] == s[5][0][2] for s in grown)
    assert all(not s[4] for s in steady if not s[5])  # no block to zero, no table change otherwise


def test_a_request_joining_ends_the_replay_and_tokens_stay_the_same(llm):
    expected = reference(llm, PROMPTS, joins_at=10)
    seen = recorded(llm.engine)
    try:
        tokens = run(llm, PROMPTS, joins_at=10)
    finally:
        del llm.engine.executor.plans.build
    assert tokens == expected
    plans = []
    for batch, *_ in seen:
        if batch.steady and all(batch is not p for p in plans):
            plans.append(batch)
    # steady alone, steady together, steady alone again once the first request finished
    assert [len(p.requests) for p in plans] == [1, 2, 1]


def test_a_failed_steady_step_is_planned_whole_again(llm):
    engine = llm.engine
    expected = reference(llm, PROMPTS[:1])
    seen = recorded(engine)
    compiled = engine.executor.worker.compiled_decode
    req = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(5):
        engine.step()
    def fail(*args):
        raise RuntimeError("a failing step")
    compiled.run = fail
    with pytest.raises(RuntimeError, match="a failing step"):
        engine.step()
    assert compiled.run is fail
    del compiled.run
    engine.step()
    failed, again = seen[-2], seen[-1]
    assert failed[0] is again[0]  # the scheduler plans the same steady step again ...
    assert again[1] is not failed[1] and [d.req_id for d in again[1].new_requests] == [req.request_id]  # ... sent whole
    while engine.has_unfinished():
        engine.step()
    del engine.executor.plans.build
    assert list(req.output_token_ids) == expected[0]
