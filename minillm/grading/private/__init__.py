"""Grader-private references (issue 27): the answers a check compares with, kept out of the grading modules.

A grading module (`minillm.grading.exNN`) ships to learners and is importable from their notebook, so
it must not hold an answer to read or call. Where a check needs a reference that the library does not
provide (a variant of what the chapter showed), it lives here, one module per exercise
(`exNN_reference.py`), imported only by that exercise's grader, and disabled (`forbid`) while learner
code runs. A student release should leave this folder out (see docs/grading.md); graders then need
the teacher's copy to run the checks that use it.
"""
