"""The learner's code is the learner's: what `@task` checks besides the answers (see minillm.grading).

Three rules, each a class of answer that passes a check of outputs alone:

1. **Not the library's answer under another name.** Every function the learner hands in, and every
   function and class reachable from it (methods of a class, its base classes that are not
   minillm's own, closures, defaults, the globals its code names, `functools.partial`, numba
   dispatchers' `py_func`, `__wrapped__`), is compared, as bytecode, with minillm's source (the
   library, its graders and their private references). Names of locals, globals and attributes are
   left out, so a renamed copy is still a copy; line numbers and docstrings are not bytecode. How
   alike two pieces are: the instructions they share in order (difflib's matching blocks) as a share
   of the longer one. It FAILs when
   - a function of at least `SMALL_INSTRUCTIONS` instructions has a minillm function's bytecode, or
     shares `FUNCTION_SHARE` of it (0.92 below 60 instructions, 0.85 from 60), or holds
     `CONTAINED_SHARE` (0.90) of a minillm function of `CONTAINED_MIN` or more while at most twice
     its size (a copy padded with statements that do nothing);
   - a class (its methods) or the group of the learner's other functions, summed over its functions
     (each with its closest function there), shares `UNIT_SHARE` of a minillm class or module's
     functions, or holds `UNIT_CONTAINED_SHARE` of one: small functions count here, so a copy
     assembled from short methods, or reached through a base class rebuilt from the library's
     source, is compared as a whole;
   - minillm's own function or class is handed in, or held by a class as a method.
   The near rules (share, containment, whole units) compare with the library and the grader-private
   references (minillm/grading/private/); a grading module's own functions only for the same
   bytecode: graders hold harnesses and wrong variants of an answer that an honest answer resembles
   (ex10's kernel resembles one of them), and a reference answer belongs in private/ (docs/grading.md).
   The exercise's given code (setup cells, the learner cells as the exercise shows them: `set_given`)
   is left out: everyone has it. The thresholds are set on this course's solutions, none of which
   comes within 0.05 of them (tests/test_grading_copies.py, MARGIN; `python tests/test_grading_copies.py`
   prints each solution's closest approach); a hand-retyped copy keeps well over 0.9 of the original. Rewriting a reference by hand so that a sixth of it differs is not caught: that
   is writing it (and a kernel written independently in exactly the library's statement order is
   indistinguishable from a copy: the message says what matched).
2. **The grader is not a library.** While a check runs, every function of a grading module
   (`minillm.grading.exNN`) other than the tools it lists in `LEARNER_TOOLS` (harnesses, a
   simulator the task asks to explore) raises when learner code calls it, and the task FAILs
   naming it, even if the learner's code caught the error. The grader's own calls pass: the guard
   looks at who called (the nearest frame that is not library code: minillm's or an installed
   package's) and lets grader code through.
3. **A check's data is not an input.** While a check runs, an audit hook (PEP 578) FAILs the task
   when learner code looks at frames or the heap (`sys._getframe`, `inspect.currentframe`,
   a traceback's `tb_frame`, a generator's `gi_frame`, `gc.get_referrers`/`get_objects`,
   `sys.settrace`/`setprofile`) — the grader's expected answers live in its frames — or reads the
   code object of a minillm function, makes a function of it, or executes source whose bytecode is
   a minillm function's (`exec(inspect.getsource(ref))` at check time).

Not defended (as the package docstring says of attacks on the grading process itself): code that
forges where it comes from (a code object whose filename claims to be minillm's or an installed
package's is refused when handed in or compiled during a check, not when made some other way), and
answers precomputed before the check (see `fresh_cases` in the package for the checks that draw
cases at grade time).
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import threading
import types
from collections import Counter
from collections.abc import Iterable, Iterator
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

# How alike two pieces of bytecode are: the instructions they share in order (difflib's matching
# blocks), as a share of the longer one. Thresholds set on this course's solutions (every learner
# function, class and group of functions of solutions/*.ipynb, the exercise's given code left out;
# tests/test_grading_copies.py keeps them MARGIN below; `python tests/test_grading_copies.py` prints
# each solution's closest match per rule, quoted in docs/grading.md); a hand-retyped copy with a few
# edits keeps over 0.9 (tests/known_wrong/copies.py).
SMALL_INSTRUCTIONS = 30  # a function shorter than this is compared only as part of its class or group
FUNCTION_SHARE = ((60, 0.85), (SMALL_INSTRUCTIONS, 0.92))  # (from this many instructions, share that is a copy)
CONTAINED_MIN, CONTAINED_SHARE = 60, 0.90  # a minillm function of >= 60 found in yours, padded up to 2x
UNIT_MIN, UNIT_SHARE = 40, 0.80  # a class or group of functions: the sum over its functions
UNIT_CONTAINED_MIN, UNIT_CONTAINED_SHARE = 80, 0.90
MIN_INSTRUCTIONS = SMALL_INSTRUCTIONS  # the name earlier graders and tests use
MAX_REACHABLE = 400

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent) + os.sep  # .../minillm/
GRADING_DIR = str(Path(__file__).resolve().parent) + os.sep  # .../minillm/grading/
PRIVATE_DIR = GRADING_DIR + "private" + os.sep  # grader-private references: answers, compared as the library's
_LIBRARY_DIRS = tuple(sorted({str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(key))}))

# --- bytecode fingerprints -----------------------------------------------------------------------

_FAST = {"LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_CLOSURE",
         "LOAD_DEREF", "STORE_DEREF", "DELETE_DEREF", "MAKE_CELL", "LOAD_CLASSDEREF", "COPY_FREE_VARS"}
_SKIP = {"RESUME", "CACHE", "NOP", "EXTENDED_ARG", "PRECALL", "KW_NAMES"}
_SAME = {"LOAD_METHOD": "LOAD_ATTR"}  # which one a call compiles to depends on how the source was compiled
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
_TOKENS: dict[tuple[int, bool], tuple[types.CodeType, tuple[str, ...]]] = {}  # (id(code), exact) -> (code, tokens)


def tokens(code: types.CodeType, exact: bool = False) -> tuple[str, ...]:
    """The instructions of `code`, names left out: what two copies of one function share.

    Locals other than arguments are all "a local" (adding one near the top would otherwise renumber
    every local after it and hide a copy); `exact=True` keeps their numbers, for "the same bytecode"."""
    key = (id(code), exact)
    hit = _TOKENS.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    out = []
    arguments = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x4) + bool(code.co_flags & 0x8)
    for ins in dis.get_instructions(code):
        op = _SAME.get(ins.opname, ins.opname)
        if op in _SKIP:
            continue
        if ins.opcode in _JUMPS:  # offsets depend on inline caches: the kind of jump is what counts
            arg = ""
        elif op in _FAST:
            arg: Any = ins.arg if exact or ins.arg is None or ins.arg < arguments else "local"
        elif op == "LOAD_CONST":
            arg = "<code>" if isinstance(ins.argval, types.CodeType) else repr(ins.argval)[:80]
        elif ins.opcode in dis.hasname:
            arg = ""
        elif op in ("COMPARE_OP", "BINARY_OP"):
            arg = ins.argrepr
        else:
            arg = ins.arg
        out.append(f"{op} {arg}")
    result = tuple(out)
    if len(_TOKENS) > 50_000:
        _TOKENS.clear()
    _TOKENS[key] = (code, result)
    return result


def code_tree(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_tree(const)


def _is_function_code(code: types.CodeType) -> bool:
    return bool(code.co_flags & 0x1) and code.co_name != "<module>"  # CO_OPTIMIZED: a def or lambda


class LibraryIndex:
    """Every function of minillm's source, by bytecode: `exact` (exact tokens -> label, functions of at
    least SMALL_INSTRUCTIONS, graders included), `sized` ((size, tokens, label), sorted by size) and
    `units` (each class, its methods and what they nest, and each module's own functions, as (label,
    [tokens, ...], total, bag of instructions)); the last two without the grading modules' own code."""

    def __init__(self) -> None:
        self.exact: dict[tuple[str, ...], str] = {}
        self.sized: list[tuple[int, tuple[str, ...], str]] = []
        self.units: list[tuple[str, list[tuple[str, ...]], int, Counter]] = []


