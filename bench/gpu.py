"""minillm's numba kernels on a GPU: correctness, bandwidth, decode throughput, CUDA graphs (chapter 10).

    python bench/gpu.py [--dtype float16] [--batch-sizes 1 32] [--contexts 1024 4096 16384] [--skip-smoke]

One script for one GPU (written for an H200; about 5 minutes, `bench/gpu_smoke.py` included):

1. **every kernel against its torch reference** on the GPU (small ragged GQA shapes, NaN in every
   unowned pool slot), and its time next to the reference's at a serving-sized shape; the tiled
   flash_attention also against the untiled prefill_attention on one 4k-token prompt;
2. **paged decode bandwidth**: bytes of K/V a decode step must read ÷ its time, for both decode
   kernels (one thread per (sequence, head); one warp per (sequence, head) with shuffles) at
   contexts 1k / 4k / 16k and batch 1 / 32, as a fraction of this GPU's measured copy bandwidth;
3. **end-to-end decode tok/s** of a random model of Qwen2.5-0.5B's shape (24 layers, hidden 896,
   14 query / 2 KV heads of 64, vocabulary 151,936; nothing is downloaded): minillm on the numba
   kernels, minillm on its torch backend, HF transformers `generate` (SDPA);
4. **CUDA graphs**: one decode step of that model on the numba kernels, eager vs replayed from a
   graph captured for its batch-size bucket (`minillm.kernels.cuda_graphs`), with the logits of
   both compared.

numba has no bfloat16 arrays, so everything runs in float16 by default. Results go to
bench/results/gpu-<date>.json and .md, labelled with the machine and date. Needs CUDA: on a CPU it
says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"  # --dry-run: "cpu", with the kernels on numba's simulator
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)


def cuda_time_s(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median time of fn() on the GPU, by CUDA events (a dry run on the CPU: one call, wall clock)."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy of 1 GiB: bytes read + bytes written, per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time_s(lambda: dst.copy_(src), iters=10)


def scenario(lens, block_size, kv_heads, q_heads, head_dim, dtype, seed=0, spare_blocks=4):
    from minillm.kernels.scenarios import paged_scenario

    num_blocks = sum(-(-n // block_size) for n in lens) + spare_blocks
    s = paged_scenario(lens, block_size=block_size, num_blocks=num_blocks, kv_heads=kv_heads, q_heads=q_heads,
                       head_dim=head_dim, seed=seed)
    for name in ("query", "key_cache", "value_cache"):
        setattr(s, name, getattr(s, name).to(dtype))
    return s.to(DEVICE)


def big_scenario(batch, context, block_size, kv_heads, q_heads, head_dim, dtype, seed=0):
    """Like `scenario` but filled on the GPU (the CPU loop would take minutes at 32 x 16k)."""
    from minillm.kernels.scenarios import PagedScenario

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=g, device=DEVICE).to(torch.int32)
    tables = order[: batch * per_seq].view(batch, per_seq).contiguous()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    q = torch.randn(batch, q_heads, head_dim, generator=g, device=DEVICE, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return PagedScenario(q, k, v, tables, lens, head_dim**-0.5)


def check_kernels(dtype: torch.dtype, tol: float, decode_kernels: tuple[str, ...], big_batch: int = 32,
                  big_context: int = 4096, tokens: int = 4096, prefill_tokens: int = 4096) -> list[dict]:
    """Each kernel on the GPU against its reference; time both at a serving-sized shape."""
    from minillm.kernels.cache_write import reshape_and_cache_reference
    from minillm.kernels.decode_attention import paged_attention_decode_reference
    from minillm.kernels.rmsnorm import rms_norm_reference
    from minillm.kernels.rope import rotary_embedding_reference
    from minillm.kernels.varlen_attention import prefill_attention_reference

    from minillm import kernels

    rows = []

    def record(name, got, want, kernel_s=None, reference_s=None):
        # relative to the largest magnitude: float16 keeps ~3 significant digits
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1.0)).item()
        ok = bool(torch.isfinite(got).all()) and err < tol
        rows.append(dict(kernel=name, ok=ok, max_error=err, kernel_ms=kernel_s and 1e3 * kernel_s,
                         reference_ms=reference_s and 1e3 * reference_s))
        timing = f"  {1e3 * kernel_s:8.3f} ms vs torch reference {1e3 * reference_s:8.3f} ms" if kernel_s else ""
        print(f"{'PASS' if ok else 'FAIL'}  {name:<28} max relative error {err:.1e}{timing}", flush=True)

    lens = [1, 15, 16, 17, 100]
    s = scenario(lens, 16, 2, 14, 64, dtype)
    for name in decode_kernels:
        fn = getattr(kernels, name)
        want = paged_attention_decode_reference(*s.args())
        big = big_scenario(big_batch, big_context, 16, 2, 14, 64, dtype)
        record(name, fn(*s.args()), want, cuda_time_s(lambda fn=fn, big=big: fn(*big.args())),
               cuda_time_s(lambda big=big: paged_attention_decode_reference(*big.args()), iters=3))

    q_lens = [17, 3, 5, 1]
    p = scenario([40, 30, 25, 9], 16, 2, 14, 64, dtype, seed=1)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), 14, 64, device=DEVICE, dtype=dtype)
    args = (query, p.key_cache, p.value_cache, p.block_tables, qsl, p.seq_lens, p.scale)
    record("prefill_attention", kernels.prefill_attention(*args), prefill_attention_reference(*args))

    # the tiled kernel (FlashAttention's way) on the same batch, then timed on one long prompt against the
    # torch reference, and against the untiled prefill_attention: chapter 10's I/O argument, on a GPU
    n = prefill_tokens
    long = scenario([n], 16, 2, 14, 64, dtype, seed=2)
    long_args = (torch.randn(n, 14, 64, device=DEVICE, dtype=dtype), long.key_cache, long.value_cache,
                 long.block_tables, torch.tensor([0, n], dtype=torch.int32, device=DEVICE), long.seq_lens, long.scale)
    record("flash_attention", kernels.flash_attention(*args), prefill_attention_reference(*args),
           cuda_time_s(lambda: kernels.flash_attention(*long_args)),
           cuda_time_s(lambda: prefill_attention_reference(*long_args), iters=3))
    untiled_s = cuda_time_s(lambda: kernels.prefill_attention(*long_args), iters=3)
    rows[-1]["untiled_prefill_ms"] = 1e3 * untiled_s
    print(f"      one prompt of {n} tokens: prefill_attention (untiled) {1e3 * untiled_s:.3f} ms = "
          f"{untiled_s / (rows[-1]['kernel_ms'] / 1e3):.1f}x flash_attention's time", flush=True)

    t = tokens
    key, value = (torch.randn(t, 2, 64, device=DEVICE, dtype=dtype) for _ in range(2))
    kc, vc = (torch.zeros(-(-t // 16) + 1, 16, 2, 64, device=DEVICE, dtype=dtype) for _ in range(2))
    slots = torch.randperm(t, device=DEVICE)
    slots[::97] = -1
    rk, rv = kc.clone(), vc.clone()
    reshape_and_cache_reference(key, value, rk, rv, slots)
    record("reshape_and_cache", *_in_place(lambda: kernels.reshape_and_cache(key, value, kc, vc, slots), (kc, vc)),
           torch.cat([rk, rv]), cuda_time_s(lambda: kernels.reshape_and_cache(key, value, kc, vc, slots)),
           cuda_time_s(lambda: reshape_and_cache_reference(key, value, rk, rv, slots)))

    x, w = torch.randn(t, 896, device=DEVICE, dtype=dtype), torch.randn(896, device=DEVICE, dtype=dtype)
    record("rms_norm", kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6),
           cuda_time_s(lambda: kernels.rms_norm(x, w, 1e-6)), cuda_time_s(lambda: rms_norm_reference(x, w, 1e-6)))

    positions = torch.randint(0, 4096, (t,), device=DEVICE)
    inv = 1e6 ** (-torch.arange(0, 64, 2, device=DEVICE).float() / 64)
    angles = torch.arange(4096, device=DEVICE).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    q0, k0 = torch.randn(t, 14, 64, device=DEVICE, dtype=dtype), torch.randn(t, 2, 64, device=DEVICE, dtype=dtype)
    q1, k1, q2, k2 = q0.clone(), k0.clone(), q0.clone(), k0.clone()
    kernels.rotary_embedding(positions, q1, k1, cos_sin.to(dtype))
    rotary_embedding_reference(positions, q2, k2, cos_sin.to(dtype))
    record("rotary_embedding", torch.cat([q1.flatten(), k1.flatten()]), torch.cat([q2.flatten(), k2.flatten()]),
           cuda_time_s(lambda: kernels.rotary_embedding(positions, q1, k1, cos_sin.to(dtype))),
           cuda_time_s(lambda: rotary_embedding_reference(positions, q2, k2, cos_sin.to(dtype))))
    return rows


def _in_place(fn, tensors):
    fn()
    return (torch.cat(tensors),)


def decode_bandwidth(dtype: torch.dtype, copy_bw: float, contexts, batches, decode_kernels: tuple[str, ...]) -> list[dict]:
    from minillm import kernels

    rows = []
    element = torch.empty((), dtype=dtype).element_size()
    for name in decode_kernels:
        fn = getattr(kernels, name)
        for batch in batches:
            for context in contexts:
                s = big_scenario(batch, context, 16, 2, 14, 64, dtype)
                seconds = cuda_time_s(lambda fn=fn, s=s: fn(*s.args()), iters=10)
                kv_bytes = 2 * batch * context * 2 * 64 * element  # K and V of every key, read once
                bw = kv_bytes / seconds
                rows.append(dict(kernel=name, batch=batch, context=context, ms=1e3 * seconds,
                                 bytes_per_s=bw, fraction_of_copy=bw / copy_bw))
                print(f"{name:<28} batch {batch:>3} context {context:>6}: {1e3 * seconds:8.3f} ms, "
                      f"{bw / 1e9:7.1f} GB/s = {bw / copy_bw:5.2f} of copy", flush=True)
    return rows


def random_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**QWEN_05B)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype).eval()


def time_minillm(hf_model, backend: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from minillm import LLM, SamplingParams

    llm = LLM(hf_model, dtype=dtype, device=DEVICE, attention_backend=backend, max_num_seqs=len(prompts),
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
    ids = torch.tensor(prompts, device=DEVICE)  # equal lengths: no padding
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf_model.generate(ids[:, :8], max_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
    return time.perf_counter() - start


def graph_step(hf_model, dtype: str, prompts: list[list[int]]) -> dict:
    """One decode step of len(prompts) sequences: eager on the numba kernels vs replayed from a graph."""
    from minillm import LLM, SamplingParams
    from minillm.kernels.cuda_graphs import DecodeGraphs, DecodeInputs, decode_forward, pick_bucket

    batch = len(prompts)
    llm = LLM(hf_model, dtype=dtype, device=DEVICE, attention_backend="numba", max_num_seqs=batch, max_model_len=1024,
              max_num_batched_tokens=max(2048, sum(len(p) for p in prompts)))  # every prompt in one prefill step
    engine = llm.engine
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill; the next plan is a decode step of every sequence
    input_ids, positions, meta, _ = engine.executor.prepare(engine.scheduler.schedule(engine.clock.now()))
    if meta.num_decode != batch or input_ids.shape[0] != batch:
        raise RuntimeError(f"expected a decode-only step of {batch} sequences, got {meta.num_decode} decode rows")
    inputs = DecodeInputs(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
    model, kv = engine.executor.worker.model, engine.executor.worker  # the worker holds the pools
    eager_s = cuda_time_s(lambda: decode_forward(model, kv.k_pool, kv.v_pool, inputs, kv.block_size))
    eager_logits = decode_forward(model, kv.k_pool, kv.v_pool, inputs, kv.block_size)
    bucket = pick_bucket(batch)
    try:
        graphs = DecodeGraphs(model, kv.k_pool, kv.v_pool, kv.block_size, kv.null_block,
                              max_blocks_per_seq=math.ceil(1024 / kv.block_size), buckets=(bucket,))
    except Exception as error:  # a capture failure is a result too: report it, keep the other numbers
        print(f"CUDA graph capture failed at batch {batch}: {type(error).__name__}: {error}", flush=True)
        return dict(batch=batch, eager_ms=1e3 * eager_s, graph_ms=None, error=f"{type(error).__name__}: {error}")
    graph_s = cuda_time_s(lambda: graphs.run(inputs))
    graph_logits = graphs.run(inputs)
    diff = (graph_logits.float() - eager_logits.float()).abs().max().item()
    same_argmax = bool((graph_logits.argmax(-1) == eager_logits.argmax(-1)).all())
    if batch > 2:  # a step smaller than its bucket: two padding rows in the replay
        fewer = DecodeInputs(*(t[: batch - 2] for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                                          inputs.block_tables, inputs.seq_lens)))
        padded_logits = graphs.run(fewer)
        eager_fewer = decode_forward(model, kv.k_pool, kv.v_pool, fewer, kv.block_size)
        diff = max(diff, (padded_logits.float() - eager_fewer.float()).abs().max().item())
        same_argmax &= bool((padded_logits.argmax(-1) == eager_fewer.argmax(-1)).all())
    print(f"decode step, batch {batch:>3} (bucket {bucket}): eager {1e3 * eager_s:7.3f} ms, graph {1e3 * graph_s:7.3f} ms "
          f"({eager_s / graph_s:4.2f}x); max |logit diff| vs eager {diff:.1e} (full and padded replay), "
          f"same argmax: {same_argmax}", flush=True)
    return dict(batch=batch, bucket=bucket, eager_ms=1e3 * eager_s, graph_ms=1e3 * graph_s, speedup=eager_s / graph_s,
                max_logit_diff=diff, same_argmax=same_argmax)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--skip-smoke", action="store_true", help="do not run bench/gpu_smoke.py first")
    parser.add_argument("--dry-run", action="store_true",
                        help="check this script on a CPU: parts 1-2 at tiny sizes on numba's simulator (run with "
                             "NUMBA_ENABLE_CUDASIM=1; no warp kernel, no timings worth reading, nothing written)")
    args = parser.parse_args()
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; none here (the kernels are tested on CPU by tests/test_kernels.py; "
              "`NUMBA_ENABLE_CUDASIM=1 python bench/gpu.py --dry-run` checks this script)")
        return 2
    started = time.perf_counter()
    machine = describe_machine()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"machine: {machine}\ndate: {stamp}\n")
    smoke = None
    if not args.skip_smoke:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_smoke.py"))], capture_output=True,
                              text=True)
        smoke = dict(returncode=proc.returncode, output=proc.stdout[-4000:] + proc.stderr[-2000:])
        print(proc.stdout, flush=True)
    dtype = getattr(torch, args.dtype)
    tol = 1e-2 if dtype == torch.float16 else 1e-4
    print("1. kernels against their torch references")
    decode_kernels = ("paged_attention_decode", "paged_attention_decode_warp")
    kernel_rows = check_kernels(dtype, tol, decode_kernels)
    copy_bw = copy_bandwidth_bytes_per_s()
    print(f"\n2. paged decode bandwidth (device copy bandwidth {copy_bw / 1e9:.0f} GB/s)")
    bandwidth_rows = decode_bandwidth(dtype, copy_bw, args.contexts, args.batch_sizes, decode_kernels)
    print(f"\n3. decode tok/s, random Qwen2.5-0.5B-shaped model, {args.dtype}, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} greedy tokens each")
    hf_model = random_model(dtype)
    rows, graph_rows = [], []
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
        print(f"batch {batch:>3}  greedy tokens numba == torch for {agree} of {batch} requests")
        graph_rows.append(graph_step(hf_model, args.dtype, prompts))
        print()
    elapsed = time.perf_counter() - started
    RESULTS.mkdir(exist_ok=True)
    day = stamp[:10]
    result = dict(machine=machine, date=stamp, args=vars(args), seconds=elapsed, smoke=smoke,
                  copy_bandwidth_bytes_per_s=copy_bw, kernels=kernel_rows, decode_bandwidth=bandwidth_rows,
                  decode_throughput=rows, cuda_graphs=graph_rows)
    (RESULTS / f"gpu-{day}.json").write_text(json.dumps(result, indent=2))
    table = [f"{machine}; {stamp}; {args.dtype}", "",
             f"Device copy bandwidth: {copy_bw / 1e9:.0f} GB/s", "",
             "| kernel | correct | ms | torch reference ms |", "|---|---|---|---|"]
    table += [f"| {r['kernel']} | {'yes' if r['ok'] else 'NO'} (max err {r['max_error']:.1e}) | "
              f"{'' if r['kernel_ms'] is None else format(r['kernel_ms'], '.3f')} | "
              f"{'' if r['reference_ms'] is None else format(r['reference_ms'], '.3f')} |" for r in kernel_rows]
    table += ["", "| decode kernel | batch | context | ms | GB/s | of copy bw |", "|---|---|---|---|---|---|"]
    table += [f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['bytes_per_s'] / 1e9:.0f} | "
              f"{r['fraction_of_copy']:.2f} |" for r in bandwidth_rows]
    table += ["", "| batch | system | output tok/s | vs HF |", "|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['system']} | {r['tok_per_s']:.0f} | {r['vs_hf']:.2f}× |" for r in rows]
    table += ["", "| batch | decode step eager ms | with CUDA graph ms | speedup |", "|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['eager_ms']:.3f} | " + (f"{r['graph_ms']:.3f} | {r['speedup']:.2f}× |"
              if r.get("graph_ms") else f"failed: {r.get('error', '')[:80]} | |") for r in graph_rows]
    (RESULTS / f"gpu-{day}.md").write_text("\n".join(table) + "\n")
    print(f"{elapsed:.0f} s; wrote bench/results/gpu-{day}.json and .md")
    return 0 if all(r["ok"] for r in kernel_rows) and (smoke is None or smoke["returncode"] == 0) else 1


def dry_run() -> int:
    """Parts 1 and 2 on the CPU under numba's simulator, at sizes it finishes in a minute."""
    global DEVICE
    import os

    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("--dry-run needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported)")
        return 2
    DEVICE = "cpu"
    rows = check_kernels(torch.float32, 1e-4, ("paged_attention_decode",), big_batch=2, big_context=20, tokens=8,
                         prefill_tokens=12)
    bandwidth = decode_bandwidth(torch.float32, 25e9, [20], [2], ("paged_attention_decode",))
    ok = all(r["ok"] for r in rows) and len(rows) == 6 and len(bandwidth) == 1
    print(f"dry run: {'ok' if ok else 'FAILED'} (the GPU-only parts, the warp kernel, end-to-end and CUDA graphs, "
          "were not run)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
