"""Grader-private code and data: the teacher's, never a learner's (see docs/grading.md).

What lives here is left out of a student release (`tools/student_release.py` drops
`minillm/grading/private/` and refuses a release that holds any of it):

- `expected/exNN_topic.json`, written by `tools/build_exercises.py`: what each graded cell prints when
  every task passes (the solution's PASS reports, which may name an answer), for nbval;
- reference modules a check needs that are not the library's (a variant the exercise asks for that
  minillm does not ship, a harness whose step is another task's answer). A grading module loads one
  with `minillm.grading.private_reference("exNN_name")` at import time, which is before any learner
  code runs in `make grade`; it uses the module's attributes only inside its checks. While a check
  runs, learner code that calls one of its functions FAILs the task (as a grader helper does), a
  class inheriting one of its classes FAILs, and the copy detector compares learner code with it.

In a student release the module is absent: `private_reference` returns a stand-in whose attributes
raise `ReferenceWithheld`; a task with an answer key (minillm/grading/answer_key.py) grades there with
the key's digests, one without reports "not graded here: your teacher grades it" instead of a
verdict (still not a PASS). Keep in a private module only what a learner must not
read; what can be built from the library (forbidden while learner code runs) belongs in the grader.
"""