def _unit_of(code: types.CodeType) -> str:
    """'Class' for a method (and what it nests), '<module>' for a module-level function."""
    outer = code.co_qualname.split(".<locals>")[0].split(".")
    return outer[0] if len(outer) > 1 else "<module>"


@functools.lru_cache(maxsize=4)
def _library_index(roots: tuple[str, ...], stamp: float) -> LibraryIndex:
    index = LibraryIndex()
    paths = sorted({path for root in roots for path in Path(root).rglob("*.py") if "__pycache__" not in path.parts})
    top = Path(PACKAGE_DIR).parent
    for path in paths:
        try:
            module = compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            continue
        relative = str(path.relative_to(top)) if path.is_relative_to(top) else str(path)
        # A grading module's own functions (not its private references) are compared for the same
        # bytecode only: a grader holds harnesses and wrong variants of an answer (ex10's kernel resembles
        # one of them), which an honest answer resembles; a reference answer belongs in private/.
        grader = str(path.resolve()).startswith(GRADING_DIR) and not str(path.resolve()).startswith(PRIVATE_DIR)
        units: dict[str, list[tuple[str, ...]]] = {}
        for code in code_tree(module):
            if not _is_function_code(code):
                continue
            toks = tokens(code)
            units.setdefault(_unit_of(code), []).append(toks)
            if len(toks) < SMALL_INSTRUCTIONS:
                continue
            label = f"{code.co_qualname} ({relative})"
            index.exact.setdefault(tokens(code, exact=True), label)
            if not grader:
                index.sized.append((len(toks), toks, label))
        for name, members in units.items() if not grader else ():
            label = f"{relative}'s functions" if name == "<module>" else f"{name} ({relative})"
            index.units.append((label, members, sum(map(len, members)), Counter(i for m in members for i in m)))
    index.sized.sort(key=lambda item: item[0])
    index.units.sort(key=lambda item: item[2])
    return index


