"""A grader's LEARNER_TOOLS are usable inside the learner's graded code, not only beside it.

ex08 task 5 lends `compare_policies` ("explore with it"); a `splitfuse_hurts()` that searches with it
must pass, while a grader helper that is not lent is still refused. ~2 s (a few simulated traces).
"""

from __future__ import annotations

from minillm.grading import ex08


def test_ex08_task_5_answer_may_search_with_compare_policies() -> None:
    def splitfuse_hurts(target):  # times the second arrival with the lent compare_policies
        first = round(1.875 * target)
        first_pass_s = ex08.compare_policies([(0.0, first, 4)], target)["splitfuse"]["steps"][0][2] / 1e3
        return [(0.0, first, 4), (0.8 * first_pass_s, round(0.78 * target), 4)]

    result = ex08.check_task_5(splitfuse_hurts, lambda: "b")
    assert result.passed, result


def test_ex08_task_5_answer_may_not_call_a_helper_that_is_not_lent() -> None:
    result = ex08.check_task_5(lambda target: ex08._checked_trace([(0.0, 480, 4), (0.005, 200, 4)]), lambda: "b")
    assert not result.passed and "_checked_trace" in "\n".join(result.lines), result
