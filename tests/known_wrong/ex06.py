"""Known-wrong answers to exercise 06 (preemption): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame

KNOWN_WRONG = [
    # task 1: the victim
    Mutant(1, "the chapter's rule transcribed: the most recently admitted", edits=((
        "    return min(reversed(running), key=lambda r: r.num_computed_tokens)", "    return running[-1]"),), expect="expected"),
    Mutant(1, "ties go to the first admitted", edits=(("return min(reversed(running), key=lambda r: r.num_computed_tokens)",
                                                       "return min(running, key=lambda r: r.num_computed_tokens)"),)),
    Mutant(1, "the most work lost: the most computed tokens", edits=(("return min(reversed(running), key=lambda r: r.num_computed_tokens)",
                                                                      "return max(reversed(running), key=lambda r: r.num_computed_tokens)"),)),
    Mutant(1, "the chapter's priority rule transcribed: latest arrival, computed tokens ignored", edits=((
        "key=lambda r: (r.priority, -r.num_computed_tokens)", "key=lambda r: (r.priority, r.arrival_time)"),), expect="priority"),
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
    Mutant(2, "the chapter's _preempt transcribed: no aging", edits=((
        "        req.priority -= 1  # aging, before the heap reads the priority\n", ""),), expect="the rules'"),
    Mutant(2, "aged after it is back in the queue (the heap read the old priority)", edits=((
        "        req.priority -= 1  # aging, before the heap reads the priority\n        self.waiting.push(req)",
        "        self.waiting.push(req)\n        req.priority -= 1"),),
        expect="the rules'"),
    Mutant(2, "delegates: super()._preempt", code=(
        "def _preempt(self, req, plan):\n    super(LearnerScheduler, self)._preempt(req, plan)\n"
        "LearnerScheduler._preempt = _preempt\n"), expect="reference ContinuousScheduler._preempt"),
    # task 3: the engine
    Mutant(3, "the engine's own scheduler", edits=(("scheduler_factory=lambda config, kv: LearnerScheduler(config, kv), ", ""),),
           expect="not your LearnerScheduler"),
    Mutant(3, "hard-coded knobs: the check's own", edits=(("LearnerScheduler(config, kv), **knobs)",
                                                            "LearnerScheduler(config, kv), **grader.ENGINE_KNOBS)"),),
           expect="a size drawn now"),
    Mutant(3, "preemptions not counted on the scheduler", edits=(("        self.num_preemptions += 1\n", ""),)),
    Mutant(3, "a knob of its own: a 10 % watermark the check did not ask for", edits=((
        "LearnerScheduler(config, kv), **knobs)", "LearnerScheduler(config, kv), **{\"kv_watermark\": 0.1, **knobs})"),),
        expect="differ"),
    # task 4: the whole step with a bulk retraction
    Mutant(4, "admits newcomers in a step that preempted", edits=(("        if not plan.preempted:\n            while self.waiting",
                                                                   "        if True:\n            while self.waiting"),)),
    Mutant(4, "no lookahead: room for this step's tokens only", edits=((
        "r.num_tokens - r.num_computed_tokens + LOOKAHEAD)", "r.num_tokens - r.num_computed_tokens)"),), expect="the rules'"),
    Mutant(4, "retracts one victim at most (no recount)", edits=(("        while len(self.running) > 1 and blocks_short() > 0:",
                                                                  "        if len(self.running) > 1 and blocks_short() > 0:"),)),
    Mutant(4, "the chapter's lazy loop transcribed: one victim per refused allocation", code=(
        "def _lazy(self, now, more_arrivals=True):\n"
        "    budget = self.config.max_num_batched_tokens\n"
        "    planned = {}\n"
        "    plan = SchedulerPlan([], [])\n"
        "    for req in list(self.running):\n"
        "        if req.status is not RequestStatus.RUNNING:\n            continue\n"
        "        n = req.num_tokens - req.num_computed_tokens\n"
        "        if n > budget:\n            break\n"
        "        while not self.kv.allocate(req, n):\n"
        "            victim = self._pick_victim()\n"
        "            budget += planned.pop(victim.request_id, (None, 0))[1]\n"
        "            self._preempt(victim, plan)\n"
        "            if victim is req:\n                break\n"
        "        if req.status is not RequestStatus.RUNNING:\n            continue\n"
        "        planned[req.request_id] = (req, n)\n"
        "        budget -= n\n"
        "    if not plan.preempted:\n"
        "        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:\n"
        "            req = self.waiting.peek()\n"
        "            n = req.num_tokens - req.num_computed_tokens\n"
        "            if n > budget or not self.kv.allocate(req, n):\n                break\n"
        "            self.waiting.remove(req)\n"
        "            plan.admitted.append((req, req.status))\n"
        "            req.status = RequestStatus.RUNNING\n"
        "            self.running.append(req)\n"
        "            planned[req.request_id] = (req, n)\n"
        "            budget -= n\n"
        "    if not planned:\n        return None\n"
        "    rows = sorted(planned.values(), key=lambda row: not (row[1] == 1 and row[0].num_computed_tokens))\n"
        "    plan.requests = [r for r, _ in rows]\n"
        "    plan.num_new_tokens = [n for _, n in rows]\n"
        "    return plan\n"
        "StepScheduler.schedule = _lazy\n"), expect="the rules'"),
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
        "from minillm.grading.private.ex06_reference import least_work_victim as _ref\n"
        "def _key(running, policy):\n"
        "    return policy, tuple((r.request_id, r.priority, r.num_computed_tokens) for r in running)\n"
        "_MEMO = {}\n"
        "for _seed in range(300):\n"
        "    _running, _policy = grader._victim_case(_seed)\n"
        "    _MEMO[_key(_running, _policy)] = _ref(_running, _policy).request_id\n"
        "def pick_victim(running, policy):\n"
        "    victim = _MEMO.get(_key(running, policy), running[0].request_id)\n"
        "    return next(r for r in running if r.request_id == victim)\n"), expect="expected"),
]
