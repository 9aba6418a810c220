"""Known-wrong answers to exercise 04 (continuous scheduler): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame, source_reexecuted

KNOWN_WRONG = [
    # task 1: retire
    Mutant(1, "keeps finished requests' slabs", edits=(("            kv.free(req)\n            after.append(None)", "            after.append(None)"),),
           expect="KV slabs held"),
    Mutant(1, "keeps the finished requests in their seats", edits=(("            after.append(None)\n", "            after.append(req)\n"),),
           expect="expected"),
    Mutant(1, "the chapter's finish transcribed: the finished leave the list, everyone behind moves up", edits=((
        "            after.append(None)\n", ""),), expect="in its own seat"),
    Mutant(1, "delegates to ContinuousScheduler.finish", code=(
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "from minillm.config import EngineConfig as _EC\n"
        "def retire(running, kv):\n"
        "    s = _Ref(_EC(kv_layout='slab').resolve(256), kv); s.running = list(running)\n"
        "    for r in list(running):\n"
        "        if r.status.finished: s.finish(r)\n"
        "    return s.running\n"), expect="reference ContinuousScheduler"),
    # task 2: admit
    Mutant(2, "admission overtakes", code=(
        "def _admit(self, budget):\n"
        "    admitted = []\n"
        "    for req in list(self.waiting):\n"
        "        if None not in self.seats:\n"
        "            break\n"
        "        n = req.num_tokens - req.num_computed_tokens\n"
        "        if n > budget or not self.kv.allocate(req, n):\n"
        "            continue  # a shorter one behind it may fit\n"
        "        self.waiting.remove(req)\n"
        "        req.status = RequestStatus.RUNNING\n"
        "        self.seats[self.seats.index(None)] = req\n"
        "        admitted.append((req, n))\n"
        "        budget -= n\n"
        "    return admitted\n"
        "LearnerScheduler.admit = _admit\n"), expect="your admit planned"),
    Mutant(2, "ignores the seat limit", edits=(("while self.waiting and None in self.seats:", "while self.waiting:"),),
           expect="max_num_seqs caps the batch"),
    Mutant(2, "a newcomer takes the highest free seat", edits=(("            self.seats[self.seats.index(None)] = req\n",
                                                                  "            self.seats[len(self.seats) - 1 - self.seats[::-1].index(None)] = req\n"),),
           expect="your admit planned"),
    Mutant(2, "budget never shrinks", edits=(("            admitted.append((req, n))\n            budget -= n",
                                              "            admitted.append((req, n))"),), expect="the token budget caps a step"),
    Mutant(2, "delegates: inherits ContinuousScheduler", code=(
        "from minillm.scheduler.continuous import ContinuousScheduler\n"
        "class LearnerScheduler(ContinuousScheduler):\n    pass\n"), expect="inherits from the reference ContinuousScheduler"),
    # task 3: the whole step
    Mutant(3, "a one-token prompt counted as a decode row", edits=(("key=lambda j: not (counts[j] == 1 and scheduled[j].num_computed_tokens)",
                                                                     "key=lambda j: not counts[j] == 1"),)),
    Mutant(3, "newcomers missing from admitted=", edits=(("admitted=[(req, RequestStatus.WAITING) for req, _ in admitted])",
                                                          "admitted=[])"),)),
    Mutant(3, "an empty batch instead of None", edits=(("        if not scheduled:\n            return None\n", ""),)),
    Mutant(3, "running requests do not draw on the budget", edits=(("            counts.append(n)\n            budget -= n\n        # 2.",
                                                                     "            counts.append(n)\n        # 2."),)),
    Mutant(3, "delegates to ContinuousScheduler.schedule", code=(
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "def _schedule(self, now, more_arrivals=True):\n    return _Ref.schedule(self, now, more_arrivals)\n"
        "LearnerScheduler.schedule = _schedule\n"), expect="reference ContinuousScheduler"),
    # task 4: the real engine
    Mutant(4, "the engine's own scheduler", edits=(("scheduler_factory=lambda config, kv: LearnerScheduler(config, kv), ", ""),),
           expect="reference ContinuousScheduler"),
    Mutant(4, "drops the knobs", edits=(("LearnerScheduler(config, kv), **knobs)", "LearnerScheduler(config, kv))"),),
           expect="a size drawn now"),
    Mutant(4, "hard-coded knobs: the check's own", edits=(("LearnerScheduler(config, kv), **knobs)",
                                                            "LearnerScheduler(config, kv), **grader.ENGINE_KNOBS)"),),
           expect="a size drawn now"),
]

# issue 18: the grader's harness as the answer, the library's class re-executed or copied, the check's frame
KNOWN_WRONG += [
    reads_the_checks_frame(1, "def retire(running, kv):\n"
                              "    keep = _expected()\n"
                              "    for req in running:\n"
                              "        if req.request_id not in keep:\n"
                              "            kv.free(req)\n"
                              "    return [r for r in running if r.request_id in keep]\n"),
    source_reexecuted(2, "LearnerScheduler", "minillm.scheduler.continuous", "ContinuousScheduler", keyword="class"),
    Mutant(3, "the grader's harness is the step: inherits the private AdmitHarness", code=(
        "from minillm.grading.private.ex04_reference import AdmitHarness as _Harness\n"
        "_admit = LearnerScheduler.admit\n"
        "class LearnerScheduler(_Harness):\n"
        "    admit = _admit\n"), expect="grader"),
    Mutant(3, "the chapter's schedule transcribed: running requests in admission order, not seat order", edits=((
        "        for req in self.seats:\n            if req is None:\n                continue\n            n = req.num_tokens",
        "        for req in sorted((r for r in self.seats if r is not None), key=lambda r: r.arrival_time):\n"
        "            n = req.num_tokens"),), expect="the seat rules plan"),
    Mutant(3, "the library's answer under another name: ContinuousScheduler's methods copied", code=(
        "from minillm.scheduler.base import SchedulerBase as _Base\n"
        "from minillm.scheduler.continuous import ContinuousScheduler as _CS\n"
        "LearnerScheduler = type('LearnerScheduler', (_Base,), {k: v for k, v in vars(_CS).items()\n"
        "                         if k not in ('__dict__', '__weakref__')})\n"), expect="is minillm's"),
    source_reexecuted(3, "LearnerScheduler", "minillm.scheduler.continuous", "ContinuousScheduler", keyword="class"),
]
