"""bench/repeat.py folds several runs of a bench into one output: every number that moved as
median [min–max] (issue 31: a published figure is the median and range of several runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import load_bench

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_numbers_that_moved_become_median_and_range_and_the_rest_stays() -> None:
    repeat = load_bench("repeat")
    runs = ["minillm 2,989 tok/s = 6.98x HF static\nbatch 16 for everyone\nat 21:46 UTC",
            "minillm 2,604 tok/s = 6.09x HF static\nbatch 16 for everyone\nat 21:50 UTC",
            "minillm 2,950 tok/s = 6.50x HF static\nbatch 16 for everyone\nat 21:58 UTC"]
    folded = repeat.fold_outputs(runs)
    assert folded[0] == "minillm 2,950 [2,604–2,989] tok/s = 6.50 [6.09–6.98]x HF static"
    assert folded[1] == "batch 16 for everyone"  # equal in every run: printed as is
    assert folded[2] == "at 21:50 [46–58] UTC"  # (a clock time is two numbers to this script)


def test_a_line_whose_text_differs_is_printed_from_the_first_run() -> None:
    repeat = load_bench("repeat")
    assert repeat.fold_outputs(["machine A, load 0.3", "machine B, load 0.4"]) == ["machine A, load 0.3"]


def test_a_padded_column_whose_width_moved_is_still_folded() -> None:
    # a table row right-aligns its numbers: "  180.0" in one run is " 1180.0" in another
    repeat = load_bench("repeat")
    folded = repeat.fold_outputs(["round_robin   120    180.0", "round_robin   120   1180.0", "round_robin   120    200.0"])
    assert folded == ["round_robin   120    200.0 [180.0–1180.0]"]


def test_a_ratio_written_after_its_x_is_folded() -> None:
    repeat = load_bench("repeat")
    folded = repeat.fold_outputs(["p99 TTFT x0.96, mean x1.04", "p99 TTFT x1.86, mean x1.06", "p99 TTFT x0.49, mean x1.04"])
    assert folded == ["p99 TTFT x0.96 [0.49–1.86], mean x1.04 [1.04–1.06]"]
    assert repeat.split_numbers("max2 tokens")[1] == []  # a digit glued to a word is not a number


def test_braces_in_a_line_survive() -> None:
    repeat = load_bench("repeat")
    assert repeat.fold_outputs(["{'a': 1}", "{'a': 3}"]) == ["{'a': 2 [1–3]}"]


def test_the_command_line_runs_a_command_and_refuses_one_run(tmp_path) -> None:
    script = "import os; print('pid-free 5 ms'); print('const 1')"
    done = subprocess.run([sys.executable, str(BENCH / "repeat.py"), "-n", "2", "--save", str(tmp_path), "--",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 runs on" in done.stdout and "const 1" in done.stdout and "load average" in done.stdout
    kept = sorted(tmp_path.glob("*-run*.txt"))  # each run's own output, kept beside the folded one
    assert len(kept) == 2 and all(k.read_text() == "pid-free 5 ms\nconst 1\n" for k in kept)
    refused = subprocess.run([sys.executable, str(BENCH / "repeat.py"), "-n", "1", "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "at least 2" in refused.stderr
