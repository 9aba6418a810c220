"""Known-wrong answers of one kind across exercises: copies of minillm that are not exact (issue 27).

Each is a near copy that minillm.grading.provenance's earlier rule (bytecode alike to 97 %, single
functions of 60 instructions or more, small functions never) let through, and that its rules now
FAIL, each for the stated reason:

- a hand-retyped copy of a long method, a few percent of it changed (a comparison turned round, an
  augmented assignment spelled out, a local that does nothing): the share rule for one function;
- a copy (one comparison turned round) padded with statements that do nothing, so that the share
  of the longer one drops under the rule: the library function is still found in it (the
  containment rule);
- a class assembled from the library's short methods, each changed a little so that no single
  method is a copy: the class compared as a whole (the unit rule, small methods included);
- the same class as a base rebuilt from the library's source, the learner's class empty: the base
  class is followed and compared as a whole.

`tests/test_grading_known_wrong.py` runs them with the exercises' own mutants (`COPIES`: (exercise
number, Mutant) pairs).
"""

from __future__ import annotations

from known_wrong import Mutant

# A retyped copy of ContinuousScheduler.schedule: the same code with small edits a learner might make.
_RETYPE_SCHEDULE = (
    "import inspect as _inspect\nimport textwrap as _textwrap\n"
    "import minillm.scheduler.continuous as _lib\n"
    "_src = _textwrap.dedent(_inspect.getsource(_lib.ContinuousScheduler.schedule))\n"
    "for _old, _new in [('        if n > budget:\\n', '        if budget < n:\\n'),\n"
    "                   ('        budget -= n + len(spec)\\n', '        budget = budget - (n + len(spec))\\n'),\n"
    "                   ('    if not planned:\\n', '    if len(planned) == 0:\\n'),\n"
    "                   ('spec = req.spec_token_ids if n == 1 else []', 'spec = [] if n != 1 else req.spec_token_ids'),\n"
    "                   ('if len(self.running) >= self.config.max_num_seqs or budget == 0:',\n"
    "                    'if budget == 0 or len(self.running) >= self.config.max_num_seqs:'),\n"
    "                   ('    plan = SchedulerPlan([], [])\\n', '    plan = SchedulerPlan([], [])\\n    steps = 0\\n')]:\n"
    "    assert _src.count(_old) == 1, _old  # the library changed: update the edit\n"
    "    _src = _src.replace(_old, _new)\n"
    "{pad}"
    "_ns = dict(vars(_lib))\nexec(_src, _ns)\n"
    "StepScheduler.schedule = _ns['schedule']\n")
_COPY_SCHEDULE = (  # the same copy with one edit only, then padded
    _RETYPE_SCHEDULE[:_RETYPE_SCHEDULE.index("for _old, _new in [")]
    + "for _old, _new in [('        if n > budget:\\n', '        if budget < n:\\n')]:\n"
    + _RETYPE_SCHEDULE[_RETYPE_SCHEDULE.index("    assert _src.count(_old) == 1"):])
_PAD_BODY = ("_head = '    plan = SchedulerPlan([], [])\\n'\n"
             "_src = _src.replace(_head, _head + ''.join(f'    unused_{i} = {i}\\n' for i in range(30)))\n")

# BlockAllocator rebuilt from its source under another name, every method a little changed (locals
# that do nothing): no single method is a copy any more; the class as a whole is.
_REBUILD_ALLOCATOR = (
    "import inspect as _inspect\nimport re as _re\n"
    "import minillm.kv.block_allocator as _lib\n"
    "_src = _inspect.getsource(_lib.BlockAllocator).replace('class BlockAllocator:', 'class {name}:', 1)\n"
    "_src = _re.sub(r'(\\n    def [^\\n]*:\\n)', lambda m: m.group(1) + '        spare_a = 0\\n        spare_b = 1\\n', _src)\n"
    "_src = _src.replace('        spare_b = 1\\n        \"\"\"One reader fewer', '        spare_b = 1\\n        spare_c = 2\\n        \"\"\"One reader fewer', 1)\n"
    "assert _src.count('spare_a') == 7 and _src.count('spare_c') == 1  # the library changed: update the edit\n"
    "_ns = dict(vars(_lib))\nexec(_src, _ns)\n"
    "{bind}\n")

COPIES = [
    ("06", Mutant(4, "the library's answer under another name: ContinuousScheduler.schedule retyped, a few "
                     "percent changed", code=_RETYPE_SCHEDULE.replace("{pad}", ""), expect="in common, in order")),
    ("06", Mutant(4, "the library's answer under another name: ContinuousScheduler.schedule copied and padded "
                     "with statements that do nothing", code=_COPY_SCHEDULE.replace("{pad}", _PAD_BODY),
                  expect="found in yours")),
    ("05", Mutant(1, "the library's answer under another name: BlockAllocator assembled from its methods, each a "
                     "little changed", code=_REBUILD_ALLOCATOR.replace("{name}", "LearnerAllocator")
                  .replace("{bind}", "LearnerAllocator = _ns['LearnerAllocator']"),
                  expect="summed over its")),
    ("05", Mutant(1, "the library's answer under another name: an empty class on a base rebuilt from "
                     "BlockAllocator's source", code=_REBUILD_ALLOCATOR.replace("{name}", "_Pool")
                  .replace("{bind}", "class LearnerAllocator(_ns['_Pool']):\n    pass"),
                  expect="your class _Pool is minillm's BlockAllocator")),
]
