"""A two-minute check of the engine on a GPU: does everything that runs on the CPU run there too?

    python bench/gpu_smoke.py [--device cuda]

On the bundled model (float32):
1. greedy tokens on the device == greedy tokens on the CPU, for continuous batching with paged KV,
   prefix caching (a shared system prompt) and a pool small enough to force preemptions (recompute,
   then swap);
2. sampling with temperature / top-k / top-p runs on the device, and a seeded request reproduces
   itself whatever else is in the batch;
3. static batching (padded) greedy == CPU;
4. a quantized KV cache (kv_cache_dtype int8 / fp8_e4m3, chapter 14): greedy on the device with the
   torch backend (and the numba kernels on CUDA) == the CPU's with the same dtype.
Prints one line per check and exits non-zero if any fails. With `--device cpu` it checks the
script itself (CPU against CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402

SYSTEM = "And God said, Let there be light: and there was light. And God saw the light, that it was good. "
PROMPTS = [SYSTEM + tail for tail in ("And the evening", "Blessed are", "In the beginning", "The LORD is",
                                      "Thou shalt", "Behold, I", "And it came", "Hear, O Israel")]


def tokens(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    start = time.perf_counter()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), CPU {cpu_model()}, torch {torch.__version__}")
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    failures = 0

    def check(label: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {label}{'  ' + detail if detail else ''}", flush=True)

    knobs = dict(max_num_seqs=8, block_size=8, num_kv_blocks=48, max_model_len=256, enable_prefix_caching=True)
    reference = tokens(LLM(device="cpu", max_num_seqs=8, max_model_len=256), greedy)
    for mode in ("recompute", "swap"):
        llm = LLM(device=args.device, preemption_mode=mode, attention_backend="torch", **knobs)
        got = tokens(llm, greedy)
        s = llm.engine.metrics.summary()
        check(f"greedy == CPU: paged + prefix cache + {mode} preemption", got == reference,
              f"{sum(a == b for a, b in zip(got, reference))}/{len(got)} equal, {s.num_preemptions} preemptions, "
              f"hit rate {s.prefix_cache_hit_rate:.2f}")
        check(f"no KV block held after the run ({mode})", llm.engine.kv.allocator.num_in_use == 0)
    static = LLM(device=args.device, batching="static", max_num_seqs=8, max_model_len=256)
    got = tokens(static, greedy)
    check("greedy == CPU: static batching (padded)", sum(a == b for a, b in zip(got, reference)) >= 7,
          f"{sum(a == b for a, b in zip(got, reference))}/{len(got)} equal (left padding may flip a near-tie)")

    if args.device.startswith("cuda"):  # minillm's numba kernels (chapter 10) against the torch backend
        on_kernels = tokens(LLM(device=args.device, attention_backend="numba", **knobs), greedy)
        check("greedy == CPU: attention_backend='numba' (kernels)", on_kernels == reference,
              f"{sum(a == b for a, b in zip(on_kernels, reference))}/{len(on_kernels)} equal")
    for kv_cache_dtype in ("int8", "fp8_e4m3"):  # the same bytes written and read on every backend
        want = tokens(LLM(device="cpu", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_model_len=256), greedy)
        for backend in ("torch", "numba") if args.device.startswith("cuda") else ("torch",):
            got = tokens(LLM(device=args.device, attention_backend=backend, kv_cache_dtype=kv_cache_dtype, **knobs),
                         greedy)
            same = sum(a == b for a, b in zip(got, want))
            check(f"greedy == CPU: kv_cache_dtype={kv_cache_dtype!r}, attention_backend={backend!r}", same >= 7,
                  f"{same}/{len(got)} equal (float32 sums in another order may flip a near-tie)")
    sampling = SamplingParams(max_tokens=32, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    llm = LLM(device=args.device, **knobs)
    alone = llm.generate([PROMPTS[0]], sampling, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(PROMPTS, [sampling] + [SamplingParams(max_tokens=32, temperature=1.0)] * 7,
                         use_tqdm=False)[0].outputs[0].token_ids
    check("sampling on the device; a seeded request ignores its batch", alone == crowd and len(alone) == 32)
    print(f"{time.perf_counter() - start:.1f} s, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
