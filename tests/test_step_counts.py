"""How much framework work one engine step does, counted (minillm/worker/step_counts.py): upper bounds
that keep the batch-1 step cheap and keep the batched step from growing (issues 25 and 29). Counts,
not times: the same step makes the same calls on any machine, under any load. (A bound is set a
little above what the code does today, run `python bench/step_profile.py --batch-sizes 1 8` to
see the counts; raise one only with a reason in the commit.)"""

from __future__ import annotations

from minillm import LLM, SamplingParams
from minillm.worker.step_counts import GENERATE_LOOP, PIECES, count_generate_decode_step, count_steps, total

PROMPT = list(range(10, 210))  # 200 tokens, as the single-stream measurement
# A batch-1 draft-model verify step of 1+4 tokens makes ~270 Python calls (~730 op by op, with 295 torch ops
# from Python): the plain step's ~177, and the proposer, the guesses' bookkeeping and the step's spec metrics.
VERIFY_STEP_CALLS = 300
# A batch-1 decode step inside LLM.generate made ~184 Python calls before the steady-decode plan (issue 29's
# second round), ~153 after it, ~131 by the third round; 102 once `LLM` feeds no Prometheus series by default
# and a steady step replays its plan (the fourth round); generate's own loop around engine.step() makes 2.
# (Counted with the counter's own bookkeeping: each piece entered adds two list calls, ~16 of the 102.)
GENERATE_STEP_CALLS = 115
GENERATE_LOOP_CALLS = 4


def decoding_engine(batch: int, compiled: bool = True):
    llm = LLM(max_num_seqs=16, max_model_len=512)
    engine = llm.engine
    if not compiled:
        engine.executor.worker.compiled_decode = None
    for i in range(batch):
        engine.add_request([t + i for t in PROMPT], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prefill, then decode
        engine.step()
    return engine


def test_a_batch_1_decode_step_dispatches_no_torch_op_and_few_python_calls():
    counts = count_steps(decoding_engine(1), num_steps=5)
    assert set(counts) == set(PIECES)
    step = total(counts)
    assert step.torch_ops == 0, {p: c.torch_ops for p, c in counts.items()}
    assert counts["forward, lm_head"].python_calls <= 8  # the compiled call and its wrapper
    assert counts["inputs, metadata"].python_calls == 0  # nothing is built for it
    # ~101 (177 before issue 29's second round, ~127 before its fourth: the steady replay, no Prometheus in LLM)
    assert step.python_calls <= 115, {p: c.python_calls for p, c in counts.items()}
    assert counts["schedule"].python_calls <= 13  # the steady-decode plan, handed out again (~11; the general loop made 28)
    assert counts["plan → data"].python_calls <= 8  # the builder's replay (~6; ~18 built whole)
    assert counts["outputs, metrics"].python_calls <= 27  # (~25: the engine's own records, no Prometheus observer)


def test_a_batch_1_decode_step_inside_generate_makes_few_python_calls():
    """The same step as `LLM.generate` runs it — the difference of two generates that differ by 32 decode
    steps — with generate's own loop around `engine.step()` counted too. Each step makes the compiled call
    (at least the wrapper and the kernel), and the whole step stays under its bound."""
    counts = count_generate_decode_step(LLM(max_num_seqs=16, max_model_len=512), PROMPT)
    assert 2 <= counts["forward, lm_head"] <= 8, counts
    assert counts["inputs, metadata"] == 0 and counts["sample"] == 0
    assert counts[GENERATE_LOOP] <= GENERATE_LOOP_CALLS, counts
    assert sum(counts.values()) <= GENERATE_STEP_CALLS, counts


def test_the_op_by_op_step_it_replaces_is_counted_too():
    """The counter is not blind: the same step without the compiled path dispatches hundreds of ops."""
    counts = count_steps(decoding_engine(1, compiled=False), num_steps=3)
    assert counts["forward, lm_head"].torch_ops_from_python >= 100
    assert total(counts).python_calls >= 2 * 200


def test_a_batched_decode_step_does_not_grow():
    """The op-by-op forward's batched step (max batch 16, the compiled path switched off: the ladder's
    mixed steps and batches above its MAX_ROWS still run it). It makes ~1270 Python calls and dispatches
    299 torch ops from Python (431 in all), as it did before issue 29's compiled decode step."""
    step = total(count_steps(decoding_engine(16, compiled=False), num_steps=3))
    assert step.python_calls <= 1300 and step.torch_ops_from_python <= 310 and step.torch_ops <= 440, step


def test_a_batch_16_decode_step_runs_compiled_and_dispatches_no_torch_op():
    """Up to MAX_ROWS (32) decode rows run compiled: no torch op."""
    counts = count_steps(decoding_engine(16), num_steps=3)
    assert total(counts).torch_ops == 0, {p: c.torch_ops for p, c in counts.items()}
    assert counts["forward, lm_head"].python_calls <= 8


def speculating_engine(method: str, compiled: bool = True, k: int = 4):
    """One request decoding with `method`'s guesses (the bundled draft model guesses k every step)."""
    llm = LLM(max_num_seqs=1, max_model_len=512, speculative_config={"method": method, "num_speculative_tokens": k})
    engine = llm.engine
    if not compiled:
        engine.executor.worker.compiled_decode = None
    engine.add_request(PROMPT, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prefill, then verify steps
        engine.step()
    return engine


def test_a_batch_1_verify_step_runs_compiled_and_dispatches_no_torch_op():
    """A draft-model verify step of 1+4 tokens at batch 1 is one compiled call, as a decode step is: no
    torch op anywhere in the step (the rejection test of greedy requests reads one numpy argmax), no
    inputs built, and a bounded number of Python calls (proposer and bookkeeping included)."""
    engine = speculating_engine("draft_model")
    drafts = engine.metrics.spec_decode.num_drafts
    counts = count_steps(engine, num_steps=4)
    assert engine.metrics.spec_decode.num_drafts - drafts == 8  # every counted step verified guesses
    step = total(counts)
    assert step.torch_ops == 0, {p: c.torch_ops for p, c in counts.items()}
    assert counts["forward, lm_head"].python_calls <= 8
    assert counts["inputs, metadata"].python_calls == 0
    assert step.python_calls <= VERIFY_STEP_CALLS, {p: c.python_calls for p, c in counts.items()}


def test_the_op_by_op_verify_step_is_counted_too():
    """Without the compiled step the same verify step dispatches hundreds of torch ops."""
    counts = count_steps(speculating_engine("draft_model", compiled=False), num_steps=2)
    assert counts["forward, lm_head"].torch_ops_from_python >= 100
    assert total(counts).python_calls >= 2 * VERIFY_STEP_CALLS
