"""Known-wrong answers to exercise 03 (dynamic batcher): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame

RULE = "return len(waiting_arrival_times) >= max_batch_size or now >= waiting_arrival_times[0] + max_queue_delay_s"

KNOWN_WRONG = [
    # task 1: the firing rule
    Mutant(1, "> for >= in the delay rule", edits=((RULE, RULE.replace("now >= waiting", "now > waiting")),),
           expect="you said False, expected True"),
    Mutant(1, "a difference of floats (now - oldest >= delay)", edits=((RULE, RULE.replace(
        "now >= waiting_arrival_times[0] + max_queue_delay_s", "now - waiting_arrival_times[0] >= max_queue_delay_s")),)),
    Mutant(1, "> for >= in the size rule", edits=((RULE, RULE.replace(">= max_batch_size", "> max_batch_size")),)),
    Mutant(1, "fires on an empty queue", edits=(("    if not waiting_arrival_times:\n        return False\n", "    if not waiting_arrival_times:\n        return True\n"),)),
    Mutant(1, "delegates to DynamicScheduler.should_fire", code=(
        "from minillm.scheduler.dynamic import DynamicScheduler as _Ref\n"
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.request import Request as _Req\n"
        "from minillm import SamplingParams as _SP\n"
        "def should_fire(now, arrivals, size, delay):\n"
        "    s = _Ref(_EC(batching='dynamic', max_num_seqs=size, max_queue_delay_ms=delay * 1000), kv=None)\n"
        "    for i, t in enumerate(arrivals):\n        s.add_request(_Req(str(i), [5], _SP(temperature=0.0), t))\n"
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
    # task 3: the rule in the scheduler
    Mutant(3, "delay in milliseconds where seconds are meant", edits=(("self.config.max_num_seqs, self.timeout_s)",
                                                                       "self.config.max_num_seqs, self.config.max_queue_delay_ms)"),)),
    Mutant(3, "the newest request's wait", edits=(("[r.arrival_time for r in self.waiting]", "[r.arrival_time for r in self.waiting][::-1]"),)),
    Mutant(3, "delegates: super().should_fire", edits=(("        return should_fire(now, [r.arrival_time for r in self.waiting], self.config.max_num_seqs, self.timeout_s)",
                                                        "        return super().should_fire(now, more_arrivals)"),), expect="reference DynamicScheduler.should_fire"),
    # task 4: knobs for the SLO
    Mutant(4, "batches too small: the TTFT promise is missed", edits=(('"max_num_seqs": 32', '"max_num_seqs": 16'),), expect="the SLO is missed"),
    Mutant(4, "batches too large: the TPOT promise is missed", edits=(('"max_num_seqs": 32', '"max_num_seqs": 128'),), expect="the SLO is missed"),
    Mutant(4, "knobs in the wrong units (seconds)", edits=(('"max_queue_delay_ms": 0', '"max_queue_delay_s": 0'),), expect="exactly the keys"),
]

# issue 18: the grader's private reference, the library's method copied, the check's frame
KNOWN_WRONG += [
    Mutant(1, "the grader's helper answers: calls grader._reference_should_fire", code=(
        "def should_fire(now, waiting_arrival_times, max_batch_size, max_queue_delay_s):\n"
        "    return grader._reference_should_fire(now, waiting_arrival_times, max_batch_size, max_queue_delay_s)\n"),
        expect="grader's minillm.grading.ex03._reference_should_fire"),
    Mutant(1, "the grader's helper handed in: should_fire = grader._reference_should_fire",
           code="should_fire = grader._reference_should_fire\n", expect="handed in"),
    reads_the_checks_frame(1, "def should_fire(now, waiting_arrival_times, max_batch_size, max_queue_delay_s):\n"
                              "    return _expected()\n", var="want"),
    Mutant(3, "the library's answer under another name: DynamicScheduler.should_fire copied into the class", code=(
        "from minillm.scheduler.base import SchedulerBase as _Base\n"
        "class MyDynamicScheduler(DynamicScheduler):\n"
        "    should_fire = DynamicScheduler.should_fire\n"), expect="is minillm's"),
]
