"""Where a minillm step's time goes, at max batch 16 and 64, on the ladder's trace.

    python bench/step_profile.py [--batch-sizes 16 64] [--num-requests 200]

For each batch size the trace is served twice by minillm continuous (bundled model, fp32, 1 thread,
attention_backend="auto"):
once plainly, to split each step's wall time into the model (forward + lm_head) and everything
around it (scheduling, building inputs, sampling, updating requests, metrics); once under
torch.profiler, to split the model's time by kind of op. Prints one table per batch size.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402  (sets the environment before torch loads)
import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

NUMBA_DECODE = "numba_cpu::paged_decode"  # a profiler range around each call of the @njit decode kernel
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
    named range (the functions are looked up on their module at each call: cpu_paged, model/fused)."""
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
    try:
        yield
    finally:
        for (module, name, _), function in zip(targets, originals):
            setattr(module, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-requests", type=int, default=200)
    cli = parser.parse_args()
    sys.argv = [sys.argv[0], "--num-requests", str(cli.num_requests)]
    args = ladder.parse_args()
    torch.set_num_threads(1)
    trace = ladder.bench_trace(args, ladder.read_hf_config(args.model)["vocab_size"])
    print(f"machine: {describe_machine()}\ntrace: {ladder.describe_trace(trace)}\n")
    print(f"attention backend: {ladder.resolve_backend('auto', 'cpu')}\n")
    for batch in cli.batch_sizes:
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
        print(f"  {'outside the model (schedule, inputs, sampling, update, metrics)':<66} "
              f"{step_ms - model_ms:6.2f} ms  {(step_ms - model_ms) / step_ms:6.1%}")
        for label, _ in [*CATEGORIES, ("other model ops (norms, RoPE, SiLU, …)", ())]:
            share = seconds.get(label, 0.0) / total
            print(f"  {label:<66} {model_ms * share:6.2f} ms  {model_ms * share / step_ms:6.1%}")
        print(f"  decode attention: keys read / keys that exist {ladder.keys_read_ratio(engine.executor.stats())}\n",
              flush=True)


if __name__ == "__main__":
    main()
