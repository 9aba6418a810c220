"""Answer keys: how a student release grades a task whose reference is grader-private.

Some checks compare the learner's code with a reference minillm does not ship (a variant the exercise
asks for): it lives in `minillm/grading/private/`, which a student release leaves out. For those
tasks the teacher's copy writes an *answer key* (`make exercises`, tools/build_exercises.py):
`minillm/grading/keys/exNN_topic.json` holds, for each case of a fixed pool (case c is built from the
number c), one salted digest of the reference's whole output on that case,

    sha256(salt(exercise, task, c) + canonical_bytes(expected output))   (first 32 hex digits)

and nothing else. The release ships the keys; the check runs the learner's code on pool cases
(the seeded ones, then some drawn at grade time) and compares digests. A digest tells whether two
outputs are the same, never what the expected one is, so a key holds no answer a learner can read.
Two rules keep it so:

- hash a whole output over a case (a schedule of every step of a trace, a transcript of a sequence
  of operations), never a small answer (a yes/no, one index): a small answer space can be searched;
- floats a correct implementation may compute in another order are quantized first (`quantized`),
  or left to property checks; `canonical_bytes` encodes a float exactly (its hex), so an unquantized
  float only matches bit for bit.

One check serves both copies (`AnswerKey.cases`, `Case.expected`, `Case.judge`):

- in the teacher's copy (the private reference is there) the check computes the expected output
  with the reference, as before, and for a pool case also checks that the key's digest is the
  reference's (`StaleAnswerKey` otherwise: the keys are tested wherever a solution is graded), then
  compares the learner's output with it and shows the difference; cases drawn at grade time are
  fresh seeds, as before;
- in a student release (the private module is a stand-in) the seeded pool cases run, then cases
  drawn now from the rest of the pool, and the learner's output is compared by digest: a mismatch
  can only say "differs", with the case's inputs, so a check keeps its property checks (shapes,
  counts, invariants that need no reference) before the comparison, for better messages.

`MINILLM_GRADING_AS_RELEASE=1` in the environment makes this copy grade as a release does (every
private reference withheld): what tests use to run a release's path without building one.

This module imports only the standard library at the top: tools/build_exercises.py loads it by path
(for `fingerprint`) without importing minillm and torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "minillm-answer-key/1"  # in every salt and fingerprint: changing the encoding changes every key
KEYS_DIR = Path(__file__).resolve().parent / "keys"
GRADING_DIR = Path(__file__).resolve().parent
DIGEST_HEX = 32  # 128 bits of sha256: no two outputs of a case collide by chance
AS_RELEASE_ENV = "MINILLM_GRADING_AS_RELEASE"
RELEASE_DIFFERS = ("differs from the expected one (this copy of the course holds only a digest of each "
                   "expected output: it can tell that yours differs, not where; the inputs above rebuild the case)")


class StaleAnswerKey(RuntimeError):
    """An answer key disagrees with the reference it was written from, or is missing: regenerate it
    (`make exercises`). A grading bug, never the learner's."""


# --- the canonical form and the digest -----------------------------------------------------------


