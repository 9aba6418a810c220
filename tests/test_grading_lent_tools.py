"""A grader's LEARNER_TOOLS are usable inside the learner's graded code, not only beside it.

ex08 task 5 lends `compare_policies` ("explore with it"); a `splitfuse_hurts()` that searches with it
must pass, while a grader helper that is not lent is still refused. ~2 s (a few simulated traces).
"""

from __future__ import annotations

from minillm.grading import ex08


def test_ex08_task_5_answer_may_search_with_compare_policies() -> None:
    def splitfuse_hurts():
        candidates = [[(0.0, 480, 4), (gap, 200, 4)] for gap in (0.001, 0.005)]
        return max(candidates, key=lambda t: (lambda r: r["splitfuse"]["p99_ttft_ms"] / r["sarathi"]["p99_ttft_ms"])(
            ex08.compare_policies(t)))

    result = ex08.check_task_5(splitfuse_hurts)
    assert result.passed, result


def test_ex08_task_5_answer_may_not_call_a_helper_that_is_not_lent() -> None:
    result = ex08.check_task_5(lambda: ex08._checked_trace([(0.0, 480, 4), (0.005, 200, 4)]))
    assert not result.passed and "_checked_trace" in "\n".join(result.lines), result
