"""What quantized KV buys at a fixed memory budget (chapter 14): tokens that fit, preemptions, p99 TTFT.

    python bench/kv_capacity.py                 # the simulated 7B/A100, then the bundled model on this CPU
    python bench/kv_capacity.py --sim-only      # the deterministic part (chapter 14, docs/results.md)

(a) The simulated Llama-2-7B on an A100 with 8 GiB of KV memory (`minillm.kv.capacity`), on the course
    trace and Azure's chat trace: every number repeats on any machine.
(b) The bundled model on this CPU, its pool sized by `num_blocks_in_budget` for the same budget in
    bytes per dtype, the CPU twin of the course trace submitted all at once (offline): the tokens that
    fit and the preemptions are decided by counts alone and repeat; the TTFT is wall time, one run
    under whatever else this machine is doing, and is printed as such.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.kv.capacity import (  # noqa: E402
    KV_CACHE_DTYPES,
    SIM_BUDGET_BYTES,
    capacity_traces,
    format_capacity,
    peak_kv_tokens_unbounded,
    simulate_capacity,
)
from minillm.kv.quant import num_blocks_in_budget  # noqa: E402
from minillm.traces.course import cpu_trace  # noqa: E402

# 2 MiB: 512 float32 tokens of the bundled model (4 layers x 4 KV heads x head_dim 32), one 512-token
# context. The 48 requests together need 3,264 tokens (the longest 210), more than any dtype's pool
# holds at this budget (fp8's 2,048 the most), so memory binds for all three when they arrive at once.
CPU_BUDGET_BYTES = 2 * 2**20
CPU_BLOCK_SIZE = 16
CPU_MAX_MODEL_LEN = 512


def simulated_part() -> None:
    print(f"(a) simulated Llama-2-7B fp16 on an A100 with {SIM_BUDGET_BYTES / 2**30:.0f} GiB of KV memory "
          "(paged, 16-token blocks, recompute on preemption)")
    rows = []
    for name, trace in capacity_traces().items():
        peak = peak_kv_tokens_unbounded(trace)
        print(f"  {name}: {len(trace)} requests; with all 80 GB the fp16 pool peaks at {peak:,} tokens in use")
        rows += simulate_capacity(trace, name, SIM_BUDGET_BYTES)
    print(format_capacity(rows))


def cpu_part() -> None:
    print(f"\n(b) bundled model on this CPU, {CPU_BUDGET_BYTES / 2**20:.0f} MiB of KV per dtype, offline "
          "(all 48 requests of the CPU course trace at once)")
    head = (f"{'kv_cache_dtype':<15} {'bytes/token':>11} {'blocks':>6} {'tokens fit':>10} {'preemptions':>11} "
            f"{'p99 TTFT (s), one run':>22}")
    print(head)
    print("-" * len(head))
    config = LLM(max_num_seqs=1, max_model_len=CPU_MAX_MODEL_LEN).model_config
    trace = cpu_trace(config.vocab_size)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    for dtype in KV_CACHE_DTYPES:
        blocks = num_blocks_in_budget(CPU_BUDGET_BYTES, config, CPU_BLOCK_SIZE, dtype, dtype_bytes=4)
        llm = LLM(kv_cache_dtype=dtype, num_kv_blocks=blocks, block_size=CPU_BLOCK_SIZE, max_num_seqs=64,
                  max_model_len=CPU_MAX_MODEL_LEN)
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False)
        s = llm.engine.metrics.summary()
        print(f"{dtype:<15} {config.kv_bytes_per_token(4, dtype):>11,} {blocks:>6} {blocks * CPU_BLOCK_SIZE:>10,} "
              f"{s.num_preemptions:>11} {s.ttft.percentiles_ms[99] / 1000:>22.2f}")
    print("TTFT above: wall time of one run on a shared CPU; the counts are what repeats.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim-only", action="store_true", help="only the deterministic simulated part")
    args = parser.parse_args()
    print(f"command: python bench/kv_capacity.py{' --sim-only' if args.sim_only else ''}")
    print(f"machine: {describe_machine()}\n")
    simulated_part()
    if not args.sim_only:
        cpu_part()


if __name__ == "__main__":
    main()