def canonical_bytes(value: Any) -> bytes:
    """A byte string that two equal outputs share, whatever containers and number types they use.

    Typed and length-prefixed, so that no two different values encode the same: None; an int (bool,
    numpy and 0-d torch integers included: Python's `True == 1` holds here too) as its decimal; a
    float exactly (its hex: quantize floats a correct answer may round differently first); a str as
    UTF-8; a list or tuple (the same: a check compares items, not containers) item by item; a dict
    and a set sorted by their items' encodings; a numpy array or torch tensor as its nested list.
    Anything else raises TypeError (a check turns objects into plain data before it compares)."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def _encode(value: Any, out: list[bytes]) -> None:
    kind = type(value).__module__.split(".")[0]
    if kind in ("numpy", "torch") and hasattr(value, "tolist"):
        value = value.tolist()  # arrays, tensors and numpy scalars as plain Python data
    if value is None:
        out.append(b"N;")
    elif isinstance(value, bool):
        out.append(b"i%d;" % int(value))
    elif isinstance(value, int):
        out.append(b"i" + int.__repr__(value).encode("ascii") + b";")
    elif isinstance(value, float):
        out.append(b"f" + float.hex(value).encode("ascii") + b";")
    elif isinstance(value, str):
        data = str.encode(value, "utf-8")
        out.append(b"s%d:" % len(data) + data)
    elif isinstance(value, (list, tuple)):
        items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
        parts = [canonical_bytes(item) for item in items]
        out.append(b"l%d[" % len(parts) + b"".join(parts) + b"]")
    elif isinstance(value, dict):
        pairs = sorted(canonical_bytes(k) + canonical_bytes(v) for k, v in dict.items(value))
        out.append(b"d%d{" % len(pairs) + b"".join(pairs) + b"}")
    elif isinstance(value, (set, frozenset)):
        parts = sorted(canonical_bytes(item) for item in value)
        out.append(b"e%d{" % len(parts) + b"".join(parts) + b"}")
    else:
        raise TypeError(f"an answer key compares plain data (None, int, float, str, lists, dicts), not "
                        f"{type(value).__name__}")


def quantized(x: float, step: float) -> int:
    """`x` as a whole number of `step`s (round half to even): a float's canonical form for a key. Two
    correct answers that differ in the last bits quantize alike unless they straddle a half step."""
    return round(float(x) / step)


def salt(exercise: str, task: int, case: int) -> bytes:
    """Per case: the same output in two cases (or tasks) has two different digests."""
    return f"{FORMAT}/{exercise}/task {task}/case {case}\n".encode()


def case_digest(exercise: str, task: int, case: int, value: Any) -> str:
    return hashlib.sha256(salt(exercise, task, case) + canonical_bytes(value)).hexdigest()[:DIGEST_HEX]


# --- key files -----------------------------------------------------------------------------------


def key_path(exercise: str, root: Path | None = None) -> Path:
    return (Path(root) / "minillm" / "grading" / "keys" if root is not None else KEYS_DIR) / f"{exercise}.json"


def declares_keys(grader_source: str) -> bool:
    """Whether a grading module's source declares an answer key (tools/build_exercises.py's test,
    made without importing it)."""
    return re.search(r"^\w+\s*=\s*AnswerKey\(", grader_source, re.MULTILINE) is not None


def fingerprint(exercise: str, root: Path | None = None) -> str:
    """What an exercise's answer key depends on, hashed: the key format, its grading module and its
    grader-private modules. A key whose fingerprint differs is stale (`make check-exercises` says so);
    a change in the library that moves an expected output is caught where solutions are graded (the
    teacher's copy checks each pool case it runs against the key)."""
    grading = Path(root) / "minillm" / "grading" if root is not None else GRADING_DIR
    number = exercise[:4]
    files = [grading / f"{number}.py", *sorted((grading / "private").glob(f"{number}_*.py"))]
    digest = hashlib.sha256(FORMAT.encode())
    for path in files:
        digest.update(f"\n{path.relative_to(grading).as_posix()}\n".encode())
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") if path.exists() else b"(missing)")
    return digest.hexdigest()


def _load(exercise: str) -> dict[str, Any] | None:
    path = key_path(exercise)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def render_keys(exercise: str) -> str:
    """The exact text of `exercise`'s key file, computed with the references (the teacher's copy)."""
    import importlib

    from minillm.grading import _Withheld

    module = importlib.import_module(f"minillm.grading.{exercise[:4]}")
    keys = sorted((value for value in vars(module).values() if isinstance(value, AnswerKey)), key=lambda k: k.task)
    if not keys:
        raise ValueError(f"minillm.grading.{exercise[:4]} declares no AnswerKey")
    if any(isinstance(key.private, _Withheld) for key in keys):
        raise StaleAnswerKey(f"{exercise}: the answer key is written from the grader-private references, which "
                             "this copy does not have (keys are written in the teacher's copy)")
    tasks = {}
    for key in keys:
        if key.exercise != exercise:
            raise ValueError(f"minillm.grading.{exercise[:4]}: task {key.task}'s AnswerKey names {key.exercise!r}")
        tasks[str(key.task)] = {"pool": key.size, "seeded": key.seeded,
                                "digests": [key.digest(case, key.reference(case)) for case in range(key.size)]}
        if key.facts is not None:
            tasks[str(key.task)]["facts"] = [key.facts(case) for case in range(key.size)]
    document = {"about": f"Generated by tools/build_exercises.py (make exercises) from minillm/grading/{exercise[:4]}.py "
                         "and its grader-private references: one salted digest of the expected output per pool case "
                         "(minillm/grading/answer_key.py). Do not edit.",
                "exercise": exercise, "format": FORMAT, "fingerprint": fingerprint(exercise), "tasks": tasks}
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


# --- what a check uses ---------------------------------------------------------------------------


def as_release() -> bool:
    """True when this process grades as a student release does (MINILLM_GRADING_AS_RELEASE=1)."""
    return os.environ.get(AS_RELEASE_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class AnswerKey:
    """One task's answer key, declared at a grading module's top level (tools/build_exercises.py finds
    it there):

        def seat_plans(number):  # the reference's output on the case built from `number`
            return run_plans(_private().SeatScheduler, scenario(number))

        KEY_3 = AnswerKey("ex04_continuous_scheduler", 3, size=256, seeded=70, reference=seat_plans,
                          private=_TEACHERS[0])

    `reference(n)` is the expected output (plain data, see canonical_bytes) of the case built from the
    number n: pool case c is built from c (c < size), a case drawn at grade time in the teacher's copy
    from a fresh seed (>= 10**6). The first `seeded` pool cases run in every grade (the check's seeded
    cases); the others are drawn from in a release. `private` is the grader-private module the
    reference needs: the teacher's copy has it, a release has a stand-in. `facts(n)`, optional, is
    public data about case n that a check needs besides the digest and that gives no answer away (the
    reference's hit rate, which the learner's must come near): written in plain per pool case, read
    back in a release (`Case.facts`). `reference` (and `facts`) is a function
    of the grading module (not a lambda, not a closure): rule 2 of minillm.grading.provenance then
    refuses it to learner code while a check runs. A key's fields are part of the grader's state
    (`minillm.grading.snapshot`): a learner cell that swaps one fails every remaining task."""

    exercise: str
    task: int
    size: int
    seeded: int
    reference: Callable[[int], Any]
    private: Any
    facts: Callable[[int], Any] | None = None
    digests: tuple[str, ...] | None = field(default=None, repr=False)
    stored_facts: tuple[Any, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.seeded <= self.size:
            raise ValueError(f"{self.exercise} task {self.task}: seeded={self.seeded} of a pool of {self.size}")
        for function in (self.reference, self.facts):
            if function is not None and (getattr(function, "__name__", "<lambda>") == "<lambda>"
                                         or getattr(function, "__closure__", None)):
                raise ValueError(f"{self.exercise} task {self.task}: a key's reference and facts are functions of the "
                                 "grading module (not lambdas or closures), so that learner code cannot call them "
                                 "during a check")
        document = _load(self.exercise)  # read now, at the grader's import: before any learner code runs
        entry = (document or {}).get("tasks", {}).get(str(self.task))
        if entry is not None and entry.get("pool") == self.size and document.get("format") == FORMAT:
            object.__setattr__(self, "digests", tuple(entry["digests"]))
            if "facts" in entry:
                object.__setattr__(self, "stored_facts", tuple(entry["facts"]))

    @property
    def teacher(self) -> bool:
        """The reference is here (the teacher's copy): compare with it; else compare digests."""
        from minillm.grading import _Withheld

        return not isinstance(self.private, _Withheld)

    def digest(self, case: int, value: Any) -> str:
        return case_digest(self.exercise, self.task, case, value)

    def _key(self, case: int) -> str:
        if self.digests is None or len(self.digests) != self.size:
            raise StaleAnswerKey(f"no answer key for {self.exercise} task {self.task} in {key_path(self.exercise)} "
                                 "(or one for another pool): regenerate it with `make exercises` in the teacher's copy")
        return self.digests[case]

    def cases(self, fresh: int) -> list[Case]:
        """The cases a check runs: the seeded pool cases, then `fresh` cases drawn now (teacher's copy:
        from seeds no one knows in advance; a release: from the rest of the pool, which only the key
        can answer)."""
        from minillm.grading import grade_time_seeds

        seeded = [Case(self, number, True) for number in range(self.seeded)]
        if self.teacher:
            return seeded + [Case(self, seed, False) for seed in grade_time_seeds(fresh)]
        rest = range(self.seeded, self.size)
        drawn = random.Random(grade_time_seeds(1)[0]).sample(rest, min(fresh, len(rest)))
        return seeded + [Case(self, number, True) for number in drawn]

    def report(self, lines: str | list[str]) -> str | list[str]:
        """A check's PASS lines, with a note in a release that says how it graded."""
        if self.teacher:
            return lines
        return [*([lines] if isinstance(lines, str) else lines),
                f"(graded with the answer key: the cases drawn now come from its pool of {self.size}, compared by digest)"]


@dataclass
class Case:
    """One case of a check: built from `number` (`pool`: a case of the key's pool)."""

    key: AnswerKey
    number: int
    pool: bool
    _want: Any = field(default=None, repr=False)
    _computed: bool = field(default=False, repr=False)

    def expected(self) -> Any:
        """The reference's output on this case (teacher's copy; checked against the key for a pool
        case), or None in a release (the check then compares with `judge` alone)."""
        if not self.key.teacher:
            return None
        if not self._computed:
            self._want, self._computed = self.key.reference(self.number), True
            if self.pool and self.key.digest(self.number, self._want) != self.key._key(self.number):
                raise StaleAnswerKey(f"the answer key of {self.key.exercise} task {self.key.task} "
                                     f"({key_path(self.key.exercise).name}) disagrees with the reference on pool case "
                                     f"{self.number}: regenerate it with `make exercises`")
        return self._want

    def facts(self) -> Any:
        """The key's public facts about this case (`AnswerKey.facts`): computed in the teacher's copy (and
        checked against the key for a pool case), read from the key in a release."""
        key = self.key
        if key.facts is None:
            raise ValueError(f"{key.exercise} task {key.task}: the answer key has no facts")
        stored = None
        if self.pool:
            if key.stored_facts is None or len(key.stored_facts) != key.size:
                raise StaleAnswerKey(f"no facts for {key.exercise} task {key.task} in {key_path(key.exercise)}: "
                                     "regenerate it with `make exercises` in the teacher's copy")
            stored = key.stored_facts[self.number]
        if not key.teacher:
            return stored
        value = key.facts(self.number)
        if self.pool and canonical_bytes(value) != canonical_bytes(stored):
            raise StaleAnswerKey(f"the answer key of {key.exercise} task {key.task} ({key_path(key.exercise).name}) "
                                 f"holds other facts than the reference's on pool case {self.number}: regenerate it "
                                 "with `make exercises`")
        return value

    def judge(self, mine: Any, where: str, explain: Callable[[Any, Any], str] | None = None) -> None:
        """Fail unless the learner's output `mine` (plain data) is the expected one. Teacher's copy:
        compared with the reference's (`explain(mine, want)` says how they differ); a release: by
        digest, and the message is `where` and "differs"."""
        from minillm.grading import Fail

        try:
            mine_bytes = canonical_bytes(mine)
        except TypeError as error:
            raise Fail(f"{where}: your answer cannot be compared: {error}") from None
        if self.key.teacher:
            want = self.expected()
            if mine_bytes != canonical_bytes(want):
                raise Fail(explain(mine, want) if explain is not None else f"{where}: yours {mine!r}, expected {want!r}")
            return
        if hashlib.sha256(salt(self.key.exercise, self.key.task, self.number) + mine_bytes).hexdigest()[:DIGEST_HEX] \
                != self.key._key(self.number):
            raise Fail(f"{where}: your answer {RELEASE_DIFFERS}")


def keyed_tasks(module: Any) -> Iterator[AnswerKey]:
    """The answer keys a grading module declares."""
    for value in vars(module).values():
        if isinstance(value, AnswerKey):
            yield value


if __name__ == "__main__":  # python -m minillm.grading.answer_key exNN_topic: print its key file
    import sys

    # The graders' AnswerKey is the package module's, not this __main__'s: render with that one.
    from minillm.grading.answer_key import render_keys as _render_keys

    sys.stdout.write(_render_keys(sys.argv[1]))
