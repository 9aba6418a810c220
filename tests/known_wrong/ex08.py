"""Known-wrong answers to exercise 08 (chunked prefill budget): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_a_traceback_frame, reads_the_checks_frame

DELEGATING_FILLER = """
from minillm.config import EngineConfig as _EC
from minillm.scheduler.continuous import ContinuousScheduler as _Ref


def fill_budget(running, waiting, budget, long_prefill_token_threshold, max_num_seqs):
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

KNOWN_WRONG = [
    # task 1: the stall-free order
    Mutant(1, "prefills before decodes", edits=(("    return decoding + others", "    return others + decoding"),),
           expect="expected"),
    Mutant(1, "decoding judged by output tokens", edits=(
        ("(decoding if one_left and req.num_computed_tokens > 0 else others)",
         "(decoding if req.num_output_tokens > 0 else others)"),), expect="expected"),
    Mutant(1, "the last prompt token not counted as a decode", edits=(
        ("(decoding if one_left and req.num_computed_tokens > 0 else others)",
         "(decoding if one_left and req.num_output_tokens > 0 else others)"),), expect="expected"),
    Mutant(1, "delegates to ContinuousScheduler._running_order", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "def serve_order(running):\n"
        "    ref = _Ref(_EC(enable_chunked_prefill=True, max_num_batched_tokens=64).resolve(256), None)\n"
        "    ref.running = list(running)\n"
        "    return ref._running_order()\n"), expect="reference ContinuousScheduler"),
    # task 2: fill the budget
    Mutant(2, "prefills before decodes", edits=(("    for req in serve_order(running):", "    for req in serve_order(running)[::-1]:"),),
           expect="a long prompt arrives among decodes"),
    Mutant(2, "chunk ignores long_prefill_token_threshold", edits=(
        ("        return min(n, long_prefill_token_threshold) if long_prefill_token_threshold else n", "        return n"),),
           expect="the cap: long_prefill_token_threshold"),
    Mutant(2, "budget overrun by one", edits=(
        ("n = min(req.num_tokens - req.num_computed_tokens, budget)", "n = min(req.num_tokens - req.num_computed_tokens, budget + 1)"),),
           expect="over the budget"),
    Mutant(2, "new prompts are not chunked", edits=(
        ("        n = chunk(req)\n        rows.append((req, n))\n        budget -= n\n        seats -= 1",
         "        n = req.num_tokens\n        if n > budget:\n            break\n        rows.append((req, n))\n"
         "        budget -= n\n        seats -= 1"),)),
    Mutant(2, "seat limit ignored", edits=(("    seats = max_num_seqs - len(running)", "    seats = max_num_seqs"),),
           expect="max_num_seqs"),
    Mutant(2, "admits with the budget spent (rows of 0 tokens)", edits=(
        ("        if budget == 0 or seats == 0:\n            break", "        if seats == 0:\n            break"),),
           expect="0 tokens"),
    Mutant(2, "delegates to ContinuousScheduler._chunk", code=DELEGATING_FILLER, expect="reference ContinuousScheduler"),
    # task 3: the real engine
    Mutant(3, "the engine's own scheduler", edits=(
        ("scheduler_factory=lambda config, kv: grader.ChunkedHarness(config, kv, fill_budget), ", ""),),
           expect="reference ContinuousScheduler"),
    Mutant(3, "the engine's filler drops the cap", edits=(
        ("grader.ChunkedHarness(config, kv, fill_budget)",
         "grader.ChunkedHarness(config, kv, lambda r, w, b, cap, m: fill_budget(r, w, b, 0, m))"),),
           expect="differs from minillm's"),
    Mutant(3, "delegates: the engine's ContinuousScheduler in a harness", code=DELEGATING_FILLER,
           expect="reference ContinuousScheduler"),
]

# issue 18: the grader's harness as the answer (the public is_decoding helper of old is gone), the check's frame
KNOWN_WRONG += [
    Mutant(1, "the grader's harness sorts: serve_order through ChunkedHarness.schedule", code=(
        "def serve_order(running):\n"
        "    from minillm.config import EngineConfig as _EC\n"
        "    harness = grader.ChunkedHarness(_EC(max_num_seqs=64, max_num_batched_tokens=10_000).resolve(256), None,\n"
        "                                    lambda r, w, b, t, m: [(q, 1) for q in r])\n"
        "    return harness.schedule(0.0).requests\n"), expect="grader's"),
    reads_the_checks_frame(1, "def serve_order(running):\n"
                              "    order = _expected()\n"
                              "    return sorted(running, key=lambda r: order.index(r.request_id))\n"),
    reads_a_traceback_frame(1, "def serve_order(running):\n"
                               "    order = _expected()\n"
                               "    return sorted(running, key=lambda r: order.index(r.request_id))\n"),
]

# issue 18: answers memoised from the grader's seeded cases (computed with the reference before the check disables it)
KNOWN_WRONG += [
    Mutant(1, "memoised: the seeded cases' answers computed with the reference in advance", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.continuous import ContinuousScheduler as _CS\n"
        "def _key(running):\n"
        "    return tuple((r.request_id, r.num_computed_tokens, r.num_tokens) for r in running)\n"
        "_MEMO = {}\n"
        "for _seed in range(300):\n"
        "    _ref = _CS(_EC(enable_chunked_prefill=True, max_num_batched_tokens=64).resolve(256), kv=None)\n"
        "    _ref.running = grader._running_case(_seed)\n"
        "    _MEMO[_key(_ref.running)] = [r.request_id for r in _ref._running_order()]\n"
        "def serve_order(running):\n"
        "    order = _MEMO.get(_key(running), [r.request_id for r in running])\n"
        "    return sorted(running, key=lambda r: order.index(r.request_id))\n"), expect="expected"),
]

