"""Grader-private references: what a check compares a learner's answer with, where the library has no
such function (the exercise asks for a variant the course has not shown). Imported only by the
graders in `minillm/grading/exNN.py`, disabled (`forbid`) while learner code runs; not for learners,
and to be left out of the student release (issue 27)."""
