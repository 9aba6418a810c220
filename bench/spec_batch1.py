"""Speculative decoding at batch 1: n-gram and draft model against plain decoding, on the wall clock.

    python bench/spec_batch1.py [--repeats 5] [--num-prompts 8] [--max-tokens 64] [--k 4] [--k 2 4 6]

One user, one stream (max_num_seqs=1), greedy, fp32, 1 thread; the bundled target, the bundled draft.
Three workloads, each served by plain decoding, n-gram prompt lookup and the draft model:

- chat-like: chapter 09's free-form trace, King James verses cut at a random point;
- code-like: chapter 09's quote trace, a prompt, the target's own continuation, the prompt again: the
  answer copies its context, as an edit of a code file copies the file;
- Azure code lengths: prompt and output lengths of the first requests of Azure's coding-assistant
  trace (minillm/traces/azure.py; prompts × `--azure-prompt-scale`, clipped to 1,024 tokens; outputs as
  they are, clipped to `--max-tokens`), the prompt text cut from the same verses (the trace has no text).

The systems run interleaved (`minillm.spec.measure`): every repetition serves the workload with each
system in turn, the order rotating; what is kept is plain decoding's time ÷ the system's within a
repetition, printed as the median over `--repeats` and its min–max. The same ratio on this process's
CPU time is printed beside it (a neighbour's load inflates wall time, much less CPU time). Printed
before and after the table: where the target's weights come from right now (reads of a buffer their size
against a 256 MiB one), which decides what a verify step costs next to a plain one. Printed
with it, deterministic whatever the load: target forward passes, acceptance rate, tokens per verify
step. Every system's greedy tokens are checked equal to plain decoding's. Several `--k` values run
each proposer once per k, in the same interleaved repetitions: which k pays is read off one table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _machine import describe_machine, describe_memory  # noqa: E402
from spec import VERSES, prompts_from_verses  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.spec.measure import Speedup, interleaved_runs  # noqa: E402
from minillm.traces.azure import azure_trace  # noqa: E402


def workloads(tokenizer, plain: LLM, args) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name -> (prompts as token ids, max_tokens per prompt)."""
    free = [tokenizer.encode(p) for p in prompts_from_verses(args.num_prompts, args.seed)]
    outs = plain.generate([{"prompt_token_ids": p} for p in free],
                          SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    quote = [o.prompt_token_ids + o.outputs[0].token_ids + o.prompt_token_ids for o in outs]
    trace = azure_trace("code", max_requests=args.num_prompts, length_scale=(args.azure_prompt_scale, 1.0),
                        max_prompt_len=1024, max_output_len=args.max_tokens, min_prompt_len=8)
    text = tokenizer.encode(" ".join(VERSES) + " ") * 40  # (encoded once: the tokenizer warns past 2,048 tokens)
    rng = random.Random(args.seed)
    azure = []
    for r in trace:
        start = rng.randrange(len(text) - r.prompt_len)
        azure.append(text[start : start + r.prompt_len])
    n = args.max_tokens
    return {"chat-like": (free, [n] * len(free)), "code-like": (quote, [n] * len(quote)),
            "Azure code lengths": (azure, [r.max_tokens for r in trace])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens (one or more)")
    parser.add_argument("--azure-prompt-scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"command: python bench/spec_batch1.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {describe_machine()}")
    print(f"bundled target + draft, fp32, 1 thread, batch 1 (max_num_seqs=1), greedy, k = {', '.join(map(str, args.k))}; "
          f"{args.num_prompts} prompts per workload, {args.repeats} interleaved repetitions\n")
    llms = {"plain": LLM(max_num_seqs=1)}
    weights_bytes = llms["plain"].engine.executor.worker.model.weight_bytes  # what one decode step reads
    print(f"memory at the start: {describe_memory(weights_bytes)}")
    for k in args.k:
        suffix = f" k={k}" if len(args.k) > 1 else ""
        llms["n-gram" + suffix] = LLM(max_num_seqs=1, speculative_config={"method": "ngram", "num_speculative_tokens": k})
        llms["draft model" + suffix] = LLM(max_num_seqs=1, speculative_config={"method": "draft_model",
                                                                               "num_speculative_tokens": k})
    header = (f"{'workload':<19} {'system':<16} {'wall ÷ plain (median; min–max)':>32} {'CPU time ÷ plain':>30} "
              f"{'passes':>7} {'accept':>7} {'tok/verify':>10}  output")
    print(header)
    for name, (prompts, max_tokens) in workloads(llms["plain"].tokenizer, llms["plain"], args).items():
        lens = sorted(map(len, prompts))
        print(f"{name}: prompts of {lens[0]}-{lens[-1]} tokens, {min(max_tokens)}-{max(max_tokens)} output tokens")
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        runs = interleaved_runs(llms, prompts, params, args.repeats)
        plain = runs["plain"]
        for system, run in runs.items():
            same = "identical" if run.tokens == plain.tokens else "DIFFERS FROM PLAIN"
            if system == "plain":
                print(f"{'':<19} {system:<16} {'1 (baseline)':>32} {'1 (baseline)':>30} {run.target_passes:>7} "
                      f"{'-':>7} {'1.00':>10}  {same}")
                continue
            wall, cpu = Speedup.of(plain, run), Speedup.of(plain, run, clock="cpu")
            print(f"{'':<19} {system:<16} {str(wall):>32} {str(cpu):>30} {run.target_passes:>7} "
                  f"{run.acceptance_rate:>7.2f} {run.tokens_per_verify:>10.2f}  {same}; {wall.verdict}", flush=True)
    print(f"memory at the end: {describe_memory(weights_bytes)}")


if __name__ == "__main__":
    main()
