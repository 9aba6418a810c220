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


# --- the learner's code is the learner's (minillm.grading.provenance) -----------------------------

import inspect  # noqa: E402
import textwrap  # noqa: E402

from minillm import padding  # noqa: E402
from minillm.grading import provenance  # noqa: E402
from minillm.scheduler.continuous import ContinuousScheduler  # noqa: E402


def _learner(source: str, name: str):
    """`name` as a notebook cell defines it (exec'd in a __main__ namespace, as the runner does)."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell 3>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def test_provenance_refuses_the_library_under_another_name() -> None:
    own = _learner("def pad_batch(prompts, pad_id):\n    return [p + [pad_id] for p in prompts]\n", "pad_batch")
    assert provenance.provenance_problem([own]) is None
    reused = types.FunctionType(padding.pad_batch.__code__, {"__name__": "__main__"}, "mine")
    assert "is minillm's pad_batch (minillm/padding.py): the same bytecode" in provenance.provenance_problem([reused])
    renamed = textwrap.dedent(inspect.getsource(padding.pad_batch)).replace("prompts", "ps").replace("width", "w")
    copy = _learner("import torch\n" + renamed, "pad_batch")
    assert "the same bytecode" in provenance.provenance_problem([copy])  # names are not what is compared
    helper = _learner("def helper():\n    return 1\n", "helper")
    helper.__code__ = padding.static_batch_steps.__code__
    wrapper = _learner("def mine(a, b):\n    return helper(a, b)\n", "mine")
    wrapper.__globals__["helper"] = helper  # reachable through the globals the learner's code names
    assert "static_batch_steps" in provenance.provenance_problem([wrapper])
    assert "handed in minillm's own" in provenance.provenance_problem([padding.pad_batch])
    copied = type("Mine", (), {"schedule": ContinuousScheduler.schedule, "__module__": "__main__"})
    assert "Mine.schedule is minillm's" in provenance.provenance_problem([copied])


def test_small_functions_are_not_compared() -> None:
    tiny = _learner("def num_waiting(self):\n    return len(self.waiting)\n", "num_waiting")
    assert len(provenance.tokens(tiny.__code__)) < provenance.MIN_INSTRUCTIONS
    assert provenance.provenance_problem([tiny]) is None


def test_grader_helpers_raise_for_learner_code_only() -> None:
    import minillm.grading.ex03 as ex03

    calls = _learner("def ask(*args):\n    return grader._reference_should_fire(*args)\n", "ask")
    calls.__globals__["grader"] = ex03

    # a check as a grading module holds it (the guard tells the grader's frames by their file)
    namespace = {"ex03": ex03, "task": task}
    exec(compile("@task(9, 'demo')\ndef check_task_9(fn):\n"
                 "    ex03._reference_should_fire(1.0, [0.0], 2, 0.5)  # the grader's own call passes\n"
                 "    return str(fn(1.0, [0.0], 2, 0.5))\n", provenance.GRADING_DIR + "ex99_demo.py", "exec"),
         namespace)  # noqa: S102
    check_task_9 = namespace["check_task_9"]
    result = check_task_9(calls)
    assert not result.passed and "grader's minillm.grading.ex03._reference_should_fire" in result.lines[0], result
    assert ex03._reference_should_fire(1.0, [0.0], 2, 0.5) is True  # restored after the check
    assert check_task_9(lambda *args: "mine").passed


def test_looking_into_the_checks_frames_fails() -> None:
    spy = _learner("import sys\ndef spy():\n    return sys._getframe(1).f_locals.get('secret')\n", "spy")
    via_traceback = _learner("def spy():\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                             "        return e.__traceback__.tb_frame.f_back.f_locals.get('secret')\n", "spy")

    @task(9, "demo")
    def check_task_9(fn):
        secret = 42  # noqa: F841  (what a learner would read)
        return str(fn())

    for cheat in (spy, via_traceback):
        result = check_task_9(cheat)
        assert not result.passed and "looked into the running program" in result.lines[0], result
    assert check_task_9(lambda: 1).passed


def test_reexecuting_minillm_source_during_a_check_fails() -> None:
    late = _learner("import inspect, textwrap\nfrom minillm import padding\n"
                    "def late(prompts, pad_id):\n"
                    "    ns = dict(vars(padding))\n"
                    "    exec(textwrap.dedent(inspect.getsource(padding.pad_batch)), ns)\n"
                    "    return ns['pad_batch'](prompts, pad_id)\n", "late")

    @task(9, "demo")
    def check_task_9(fn):
        return str(fn([[1, 2], [3]], 0)[0].tolist())

    result = check_task_9(late)
    assert not result.passed and "minillm's" in result.lines[0], result


# --- a stub met by a check, grader-private references (minillm/grading/private/) --------------------


def test_a_stub_the_check_caught_still_says_not_written_yet() -> None:
    @task(4, "step")
    def check_task_4(fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001  (a check reporting the learner's exception its own way)
            raise Fail(f"scenario 0: {type(error).__name__}: {error}") from None
        return "fine"

    def stub():
        raise NotImplementedError("TODO: task 4: the whole step")

    assert check_task_4(stub).lines == ["not written yet (NotImplementedError: TODO: task 4: the whole step)"]
    assert check_task_4(lambda: 1 / 0).lines == ["scenario 0: ZeroDivisionError: division by zero"]


def test_a_private_reference_missing_from_a_release_is_not_graded_here_and_never_a_pass() -> None:
    from minillm.grading import ReferenceWithheld, private_reference

    withheld = private_reference("no_such_reference_in_this_copy")  # as in a student release
    with pytest.raises(ReferenceWithheld, match="not in a student release"):
        withheld.Reference  # noqa: B018

    @task(3, "step")
    def check_task_3(fn):
        expected = withheld.reference_step(5)  # the check needs the teacher's reference
        return f"{fn(5) == expected}"

    result = check_task_3(lambda n: n)
    assert not result.passed and result.withheld and result.headline == "task 3 (step): NOT GRADED HERE", result
    assert result.to_json()["withheld"] is True


def test_a_private_module_that_imports_something_missing_is_an_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import minillm.grading.private as private_package
    from minillm.grading import private_reference

    monkeypatch.setattr(private_package, "__path__", [*private_package.__path__, str(tmp_path)])
    (tmp_path / "_broken_for_test.py").write_text("import a_module_nobody_installed_for_test\n", encoding="utf-8")
    try:
        with pytest.raises(ModuleNotFoundError, match="a_module_nobody_installed_for_test"):
            private_reference("_broken_for_test")  # the module is there: not a release, a real error
    finally:
        sys.modules.pop("minillm.grading.private._broken_for_test", None)


def test_private_modules_are_guarded_like_graders_while_a_check_runs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import minillm.grading.private as private_package
    from minillm.grading import private_reference, provenance

    name = "_reference_for_test"
    monkeypatch.setattr(private_package, "__path__", [*private_package.__path__, str(tmp_path)])
    (tmp_path / f"{name}.py").write_text("def reference_step(n):\n    return n + 1\n", encoding="utf-8")
    try:
        reference = private_reference(name)
        assert reference.reference_step(1) == 2
        assert reference in provenance.grading_modules()
        calls = _learner_fn("def mine(n):\n    return ref.reference_step(n)\n", "mine", ref=reference)

        namespace = {"reference": reference, "task": task}
        exec(compile("@task(9, 'demo')\ndef check_task_9(fn):\n"
                     "    assert reference.reference_step(1) == 2  # the grader's own call passes\n"
                     "    return str(fn(1))\n", provenance.GRADING_DIR + "ex99_demo.py", "exec"), namespace)  # noqa: S102
        result = namespace["check_task_9"](calls)
        assert not result.passed and "_reference_for_test.reference_step" in result.lines[0], result
        assert namespace["check_task_9"](lambda n: str(n + 1)).passed
    finally:
        sys.modules.pop(f"minillm.grading.private.{name}", None)


def _learner_fn(source: str, name: str, **names):
    namespace = {"__name__": "__main__", **names}
    exec(compile(source, "<cell 3>", "exec"), namespace)  # noqa: S102
    return namespace[name]
