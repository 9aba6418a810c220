"""The graders of the exercises (`exercises/exNN_*.ipynb`): checks that live outside the notebooks.

A learner's notebook only holds the learner's code. Every check lives here, in
`minillm/grading/exNN.py`, and `make grade` (`tools/grade.py`, which runs `minillm.grading.runner`)
grades what the learner wrote, not what the notebook says about itself:

- it keeps ONLY the learner's cells (the cells that hold a `raise NotImplementedError` stub in the
  generated exercise, matched by cell id) and takes every other cell from the exercise's manifest
  (`minillm/grading/cells/`); cells the learner added are dropped, edited helper or graded cells are
  replaced by the course's;
- it runs them in a fresh process with plain `exec`, and where a graded cell stands it calls the
  check function it captured *before* any learner code ran, so a redefined, reloaded or
  monkeypatched checker has no effect; the verdict is the check's return value, never printed text;
- before each check it compares the grader and minillm (the reference) with a snapshot taken before
  the learner's code ran: a learner cell that patched them fails every remaining task;
- while learner code runs under a check, the reference it is compared with raises (`forbid`), so a
  solution that delegates to it (`super()._preempt(req)`, `BlockAllocator.allocate(self)`,
  `reference.pad_batch(...)`, `class LearnerScheduler(ContinuousScheduler): pass`) fails, saying so.

What this does not defend against: code that attacks the grading process itself (it runs in the
learner's process). It defeats editing cells, redefining or patching checks and references, and
delegating to the reference, which is what a grade has to survive.

How to add an exercise (ex08, ex09, ex10 are added this way; nothing outside your files changes)
------------------------------------------------------------------------------------------------
1. `solutions/exNN_topic.ipynb`: the solved notebook. Its setup cell imports the grader:
   `from minillm.grading import exNN as grader`. Learner code goes between `# BEGIN SOLUTION` and
   `# END SOLUTION` lines (`tools/build_exercises.py` turns each region into a stub). Each graded
   cell holds exactly two lines, the marker and one call whose arguments are names the learner's
   cells define:

       # NBVAL_CHECK_OUTPUT
       grader.check_task_2(LearnerScheduler)

   A demo cell that no check needs (a plot, a run on the real model for show) may carry the cell
   tag `grading-skip`: grading does not run it. Execute the solution so the graded cells store
   their `task N (...): PASS` output, then run
   `.venv/bin/python tools/build_exercises.py` (CI runs `--check`): the exercise opens clean (no
   output; cells from the first learner cell on tagged `raises-exception`, so Run All shows every
   task), and the graded outputs go to the grader-private `private/expected/exNN_topic.json`.
   Put the `def`/`class` line of a learner's function outside its solution region, so that the
   stub still defines the name the graded cell passes.
   Hints: tiered, in markdown cells, `<details><summary>Hint 1</summary>…</details>` (a nudge),
   then `Hint 2` (stronger); never the solution's code.

2. `minillm/grading/exNN.py`: one function per task, decorated with `@task`:

       from minillm.grading import Fail, forbid, task

       @task(2, "admit")
       def check_task_2(scheduler_class) -> str:
           ...                              # build cases; compute the expected answers first
           with forbid(ContinuousScheduler):  # then run the learner's code, reference disabled
               got = run(scheduler_class)
           if got != expected:
               raise Fail(f"case 3: you planned {got}, expected {expected}")
           return "69 seeded traces agree with ContinuousScheduler"   # PASS detail line(s)

   The function takes the learner's objects (positionally, as the graded cell passes them) and
   returns the PASS detail (a str or list of str) or raises `Fail(message)`. `@task` turns that into
   a `TaskResult` (`passed`, `lines`; its repr is the `task N (name): PASS` report) and turns any
   exception from learner code into a FAIL that names it (`NotImplementedError` says "not written
   yet"). `forbid(*targets)` takes functions, classes (all their methods) or `(owner, "name")`
   pairs; while active, calling any of them raises and the task FAILs with "your code called the
   reference X: write it yourself", even if the learner's code swallowed the exception.
   `refuse_subclass(cls, Reference)` fails a class that inherits what it should implement.
   Checks must be deterministic (fixed seeds) and fail on the first difference, with a message that
   shows it. Where a learner could precompute the seeded cases' answers (with the reference, before
   the check disables it) or special-case the seeds, add cases from `grade_time_seeds(n)`: drawn when
   the check runs, they cannot be known in advance, and a correct answer passes them all.
   Every check also runs the rules of `minillm.grading.provenance` (the learner's code is the
   learner's; grader helpers are not answers; a check's data is not an input): list in
   `LEARNER_TOOLS` what the module lends the learner during a check. A reference the library does
   not have goes in a grader-private module, `private_reference("exNN_what")` (docs/grading.md,
   "Grader-private references"): left out of a student release, compared with learner code at
   every size; give the task an answer key (`minillm.grading.answer_key.AnswerKey`, docs/grading.md
   "Answer keys") so that a release grades it too. Let a learner's `NotImplementedError` through (or raise `Fail` from inside the
   `except`): a stub then reads "not written yet". `check_time_limit_s=` on `@task` bounds a check (default 180 s).

3. `tests/known_wrong/exNN.py`: `KNOWN_WRONG = [Mutant(...), ...]` (see tests/known_wrong/__init__.py):
   for every task, a few wrong implementations of the bug classes it is about, written either as
   text edits of the solution's learner cells (`edits=[("budget -= n", "")]`) or as a cell the
   learner might write (`code="class LearnerScheduler(ContinuousScheduler): pass"`).
   `tests/test_grading_known_wrong.py` globs these files: it executes the solution's cells with the
   mutant applied, in-process, and asserts that the mutant's task FAILS (and, with `expect=`, that
   the message says why), and that the unmodified solution passes every task. Every task needs at
   least two mutants; every exercise needs one delegation mutant.

4. Nothing else: `tests/test_exercises.py` globs `solutions/ex*.ipynb` and, for each, grades the
   solution (must pass), the untouched exercise (must fail), and the two cheats (a graded cell
   replaced by a print of its PASS text; an added cell that redefines the checker; both must fail).
"""