def source_roots() -> tuple[str, ...]:
    """minillm's source folders: the package, and the folders it extends its subpackages' paths with
    (`minillm.kernels` finds its kernels in the repository's kernels/)."""
    roots = {PACKAGE_DIR}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "minillm" and module is not None:
            roots.update(str(Path(p).resolve()) + os.sep for p in getattr(module, "__path__", ()) or ())
    return tuple(sorted(roots))


_CURRENT: list = []  # the index library_index() last returned: what matches use between two refreshes


def library_index() -> LibraryIndex:
    """Fingerprints of every function in minillm's source files (rebuilt when a file changes; looked
    at once per check)."""
    roots = source_roots()
    stamp = max((p.stat().st_mtime for root in roots for p in Path(root).rglob("*.py")), default=0.0)
    index = _library_index(roots, stamp)
    _CURRENT[:] = [index]
    return index


def _index() -> LibraryIndex:
    return _CURRENT[0] if _CURRENT else library_index()


# --- the exercise's given code: the same for every learner, never a copy ---------------------------

_GIVEN: frozenset = frozenset()


def set_given(sources: Iterable[str]) -> None:
    """The code every learner is given (the exercise's setup cells, the learner cells as the exercise
    shows them): its functions are not compared (a given `add_request` may well be a harness's).
    The runner calls this before any learner code runs; the tamper check watches it."""
    global _GIVEN
    found = set()
    for source in sources:
        try:
            module = compile(source, "<given>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            continue
        found.update(tokens(code) for code in code_tree(module) if _is_function_code(code))
    _GIVEN = frozenset(found)


def given() -> frozenset:
    return _GIVEN


# --- how alike ---------------------------------------------------------------------------------------

_SHARED: dict[tuple[int, int], int] = {}


def shared(mine: tuple[str, ...], theirs: tuple[str, ...]) -> int:
    """The instructions `mine` and `theirs` have in common, in order (difflib's matching blocks)."""
    key = (id(mine), id(theirs))
    hit = _SHARED.get(key)
    if hit is None:
        if len(_SHARED) > 200_000:
            _SHARED.clear()
        matcher = SequenceMatcher(None, mine, theirs, autojunk=False)
        hit = _SHARED[key] = sum(block.size for block in matcher.get_matching_blocks())
    return hit


def _upper(mine: tuple[str, ...], theirs: tuple[str, ...]) -> int:
    """A cheap bound on shared(): what their multisets of instructions have in common."""
    matcher = SequenceMatcher(None, mine, theirs, autojunk=False)
    return round(matcher.quick_ratio() * (len(mine) + len(theirs)) / 2)


def _function_share(size: int) -> float | None:
    return next((share for floor, share in FUNCTION_SHARE if size >= floor), None)


_MATCHES: dict[int, tuple[types.CodeType, str | None, object, frozenset]] = {}


def library_match(code: types.CodeType) -> str | None:
    """'X is minillm's Y ...' when `code` (or a function inside it) is a minillm function's bytecode,
    or a near copy of one (FUNCTION_SHARE, CONTAINED_SHARE), else None. The given code is skipped."""
    index = _index()
    hit = _MATCHES.get(id(code))
    if hit is not None and hit[0] is code and hit[2] is index and hit[3] is _GIVEN:
        return hit[1]
    if len(_MATCHES) > 10_000:
        _MATCHES.clear()
    result = _library_match(code, index)
    _MATCHES[id(code)] = (code, result, index, _GIVEN)
    return result


def _library_match(code: types.CodeType, index: LibraryIndex) -> str | None:
    for inner in code_tree(code):
        if not _is_function_code(inner):
            continue
        toks = tokens(inner)
        if len(toks) < SMALL_INSTRUCTIONS or toks in _GIVEN:
            continue
        label = index.exact.get(tokens(inner, exact=True))
        if label is not None:
            return f"{inner.co_qualname} is minillm's {label}: the same bytecode"
        found = _near_function(toks, index)
        if found is not None:
            return f"{inner.co_qualname} is minillm's {found}"
    return None


def _near_function(toks: tuple[str, ...], index: LibraryIndex) -> str | None:
    """A near copy: the share of the longer one the two have in common is at least FUNCTION_SHARE's
    (for the longer one's size), or a minillm function of CONTAINED_MIN or more is CONTAINED_SHARE
    found in `toks` that is at most twice its size (a copy padded with statements that do nothing)."""
    mine = len(toks)
    for size, other, label in index.sized:
        if size > 2 * mine:
            break
        if 2 * size < mine and size < CONTAINED_MIN:
            continue
        longer = max(mine, size)
        share = _function_share(longer)
        contained = size >= CONTAINED_MIN and mine <= 2 * size
        if share is None and not contained:
            continue
        need = min(share * longer if share is not None else float("inf"),
                   CONTAINED_SHARE * size if contained else float("inf"))
        if _upper(toks, other) < need:
            continue
        common = shared(toks, other)
        if share is not None and common >= share * longer:
            return f"{label} with {common / longer:.0%} of the longer one's bytecode in common, in order"
        if contained and common >= CONTAINED_SHARE * size:
            return f"{label}, {common / size:.0%} of its bytecode found in yours, in order"
    return None


def unit_match(label: str, members: list[tuple[str, ...]]) -> str | None:
    """A class (its methods) or a group of functions whose whole matches one of minillm's classes or
    modules: summed over its functions, each one's instructions in common with its closest function
    there, as a share of the larger whole (UNIT_SHARE), or that whole found in it (UNIT_CONTAINED_SHARE).
    Small functions count here: a copy assembled from many short methods is still a copy."""
    members = [m for m in members if m not in _GIVEN]
    total = sum(map(len, members))
    if total < UNIT_MIN:
        return None
    bag = Counter(i for m in members for i in m)
    for name, theirs, size, their_bag in _index().units:
        if size * UNIT_SHARE > total and size > total:
            break
        whole = max(total, size)
        alike = size >= UNIT_SHARE * total or (size >= UNIT_CONTAINED_MIN and total <= 2 * size)
        if not alike:
            continue
        upper = sum((bag & their_bag).values())  # no order can share more than the two bags of instructions
        if upper < UNIT_SHARE * whole and (size < UNIT_CONTAINED_MIN or upper < UNIT_CONTAINED_SHARE * size):
            continue
        mine = sum(max((shared(m, o) for o in theirs), default=0) for m in members)
        if mine >= UNIT_SHARE * whole:
            return (f"{label} is minillm's {name}: summed over its {len(members)} function(s), "
                    f"{mine / whole:.0%} of the bytecode in common, in order")
        if size >= UNIT_CONTAINED_MIN and total <= 2 * size:
            found = sum(max((shared(m, o) for m in members), default=0) for o in theirs)
            if found >= UNIT_CONTAINED_SHARE * size:
                return (f"{label} holds minillm's {name}: {found / size:.0%} of its bytecode found in yours, "
                        "in order")
    return None


# --- where code comes from -----------------------------------------------------------------------

_KIND: dict[str, str] = {}


def file_kind(filename: str) -> str:
    """'grader' (minillm/grading), 'library' (the rest of minillm, an installed package, the standard
    library) or 'learner' (a notebook cell, exec'd text, anything else)."""
    kind = _KIND.get(filename)
    if kind is None:
        if filename.startswith("<frozen "):
            kind = "library"
        else:
            try:
                real = os.path.realpath(filename) if os.path.isabs(filename) else ""
            except (OSError, ValueError):
                real = ""
            if real.startswith(GRADING_DIR):
                kind = "grader"
            elif real.startswith(PACKAGE_DIR) or real.startswith(_LIBRARY_DIRS) or real.startswith(source_roots()):
                kind = "library"
            else:
                kind = "learner"
        _KIND[filename] = kind
    return kind


_INSPECTORS = {"inspect", "traceback", "linecache"}


def caller_is_learner(frame: types.FrameType | None) -> bool:
    """Walk up from `frame` through library code: True if learner code comes before grader code."""
    while frame is not None:
        code = frame.f_code
        kind = file_kind(code.co_filename)
        if kind == "grader":
            return False
        if kind == "learner":
            return True
        frame = frame.f_back
    return False


def direct_caller_is_learner(frame: types.FrameType | None) -> bool:
    """The first frame outside inspect/traceback is learner code (for frame and heap introspection)."""
    while frame is not None and frame.f_globals.get("__name__") in _INSPECTORS:
        frame = frame.f_back
    return frame is not None and file_kind(frame.f_code.co_filename) == "learner"


# --- what the learner handed in ------------------------------------------------------------------


def _resolve(module: types.ModuleType, qualname: str) -> Any:
    owner: Any = module
    for part in qualname.split("."):
        if part == "<locals>":
            return None
        space = vars(owner) if hasattr(owner, "__dict__") else {}
        if part not in space:
            return None
        owner = space[part]
        if isinstance(owner, (staticmethod, classmethod)):
            owner = owner.__func__
        elif isinstance(owner, property):
            owner = owner.fget
    return owner


def is_original(obj: Any) -> bool:
    """`obj` is the function or class a module defines (not a copy made from its code or source)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    if _resolve(module, getattr(obj, "__qualname__", "")) is obj:
        return True
    return any(value is obj for value in vars(module).values())


def _from_minillm(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "minillm"


def _traversable(function: types.FunctionType) -> bool:
    """A function to compare: the learner's own, or a copy of minillm's (not an installed package's)."""
    if is_original(function):
        return False
    name = function.__globals__.get("__name__", "")
    return (name == "__main__" or name.split(".")[0] == "minillm"
            or file_kind(function.__code__.co_filename) != "library" or _from_minillm(function))


def _unwrap(value: Any) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, types.MethodType):
        return value.__func__
    return value


def reachable(objects: Iterable[Any]) -> tuple[list[types.FunctionType], list[type], list[types.CodeType]]:
    """The learner's functions, classes and loose code objects reachable from `objects`."""
    functions: list[types.FunctionType] = []
    classes: list[type] = []
    codes: list[types.CodeType] = []
    seen: set[int] = set()
    pending = list(objects)
    while pending and len(seen) < MAX_REACHABLE:
        value = _unwrap(pending.pop())
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, types.ModuleType)):
            continue
        seen.add(id(value))
        if isinstance(value, types.CodeType):
            codes.append(value)
        elif isinstance(value, property):
            pending += [value.fget, value.fset, value.fdel]
        elif isinstance(value, functools.partial):
            pending += [value.func, *value.args, *value.keywords.values()]
        elif isinstance(value, types.FunctionType):
            if not _traversable(value):
                continue
            functions.append(value)
            pending += [cell.cell_contents for cell in (value.__closure__ or ()) if _cell_set(cell)]
            pending += list(value.__defaults__ or ()) + list((value.__kwdefaults__ or {}).values())
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                pending.append(wrapped)
            names = {name for code in code_tree(value.__code__) for name in code.co_names}
            pending += [value.__globals__[n] for n in names if n in value.__globals__
                        and not isinstance(value.__globals__[n], types.ModuleType)]
        elif isinstance(value, type):
            if is_original(value) or value.__module__ == "builtins":
                continue
            classes.append(value)
            pending += [v for v in vars(value).values()]
            pending += [base for base in value.__bases__]
        elif isinstance(value, (list, tuple, set, frozenset)):
            pending += list(value)[:50]
        elif isinstance(value, dict):
            pending += list(value.values())[:50]
        elif hasattr(value, "py_func"):  # a numba dispatcher (CPU or CUDA)
            pending.append(value.py_func)
        elif callable(value) and not is_original(type(value)):
            pending.append(type(value))
    return functions, classes, codes


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', obj))}"


