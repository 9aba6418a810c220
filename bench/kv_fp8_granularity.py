"""FP8 E4M3 KV: one static scale per tensor, or a scale per (token, head)? The measurement behind
minillm.kv.quant's choice (chapter 14).

    python bench/kv_fp8_granularity.py [--model models/minillm-target] [--text "..."]

Takes the real K and V of the bundled model (HF transformers' cache after one forward over a
passage: K after RoPE, as the pool stores it) and stores them three ways — int8 with a scale per
(token, head), FP8 with a static scale of 1 (vLLM's default without calibrated scales), FP8 with a
scale per (token, head) (max |x| / 448) — then prints per layer and tensor the relative RMS error
‖x − x̂‖ / ‖x‖, the largest |x − x̂|, the share of numbers below FP8's smallest normal 2⁻⁶ (the
only ones a per-token scale can help: above it the relative error is the same 3 mantissa bits at
any scale), and the bytes per (token, head). Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from minillm.kv.quant import (  # noqa: E402
    SCALE_BYTES,
    dequantize_fp8_e4m3,
    dequantize_int8,
    quantize_fp8_e4m3,
    quantize_int8,
)

PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
           "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
           "the light from the darkness.")
SMALLEST_NORMAL = 2.0**-6


def stored_three_ways(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"int8 / token+head": dequantize_int8(*quantize_int8(x)),
            "fp8 / tensor (1)": dequantize_fp8_e4m3(*quantize_fp8_e4m3(x)),
            "fp8 / token+head": dequantize_fp8_e4m3(*quantize_fp8_e4m3(x, per_token_scale=True))}


def kv_of(model_dir: str, text: str) -> list[tuple[str, torch.Tensor]]:
    """(name, rows [tokens * heads, D]) for K and V of every layer: HF transformers' cache after one forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    out = []
    for i, layer in enumerate(cache.layers):
        for name, x in (("K", layer.keys), ("V", layer.values)):
            out.append((f"{i} {name}", x.transpose(1, 2).reshape(-1, x.shape[-1])))  # rows: (token, head)
    return out


def relative_errors(rows: torch.Tensor) -> dict[str, float]:
    """‖x − x̂‖ / ‖x‖ of each way of storing `rows`."""
    return {method: ((rows - x_hat).norm() / rows.norm()).item() for method, x_hat in stored_three_ways(rows).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "minillm-target"))
    parser.add_argument("--text", default=PASSAGE)
    args = parser.parse_args()
    tensors = kv_of(args.model, args.text)
    head_dim = tensors[0][1].shape[-1]
    print(f"{args.model}: {tensors[0][1].shape[0]} (token, head) rows per tensor, head_dim {head_dim}; bytes per "
          f"(token, head): int8 {head_dim + SCALE_BYTES}, fp8/tensor {head_dim}, fp8/token+head "
          f"{head_dim + SCALE_BYTES} (float32 {4 * head_dim})")
    print(f"{'layer':>7} {'max|x|':>7} {'<2^-6':>6}  " + "  ".join(f"{m:>24}" for m in stored_three_ways(torch.ones(1, 4))))
    totals: dict[str, list[float]] = {}
    for name, x in tensors:
        cells = []
        for (method, rel), x_hat in zip(relative_errors(x).items(), stored_three_ways(x).values()):
            totals.setdefault(method, []).append(rel)
            cells.append(f"rel {rel:.2e} max {(x - x_hat).abs().max().item():.1e}")
        small = (x.abs() < SMALLEST_NORMAL).float().mean().item()
        print(f"{name:>7} {x.abs().max().item():7.2f} {small:6.1%}  " + "  ".join(f"{c:>24}" for c in cells))
    mean = {m: sum(v) / len(v) for m, v in totals.items()}
    print("mean relative RMS error: " + ", ".join(f"{m} {e:.3e}" for m, e in mean.items()))
    ratio = mean["fp8 / tensor (1)"] / mean["fp8 / token+head"]
    print(f"fp8 per tensor / per token+head error: {ratio:.3f}x, for {SCALE_BYTES} bytes less per (token, head)")


if __name__ == "__main__":
    main()
