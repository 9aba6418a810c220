"""The two CPU attention backends against each other: the measurement behind attention_backend="auto".

    python bench/attention_backends.py [--num-requests 200] [--repeats 3] [--quick]

1. One decode layer call at the ladder's shapes (bundled target: 8 query / 4 KV heads, head_dim 32,
   block 16; 16 sequences of 17-224 tokens, blocks scattered over the pool): "torch" (length groups
   gathered block by block, one SDPA per group; the runner's grouping) vs "numba_cpu" (the @njit
   kernel reading the pool in place), calls interleaved, median of each, µs per call (CPU time).
2. The ladder's trace served by minillm continuous (max batch 16, fp32, 1 thread) on each backend,
   round-robin, best of `--repeats`: output tok/s and tokens per CPU-second, greedy tokens compared.
3. The kernel's first-call cost in a fresh process: compiling with an empty numba cache (what a clean
   CI machine pays once), then loading it from the on-disk cache (what every later process pays).

minillm/attention/select.py makes "auto" pick "numba_cpu" on a CPU because of these numbers; rerun
this on a new machine and change that rule if torch comes out ahead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402  (sets the environment before torch loads)
import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402

from minillm.attention.select import make_attention  # noqa: E402
from minillm.kv.block_manager import BlockManager  # noqa: E402
from minillm.request import Request, SamplingParams  # noqa: E402
from minillm.scheduler.base import SchedulerPlan  # noqa: E402
from minillm.scheduler.output import SchedulerOutputBuilder  # noqa: E402
from minillm.worker.model_runner import ModelRunner  # noqa: E402

BACKENDS = ("torch", "numba_cpu")


def decode_layer_call(backend: str, lens: list[int], h_q=8, h_kv=4, d=32, block_size=16, seed=0):
    """A function running one layer's decode attention for sequences of `lens` tokens."""
    torch.manual_seed(seed)
    kv = BlockManager(1, h_kv, d, 4 * sum(lens) // block_size + 64, block_size, max_model_len=max(lens) + 1)
    # scatter each sequence's blocks: allocate a throwaway request between real ones
    reqs = []
    for i, n in enumerate(lens):
        filler = Request(f"f{i}", [5] * block_size * (1 + i % 3), SamplingParams(), 0.0)
        kv.allocate(filler, len(filler.prompt_token_ids))
        req = Request(f"r{i}", [5] * n, SamplingParams(), 0.0)
        assert kv.allocate(req, n)
        req.num_computed_tokens = n - 1
        reqs.append(req)

    class Model:
        device, dtype = torch.device("cpu"), torch.float32
        fused_ops = None  # a stand-in with no layers: never the compiled decode step (model/decode_step.py asks)

        class config:  # noqa: N801 - stands in for a ModelConfig
            sliding_windows = (None,)

    runner = ModelRunner(Model(), kv.cache_spec, backend)  # the worker holds the pools
    plan = SchedulerOutputBuilder(kv).build(SchedulerPlan(reqs, [1] * len(reqs)))
    runner.update_state(plan)
    runner.k_pool.normal_()
    runner.v_pool.normal_()
    meta = runner.prepare(plan).meta
    attention = make_attention(runner.attention_backend, runner.k_pool, runner.v_pool, meta, (None,))
    q, k, v = torch.randn(len(lens), h_q, d), torch.randn(len(lens), h_kv, d), torch.randn(len(lens), h_kv, d)
    return lambda: attention(0, q, k, v)


def interleaved_medians_us(fns: dict, repeats: int, calls: int = 20) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - t0) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


FIRST_CALL = """
import time, torch
t0 = time.perf_counter()
from minillm.kernels import paged_attention_decode_cpu
q, k = torch.randn(2, 8, 32), torch.randn(4, 16, 4, 32)
t1 = time.perf_counter()
paged_attention_decode_cpu(q, k, k, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                           torch.tensor([20, 30], dtype=torch.int32), 0.2)
print(f"{t1 - t0:.2f} {time.perf_counter() - t1:.2f}")
"""


def first_call_s(cache_dir: str) -> tuple[float, float]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=600,
                         check=True)
    import_s, call_s = out.stdout.split()
    return float(import_s), float(call_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="40 requests, 1 round")
    cli = parser.parse_args()
    if cli.quick:
        cli.num_requests, cli.repeats = 40, 1
    torch.set_num_threads(1)
    print(f"machine: {describe_machine()}\n")

    lens = torch.randint(17, 225, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    us = interleaved_medians_us({b: decode_layer_call(b, lens) for b in BACKENDS}, repeats=15)
    print(f"1. one decode layer call, 16 sequences of {min(lens)}-{max(lens)} tokens (8 q / 4 KV heads, D=32, "
          f"block 16), median CPU µs: " + ", ".join(f"{b} {t:.0f}" for b, t in us.items())
          + f"; torch / numba_cpu = {us['torch'] / us['numba_cpu']:.2f}")

    sys.argv = [sys.argv[0], "--num-requests", str(cli.num_requests)]
    args = ladder.parse_args()
    trace = ladder.bench_trace(args, ladder.read_hf_config(args.model)["vocab_size"])
    best: dict[str, ladder.Run] = {}
    for _ in range(cli.repeats):
        for backend in BACKENDS:
            llm = ladder.make_measured_llm(args.model, "cpu", "continuous", args.batch_size,
                                           attention_backend=backend)
            run = ladder.run_minillm(llm, "continuous", trace)
            if backend not in best or run.wall_s < best[backend].wall_s:
                best[backend] = run
    tok_s = {b: r.summary.output_throughput for b, r in best.items()}
    per_cpu = {b: r.summary.total_output_tokens / r.cpu_s for b, r in best.items()}
    same = sum(a == b for a, b in zip(best["torch"].tokens, best["numba_cpu"].tokens))
    print(f"2. minillm continuous on the ladder trace ({len(trace)} requests, max batch {args.batch_size}, best of "
          f"{cli.repeats}): output tok/s " + ", ".join(f"{b} {t:.0f}" for b, t in tok_s.items())
          + f" (numba_cpu / torch = {tok_s['numba_cpu'] / tok_s['torch']:.2f}); per CPU-second "
          + ", ".join(f"{b} {t:.0f}" for b, t in per_cpu.items())
          + f" ({per_cpu['numba_cpu'] / per_cpu['torch']:.2f}); greedy tokens equal for {same} of {len(trace)}")

    with tempfile.TemporaryDirectory() as cache:
        cold_import, cold = first_call_s(cache)
        _, warm = first_call_s(cache)
    print(f"3. first call in a fresh process: {cold:.2f} s with an empty numba cache (compile), {warm:.2f} s from "
          f"the on-disk cache (import of numba + kernel module: {cold_import:.2f} s)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
