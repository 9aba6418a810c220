"""The prefix cache's offload tier on the multi-tenant trace, priced by the simulator (chapter 14).

    python bench/offload.py                                  # 96 tenants, 2048-token system prompts, llama-7b / A100
    python bench/offload.py --model llama-7b-gqa --tenants 384

Replays one tenant trace (minillm/traces/tenant.py) three times through the real scheduler and KV
manager on simulated hardware — no prefix cache, the device prefix cache, the device cache with a
host tier (`kv_offloading_size`) — and prints hit rates, host hits, prompt tokens computed, blocks
moved, the seconds the host link carried, and the prefix-hit economics: recompute saved against
transfer (minillm/sim/offload_economics.py). Simulated: the same numbers on every machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from minillm.sim.offload_economics import format_offload_economics, offload_economics
from minillm.traces.tenant import make_tenant_trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tenants", type=int, default=96)
    parser.add_argument("--system-prompt-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=0.5, help="tenant popularity skew (0: equal)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default="A100-80GB")
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--host-gib", type=float, default=64.0, help="the host tier (kv_offloading_size)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, int8 or fp8_e4m3: fewer bytes per copy")
    args = parser.parse_args(argv)
    print("$ python bench/offload.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    trace = make_tenant_trace(args.requests, num_tenants=args.tenants, system_prompt_len=args.system_prompt_len,
                              question_len=args.question_len, output_len=args.output_len, zipf_s=args.zipf,
                              seed=args.seed, vocab_size=32000, rate_per_s=args.rate)
    print(f"trace: {args.requests} requests, {args.tenants} tenants (zipf {args.zipf:g}), system prompt "
          f"{args.system_prompt_len} + question {args.question_len} tokens, {args.output_len} out, {args.rate:g} req/s")
    print(format_offload_economics(offload_economics(trace, hardware=args.hardware, model=args.model,
                                                     host_gib=args.host_gib,
                                                     engine_config={"kv_cache_dtype": args.kv_cache_dtype})))


if __name__ == "__main__":
    main()
