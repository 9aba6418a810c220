"""Known-wrong answers to exercise 08 (chunked prefill, in whole blocks): see tests/known_wrong/__init__.py.

Besides the bugs of each rule, chapter 08's printed code transcribed for the old tasks fails: the
admission-order `_running_order`, the unaligned `_chunk`, SplitFuse's `step_budget` without whole
blocks; and task 5's old answer, a trace tuned for target 256 only, fails at the targets drawn when
the check runs."""

from known_wrong import Mutant, reads_a_traceback_frame, reads_the_checks_frame

SORT = "    others.sort(key=lambda req: req.num_tokens - req.num_computed_tokens)  # stable: admission order among equals\n"
ALIGN = ("        if n < missing:  # the prompt goes on next step: end this chunk on a block boundary\n"
         "            n -= (req.num_computed_tokens + n) % block_size\n")
SHARE = "        budget = decodes + min(room, -(-share // block_size) * block_size)  # in whole blocks, within the room"
SECOND = "    second = (0.8 * first_pass_s, round(0.78 * target), 4)  # arrives late in the first pass"

DELEGATING_FILLER = """
from minillm.config import EngineConfig as _EC
from minillm.scheduler.continuous import ContinuousScheduler as _Ref


def fill_budget(running, waiting, budget, long_prefill_token_threshold, max_num_seqs, block_size):
    ref = _Ref(_EC(enable_chunked_prefill=True, max_num_batched_tokens=budget,
                   long_prefill_token_threshold=long_prefill_token_threshold).resolve(256), None)
    ref.running = list(running)
    rows = []
    for req in ref._running_order():
        n = ref._chunk(req.num_tokens - req.num_computed_tokens, budget)
        if n == 0:
            break
        rows.append((req, n))
        budget -= n
    for req in waiting[: max_num_seqs - len(running)]:
        n = ref._chunk(req.num_tokens, budget)
        if n == 0:
            break
        rows.append((req, n))
        budget -= n
    return rows
"""
# Chapter 08's SplitFuseChunking.step_budget and even_share, retyped: no whole blocks.
CHAPTER_SPLITFUSE = """
def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs, block_size):
    decodes, pending = 0, 0
    for r in running:
        missing = r.num_tokens - r.num_computed_tokens
        if missing == 1 and r.num_computed_tokens:
            decodes += 1
        else:
            pending += missing
    seats = max_num_seqs - len(running)
    if seats > 0 and waiting:
        pending += sum(r.num_tokens - r.num_computed_tokens for r in waiting[:seats])
    room = target - decodes
    if decodes >= target or pending <= room:
        budget = target
    else:
        passes = -(-pending // room)
        budget = decodes + -(-pending // passes)
    return fill_budget(running, waiting, budget, long_prefill_token_threshold, max_num_seqs, block_size)
"""
SPLITFUSE_COPY = """
import inspect as _inspect
import textwrap as _textwrap

import minillm.scheduler.chunk_policy as _lib
from minillm.config import EngineConfig as _EC

_ns = dict(vars(_lib))
exec(_textwrap.dedent(_inspect.getsource(_lib.SplitFuseChunking)).replace("class SplitFuseChunking", "class MySplit", 1),
     _ns)
MySplit = _ns["MySplit"]


def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs, block_size):
    policy = MySplit(_EC(enable_chunked_prefill=True, chunk_policy="splitfuse", max_num_batched_tokens=target,
                         max_num_seqs=max_num_seqs))
    return fill_budget(running, waiting, policy.step_budget(running, waiting), long_prefill_token_threshold,
                       max_num_seqs, block_size)
"""

