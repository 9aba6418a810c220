"""Forward-pass speed: minillm's own model vs HF transformers' forward, same weights, same machine.

    python bench/forward.py [--quick]

1. Decode step (one new token per sequence, KV cache in place) on the bundled target at batch 1
   and 32: minillm's step time ÷ HF's step time (lower is better; aim ≤ 0.6).
2. A random fp32 model with Qwen2.5-0.5B's shape at batch 1: weight bytes read per decode step ÷
   step time ÷ this machine's measured copy bandwidth — how close a decode step gets to the
   memory-bandwidth roofline (aim ≥ 0.7).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

from minillm.kv.slab import SlabKVManager  # noqa: E402
from minillm.llm import BUNDLED_TARGET  # noqa: E402
from minillm.model.loader import build_model, load_hf_model  # noqa: E402
from minillm.request import Request, SamplingParams  # noqa: E402
from minillm.scheduler.base import SchedulerPlan  # noqa: E402
from minillm.scheduler.output import SchedulerOutputBuilder  # noqa: E402
from minillm.sim.hardware import measure_copy_bandwidth  # noqa: E402
from minillm.worker.model_runner import ModelRunner  # noqa: E402


def median_times(fns, repeats: int) -> list[float]:
    """Median time of each function, calls interleaved so that load on a shared machine hits all alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def minillm_decode_step(model, batch: int, context: int):
    """A function running one engine decode step (prepare tensors + forward + logits) for `batch` sequences."""
    c = model.config
    kv = SlabKVManager(c.num_layers, c.num_kv_heads, c.head_dim, num_slabs=batch, slab_len=context + 8,
                       dtype=model.dtype)
    runner, plans = ModelRunner(model, kv.cache_spec), SchedulerOutputBuilder(kv)
    reqs = [Request(str(i), [5] * context, SamplingParams(max_tokens=1, temperature=0.0), 0.0) for i in range(batch)]
    for r in reqs:
        kv.allocate(r, context)
    prefill = plans.build(SchedulerPlan(reqs, [context] * batch))
    runner.update_state(prefill)
    runner.compute_logits(prefill)
    for r in reqs:
        r.num_computed_tokens = context
        r.all_token_ids.append(7)

    decode = plans.build(SchedulerPlan(reqs, [1] * batch))
    runner.update_state(decode)

    def step() -> None:  # num_computed_tokens stays put: every step rewrites the same slot
        runner.compute_logits(decode)

    return step


def hf_decode_step(hf_model, batch: int, context: int):
    """A function running one HF forward of one new token per sequence against a `context`-token cache."""
    from transformers import DynamicCache

    ids = torch.full((batch, context), 5)
    with torch.inference_mode():
        out = hf_model(ids, use_cache=True)
        cache: DynamicCache = out.past_key_values
        new = torch.full((batch, 1), 7)
        position = torch.full((batch, 1), context)

    def step() -> None:
        with torch.inference_mode():
            hf_model(new, cache=cache, position_ids=position, use_cache=True)
            cache.crop(-1)  # drop the new token again: the context stays fixed, as in minillm's loop

    return step


def bench_bundled(repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED_TARGET), dtype=torch.float32).eval()
    model = load_hf_model(hf)
    print(f"\n[1] decode step, bundled target ({model.num_params / 1e6:.1f} M params, fp32), context 64")
    print(f"{'batch':>6} {'minillm ms':>11} {'HF ms':>9} {'minillm/HF':>11}")
    for batch in (1, 32):
        ours, theirs = median_times([minillm_decode_step(model, batch, 64), hf_decode_step(hf, batch, 64)], repeats)
        print(f"{batch:>6} {ours * 1e3:>11.3f} {theirs * 1e3:>9.3f} {ours / theirs:>11.2f}")


def random_half_b_model():
    """Qwen2.5-0.5B's shape with random fp32 weights, built directly (no HF model in memory)."""
    from minillm.model.config import ModelConfig

    config = ModelConfig.from_hf_dict(dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1e6))
    g = torch.Generator().manual_seed(0)
    c, state = config, {}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": torch.ones(c.hidden_size),
                  p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
                  p + "self_attn.q_proj.weight": rand(q, c.hidden_size), p + "self_attn.q_proj.bias": rand(q),
                  p + "self_attn.k_proj.weight": rand(kv, c.hidden_size), p + "self_attn.k_proj.bias": rand(kv),
                  p + "self_attn.v_proj.weight": rand(kv, c.hidden_size), p + "self_attn.v_proj.bias": rand(kv),
                  p + "self_attn.o_proj.weight": rand(c.hidden_size, q),
                  p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
                  p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
                  p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size)}
    state["model.embed_tokens.weight"] = rand(c.vocab_size, c.hidden_size)
    state["model.norm.weight"] = torch.ones(c.hidden_size)
    return build_model(config, state, torch.float32, "cpu", max_positions=4096)


def read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a pure streaming read (a sum over a tensor far larger than the caches)."""
    x = torch.ones(num_bytes // 4)
    (t,) = median_times([lambda: x.sum()], repeats)
    return num_bytes / t


def bench_bandwidth(repeats: int) -> None:
    model = random_half_b_model()
    copy = max(measure_copy_bandwidth(1.0) for _ in range(3))  # bytes read + bytes written, per s
    read = read_bandwidth()
    (step,) = median_times([minillm_decode_step(model, 1, 64)], repeats)
    achieved = model.weight_bytes / step
    print(f"\n[2] decode step, random {model.num_params / 1e6:.0f} M-param fp32 model (Qwen2.5-0.5B shape), batch 1")
    print(f"weight bytes per step {model.weight_bytes / 1e9:.2f} GB, step {step * 1e3:.1f} ms → "
          f"{achieved / 1e9:.1f} GB/s of weights read")
    print(f"  ÷ copy bandwidth, STREAM-style read+write {copy / 1e9:.1f} GB/s: {achieved / copy:.2f}")
    print(f"  ÷ copy bandwidth, bytes copied per second {copy / 2e9:.1f} GB/s: {achieved / (copy / 2):.2f}")
    print(f"  ÷ streaming read bandwidth {read / 1e9:.1f} GB/s: {achieved / read:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"machine: {describe_machine()}")
    bench_bundled(repeats=20 if args.quick else 100)
    bench_bandwidth(repeats=5 if args.quick else 15)


if __name__ == "__main__":
    main()
