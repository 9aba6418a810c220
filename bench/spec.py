"""Speculative decoding against plain decoding, on the bundled target + draft (chapter 09).

    python bench/spec.py [--num-requests 32] [--max-tokens 64] [--k 4]

For batch 1 and batch 16 (max_num_seqs), the same seeded prompts (KJV verses cut at a random
point, greedy, EOS ignored) are served by: plain decoding, n-gram prompt lookup, and the bundled
draft model, in the same process, one after another. Printed per system: output tok/s and its
ratio to plain decoding at that batch size (wall clock, draft cost included), tokens per target
forward (1 + accepted guesses per speculative row, averaged over all rows), acceptance rate, mean
acceptance length and acceptance per position. Greedy tokens are checked equal to plain decoding.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _machine import describe_machine  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402

VERSES = [  # King James Version (public domain), the text the bundled models were trained on
    "In the beginning God created the heaven and the earth. And the earth was without form, and void",
    "And God said, Let there be light: and there was light. And God saw the light, that it was good",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that mourn",
    "For God so loved the world, that he gave his only begotten Son, that whosoever believeth in him",
    "And it came to pass in those days, that there went out a decree from Caesar Augustus",
    "Hear, O Israel: The LORD our God is one LORD: And thou shalt love the LORD thy God with all thine heart",
    "To every thing there is a season, and a time to every purpose under the heaven: A time to be born",
    "Thou shalt not kill. Thou shalt not commit adultery. Thou shalt not steal. Thou shalt not bear false",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them",
]


def prompts_from_verses(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [(verse := rng.choice(VERSES))[: rng.randint(30, len(verse))] for _ in range(n)]


def serve(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe_machine()}\nbundled target + draft, fp32, 1 thread; {args.num_requests} prompts, "
          f"{args.max_tokens} greedy tokens each, k = {args.k}\n")
    prompts = prompts_from_verses(args.num_requests, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    systems = {"plain": None, "n-gram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4},
               "draft model": {"method": "draft_model", "num_speculative_tokens": args.k}}
    print(f"{'batch':>5} {'system':<12} {'tok/s':>8} {'vs plain':>9} {'tok/fwd':>8} {'accept':>7} {'mean len':>9}  per position")
    for batch in (1, 16):
        base_tokens, base_tps = None, None
        for name, spec in systems.items():
            llm = LLM(max_num_seqs=batch, speculative_config=spec)
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
            llm.engine.metrics = type(llm.engine.metrics)()
            tokens, wall = serve(llm, prompts, params)
            tps = sum(len(t) for t in tokens) / wall
            steps = llm.engine.metrics.steps
            rows = sum(s.num_seqs for s in steps)
            emitted = sum(len(t) for t in tokens)
            stats = llm.engine.metrics.spec_decode
            if base_tokens is None:
                base_tokens, base_tps = tokens, tps
            same = "" if tokens == base_tokens else "  (TOKENS DIFFER)"
            per_pos = ", ".join(f"{a / stats.num_drafts:.2f}" for a in stats.num_accepted_tokens_per_pos) \
                if stats.num_drafts else "-"
            print(f"{batch:>5} {name:<12} {tps:>8.0f} {tps / base_tps:>8.2f}x {emitted / rows:>8.2f} "
                  f"{stats.acceptance_rate if stats.num_drafts else 0:>7.2f} "
                  f"{stats.mean_acceptance_length if stats.num_drafts else 1:>9.2f}  {per_pos}{same}", flush=True)


if __name__ == "__main__":
    main()
