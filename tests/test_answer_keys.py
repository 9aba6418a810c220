"""Answer keys (minillm/grading/answer_key.py): a student release grades the tasks whose reference is
grader-private, and the keys hold no answer.

The canonical form and the digest are checked on small values; the keys in minillm/grading/keys/
against the references on pool cases that no grade of a solution runs (the seeded ones are checked
wherever a solution is graded); and each keyed exercise is graded as a release grades it
(MINILLM_GRADING_AS_RELEASE=1: every private reference withheld, in a fresh process): the solution
passes every keyed task, and every known-wrong answer of those tasks fails.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.grading import answer_key, snapshot, tampered
from minillm.grading.answer_key import AnswerKey, canonical_bytes, case_digest, quantized

REPO_ROOT = Path(__file__).resolve().parent.parent
GRADERS = sorted(p for p in (REPO_ROOT / "minillm" / "grading").glob("ex[0-9][0-9].py")
                 if answer_key.declares_keys(p.read_text(encoding="utf-8")))
KEYED = [p.stem[2:] for p in GRADERS]


def test_equal_outputs_encode_alike_and_different_ones_do_not() -> None:
    assert canonical_bytes([1, (2, "a"), None]) == canonical_bytes((1, [2, "a"], None))
    assert canonical_bytes({"b": 1, "a": [2]}) == canonical_bytes({"a": [2], "b": 1})
    assert canonical_bytes({3, 1, 2}) == canonical_bytes(frozenset([2, 3, 1]))
    assert canonical_bytes(True) == canonical_bytes(1)  # as Python compares them
    different = [1, 1.0, "1", [1], [[1]], None, 0, "", [], {}, [1, 2], [12], ["1", "2"], ["12"], [[1], 2], [1, [2]],
                 {"a": 1}, {"a": "1"}, 0.3, 0.1 + 0.2]
    encoded = [canonical_bytes(value) for value in different]
    assert len(set(encoded)) == len(encoded), [v for v, e in zip(different, encoded) if encoded.count(e) > 1]
    with pytest.raises(TypeError, match="plain data"):
        canonical_bytes([1, object()])


def test_numpy_and_torch_values_encode_as_their_python_values() -> None:
    import numpy as np
    import torch

    assert canonical_bytes(np.int64(7)) == canonical_bytes(7)
    assert canonical_bytes(np.array([[1, 2], [3, 4]])) == canonical_bytes([[1, 2], [3, 4]])
    assert canonical_bytes(torch.tensor([5, -1])) == canonical_bytes([5, -1])
    assert canonical_bytes(torch.tensor(0.5)) == canonical_bytes(0.5)


def test_quantized_floats_forgive_the_last_bits_only() -> None:
    a = 0.1 + 0.2  # 0.30000000000000004
    assert quantized(a, 1e-6) == quantized(0.3, 1e-6) == 300000
    assert quantized(0.3000015, 1e-6) != quantized(0.3, 1e-6)
    assert canonical_bytes(a) != canonical_bytes(0.3)  # unquantized: bit for bit


def test_a_digest_is_salted_per_exercise_task_and_case() -> None:
    value = [[1, 2], [3]]
    digests = {case_digest("ex04_continuous_scheduler", 3, 0, value), case_digest("ex04_continuous_scheduler", 3, 1, value),
               case_digest("ex04_continuous_scheduler", 2, 0, value), case_digest("ex05_block_allocator", 3, 0, value)}
    assert len(digests) == 4
    assert case_digest("ex04_continuous_scheduler", 3, 0, value) == case_digest("ex04_continuous_scheduler", 3, 0,
                                                                              ([1, 2], (3,)))
    assert len(case_digest("ex04_continuous_scheduler", 3, 0, value)) == answer_key.DIGEST_HEX


def _key(number: str) -> list[AnswerKey]:
    module = importlib.import_module(f"minillm.grading.ex{number}")
    return sorted(answer_key.keyed_tasks(module), key=lambda key: key.task)


def test_the_keyed_exercises_include_ex03_ex04_ex05() -> None:
    assert {"03", "04", "05"} <= set(KEYED)


@pytest.mark.parametrize("number", KEYED)
def test_each_key_file_is_in_step_and_holds_only_digests(number: str) -> None:
    keys = _key(number)
    assert keys, f"ex{number} declares no AnswerKey"
    stem = keys[0].exercise
    document = json.loads(answer_key.key_path(stem).read_text(encoding="utf-8"))
    assert document["fingerprint"] == answer_key.fingerprint(stem), "stale: run make exercises"
    assert sorted(document["tasks"]) == sorted(str(key.task) for key in keys)
    for key in keys:
        entry = document["tasks"][str(key.task)]
        assert entry["pool"] == key.size == len(entry["digests"]) and entry["seeded"] == key.seeded
        assert key.digests == tuple(entry["digests"])
        assert all(len(d) == answer_key.DIGEST_HEX and int(d, 16) >= 0 for d in entry["digests"])
        assert len(set(entry["digests"])) == key.size  # salted per case: no two cases share a digest
        assert set(entry) == {"pool", "seeded", "digests"} | ({"facts"} if key.facts is not None else set())
        if key.facts is not None:
            assert key.stored_facts == tuple(entry["facts"]) and len(entry["facts"]) == key.size
    assert set(document) == {"about", "exercise", "format", "fingerprint", "tasks"}


@pytest.mark.parametrize("number", KEYED)
def test_keys_agree_with_the_references_on_unseeded_pool_cases(number: str) -> None:
    """The seeded pool cases are checked against the key wherever a solution is graded; two drawn now
    from the rest of each pool (what only a release runs) are checked here."""
    draw = random.SystemRandom()
    for key in _key(number):
        for case in draw.sample(range(key.seeded, key.size), min(2, key.size - key.seeded)):
            assert key.digest(case, key.reference(case)) == key.digests[case], (
                f"ex{number} task {key.task}: the key disagrees with the reference on pool case {case}: "
                "run make exercises")
            if key.facts is not None:
                assert canonical_bytes(key.facts(case)) == canonical_bytes(key.stored_facts[case]), (number, key.task, case)


def test_swapping_a_keys_digests_is_tampering() -> None:
    key = _key("04")[0]
    before = snapshot()
    saved = key.digests
    object.__setattr__(key, "digests", tuple("0" * answer_key.DIGEST_HEX for _ in range(key.size)))
    try:
        assert "minillm.grading.ex04.KEY_1" in tampered(before)
    finally:
        object.__setattr__(key, "digests", saved)
    assert tampered(before) == []


# --- graded as a release grades: every private reference withheld, in a fresh process -------------

_RELEASE_RUN = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
from known_wrong import run_task
from minillm.grading import answer_key
number = sys.argv[2]
keyed = sorted(key.task for key in answer_key.keyed_tasks(importlib.import_module(f"minillm.grading.ex{number}")))
mutants = [m for m in importlib.import_module(f"known_wrong.ex{number}").KNOWN_WRONG if m.task in keyed]
out = {"keyed": keyed, "solution": {t: run_task(number, t).to_json() for t in keyed},
       "mutants": [[m.task, m.name, run_task(number, m.task, m).to_json()] for m in mutants]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("number", KEYED)
def test_a_release_grades_every_keyed_task_passes_the_solution_and_fails_each_known_wrong(number: str) -> None:
    env = dict(os.environ, **{answer_key.AS_RELEASE_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _RELEASE_RUN, str(REPO_ROOT / "tests"), number], env=env,
                          capture_output=True, text=True, timeout=1500, cwd=REPO_ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["keyed"], f"ex{number}: no keyed task"
    for task, result in out["solution"].items():
        assert result["passed"] and not result["withheld"], (task, result)
        assert any("graded with the answer key" in line for line in result["lines"]), (task, result)
    passed = [(task, name) for task, name, result in out["mutants"] if result["passed"] or result["withheld"]]
    assert not passed, f"ex{number}: known-wrong answers a release does not fail: {passed}"
    by_digest = {task for task, _, result in out["mutants"] if "differs from the expected one" in " ".join(result["lines"])}
    assert by_digest == set(out["keyed"]), f"ex{number}: tasks where no known-wrong answer met the key: " \
                                           f"{set(out['keyed']) - by_digest}"