from __future__ import annotations

import functools
import random
import signal
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from minillm.grading import provenance

DEFAULT_TIME_LIMIT_S = 180


class Fail(Exception):
    """Raised by a check: the learner's answer is wrong; the message says how."""


class DelegationError(RuntimeError):
    """Raised when learner code calls a reference that `forbid` disabled."""


class ReferenceWithheld(LookupError):
    """A check needed a grader-private reference (minillm/grading/private/) that this copy of the
    course does not have: a student release. The task is reported as not graded here."""


class _Withheld(types.ModuleType):
    """The stand-in for a grader-private module missing from a student release: every attribute raises."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ReferenceWithheld(f"{self.__name__}.{attr} is the teacher's (minillm/grading/private/ is not in a "
                                "student release): this task is graded in the teacher's copy of the course")


def private_reference(name: str) -> types.ModuleType:
    """The grader-private module `minillm.grading.private.<name>` (docs/grading.md, "Grader-private
    references"), imported now: call it at a grading module's import time, before learner code runs,
    and use its attributes only inside checks. In a student release, where it is left out, a stand-in
    whose attributes raise ReferenceWithheld: a check with an answer key (minillm.grading.answer_key)
    grades with the key there, another reports "not graded here"."""
    import importlib

    from minillm.grading.answer_key import as_release

    full = f"{__name__}.private.{name}"
    if as_release():  # MINILLM_GRADING_AS_RELEASE=1: grade as a student release does (answer keys only)
        return _Withheld(full)
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as error:
        if error.name not in (full, f"{__name__}.private"):
            raise  # the private module exists but imports something missing: a real error
        return _Withheld(full)


WITHHELD = "NOT GRADED HERE"  # the verdict of a task whose reference a student release leaves out


@dataclass
class TaskResult:
    task: int
    name: str
    passed: bool
    lines: list[str] = field(default_factory=list)
    withheld: bool = False  # its grader-private reference is not in this copy (never a PASS)

    @property
    def headline(self) -> str:
        verdict = "PASS" if self.passed else WITHHELD if self.withheld else "FAIL"
        return f"task {self.task} ({self.name}): {verdict}"

    def report(self) -> str:
        return "\n".join([self.headline, *(f"  {line}" for line in self.lines)])

    def __repr__(self) -> str:  # what a notebook shows under the graded cell
        return self.report()

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "name": self.name, "passed": self.passed, "lines": list(self.lines),
                "withheld": self.withheld}


# --- the reference, disabled while learner code runs ---------------------------------------------

# id(code object installed in a reference) -> the reference's name; the hits of the running check
_TRIPWIRES: dict[int, tuple[types.CodeType, str]] = {}
_HITS: list[str] = []


def _tripwire(*args, **kwargs):  # its code is installed into disabled references
    raise __import__("minillm.grading", fromlist=["_tripped"])._tripped(__import__("sys")._getframe(0).f_code)


def _tripped(code: types.CodeType) -> DelegationError:
    label = _TRIPWIRES.get(id(code), (None, "a reference function"))[1]
    message = f"your code called the reference {label}: write it yourself"
    _HITS.append(message)
    return DelegationError(message)


def _label(owner: Any, name: str) -> str:
    return f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}"


def _functions_of(target: Any) -> Iterator[tuple[types.FunctionType, str]]:
    """The Python functions behind a target (a function, a class, or (owner, name)), with labels."""
    if isinstance(target, tuple):
        owner, name = target
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        items = [(name, raw)]
        prefix_owner = owner
    elif isinstance(target, type):
        items = list(vars(target).items())
        prefix_owner = target
    elif isinstance(target, types.FunctionType):
        yield target, f"{target.__module__}.{target.__qualname__}"
        return
    else:
        raise TypeError(f"forbid() takes functions, classes or (owner, name) pairs, not {target!r}")
    for name, raw in items:
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property):
            for accessor in (raw.fget, raw.fset):
                if isinstance(accessor, types.FunctionType):
                    yield accessor, _label(prefix_owner, name)
        elif isinstance(raw, types.FunctionType):
            yield raw, _label(prefix_owner, name)


@contextmanager
def forbid(*targets: Any) -> Iterator[None]:
    """While active, every Python function behind `targets` raises DelegationError when called, and
    the call is recorded: the enclosing `@task` check FAILs naming it, even if the learner's code
    caught the exception. The functions' code objects are swapped, so references the learner took
    earlier (`f = Reference.method`) are disabled too."""
    swapped: list[tuple[types.FunctionType, types.CodeType]] = []
    try:
        for target in targets:
            for function, label in _functions_of(target):
                if function.__closure__:  # a code swap needs equal free variables: leave closures alone
                    continue
                if any(function is done for done, _ in swapped):
                    continue
                code = _tripwire.__code__.replace(co_name=function.__code__.co_name)
                _TRIPWIRES[id(code)] = (code, label)
                swapped.append((function, function.__code__))
                function.__code__ = code
        yield
    finally:
        for function, original in reversed(swapped):
            _TRIPWIRES.pop(id(function.__code__), None)
            function.__code__ = original


def refuse_subclass(cls: Any, *references: type) -> None:
    """Fail a learner class that inherits from the reference it is meant to replace."""
    if not isinstance(cls, type):
        raise Fail(f"expected a class, got {type(cls).__name__}")
    for reference in references:
        if issubclass(cls, reference):
            raise Fail(f"{cls.__name__} inherits from the reference {reference.__name__}: "
                       f"write it yourself instead of reusing {reference.__name__}'s code")


# --- tasks ---------------------------------------------------------------------------------------


class _TimeLimit(BaseException):
    pass


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def expire(*_):
        raise _TimeLimit()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def task(number: int, name: str, check_time_limit_s: int = DEFAULT_TIME_LIMIT_S) -> Callable:
    """Register a check: `@task(2, "admit")` on `def check_task_2(...) -> str | list[str]`."""

    def decorate(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(*args: Any) -> TaskResult:
            del _HITS[:]
            withheld = False
            try:
                with _time_limit(check_time_limit_s):
                    own = provenance.provenance_problem(args, sys.modules.get(check.__module__), number)
                    if own is not None:
                        raise Fail(own)
                    with provenance.guard_graders(number), provenance.watch_learner():
                        detail = check(*args)
                problem = None
            except Fail as failure:
                stub = _stub_behind(failure)
                problem = str(failure) if stub is None else f"not written yet (NotImplementedError: {stub})"
            except NotImplementedError as error:
                problem = f"not written yet (NotImplementedError: {error})"
            except DelegationError as error:
                problem = str(error)
            except ReferenceWithheld as error:
                problem, withheld = f"not graded here: {error}", True
            except _TimeLimit:
                problem = f"no answer within {check_time_limit_s} s: does a loop never end?"
            except RecursionError as error:
                problem = f"RecursionError: {error}"
            except Exception as error:  # noqa: BLE001  (the learner's code failed: that is the report)
                problem = f"{type(error).__name__}: {error}"
            if _HITS:
                problem = _HITS[0] + ("" if problem is None or problem in _HITS else f" ({problem})")
                del _HITS[:]
                withheld = False  # the learner's code called what it must not: that is the verdict
            if problem is not None:
                return TaskResult(number, name, False, [problem], withheld=withheld)
            lines = [detail] if isinstance(detail, str) else list(detail or [])
            return TaskResult(number, name, True, lines)

        run.grading_task = (number, name)
        return run

    return decorate


def _stub_behind(failure: BaseException) -> str | None:
    """The message of a NotImplementedError (a stub) that a check caught and turned into this Fail
    (`raise Fail(...)` inside its `except`, `from None` included), or None: a task whose code is not
    written yet says so, whatever the check was comparing when it met the stub."""
    seen, error = set(), failure.__cause__ or failure.__context__
    while error is not None and id(error) not in seen:
        if isinstance(error, NotImplementedError):
            return str(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run_until_done(engine: Any, max_iterations: int, stalled: str) -> None:
    """Step `engine` until nothing is unfinished, waiting for work when a step runs nothing.

    After `max_iterations` with requests left, FAIL with `stalled` (its `{unfinished}` becomes their
    count): the message should say what the learner's code may have missed.
    """
    if not engine.run_until_done(max_iterations=max_iterations):  # the engine's one step-until-done loop
        raise Fail(stalled.format(unfinished=len(engine.requests)))


def grade_time_seeds(count: int) -> list[int]:
    """`count` seeds drawn when the check runs (from the OS, not from a generator a learner could seed):
    cases made from them cannot be memoised or special-cased in advance, and a correct answer passes
    them all, so a correct solution's verdict stays the same from run to run."""
    draw = random.SystemRandom()
    return [draw.randrange(10**6, 10**9) for _ in range(count)]


def tasks_of(module: types.ModuleType) -> dict[int, Callable]:
    """The `@task` checks of a grading module, by task number."""
    found = {}
    for value in vars(module).values():
        info = getattr(value, "grading_task", None)
        if info is not None and getattr(value, "__module__", None) == module.__name__:
            found[info[0]] = value
    return dict(sorted(found.items()))


# --- tamper evidence -----------------------------------------------------------------------------


def _identity(value: Any) -> tuple:
    code = getattr(value, "__code__", None)
    return (id(value), id(code) if code is not None else None)


# What the checks rely on outside minillm: a learner cell that replaces one of these (torch.equal,
# Tensor.tolist, sorted, random.Random, ...) is tampering too. None: every callable of the module.
# (Not all of torch: from_pretrained itself swaps torch.manual_seed while it loads a model.)
LIBRARIES: dict[str, tuple[str, ...] | None] = {
    "builtins": None,
    "random": None,
    "torch": ("equal", "allclose", "isclose", "eq", "ne", "tensor", "as_tensor", "stack", "cat", "all", "any",
              "repeat_interleave", "cumsum", "arange", "full", "zeros",
              # the graders' random sources: a learner cell that replaces one chooses the check's cases
              "randn", "rand", "randint", "randperm", "multinomial", "softmax", "Generator", "normal"),
    "torch.Tensor": ("__eq__", "__ne__", "__bool__", "__iter__", "__getitem__", "__len__", "tolist", "item",
                     "equal", "all", "any", "long", "as_subclass"),
    "numpy": ("array_equal", "allclose", "isclose", "sort", "cumsum", "array", "asarray"),
    "numpy.random": ("default_rng", "seed", "randint", "random", "shuffle", "Generator"),
}


def _library_state() -> dict[str, tuple]:
    state: dict[str, tuple] = {}
    for owner_name, names in LIBRARIES.items():
        module_name, _, class_name = owner_name.partition(".")
        owner = sys.modules.get(module_name)  # a library nobody imported cannot have been patched
        if owner is not None and class_name:
            owner = getattr(owner, class_name, None)
        if owner is None:
            continue
        if names is None:
            state.update((f"{owner_name}.{n}", (id(v),)) for n, v in vars(owner).items() if callable(v))
        else:  # looked up as the checks look them up (a Tensor method lives on a base class)
            state.update((f"{owner_name}.{n}", (id(getattr(owner, n, None)),)) for n in names)
    return state


def snapshot(prefixes: Iterable[str] = ("minillm",), libraries: bool = True) -> dict[str, tuple]:
    """Identity of every function, class attribute and code object in the loaded modules whose name
    starts with one of `prefixes`, and of the library functions in LIBRARIES: what a learner could
    monkeypatch."""
    prefixes = tuple(prefixes)
    state: dict[str, tuple] = _library_state() if libraries else {}
    if any("minillm.grading.provenance".startswith(prefix) for prefix in prefixes):
        state["minillm.grading.provenance._GIVEN"] = (id(provenance._GIVEN),)  # what the copy detector skips
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, (types.FunctionType, type)):
                state[f"{module_name}.{attr}"] = _identity(value)
            elif type(value).__name__ == "AnswerKey" and type(value).__module__ == "minillm.grading.answer_key":
                # what a key grades with: swapping its digests or its reference would choose the verdict
                state[f"{module_name}.{attr}"] = (id(value), *(id(getattr(value, name)) for name in (
                    "exercise", "task", "size", "seeded", "reference", "private", "facts", "digests", "stored_facts")))
            if isinstance(value, type) and value.__module__ == module_name:
                for name, raw in list(vars(value).items()):
                    if isinstance(raw, (types.FunctionType, property, staticmethod, classmethod)):
                        inner = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
                        state[f"{module_name}.{attr}.{name}"] = (id(raw), *_identity(inner))
    return state


def tampered(before: dict[str, tuple], prefixes: Iterable[str] = ("minillm",), libraries: bool = True) -> list[str]:
    """The names in `before` whose function, attribute or code has changed since."""
    now = snapshot(prefixes, libraries)
    return sorted(name for name, identity in before.items() if now.get(name) != identity)
