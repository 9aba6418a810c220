"""The pieces of minillm.grading, without a notebook: forbid, @task, the tamper snapshot, compose().

The end-to-end proofs (solutions pass, untouched exercises and cheats fail) are in
test_exercises.py; the known-wrong implementations of every task in test_grading_known_wrong.py.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from minillm.grading import (
    DelegationError,
    Fail,
    TaskResult,
    forbid,
    refuse_subclass,
    snapshot,
    tampered,
    task,
)
from minillm.grading.runner import GradingSetupError, compose, parse_graded_call


def reference_add(a, b):
    return a + b


class Reference:
    def method(self, x):
        return x * 2

    @property
    def value(self):
        return 3


class Learner(Reference):
    def method(self, x):
        return super().method(x)


# --- forbid -------------------------------------------------------------------------------------


def test_forbid_disables_functions_methods_and_earlier_references_then_restores() -> None:
    captured = reference_add  # taken before the check: disabled too (the code object is swapped)
    unbound = Reference.method
    with forbid(reference_add, Reference):
        with pytest.raises(DelegationError, match="reference .*reference_add: write it yourself"):
            captured(1, 2)
        with pytest.raises(DelegationError, match="Reference.method"):
            unbound(Reference(), 1)
        with pytest.raises(DelegationError, match="Reference.method"):
            Learner().method(1)  # super() reaches the reference
        with pytest.raises(DelegationError, match="Reference.value"):
            Reference().value  # noqa: B018
    assert captured(1, 2) == 3 and Learner().method(2) == 4 and Reference().value == 3


def test_forbid_takes_owner_name_pairs_and_refuses_other_targets() -> None:
    with forbid((Reference, "method")):
        with pytest.raises(DelegationError):
            Reference().method(1)
        assert Reference().value == 3  # only the named attribute
    with pytest.raises(TypeError, match="forbid\\(\\) takes functions, classes"):
        with forbid(42):
            pass


def test_a_swallowed_delegation_still_fails_the_task() -> None:
    @task(7, "demo")
    def check_task_7(learner_fn):
        with forbid(reference_add):
            got = learner_fn(2, 3)
        if got != 5:
            raise Fail(f"got {got}")
        return "fine"

    def sneaky(a, b):
        try:
            return reference_add(a, b)
        except Exception:  # noqa: BLE001
            return a + b  # the learner caught the error and answered anyway

    result = check_task_7(sneaky)
    assert not result.passed and "your code called the reference" in result.lines[0]
    assert check_task_7(lambda a, b: a + b).passed
    assert repr(check_task_7(lambda a, b: a + b)) == "task 7 (demo): PASS\n  fine"


def test_task_turns_failures_and_learner_errors_into_fail_lines() -> None:
    @task(1, "x")
    def check_task_1(fn):
        return [f"value {fn()}"]

    def todo():
        raise NotImplementedError("TODO: your code here")

    assert check_task_1(lambda: 4) == TaskResult(1, "x", True, ["value 4"])
    assert check_task_1(todo).lines == ["not written yet (NotImplementedError: TODO: your code here)"]
    assert check_task_1(lambda: 1 / 0).lines == ["ZeroDivisionError: division by zero"]
    assert check_task_1.grading_task == (1, "x")


def test_refuse_subclass() -> None:
    with pytest.raises(Fail, match="Learner inherits from the reference Reference"):
        refuse_subclass(Learner, Reference)
    refuse_subclass(Reference, Learner)  # a parent of the learner's class is not a subclass
    with pytest.raises(Fail, match="expected a class"):
        refuse_subclass(42, Reference)


# --- tamper evidence ------------------------------------------------------------------------------


def test_snapshot_sees_patched_functions_methods_and_code() -> None:
    module = types.ModuleType("minillm_fake_for_test")
    exec("def f():\n    return 1\nclass C:\n    def m(self):\n        return 2\n", module.__dict__)  # noqa: S102
    sys.modules[module.__name__] = module
    try:
        before = snapshot(("minillm_fake_for_test",), False)
        assert tampered(before, ("minillm_fake_for_test",), False) == []
        module.C.m = lambda self: 3
        module.f.__code__ = (lambda: 4).__code__
        assert tampered(before, ("minillm_fake_for_test",), False) == ["minillm_fake_for_test.C.m",
                                                                       "minillm_fake_for_test.f"]
    finally:
        del sys.modules[module.__name__]


def test_snapshot_sees_patched_library_functions() -> None:
    import torch

    before = snapshot()
    original = torch.equal
    try:
        torch.equal = lambda *args: True  # a learner making every comparison pass
        assert "torch.equal" in tampered(before)
    finally:
        torch.equal = original
    tolist = torch.Tensor.tolist
    try:
        torch.Tensor.tolist = lambda self: []
        assert "torch.Tensor.tolist" in tampered(before)
    finally:
        torch.Tensor.tolist = tolist
    assert tampered(before) == []


# --- compose: what is run ---------------------------------------------------------------------------


def _cell(cid: str, source: str, kind: str = "code") -> dict:
    cell = {"cell_type": kind, "id": cid, "metadata": {}, "source": source}
    if kind == "code":
        cell.update(outputs=[], execution_count=None)
    return cell


SOLUTION = [
    _cell("md", "# Exercise 99", "markdown"),
    _cell("setup", "from minillm.grading import ex99 as grader\nHELPER = 1"),
    _cell("mine", "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION"),
    _cell("graded", "# NBVAL_CHECK_OUTPUT\ngrader.check_task_1(f)"),
]


def _notebook(path: Path, cells: list[dict]) -> Path:
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}), encoding="utf-8")
    return path


def test_compose_keeps_only_the_learners_cells(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    solution = _notebook(tmp_path / "s" / "ex99_demo.ipynb", SOLUTION)
    learner_cells = [
        SOLUTION[0],
        _cell("setup", "HELPER = 2  # an edited helper cell"),
        _cell("cheat", "grader.check_task_1 = lambda *a: 'PASS'"),  # an added cell
        _cell("mine", "def f():\n    return 2"),
        _cell("graded", "print('task 1 (f): PASS')"),  # cheat (a)
    ]
    learner = _notebook(tmp_path / "ex99_demo.ipynb", learner_cells)
    plan = compose(solution, learner)
    assert plan.grader == "minillm.grading.ex99"
    assert [(c["kind"], c.get("source")) for c in plan.cells] == [
        ("setup", SOLUTION[1]["source"]), ("learner", "def f():\n    return 2"), ("graded", None)]
    assert plan.cells[2]["task"] == 1 and plan.cells[2]["args"] == ["f"]
    notes = " | ".join(plan.notes)
    assert "cell 1 (given code) differs" in notes and "cell 3 (graded) differs" in notes
    assert "1 code cell(s) you added were not run" in notes


def test_compose_turns_a_deleted_learner_cell_into_a_stub(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    solution = _notebook(tmp_path / "s" / "ex99_demo.ipynb", SOLUTION)
    learner = _notebook(tmp_path / "ex99_demo.ipynb", [c for c in SOLUTION if c["id"] != "mine"])
    plan = compose(solution, learner)
    assert "NotImplementedError" in plan.cells[1]["source"]
    assert any("missing from your notebook" in note for note in plan.notes)


@pytest.mark.parametrize("source", ["grader.check_task_1(f)\nprint(1)", "check_task_1(f)", "grader.check_task_1(f, x=1)",
                                    "other.check_task_1(f)", "grader.check(f)"])
def test_graded_cells_must_be_one_plain_call(source: str) -> None:
    with pytest.raises(GradingSetupError, match="a graded cell holds one call"):
        parse_graded_call(source, "ex99 cell 3")


def test_parse_graded_call() -> None:
    assert parse_graded_call("grader.check_task_12(make_llm, Learner)", "x") == (12, ["make_llm", "Learner"])
