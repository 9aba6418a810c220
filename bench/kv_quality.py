"""What squeezing the KV cache costs in quality (chapter 14): the quality table of minillm.kv.quality.

    python bench/kv_quality.py                      # bundled model, then the float64 control
    python bench/kv_quality.py --texts 6 --tokens 256

Each row is one engine configuration (LLM keyword arguments; the first is the reference): exact,
the engine's int8 and fp8 e4m3 KV pools (`kv_cache_dtype`), StreamingLLM and H2O eviction at int8's
memory and at a tighter budget.
Quality numbers, not timings: they repeat on a machine, and may differ in the last digits on another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

from minillm import LLM  # noqa: E402
from minillm.kv.quality import (  # noqa: E402
    QualityRow,
    format_table,
    heldout_token_ids,
    measure_quality,
    random_control_model,
)

SCALE_BYTES = 4  # one float32 scale per token and KV head


def rows_for(int8_budget: int, tight_budget: int) -> list[QualityRow]:
    def evict(policy: str, budget: int) -> QualityRow:
        return QualityRow(f"{policy} {budget}", {"kv_eviction": {"policy": policy, "budget_tokens": budget}})

    return [QualityRow("exact", {}),
            QualityRow("int8 KV", {"kv_cache_dtype": "int8"}),
            QualityRow("fp8 e4m3 KV", {"kv_cache_dtype": "fp8_e4m3"}),
            evict("streaming", int8_budget), evict("h2o", int8_budget),
            evict("streaming", tight_budget), evict("h2o", tight_budget)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=3, help="held-out chapters scored")
    parser.add_argument("--tokens", type=int, default=176, help="tokens per chapter (16 of them the prompt)")
    parser.add_argument("--tight", type=int, default=24, help="the tighter eviction budget")
    args = parser.parse_args()
    print(f"machine: {describe_machine()}")  # quality, not timing: the last digits may differ on another CPU
    make = lambda **knobs: LLM(max_num_seqs=4, max_model_len=max(256, args.tokens + 64), **knobs)  # noqa: E731
    llm = make()
    cfg = llm.model_config
    share = (cfg.head_dim + SCALE_BYTES) / (cfg.head_dim * 4)  # int8 + scale vs float32, per value
    budget = round(share * args.tokens)
    texts = heldout_token_ids(llm.tokenizer, args.texts, args.tokens)
    print(f"bundled model: int8 KV + scales = {share:.1%} of float32; eviction at that memory: {budget} of "
          f"{args.tokens} tokens")
    results = measure_quality(rows_for(budget, args.tight), texts, make_llm=make, prompt_tokens=16, num_greedy_tokens=48)
    print(format_table(results, f"bundled model (float32), {args.texts} held-out chapters x {args.tokens} tokens"))
    control = random_control_model()
    make_control = lambda **knobs: LLM(control, dtype="float64", max_num_seqs=4, max_model_len=256, **knobs)  # noqa: E731
    results = measure_quality(rows_for(budget, args.tight), [t[:96] for t in texts[:2]], make_llm=make_control,
                              prompt_tokens=16, num_greedy_tokens=32)
    print(format_table(results, "control: tiny random model, float64, 2 held-out chapters x 96 tokens"))


if __name__ == "__main__":
    main()