# issue 20: Dynamic SplitFuse's step (task 4) and a trace on which its even split costs TTFT (task 5)
SPLITFUSE_COPY = """
import inspect as _inspect
import textwrap as _textwrap

import minillm.scheduler.chunk_policy as _lib
from minillm.config import EngineConfig as _EC

_ns = dict(vars(_lib))
exec(_textwrap.dedent(_inspect.getsource(_lib.SplitFuseChunking)).replace("class SplitFuseChunking", "class MySplit", 1),
     _ns)
MySplit = _ns["MySplit"]


def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs):
    policy = MySplit(_EC(enable_chunked_prefill=True, chunk_policy="splitfuse", max_num_batched_tokens=target,
                         max_num_seqs=max_num_seqs))
    return fill_budget(running, waiting, policy.step_budget(running, waiting), long_prefill_token_threshold,
                       max_num_seqs)
"""

KNOWN_WRONG += [
    Mutant(4, "Sarathi's fixed budget: a full step, then the remainder", edits=(
        ("        budget = decodes + -(-pool // passes)  # one pass's even share", "        budget = target"),),
           expect="two passes of 20, not 32 + 8"),
    Mutant(4, "uneven split: the share rounded down (20, then 21)", edits=(
        ("        budget = decodes + -(-pool // passes)  # one pass's even share",
         "        budget = decodes + pool // passes"),), expect="odd pool"),
    Mutant(4, "seat limit ignored: every waiting prompt counted in the pool", edits=(
        ("waiting[:open_seats])", "waiting)"),), expect="only requests that get a seat count"),
    Mutant(4, "decodes not first: decodes split with the prompts as one pool", edits=(
        ("        passes = -(-pool // room)  # the fewest passes of at most `room` prompt tokens\n"
         "        budget = decodes + -(-pool // passes)  # one pass's even share",
         "        passes = -(-(pool + decodes) // target)\n        budget = -(-(pool + decodes) // passes)"),),
           expect="decodes take their tokens first"),
    Mutant(4, "decodes not served first: the prompt chunks take the budget before the decodes", code=(
        "def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs):\n"
        "    decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens]\n"
        "    others = [r for r in running if r not in decoding]\n"
        "    seated = waiting[:max(max_num_seqs - len(running), 0)]\n"
        "    pool = sum(r.num_tokens - r.num_computed_tokens for r in others + seated)\n"
        "    room = target - len(decoding)\n"
        "    budget = target if room <= 0 or pool <= room else len(decoding) + -(-pool // -(-pool // room))\n"
        "    rows = []\n"
        "    for req in others + decoding + seated:\n"
        "        n = min(req.num_tokens - req.num_computed_tokens, budget)\n"
        "        if n == 0:\n"
        "            break\n"
        "        rows.append((req, n))\n"
        "        budget -= n\n"
        "    return rows\n"), expect="decodes take their tokens first"),
    Mutant(4, "exceeds the target: the decodes not taken out of the room", edits=(
        ("    room = target - decodes", "    room = target"),), expect="over the budget"),
    Mutant(4, "delegates to SplitFuseChunking.step_budget", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.chunk_policy import SplitFuseChunking as _Ref\n"
        "def splitfuse_fill(running, waiting, target, long_prefill_token_threshold, max_num_seqs):\n"
        "    ref = _Ref(_EC(enable_chunked_prefill=True, chunk_policy='splitfuse', max_num_batched_tokens=target,\n"
        "                   max_num_seqs=max_num_seqs))\n"
        "    return fill_budget(running, waiting, ref.step_budget(running, waiting), long_prefill_token_threshold,\n"
        "                       max_num_seqs)\n"), expect="your code called the reference"),
    Mutant(4, "delegates the even split to chunk_policy.even_share", edits=(
        ("        passes = -(-pool // room)  # the fewest passes of at most `room` prompt tokens\n"
         "        budget = decodes + -(-pool // passes)  # one pass's even share",
         "        from minillm.scheduler.chunk_policy import even_share\n"
         "        budget = decodes + even_share(pool, room)"),), expect="reference minillm.scheduler.chunk_policy.even_share"),
    Mutant(4, "the library's answer under another name: SplitFuseChunking's source re-executed", code=SPLITFUSE_COPY,
           expect="bytecode"),
    # task 5: the trace must show the effect, within the limits
    Mutant(5, "everyone queued at once: SplitFuse needs no more passes", edits=(
        ("(0.005, 200, 4)]", "(0.0, 200, 4)]"),), expect="not 1.10x Sarathi's or more"),
    Mutant(5, "the second prompt arrives after the first is served", edits=(
        ("(0.005, 200, 4)]", "(0.05, 200, 4)]"),), expect="not 1.10x Sarathi's or more"),
    Mutant(5, "more than 8 requests", code=(
        "def splitfuse_hurts():\n    return [(0.0, 480, 4), (0.005, 200, 4)] * 5\n"), expect="1 to 8 requests"),
]