def tools_of(module: types.ModuleType | None, task: int | None) -> set[str]:
    """The names a grading module lends the learner in `task`: `LEARNER_TOOLS` is a tuple of names
    (every task) or a dict name -> task numbers."""
    tools = getattr(module, "LEARNER_TOOLS", ()) if module is not None else ()
    if isinstance(tools, dict):
        return {name for name, tasks in tools.items() if tasks is None or task in tasks}
    return set(tools)


def provenance_problem(objects: Iterable[Any], module: types.ModuleType | None = None,
                       task: int | None = None) -> str | None:
    """Why the learner's objects are not the learner's code, or None (rule 1 of the module docstring)."""
    objects = list(objects)
    library_index()  # refreshed once per check
    for obj in objects:
        inner = getattr(obj, "py_func", obj)
        if isinstance(_unwrap(inner), (types.FunctionType, type)) and _from_minillm(_unwrap(inner)) \
                and is_original(_unwrap(inner)):
            return (f"you handed in minillm's own {_name(_unwrap(inner))}, the reference itself (or a grader's "
                    "function): write it yourself")
    functions, classes, codes = reachable(objects)
    for cls in classes:
        graders = [base for base in cls.__mro__[1:] if base.__module__.startswith("minillm.grading")]
        if graders:
            return (f"{cls.__name__} inherits from the grader's {_name(graders[0])}: a grader's class is not an "
                    "answer; write your own")
        for attr, raw in vars(cls).items():
            value = _unwrap(raw.fget if isinstance(raw, property) else raw)
            if isinstance(value, (types.FunctionType, type)) and _from_minillm(value) and is_original(value):
                return (f"{cls.__name__}.{attr} is minillm's {_name(value)}: a method taken from the library is "
                        "the library's answer, not yours")
    for code in [f.__code__ for f in functions] + codes:
        match = library_match(code)
        if match is not None:
            return (f"{match}. Code reused from minillm (its code object, its source re-executed, a copy "
                    "with the names changed) is the library's answer under another name: write it yourself")
    for label, members in _units(functions, classes):
        match = unit_match(label, members)
        if match is not None:
            return (f"{match}. A class or a set of functions copied from minillm, piece by piece (small "
                    "methods included, a base class rebuilt from its source included), is the library's "
                    "answer under another name: write it yourself")
    for function in functions:
        where = function.__code__.co_filename
        if file_kind(where) != "learner" and function.__globals__.get("__name__") == "__main__":
            return (f"{function.__qualname__} claims to be defined in {where}: define it in your cell "
                    "(code that forges where it comes from is not graded)")
    return None


