"""Known-wrong answers to exercise 03 (dynamic batcher): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame

RULE = "return len(waiting) >= max_batch_size or any(now >= arrival + wait for arrival, wait in waiting)"

KNOWN_WRONG = [
    # task 1: the firing rule
    Mutant(1, "> for >= in the deadline rule", edits=((RULE, RULE.replace("now >= arrival", "now > arrival")),),
           expect="you said False, expected True"),
    Mutant(1, "a difference of floats (now - arrival >= wait)", edits=((RULE, RULE.replace(
        "now >= arrival + wait", "now - arrival >= wait")),)),
    Mutant(1, "> for >= in the size rule", edits=((RULE, RULE.replace(">= max_batch_size", "> max_batch_size")),)),
    Mutant(1, "fires on an empty queue", edits=(("    if not waiting:\n        return False\n", "    if not waiting:\n        return True\n"),)),
    Mutant(1, "the chapter's rule transcribed: only the oldest request's deadline", edits=((RULE,
        "return len(waiting) >= max_batch_size or now >= waiting[0][0] + waiting[0][1]"),), expect="you said False, expected True"),
    Mutant(1, "every request waits as long as the most patient one", edits=((RULE,
        "return len(waiting) >= max_batch_size or now >= waiting[0][0] + max(w for _, w in waiting)"),)),
    Mutant(1, "delegates to DynamicScheduler.should_fire", code=(
        "from minillm.scheduler.dynamic import DynamicScheduler as _Ref\n"
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.request import Request as _Req\n"
        "from minillm import SamplingParams as _SP\n"
        "def should_fire(now, waiting, size):\n"
        "    delay = min((w for _, w in waiting), default=0.0)\n"
        "    s = _Ref(_EC(batching='dynamic', max_num_seqs=size, max_queue_delay_ms=delay * 1000), kv=None)\n"
        "    for i, (t, _) in enumerate(waiting):\n        s.add_request(_Req(str(i), [5], _SP(temperature=0.0), t))\n"
        "    return s.should_fire(now, True)\n"), expect="reference DynamicScheduler.should_fire"),
    # task 2: who shares a batch
    Mutant(2, "a batch ends after the sum of durations, not the longest", edits=(("now += max(durations[i] for i in batch)",
                                                                                  "now += sum(durations[i] for i in batch)"),)),
    Mutant(2, "late arrivals join the running batch", edits=(("            batch, waiting = waiting[:max_batch_size], waiting[max_batch_size:]",
                                                              "            while next_arrival < len(arrival_times) and arrival_times[next_arrival] <= now + max(durations[i] for i in waiting[:max_batch_size]) and len(waiting) < max_batch_size:\n"
                                                              "                waiting.append(next_arrival)\n                next_arrival += 1\n"
                                                              "            batch, waiting = waiting[:max_batch_size], waiting[max_batch_size:]"),)),
    Mutant(2, "the newest requests form the batch", edits=(("            batch, waiting = waiting[:max_batch_size], waiting[max_batch_size:]",
                                                            "            batch, waiting = waiting[-max_batch_size:], waiting[:-max_batch_size]"),)),
    Mutant(2, "delegates to the engine", code=(
        "def dynamic_batches(arrival_times, durations, max_batch_size, max_queue_delay):\n"
        "    return grader._engine_batches(arrival_times, durations, max_batch_size, max_queue_delay)\n"),
           expect="reference"),
    # task 3: the rule and its timer in the scheduler
    Mutant(3, "no timer: the stock next_wakeup sleeps past an interactive deadline", edits=((
        "        if self.rows or not self.waiting:\n            return None\n"
        "        return min(r.arrival_time + longest_wait_s(r, self.timeout_s) for r in self.waiting)",
        "        return super().next_wakeup(now)"),), expect="differ from the deadline rule's"),
    Mutant(3, "the timer wakes at the oldest request's deadline", edits=((
        "        return min(r.arrival_time + longest_wait_s(r, self.timeout_s) for r in self.waiting)",
        "        return self.waiting[0].arrival_time + longest_wait_s(self.waiting[0], self.timeout_s)"),),
        expect="differ from the deadline rule's"),
    Mutant(3, "delay in milliseconds where seconds are meant", edits=(("pairs = [(r.arrival_time, longest_wait_s(r, self.timeout_s)) for r in self.waiting]",
                                                                       "pairs = [(r.arrival_time, longest_wait_s(r, self.config.max_queue_delay_ms)) for r in self.waiting]"),)),
    Mutant(3, "one delay for everyone (the priority ignored)", edits=(("pairs = [(r.arrival_time, longest_wait_s(r, self.timeout_s)) for r in self.waiting]",
                                                                       "pairs = [(r.arrival_time, self.timeout_s) for r in self.waiting]"),)),
    Mutant(3, "delegates: super().should_fire", edits=(("        return should_fire(now, pairs, self.config.max_num_seqs)",
                                                        "        return super().should_fire(now, more_arrivals)"),), expect="reference DynamicScheduler.should_fire"),
    # task 4: knobs for the SLO, by search
    Mutant(4, "hard-coded knobs that fit the seeded trace", code=(
        "def choose_knobs(simulate, ttft_slo_ms, tpot_slo_ms):\n"
        "    return {'max_num_seqs': 32, 'max_queue_delay_ms': 0}\n"), expect="a trace drawn now"),
    Mutant(4, "the TTFT promise ignored: the first size that keeps the TPOT promise", edits=((
        'if result["p99_tpot_ms"] <= tpot_slo_ms and (best is None or result["p99_ttft_ms"] < best[0]):',
        'if result["p99_tpot_ms"] <= tpot_slo_ms and best is None:'),), expect="the SLO is missed"),
    Mutant(4, "knobs in the wrong units (seconds)", edits=(('"max_queue_delay_ms": 0}', '"max_queue_delay_s": 0}'),),
           expect="exactly the keys"),
]

# issue 18: the grader's private reference, the library's method copied, the check's frame
KNOWN_WRONG += [
    Mutant(1, "the grader's helper answers: calls grader._reference_should_fire", code=(
        "def should_fire(now, waiting, max_batch_size):\n"
        "    return grader._reference_should_fire(now, waiting, max_batch_size)\n"),
        expect="grader's minillm.grading.ex03._reference_should_fire"),
    Mutant(1, "the grader's private rule answers: calls its fires()", code=(
        "from minillm.grading.private.ex03_reference import fires as _fires\n"
        "def should_fire(now, waiting, max_batch_size):\n"
        "    return _fires(now, waiting, max_batch_size)\n"), expect="grader's"),
    Mutant(1, "the grader's helper handed in: should_fire = grader._reference_should_fire",
           code="should_fire = grader._reference_should_fire\n", expect="handed in"),
    reads_the_checks_frame(1, "def should_fire(now, waiting, max_batch_size):\n"
                              "    return _expected()\n", var="want"),
    Mutant(3, "the library's answer under another name: DynamicScheduler.should_fire copied into the class", code=(
        "from minillm.scheduler.base import SchedulerBase as _Base\n"
        "_wake = MyDynamicScheduler.next_wakeup\n"
        "class MyDynamicScheduler(DynamicScheduler):\n"
        "    should_fire = DynamicScheduler.should_fire\n"
        "    next_wakeup = _wake\n"), expect="is minillm's"),
    Mutant(3, "the grader's scheduler handed in: inherits the private DeadlineScheduler", code=(
        "from minillm.grading.private.ex03_reference import DeadlineScheduler as _Ref\n"
        "class MyDynamicScheduler(_Ref):\n"
        "    should_fire = _Ref.should_fire\n"
        "    next_wakeup = _Ref.next_wakeup\n"), expect="minillm"),
]

# A memo of task 1's seeded cases (the reference asked in advance, at cell time) that answers the cases drawn at
# grade time with bool(waiting): it passed 43 % of grades while those were drawn as the seeded ones, mostly
# True; every grade now draws cases where someone waits too early to fire (minillm/grading/ex03.py).
KNOWN_WRONG += [
    Mutant(1, "memoised: the seeded cases' answers computed with the reference in advance, bool(waiting) for "
              "the others", code=(
        "import numpy as _np\n"
        "_rng = _np.random.default_rng(7)\n"
        "_SEEDED = list(grader.WRITTEN_FIRING_CASES) + [grader._firing_case(_rng)\n"
        "                                               for _ in range(grader.SEEDED_FIRING_CASES)]\n"
        "_MEMO = {(_now, tuple(_waiting), _size): grader._reference_should_fire(_now, _waiting, _size)\n"
        "         for _now, _waiting, _size in _SEEDED}\n"
        "def should_fire(now, waiting, max_batch_size):\n"
        "    return _MEMO.get((now, tuple(waiting), max_batch_size), bool(waiting))\n"),
        expect="you said True, expected False"),
]
