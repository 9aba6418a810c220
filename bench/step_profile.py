"""Where a minillm step's time goes: small batches as one chat, max batch 16 and 64 on the ladder's trace.

    python bench/step_profile.py [--batch-sizes 16 64] [--num-requests 200] [--profiler-table 15]
    python bench/step_profile.py --batch-sizes 1 2 4 8
    python bench/step_profile.py --batch-sizes 1 2 4 8 16 32 --compare [--rounds 5]
    python bench/step_profile.py --calls

Every run uses the bundled model, fp32, 1 thread, attention_backend="auto".

**Small batches (below 16)**: B requests decoding together, each a 200-token prompt and 128
generated tokens (issue 29's single-stream measurement when B = 1). For each B, a table per piece
of the step (minillm/worker/step_counts.py names them: schedule, plan → data, apply plan, inputs
and metadata, forward and lm_head, sample, update requests, outputs and metrics, the step's glue):
its wall ms per decode step and share, and its counts per step — Python calls and torch ops
(dispatched from Python / all) — with the compiled decode step (minillm/model/decode_step.py, taken
up to its MAX_ROWS rows) and without it (the op-by-op forward), so each count's before/after is on
one line. Counts are exact and repeat on any machine; the ms move with the machine's load.
`--compare` prints instead, for every batch size listed (this workload, MAX_ROWS lifted), the
wall-clock ratio op-by-op ÷ compiled per decode step in `--rounds` interleaved rounds (median and
range), which is how `MAX_ROWS` is chosen.

`--calls` prints only counts, in a few seconds: Python calls per batch-1 decode step by piece, in
`engine.step()` and inside `LLM.generate` (its loop around the steps included; tests/test_step_counts.py
holds both under upper bounds).

**Max batch 16 and 64**: the ladder's trace (bench/ladder.py) is served twice by minillm
continuous: once plainly, to split each step's wall time into the model (forward + lm_head) and
everything around it (scheduling, building inputs, sampling, updating requests, metrics); once
under torch.profiler, to split the model's time by kind of op. Prints one table per batch size; each
kind's share of the profiled ops is the sum of torch's own `Self CPU %` over its ops, which
`--profiler-table ROWS` prints beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402  (sets the environment before torch loads)
import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from minillm import SamplingParams  # noqa: E402
from minillm.worker.step_counts import (  # noqa: E402
    GENERATE_LOOP,
    GLUE,
    PIECES,
    count_generate_decode_step,
    count_steps,
    timed_pieces,
    total,
)

CHAT_PROMPT, CHAT_TOKENS = 200, 128  # one chat's request, as issue 29 measured llama.cpp and minillm
SMALL = 16  # batch sizes below this run the chat workload

NUMBA_DECODE = "numba_cpu::paged_decode"  # a profiler range around each call of the @njit decode kernel
COMPILED_STEP = "numba_cpu::decode_step"  # ... and around each compiled decode step (minillm/model/decode_step.py)
# (label, op names), first match wins; the rest is "other model ops". The float32 CPU forward runs
# its matmuls as oneDNN's `mkldnn::_linear_pointwise` on packed weights (minillm/model/fused.py),
# one-row ones and other dtypes as `aten::mm` / `aten::addmm` under `aten::linear` / `aten::matmul`
# (those two wrappers have almost no self time of their own, but count them where they do).
MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
CATEGORIES = [
    ("matmuls (q|k|v, o, gate|up, down, lm_head)", MATMUL_OPS),
    ("attention (SDPA, numba_cpu decode kernel)", ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                                   "aten::_scaled_dot_product_attention_math",
                                                   "aten::scaled_dot_product_attention", NUMBA_DECODE)),
    ("KV reads/writes (block gathers, cache writes, zeroing)", ("aten::index_select", "aten::index_copy_",
                                                               "aten::index_fill_")),
    ("compiled decode steps (the whole forward, steps of few rows)", (COMPILED_STEP,)),
]


def categorize(prof) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        label = next((lab for lab, names in CATEGORIES if event.key in names), "other model ops (norms, RoPE, SiLU, …)")
        seconds[label] += event.self_cpu_time_total / 1e6
    return seconds


@contextmanager
def numba_calls_in_ranges():
    """The profiler sees torch ops only: while profiling, each call of a numba function runs in a
    named range (the functions are looked up on their module at each call: cpu_paged, model/fused),
    and so does each compiled decode step."""
    from minillm.kernels import cpu_decode_attention, cpu_fused_ops

    targets = [(cpu_decode_attention, name, NUMBA_DECODE) for name in ("paged_decode_f32", "paged_decode_f64")] + [
        (cpu_fused_ops, name, f"numba_cpu::{name}") for name in ("add_rms_norm", "rms_norm", "rotary")]
    originals = [getattr(module, name) for module, name, _ in targets]

    def in_a_range(function, label):
        def wrapped(*args):
            with record_function(label):
                function(*args)
        return wrapped

    for (module, name, label), function in zip(targets, originals):
        setattr(module, name, in_a_range(function, label))
    from minillm.model.decode_step import CompiledDecode

    run = CompiledDecode.run

    def run_in_a_range(self, *args):
        with record_function(COMPILED_STEP):
            return run(self, *args)
    CompiledDecode.run = run_in_a_range
    try:
        yield
    finally:
        CompiledDecode.run = run
        for (module, name, _), function in zip(targets, originals):
            setattr(module, name, function)


def chat_engine(model, batch: int, compiled: bool):
    """An engine holding `batch` chat requests, prefilled: what follows are decode steps of `batch` rows."""
    llm = ladder.make_measured_llm(model, "cpu", "continuous", max(batch, 2))
    engine = llm.engine
    if not compiled:
        engine.executor.worker.compiled_decode = None
    for i in range(batch):
        prompt = [ladder.NUM_SPECIAL_TOKENS + (7 * i + j) % 1000 for j in range(CHAT_PROMPT)]
        engine.add_request(prompt, SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    return engine


def decode_ms_per_step(engine, num_steps: int, pieces: bool = True) -> tuple[float, dict[str, float]]:
    """Mean wall ms of the engine's next `num_steps` steps, and each piece's (timed only with `pieces`)."""
    seconds: dict[str, float] = {}
    with timed_pieces(engine) if pieces else nullcontext(seconds) as seconds:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        elapsed = time.perf_counter() - start
    return 1e3 * elapsed / num_steps, {p: 1e3 * s / num_steps for p, s in seconds.items()}


def small_batch_table(model, batch: int) -> None:
    steps = CHAT_TOKENS // 2 - 2
    counts, ms = {}, {}
    for compiled in (False, True):
        ms[compiled] = decode_ms_per_step(chat_engine(model, batch, compiled), steps)
        counts[compiled] = count_steps(chat_engine(model, batch, compiled), 10)
    engine = chat_engine(model, batch, True)
    taken = engine.executor.worker.compiled_decode
    mode = ("compiled" if taken is not None and batch <= taken.max_rows
            else f"op-by-op ({engine.executor.worker.compiled_decode_off or 'above MAX_ROWS'})")
    print(f"batch {batch}: {batch} request(s) of a {CHAT_PROMPT}-token prompt and {CHAT_TOKENS} tokens; "
          f"the engine's decode step here: {mode}")
    print(f"  {'per decode step':<18} {'ms op-by-op':>11} {'ms engine':>10}   {'Python calls':>14}   "
          f"{'torch ops from Python':>21}   {'torch ops, all':>14}")
    for piece in PIECES:
        row = [ms[False][1].get(piece, 0.0), ms[True][1].get(piece, 0.0)]
        if piece == GLUE:
            row = [ms[c][0] - sum(ms[c][1].values()) for c in (False, True)]
        a, b = counts[False][piece], counts[True][piece]
        print(f"  {piece:<18} {row[0]:11.3f} {row[1]:10.3f}   {a.python_calls:6.0f} → {b.python_calls:5.0f}   "
              f"{a.torch_ops_from_python:12.0f} → {b.torch_ops_from_python:5.0f}   "
              f"{a.torch_ops:6.0f} → {b.torch_ops:5.0f}")
    a, b = total(counts[False]), total(counts[True])
    print(f"  {'whole step':<18} {ms[False][0]:11.3f} {ms[True][0]:10.3f}   {a.python_calls:6.0f} → {b.python_calls:5.0f}   "
          f"{a.torch_ops_from_python:12.0f} → {b.torch_ops_from_python:5.0f}   {a.torch_ops:6.0f} → {b.torch_ops:5.0f}")
    print("  (ms: means per decode step; the machine's load moves them. Counts: exact, op-by-op → engine.)\n",
          flush=True)


def calls_table(model) -> None:
    """Python calls per batch-1 decode step, by piece: in engine.step() (10 steps counted) and inside
    LLM.generate (two generates differing by 32 tokens, the difference per token)."""
    in_step = count_steps(chat_engine(model, 1, True), 10)
    llm = ladder.make_measured_llm(model, "cpu", "continuous", 2)
    prompt = [ladder.NUM_SPECIAL_TOKENS + j % 1000 for j in range(CHAT_PROMPT)]
    in_generate = count_generate_decode_step(llm, prompt)
    print(f"Python calls per batch-1 decode step ({CHAT_PROMPT}-token prompt, greedy; exact counts):")
    print(f"  {'piece':<18} {'engine.step()':>13} {'LLM.generate':>13}")
    for piece in (*PIECES, GENERATE_LOOP):
        step = in_step[piece].python_calls if piece in in_step else 0.0
        print(f"  {piece:<18} {step:13.1f} {in_generate[piece]:13.1f}")
    print(f"  {'whole step':<18} {total(in_step).python_calls:13.1f} {sum(in_generate.values()):13.1f}\n", flush=True)


def compare(model, batch_sizes: list[int], rounds: int) -> None:
    """op-by-op ÷ compiled wall time per decode step, interleaved rounds: median and range."""
    print(f"compiled decode vs the op-by-op forward, {rounds} interleaved rounds (MAX_ROWS lifted to measure "
          "every batch size):")
    steps = CHAT_TOKENS // 2 - 2
    for batch in batch_sizes:
        ratios = []
        for _ in range(rounds):
            plain = decode_ms_per_step(chat_engine(model, batch, False), steps, pieces=False)[0]
            engine = chat_engine(model, batch, True)
            engine.executor.worker.compiled_decode.max_rows = max(batch_sizes)
            ratios.append(plain / decode_ms_per_step(engine, steps, pieces=False)[0])
        print(f"  batch {batch:>3}: op-by-op ÷ compiled {statistics.median(ratios):.2f}× "
              f"(range {min(ratios):.2f}–{max(ratios):.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--compare", action="store_true", help="small batches: compiled vs op-by-op, interleaved")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --compare")
    parser.add_argument("--calls", action="store_true", help="only the Python calls per batch-1 decode step")
    parser.add_argument("--profiler-table", type=int, default=0, metavar="ROWS",
                        help="max batch 16 and up: also print torch.profiler's own table, its ROWS costliest ops")
    cli = parser.parse_args()
    sys.argv = [sys.argv[0], "--num-requests", str(cli.num_requests)]
    args = ladder.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe_machine()}")
    print(f"attention backend: {ladder.resolve_backend('auto', 'cpu')}\n")
    if cli.calls:
        calls_table(args.model)
        return
    if cli.compare:
        compare(args.model, cli.batch_sizes, cli.rounds)
        return
    for batch in [b for b in cli.batch_sizes if b < SMALL]:
        small_batch_table(args.model, batch)
    large = [b for b in cli.batch_sizes if b >= SMALL]
    if large:
        trace = ladder.bench_trace(args, ladder.read_hf_config(args.model)["vocab_size"])
        print(f"trace: {ladder.describe_trace(trace)}\n")
    for batch in large:
        plain = ladder.run_minillm(ladder.make_measured_llm(args.model, "cpu", "continuous", batch), "continuous",
                                   trace)
        engine = plain.engine
        num_steps = len(plain.steps)
        step_ms = 1e3 * engine.time_in_steps_s / num_steps
        model_ms = 1e3 * engine.executor.stats().model_time_s / num_steps
        llm = ladder.make_measured_llm(args.model, "cpu", "continuous", batch)
        with numba_calls_in_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
            ladder.run_minillm(llm, "continuous", trace)
        seconds = categorize(prof)
        total = sum(seconds.values())
        print(f"max batch {batch}: {num_steps} steps, {plain.summary.output_throughput:.0f} output tok/s, "
              f"{step_ms:.2f} ms per step")
        print(f"  {'':<66} {'ms':>6}     {'step':>6}  {'profiled':>8}")
        print(f"  {'outside the model (schedule, inputs, sampling, update, metrics)':<66} "
              f"{step_ms - model_ms:6.2f} ms  {(step_ms - model_ms) / step_ms:6.1%}")
        for label, _ in [*CATEGORIES, ("other model ops (norms, RoPE, SiLU, …)", ())]:
            share = seconds.get(label, 0.0) / total
            print(f"  {label:<66} {model_ms * share:6.2f} ms  {model_ms * share / step_ms:6.1%}  {share:8.1%}")
        print("  (step: share of the step's wall time, the model's time split as the profiled ops split; "
              "profiled: share of the\n   profiled ops' self time, the sum of torch's `Self CPU %` over the "
              "category's rows in --profiler-table)")
        if cli.profiler_table:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=cli.profiler_table))
        print(f"  decode attention: keys read / keys that exist {ladder.keys_read_ratio(engine.executor.stats())}\n",
              flush=True)


if __name__ == "__main__":
    main()
