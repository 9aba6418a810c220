"""Known-wrong answers to exercise 06 (preemption): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame

KNOWN_WRONG = [
    # task 1: the victim
    Mutant(1, "fcfs preempts the oldest", edits=(("    return running[-1]", "    return running[0]"),)),
    Mutant(1, "priority ties go to the first admitted", edits=(("return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))",
                                                                "return max(running, key=lambda r: (r.priority, r.arrival_time))"),)),
    Mutant(1, "priority preempts the most important", edits=(("return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))",
                                                              "return min(reversed(running), key=lambda r: (r.priority, r.arrival_time))"),)),
    Mutant(1, "delegates to ContinuousScheduler._pick_victim", code=(
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "from minillm.config import EngineConfig as _EC\n"
        "def pick_victim(running, policy):\n"
        "    s = _Ref(_EC(scheduling_policy=policy).resolve(256), kv=None); s.running = running\n"
        "    return s._pick_victim()\n"), expect="reference ContinuousScheduler._pick_victim"),
    # task 2: preempt by recompute
    Mutant(2, "the request's own count not kept", edits=(("        req.num_preemptions += 1\n", ""),), expect="num_preemptions"),
    Mutant(2, "progress kept (num_computed_tokens not reset)", edits=(("        req.num_computed_tokens = 0\n", ""),), expect="not 0"),
    Mutant(2, "not recorded in the plan", edits=(("        plan.preempted.append(req)\n", ""),), expect="not in plan.preempted"),
    Mutant(2, "left in running", edits=(("        self.running.remove(req)\n", ""),)),
    Mutant(2, "delegates: super()._preempt", code=(
        "def _preempt(self, req, plan):\n    super(LearnerScheduler, self)._preempt(req, plan)\n"
        "LearnerScheduler._preempt = _preempt\n"), expect="reference ContinuousScheduler._preempt"),
    # task 3: the engine
    Mutant(3, "the engine's own scheduler", edits=(("scheduler_factory=lambda config, kv: LearnerScheduler(config, kv), ", ""),),
           expect="not your LearnerScheduler"),
    Mutant(3, "preemptions not counted on the scheduler", edits=(("        self.num_preemptions += 1\n", ""),)),
    # task 4: the whole step
    Mutant(4, "admits newcomers in a step that preempted", edits=(("        if not plan.preempted:\n            while self.waiting",
                                                                   "        if True:\n            while self.waiting"),)),
    Mutant(4, "a planned victim stays in the plan", edits=(("budget += planned.pop(victim.request_id, (None, 0))[1]",
                                                            "budget += 0"),)),
    Mutant(4, "admission overtakes", edits=(("                if n > budget or not self.kv.allocate(req, n):\n                    break",
                                             "                if n > budget or not self.kv.allocate(req, n):\n                    break  # noqa\n                pass"),
                                            ("                req = self.waiting.peek()\n",
                                             "                fits = [r for r in self.waiting if r.num_tokens - r.num_computed_tokens <= budget]\n"
                                             "                req = fits[0] if fits else self.waiting.peek()\n"))),
    Mutant(4, "delegates to ContinuousScheduler.schedule", code=(
        "from minillm.scheduler.continuous import ContinuousScheduler as _Ref\n"
        "class StepScheduler(LearnerScheduler):\n"
        "    def schedule(self, now, more_arrivals=True):\n        return _Ref.schedule(self, now, more_arrivals)\n"),
           expect="reference ContinuousScheduler.schedule"),
]

# issue 18: the library's method under another name, the check's frame
KNOWN_WRONG += [
    reads_the_checks_frame(1, "def pick_victim(running, policy):\n"
                              "    return next(r for r in running if r.request_id == _expected())\n"),
    Mutant(2, "the library's answer under another name: ContinuousScheduler._preempt's code object reused", code=(
        "import types as _types\n"
        "import minillm.scheduler.continuous as _lib\n"
        "LearnerScheduler._preempt = _types.FunctionType(_lib.ContinuousScheduler._preempt.__code__, vars(_lib),\n"
        "                                                '_preempt')\n"), expect="bytecode"),
    Mutant(4, "the library's answer under another name: ContinuousScheduler.schedule's source re-executed", code=(
        "import inspect as _inspect\n"
        "import textwrap as _textwrap\n"
        "import minillm.scheduler.continuous as _lib\n"
        "_ns = dict(vars(_lib))\n"
        "exec(_textwrap.dedent(_inspect.getsource(_lib.ContinuousScheduler.schedule)), _ns)\n"
        "StepScheduler.schedule = _ns['schedule']\n"), expect="bytecode"),
]

# issue 18: answers memoised from the grader's seeded cases (computed with the reference in advance)
KNOWN_WRONG += [
    Mutant(1, "memoised: the seeded cases' answers computed with the reference in advance", code=(
        "from minillm.config import EngineConfig as _EC\n"
        "from minillm.scheduler.continuous import ContinuousScheduler as _CS\n"
        "def _key(running, policy):\n"
        "    return policy, tuple((r.request_id, r.priority, r.arrival_time) for r in running)\n"
        "_MEMO = {}\n"
        "for _seed in range(300):\n"
        "    _running, _policy = grader._victim_case(_seed)\n"
        "    _ref = _CS(_EC(scheduling_policy=_policy).resolve(256), kv=None)\n"
        "    _ref.running = list(_running)\n"
        "    _MEMO[_key(_running, _policy)] = _ref._pick_victim().request_id\n"
        "def pick_victim(running, policy):\n"
        "    victim = _MEMO.get(_key(running, policy), running[0].request_id)\n"
        "    return next(r for r in running if r.request_id == victim)\n"), expect="expected"),
]