def _members(cls: type) -> list[types.FunctionType]:
    found = []
    for raw in vars(cls).values():
        values = [raw.fget, raw.fset, raw.fdel] if isinstance(raw, property) else [_unwrap(raw)]
        found += [v for v in values if isinstance(v, types.FunctionType) and _traversable(v)]
    return found


def _units(functions: list[types.FunctionType], classes: list[type]) -> Iterator[tuple[str, list[tuple[str, ...]]]]:
    """Each of the learner's classes (its methods, and what they nest) and the group of the learner's
    other functions, as lists of bytecode tokens: what unit_match compares with minillm's classes and
    modules."""
    owned: set[int] = set()
    for cls in classes:
        methods = _members(cls)
        owned.update(id(f) for f in methods)
        yield (f"your class {cls.__qualname__}",
               [tokens(code) for f in methods for code in code_tree(f.__code__) if _is_function_code(code)])
    rest = [f for f in functions if id(f) not in owned]
    if rest:
        names = ", ".join(sorted({f.__qualname__ for f in rest})[:6]) + (", ..." if len(rest) > 6 else "")
        yield (f"your functions ({names})",
               [tokens(code) for f in rest for code in code_tree(f.__code__) if _is_function_code(code)])


# --- the grader's helpers, guarded while a check runs ---------------------------------------------