KNOWN_WRONG = [
    # task 1: the stall-free order, shortest remaining prefill first
    Mutant(1, "prefills before decodes", edits=(("    return decoding + others", "    return others + decoding"),),
           expect="expected"),
    Mutant(1, "transcribes chapter 08's _running_order: the prefills in admission order", edits=((SORT, ""),),
           expect="fewest missing tokens first"),
    Mutant(1, "the longest remaining prefill first", edits=((
        "others.sort(key=lambda req: req.num_tokens - req.num_computed_tokens)",
        "others.sort(key=lambda req: req.num_computed_tokens - req.num_tokens)"),), expect="expected"),
    Mutant(1, "decoding judged by output tokens", edits=(
        ("(decoding if one_left and req.num_computed_tokens > 0 else others)",
         "(decoding if req.num_output_tokens > 0 else others)"),), expect="expected"),
    Mutant(1, "delegates to ContinuousScheduler._running_order, then sorts", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "def serve_order(running):\n"
        "    ref = _Ref(_EC(enable_chunked_prefill=True, max_num_batched_tokens=64).resolve(256), None)\n"
        "    ref.running = list(running)\n"
        "    order = ref._running_order()\n"
        "    return order\n"), expect="reference ContinuousScheduler"),
    Mutant(1, "delegates to the grader's private reference", code=(
        "from minillm.grading.private.ex08_reference import serve_order\n"), expect="reference"),
    Mutant(1, "the grader's harness sorts: serve_order through ChunkedHarness.schedule", code=(
        "def serve_order(running):\n"
        "    from minillm.config import EngineConfig as _EC\n"
        "    harness = grader.ChunkedHarness(_EC(max_num_seqs=64, max_num_batched_tokens=10_000).resolve(256), None,\n"
        "                                    lambda r, w, b, t, m, bs: [(q, 1) for q in r])\n"
        "    return harness.schedule(0.0).requests\n"), expect="grader's"),
    reads_the_checks_frame(1, "def serve_order(running):\n"
                              "    order = _expected()\n"
                              "    return sorted(running, key=lambda r: order.index(r.request_id))\n"),
    reads_a_traceback_frame(1, "def serve_order(running):\n"
                               "    order = _expected()\n"
                               "    return sorted(running, key=lambda r: order.index(r.request_id))\n"),
    Mutant(1, "memoised: the seeded cases' answers computed with the reference in advance", code=(
        "from minillm.grading.private import ex08_reference as _ref\n"
        "def _key(running):\n"
        "    return tuple((r.request_id, r.num_computed_tokens, r.num_tokens) for r in running)\n"
        "_MEMO = {}\n"
        "for _seed in range(300):\n"
        "    _running = grader._running_case(_seed)\n"
        "    _MEMO[_key(_running)] = [r.request_id for r in _ref.serve_order(_running)]\n"
        "def serve_order(running):\n"
        "    order = _MEMO.get(_key(running), [r.request_id for r in running])\n"
        "    return sorted(running, key=lambda r: order.index(r.request_id))\n"), expect="expected"),
    # task 2: fill the budget in whole blocks
    Mutant(2, "transcribes chapter 08's _chunk: chunks not aligned to blocks", edits=((ALIGN, ""),),
           expect="step"),
    Mutant(2, "a waiting prompt with no whole block is overtaken by the next",
           edits=(("            break  # no whole block for it now", "            continue  # no whole block for it now"),),
           expect="step"),
    Mutant(2, "aligns a chunk that finishes its request too",
           edits=(("        if n < missing:  # the prompt goes on", "        if True:  # the prompt goes on"),)),
    Mutant(2, "chunk ignores long_prefill_token_threshold", edits=((
        "        if long_prefill_token_threshold:\n            n = min(n, long_prefill_token_threshold)\n", ""),),
           expect="the cap: long_prefill_token_threshold"),
    Mutant(2, "budget overrun by one", edits=(("        n = min(missing, budget)\n", "        n = min(missing, budget + 1)\n"),),
           expect="over the budget"),
    Mutant(2, "seat limit ignored", edits=(("    seats = max_num_seqs - len(running)", "    seats = max_num_seqs"),),
           expect="max_num_seqs"),
    Mutant(2, "delegates to ContinuousScheduler._chunk", code=DELEGATING_FILLER, expect="reference ContinuousScheduler"),
    Mutant(2, "delegates to the grader's private fill_budget", code=(
        "from minillm.grading.private.ex08_reference import fill_budget as _fill\n"
        "def fill_budget(running, waiting, budget, long_prefill_token_threshold, max_num_seqs, block_size):\n"
        "    return _fill(running, waiting, budget, long_prefill_token_threshold, max_num_seqs, block_size)\n"),
        expect="reference"),
    # task 3: the real engine
    Mutant(3, "the engine's own scheduler", edits=(
        ("scheduler_factory=lambda config, kv: grader.ChunkedHarness(config, kv, fill_budget), ", ""),),
           expect="reference ContinuousScheduler"),
    Mutant(3, "the engine's filler ignores the block size", edits=(
        ("grader.ChunkedHarness(config, kv, fill_budget)",
         "grader.ChunkedHarness(config, kv, lambda r, w, b, cap, m, bs: fill_budget(r, w, b, cap, m, 1))"),),
           expect="differs from the rule's"),
    Mutant(3, "delegates: the engine's ContinuousScheduler in a harness", code=DELEGATING_FILLER,
           expect="reference ContinuousScheduler"),
    Mutant(3, "fits the seeded knobs only: the check's knobs hard-coded, **knobs ignored", edits=((
        "scheduler_factory=lambda config, kv: grader.ChunkedHarness(config, kv, fill_budget), **knobs)",
        "scheduler_factory=lambda config, kv: grader.ChunkedHarness(config, kv, fill_budget), "
        "**grader.ENGINE_KNOBS)"),), expect="knobs drawn as the check ran"),
    # task 4: SplitFuse's step in whole blocks
    Mutant(4, "Sarathi's fixed budget: a full step, then the remainder", edits=((SHARE, "        budget = target"),),
           expect="two passes of 20, not 32 + 8"),
    Mutant(4, "the share not in whole blocks", edits=((SHARE, "        budget = decodes + share"),),
           expect="rounds up to 24"),
    Mutant(4, "transcribes chapter 08's step_budget and even_share: no whole blocks", code=CHAPTER_SPLITFUSE,
           expect="rounds up to 24"),
    Mutant(4, "a share rounded up past the room", edits=((SHARE, "        budget = decodes + -(-share // block_size) * block_size"),),
           expect="over the budget"),
    Mutant(4, "seat limit ignored: every waiting prompt counted in the pool", edits=(
        ("waiting[:open_seats])", "waiting)"),), expect="only requests that get a seat count"),
    Mutant(4, "exceeds the target: the decodes not taken out of the room", edits=(
        ("    room = target - decodes", "    room = target"),), expect="over the budget"),
    Mutant(4, "delegates to SplitFuseChunking.step_budget", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.chunk_policy import SplitFuseChunking as _Ref\n"
        "def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs, block_size):\n"
        "    ref = _Ref(_EC(enable_chunked_prefill=True, chunk_policy='splitfuse', max_num_batched_tokens=target,\n"
        "                   max_num_seqs=max_num_seqs))\n"
        "    return fill_budget(running, waiting, ref.step_budget(running, waiting), long_prefill_token_threshold,\n"
        "                       max_num_seqs, block_size)\n"), expect="your code called the reference"),
    Mutant(4, "delegates the even split to chunk_policy.even_share", edits=(
        ("        passes = -(-pool // room)  # the fewest passes of at most `room` prompt tokens\n"
         "        share = -(-pool // passes)  # one pass's even share\n",
         "        from minillm.scheduler.chunk_policy import even_share\n"
         "        share = even_share(pool, room)\n"),), expect="reference minillm.scheduler.chunk_policy.even_share"),
    Mutant(4, "the library's answer under another name: SplitFuseChunking's source re-executed", code=SPLITFUSE_COPY,
           expect="bytecode"),
    # task 5: the trace must show the effect at any target, and WHY is graded
    Mutant(5, "everyone queued at once: SplitFuse needs no more passes", edits=(
        (SECOND, "    second = (0.0, round(0.78 * target), 4)"),), expect="not 1.10x Sarathi's or more"),
    Mutant(5, "the second prompt arrives after the first is served", edits=(
        (SECOND, "    second = (3 * first_pass_s, round(0.78 * target), 4)"),), expect="not 1.10x Sarathi's or more"),
    Mutant(5, "the old answer: a trace tuned for target 256 only", code=(
        "def splitfuse_hurts(target):\n    return [(0.0, 480, 4), (0.005, 200, 4)]\n"), expect="drawn as the check ran"),
    Mutant(5, "the wrong reason: longer steps", edits=(('    return "b"  # the split', '    return "a"  # the split'),),
           expect="is not what happens"),
    Mutant(5, "the wrong reason: more steps", edits=(('    return "b"  # the split', '    return "d"  # the split'),),
           expect="is not what happens"),
    Mutant(5, "more than 8 requests", code=(
        "def splitfuse_hurts(target):\n    return [(0.0, 480, 4), (0.005, 200, 4)] * 5\n"), expect="1 to 8 requests"),
]
