"""Chunked prefill: inter-token latency against time to first token as the step budget shrinks (chapter 08).

    python bench/chunked.py [--num-requests 48] [--rate 12] [--budgets 0 512 128 32]

One seeded trace — Poisson arrivals, most prompts short, a heavy tail of long ones (the seeds'
pitfall 1: a long prompt's prefill stalls every running decode) — served by minillm continuous on
the bundled model (fp32, CPU, 1 thread) without chunking (budget 0) and with
`enable_chunked_prefill=True, max_num_batched_tokens=B`; then the same sweep on the 7B/A100
simulator. Printed per budget: p99 and mean ITL, mean and p99 TTFT, output tok/s, and whether the
greedy tokens equal the unchunked run's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.sim import simulate  # noqa: E402
from minillm.traces.synthetic import LengthDist, make_trace  # noqa: E402


def knobs(budget: int) -> dict:
    return {} if budget == 0 else {"enable_chunked_prefill": True, "max_num_batched_tokens": budget}


def row(label: str, s, same: str = "") -> str:
    return (f"{label:>10} {s.itl.percentiles_ms[99]:>10.1f} {s.itl.mean_ms:>9.1f} {s.ttft.mean_ms:>10.1f} "
            f"{s.ttft.percentiles_ms[99]:>10.1f} {s.output_throughput:>8.0f} {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=12.0, help="requests/s (Poisson)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 512, 128, 32])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trace = make_trace(args.num_requests, seed=args.seed, vocab_size=4096, rate_per_s=args.rate,
                       prompt_len=LengthDist.lognormal(150, 1.4), output_len=LengthDist.lognormal(48, 0.4),
                       min_prompt_len=4, max_prompt_len=1800, min_output_len=8, max_output_len=128,
                       token_id_range=(6, 4096))
    longest = max(r.prompt_len for r in trace)
    print(f"machine: {describe_machine()}\ntrace: {len(trace)} requests at {args.rate:g}/s, prompts median "
          f"{sorted(r.prompt_len for r in trace)[len(trace) // 2]} / max {longest} tokens\n")
    header = f"{'budget':>10} {'p99 ITL':>10} {'mean ITL':>9} {'mean TTFT':>10} {'p99 TTFT':>10} {'tok/s':>8}  (ms)"
    print("bundled model on this CPU, max_num_seqs 16\n" + header)
    reference = None
    for budget in args.budgets:
        llm = LLM(max_num_seqs=16, max_model_len=2048, **knobs(budget))
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params,
                            arrival_times=[r.arrival_time_s for r in trace], use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        same = "tokens == unchunked" if tokens == reference else "TOKENS DIFFER"
        print(row("none" if budget == 0 else str(budget), llm.engine.metrics.summary(), same), flush=True)
    print("\n7B on an A100-80GB (simulator), max_num_seqs 64, 20x the rate\n" + header)
    sim_trace = make_trace(args.num_requests * 4, seed=args.seed, vocab_size=32000, rate_per_s=args.rate * 20,
                           prompt_len=LengthDist.lognormal(200, 1.3), output_len=LengthDist.lognormal(128, 0.4),
                           min_prompt_len=4, max_prompt_len=4000, min_output_len=8, max_output_len=512)
    for budget in args.budgets:
        config = {"max_num_seqs": 64, **knobs(budget if budget == 0 else budget * 4)}
        res = simulate(sim_trace, hardware="A100-80GB", model="llama-7b", engine_config=config)
        print(row("none" if budget == 0 else str(budget * 4), res.summary), flush=True)


if __name__ == "__main__":
    main()