_GUARDED: dict[int, tuple[types.CodeType, types.FunctionType, str]] = {}  # id(trampoline code) -> ...
_LOCK = threading.RLock()


def _trampoline(*args, **kwargs):  # its code is installed into the grader's helpers during a check
    return __import__("minillm.grading.provenance", fromlist=["_through"])._through(
        __import__("sys")._getframe(0), args, kwargs)


def _through(frame, args, kwargs):
    entry = _GUARDED.get(id(frame.f_code))
    if entry is None:  # cannot happen while the guard is on; be loud if it does
        raise RuntimeError("minillm.grading: a guarded grader function lost its guard")
    _, shadow, label = entry
    if caller_is_learner(frame.f_back):
        from minillm.grading import _HITS, DelegationError

        message = (f"your code called the grader's {label}: a grader's helper is not an answer (only "
                   "its LEARNER_TOOLS are yours to use): write it yourself")
        _HITS.append(message)
        raise DelegationError(message)
    return shadow(*args, **kwargs)


def _grader_functions(module: types.ModuleType, task: int | None) -> Iterator[tuple[types.FunctionType, str]]:
    tools = tools_of(module, task)
    for name, value in list(vars(module).items()):
        if name in tools or name.startswith("check_task_") or name.startswith("__"):
            continue
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            yield value, f"{module.__name__}.{name}"
        elif isinstance(value, type) and value.__module__ == module.__name__:
            for attr, raw in list(vars(value).items()):
                raw = raw.fget if isinstance(raw, property) else _unwrap(raw)
                if isinstance(raw, types.FunctionType):
                    yield raw, f"{module.__name__}.{name}.{attr}"


