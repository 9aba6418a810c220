"""Run a bench several times and print its output folded: every number as median [min–max] (issue 31).

A single timing on a shared 2-core VM moves 10–20 % between runs, so a figure published in README or
docs/ is the median of several runs with its range, the date, the CPU model, the load and the exact
command. This script does that for any bench without knowing its output: it runs the command N
times, splits each output line into its text and its numbers, and where a line has the same text in
every run it prints the line once with each number replaced by `median [min–max]` (a number equal in
every run is printed as is). Lines whose text differs between runs (a timestamp, a machine line) are
printed from the first run.

    python bench/repeat.py -n 3 -- python bench/ladder.py
    python bench/repeat.py -n 3 --keep 'x|tok/s' -- python bench/router.py policies --rate 4

The header says when each run started, the load average before it and the CPU model; `--keep REGEX`
prints only the folded lines matching it (the headline rows), after the header.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "repeat")
# a number not glued to a word, except a ratio written "x0.96" (the benches print ratios so)
NUMBER = re.compile(r"(?:(?<![\w.])|(?<=\bx))[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def split_numbers(line: str) -> tuple[str, list[str]]:
    """('ratio {} at {} tok/s', ['6.98', '2,989']) for 'ratio 6.98 at 2,989 tok/s'."""
    numbers = NUMBER.findall(line)
    return NUMBER.sub("{}", line.replace("{", "{{").replace("}", "}}")), numbers


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _decimals(texts: list[str]) -> int:
    return max((len(t.split(".", 1)[1]) if "." in t and "e" not in t.lower() else 0) for t in texts)


def fold_number(texts: list[str]) -> str:
    """One number as seen in each run: as is when every run printed the same, else median [min–max]."""
    if len(set(texts)) == 1:
        return texts[0]
    values = [_value(t) for t in texts]
    places = _decimals(texts)

    def show(v: float) -> str:
        return f"{v:,.{places}f}" if any("," in t for t in texts) else f"{v:.{places}f}"

    return f"{show(statistics.median(values))} [{show(min(values))}–{show(max(values))}]"


def fold_outputs(outputs: list[str]) -> list[str]:
    """Line by line over the runs' outputs (as long as the shortest); see the module docstring."""
    runs = [out.splitlines() for out in outputs]
    folded = []
    for lines in zip(*runs):
        parts = [split_numbers(line) for line in lines]
        template, _ = parts[0]
        # a padded column's width moves with its number ("  180.0" / " 1180.0"): compare the text, not the spaces
        if any(t.split() != template.split() or len(n) != len(parts[0][1]) for t, n in parts):
            folded.append(lines[0])
            continue
        columns = zip(*(numbers for _, numbers in parts))
        folded.append(template.format(*(fold_number(list(col)) for col in columns)))
    return folded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=3, help="how many times to run the command (>= 2)")
    parser.add_argument("--keep", default=None, help="print only folded lines matching this regex")
    parser.add_argument("--save", default=str(RESULTS), help="folder that keeps each run's own output (git-ignored)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the bench command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to repeat after --, e.g. -- python bench/ladder.py")
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 to give a range (got {args.runs})")
    outputs, header = [], []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        started = datetime.datetime.now(datetime.timezone.utc)
        t0 = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            print(f"run {i + 1} failed (exit {done.returncode}): {shlex.join(command)}", file=sys.stderr)
            return done.returncode
        outputs.append(done.stdout)
        header.append(f"run {i + 1}: {started:%Y-%m-%d %H:%M} UTC, load average {load:.1f} before, "
                      f"{time.monotonic() - t0:.0f} s")
    os.makedirs(args.save, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for i, out in enumerate(outputs):
        with open(os.path.join(args.save, f"{stamp}-run{i + 1}.txt"), "w") as f:
            f.write(out)
    print(f"$ {shlex.join(command)}")
    print(f"{args.runs} runs on {cpu_model()} ({os.cpu_count()} CPUs); every number that moved is "
          f"median [min–max] of the runs")
    print("\n".join(header))
    print(f"each run's own output: {os.path.relpath(args.save, os.getcwd())}/{stamp}-run*.txt")
    keep = re.compile(args.keep) if args.keep else None
    for line in fold_outputs(outputs):
        if keep is None or keep.search(line):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
