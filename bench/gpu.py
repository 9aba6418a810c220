"""Decode throughput on a GPU: minillm's numba kernels vs its torch backend vs HF transformers (chapter 10).

    python bench/gpu.py [--batch-sizes 1 32] [--new-tokens 64] [--dtype bfloat16]

A random model of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads, intermediate
4864, vocabulary 151,936), built in this process (nothing is downloaded), served greedily from the
same prompts by: minillm with attention_backend="numba", minillm with "torch", and HF `generate`.
Prints output tok/s per system and batch size with the ratio to HF, and writes JSON and a markdown
table to bench/results/gpu-<date>.{json,md}, labelled with the machine. CUDA graphs are not used
yet (decode steps are launched op by op in every system). Needs CUDA: on a CPU it says so and exits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def random_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def time_minillm(hf_model, backend: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from minillm import LLM, SamplingParams

    llm = LLM(hf_model, dtype=dtype, device="cuda", attention_backend=backend, max_num_seqs=len(prompts),
              max_model_len=1024)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)  # warm-up: numba compiles its kernels here
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def time_hf(hf_model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")  # equal lengths: no padding
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf_model.generate(ids[:, :8], max_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; none here (the kernels are tested on CPU by tests/test_kernels.py)")
        return 2
    machine = f"{describe_machine()}; {torch.cuda.get_device_name()}"
    print(f"machine: {machine}\nrandom Qwen2.5-0.5B-shaped model, {args.dtype}, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} greedy tokens each\n")
    hf_model = random_model(getattr(torch, args.dtype))
    rows = []
    g = torch.Generator().manual_seed(1)
    for batch in args.batch_sizes:
        prompts = torch.randint(10, 150000, (batch, args.prompt_len), generator=g).tolist()
        tokens = batch * args.new_tokens
        hf_s = time_hf(hf_model, prompts, args.new_tokens)
        numba_s, numba_tokens = time_minillm(hf_model, "numba", args.dtype, prompts, args.new_tokens)
        torch_s, torch_tokens = time_minillm(hf_model, "torch", args.dtype, prompts, args.new_tokens)
        agree = sum(a == b for a, b in zip(numba_tokens, torch_tokens))
        for name, seconds in (("HF transformers", hf_s), ("minillm numba", numba_s), ("minillm torch", torch_s)):
            rows.append(dict(batch=batch, system=name, tok_per_s=tokens / seconds, vs_hf=hf_s / seconds,
                             seconds=seconds))
            print(f"batch {batch:>3}  {name:<16} {tokens / seconds:9.0f} tok/s  {hf_s / seconds:5.2f}x HF", flush=True)
        print(f"batch {batch:>3}  greedy tokens numba == torch for {agree} of {batch} requests\n")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    (RESULTS / f"gpu-{stamp}.json").write_text(json.dumps(dict(machine=machine, args=vars(args), rows=rows), indent=2))
    table = ["| batch | system | output tok/s | vs HF |", "|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['system']} | {r['tok_per_s']:.0f} | {r['vs_hf']:.2f}× |" for r in rows]
    (RESULTS / f"gpu-{stamp}.md").write_text(f"{machine}, {stamp}\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