def grading_modules() -> list[types.ModuleType]:
    """The grading modules (minillm.grading.exNN), the grader-private ones they loaded
    (minillm.grading.private.*) and the answer keys' module (its digests and canonical form are no
    tool for learner code): what rule 2 guards."""
    return [m for n, m in list(sys.modules.items()) if m is not None
            and (n.startswith("minillm.grading.ex") or n.startswith("minillm.grading.private.")
                 or n == "minillm.grading.answer_key")]


class guard_graders:
    """While active, the grading modules' functions (but their LEARNER_TOOLS) raise when learner code
    calls them (rule 2). Re-entrant: a check that runs inside another only adds what is missing."""

    def __init__(self, task: int | None = None) -> None:
        self.task = task

    def __enter__(self):
        self.swapped: list[tuple[types.FunctionType, types.CodeType]] = []
        with _LOCK:
            for module in grading_modules():
                for function, label in _grader_functions(module, self.task):
                    code = function.__code__
                    if function.__closure__ or id(code) in _GUARDED or code.co_freevars:
                        continue
                    shadow = types.FunctionType(code, function.__globals__, function.__name__,
                                                function.__defaults__, None)
                    shadow.__kwdefaults__ = function.__kwdefaults__
                    shadow.__qualname__ = function.__qualname__
                    trampoline = _trampoline.__code__.replace(co_name=code.co_name)
                    _GUARDED[id(trampoline)] = (trampoline, shadow, label)
                    self.swapped.append((function, code))
                    function.__code__ = trampoline
        return self

    def __exit__(self, *exc):
        with _LOCK:
            for function, original in reversed(self.swapped):
                _GUARDED.pop(id(function.__code__), None)
                function.__code__ = original
        return False


