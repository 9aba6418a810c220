"""How many torch threads pay for a step of each size, per dtype: the measurement behind
minillm/worker/threads.py's `THREADS_BY_TOKENS`.

    python bench/threads.py [--dtypes float32 bfloat16] [--decode-rows 8 16 64] [--prefill-tokens 64 256 1024]
                            [--max-threads N] [--rounds 5] [--steps 20]

The bundled model (continuous batching, the engine's own op-by-op step: the compiled decode step
of minillm/model/decode_step.py is switched off, it runs one thread whatever the count) serves two
kinds of step: decode steps of R rows (R requests decoding together, 200-token prompts) and
prefill steps of T tokens (one request's prompt). For each size, each dtype and each thread count
1 … N, `--rounds` interleaved rounds time `--steps` steps each; the table gives each count's speed
÷ 1 thread as the median and range over the rounds. A count "pays" at a size when even its worst
round is 10 % faster than one thread there, and at every larger size measured; the printed rule is
the table to copy into minillm/worker/threads.py. On a machine whose cores are shared with other
work, a second thread that waits for its core shows up here as a loss: run it on a quiet machine,
and keep one thread where you cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402  (sets the environment before torch loads)
import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.worker.threads import StepThreads  # noqa: E402

PAYS = 1.10  # a thread count pays when its worst round is this much faster than one thread
PROMPT = 200


def make_llm(dtype: str, max_rows: int) -> LLM:
    llm = LLM(dtype=dtype, max_num_seqs=max_rows, max_model_len=2048, enable_prefix_caching=False)
    llm.engine.executor.worker.compiled_decode = None  # the op-by-op step, which threads can split
    return llm


def time_decode(llm: LLM, rows: int, steps: int) -> float:
    """Seconds per decode step of `rows` rows."""
    engine = llm.engine
    for i in range(rows):
        prompt = [ladder.NUM_SPECIAL_TOKENS + (11 * i + j) % 1000 for j in range(PROMPT)]
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps


def time_prefill(llm: LLM, tokens: int, steps: int) -> float:
    """Seconds per prefill step of `tokens` tokens (one request's prompt, then it stops)."""
    engine, total = llm.engine, 0.0
    for k in range(steps):
        prompt = [ladder.NUM_SPECIAL_TOKENS + (13 * k + j) % 1000 for j in range(tokens)]
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        total += time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
    return total / steps


def measure(llm: LLM, kind: str, size: int, threads: list[int], rounds: int, steps: int) -> dict[int, list[float]]:
    """Per thread count: speed ÷ 1 thread in each round (counts interleaved within a round)."""
    worker = llm.engine.executor.worker
    speedups: dict[int, list[float]] = {n: [] for n in threads}
    for _ in range(rounds):
        seconds = {}
        for n in threads:
            worker.threads = StepThreads(llm.model.dtype, num_threads=n)  # sets n now, and holds it
            seconds[n] = (time_decode if kind == "decode" else time_prefill)(llm, size, steps)
        for n in threads:
            speedups[n].append(seconds[1] / seconds[n])
    return speedups


def rule(results: dict[int, list[dict[int, list[float]]]]) -> list[tuple[int, int]]:
    """[(fewest tokens, threads)]: from each size on, the most threads that pay there (for every kind
    of step measured at that size) and at every larger size."""
    sizes = sorted(results)
    best = {}
    for size in sizes:
        best[size] = min(max([n for n, r in speedups.items() if n > 1 and min(r) >= PAYS], default=1)
                         for speedups in results[size])
    table, suffix_min = [], None
    for size in reversed(sizes):  # a count that stops paying at a larger size is not trusted below it
        suffix_min = best[size] if suffix_min is None else min(suffix_min, best[size])
        best[size] = suffix_min
    for size in sizes:
        if not table or table[-1][1] != best[size]:
            table.append((size, best[size]))
    if table[0][0] != 1:
        table = [(1, 1), *table] if table[0][1] != 1 else [(1, 1), *table[1:]]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--max-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.max_threads)
    threads = list(range(1, args.max_threads + 1))
    print(f"machine: {describe_machine()}")
    print(f"bundled model, op-by-op step; threads {threads}; {args.rounds} interleaved rounds of {args.steps} steps; "
          f"speed ÷ 1 thread, median (range)\n")
    table = {}
    for dtype in args.dtypes:
        llm = make_llm(dtype, max(args.decode_rows))
        results: dict[int, list[dict[int, list[float]]]] = {}
        sizes = [("decode", r) for r in args.decode_rows] + [("prefill", t) for t in args.prefill_tokens]
        for kind, size in sizes:
            speedups = measure(llm, kind, size, threads, args.rounds, args.steps)
            results.setdefault(size, []).append(speedups)
            cells = "  ".join(f"{n} threads {statistics.median(r):.2f}× ({min(r):.2f}–{max(r):.2f})"
                              for n, r in speedups.items() if n > 1)
            print(f"  {dtype:<9} {kind:<7} {size:>5} tokens: {cells}", flush=True)
        table[dtype] = rule(results)
    print("\nTHREADS_BY_TOKENS for minillm/worker/threads.py (fewest tokens, threads):")
    for dtype, steps in table.items():
        print(f"    torch.{dtype}: {steps},")


if __name__ == "__main__":
    main()