# --- the audit hook: looking into the grader, re-executing minillm during a check ----------------

_ACTIVE = [0]  # > 0 while a check runs
_STATE = threading.local()
_FRAME_EVENTS = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_referrers",
                 "gc.get_referents", "gc.get_objects"}
_FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"}
_installed = [False]


def _hit(message: str) -> None:
    from minillm.grading import _HITS, DelegationError

    _HITS.append(message)
    raise DelegationError(message)


def _audit(event: str, args: tuple) -> None:
    if not _ACTIVE[0] or getattr(_STATE, "busy", False):
        return
    if event in _FRAME_EVENTS:
        kind = "frames"
    elif event == "object.__getattr__":
        kind = "attr"
    elif event in ("exec", "function.__new__"):
        kind = "code"
    elif event == "code.__new__":
        kind = "new code"
    else:
        return
    _STATE.busy = True
    try:
        caller = sys._getframe(1)
        if kind == "frames":
            if direct_caller_is_learner(caller):
                _hit(f"your code looked into the running program ({event}): a check's expected answers live in "
                     "the grader's frames; reading them is not an answer")
        elif kind == "attr":
            obj, name = args[0], args[1]
            if name in _FRAME_ATTRS and direct_caller_is_learner(caller):
                _hit(f"your code looked into the running program (.{name}): a check's expected answers live "
                     "in the grader's frames; reading them is not an answer")
            if name == "__code__" and isinstance(obj, types.FunctionType) and _from_minillm(obj) \
                    and is_original(obj) and direct_caller_is_learner(caller):
                _hit(f"your code read the code object of minillm's {_name(obj)} during the check: the library's "
                     "code under another name is not yours")
        elif kind == "code":
            code = args[0]
            if isinstance(code, types.CodeType):
                if file_kind(code.co_filename) == "learner":
                    match = library_match(code)
                    if match is not None:
                        _hit(f"your code executed minillm's code during the check ({match}): write it yourself")
                elif event == "function.__new__" and file_kind(code.co_filename) in ("library", "grader") \
                        and os.path.realpath(code.co_filename).startswith(source_roots()) \
                        and direct_caller_is_learner(caller):
                    _hit(f"your code made a function of minillm's code ({code.co_qualname}) during the check: "
                         "the library's code under another name is not yours")
        elif kind == "new code":
            filename = args[1] if len(args) > 1 else ""
            if isinstance(filename, str) and file_kind(filename) != "learner" and direct_caller_is_learner(caller):
                _hit(f"your code made a code object that claims to come from {filename}: write your own")
    finally:
        _STATE.busy = False


class watch_learner:
    """While active, the audit hook enforces rule 3 (and the runtime half of rule 1)."""

    def __enter__(self):
        if not _installed[0]:
            sys.addaudithook(_audit)
            _installed[0] = True
        library_index()  # built before learner code runs, outside the hook
        _ACTIVE[0] += 1
        return self

    def __exit__(self, *exc):
        _ACTIVE[0] -= 1
        return False
