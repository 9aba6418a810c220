"""Tensor / pipeline parallel on this CPU: step time and communication vs one process (chapter 12).

    python bench/parallel_steps.py [--repeats 3] [--max-tokens 32] [--num-prompts 8]

Runs the same greedy workload (the bundled model, float32) on:
    uni        the default engine, one process (fused CPU ops)              <- the peer
    mp tp1     one worker process: the cost of the process boundary alone (torch ops, no collective)
    mp tp2     two ranks, tensor parallel (2 all-reduces per layer + 1 for the embedding, logits gathered)
    mp pp2     two stages of 2 layers (one send/recv of [tokens, hidden] per step)
    pp2 mbN    the same, each step cut into N micro-batches that follow each other through the stages
Engines are built once (start-up not timed), warmed up, then timed round-robin `--repeats` times;
the best run of each is kept. Prints seconds per engine step, the ratio to `uni`, TTFT and TPOT of
one request alone (a 256-token prompt), and per step
the collectives each rank called, the bytes it handed them and the time it spent in them (a
later stage's recv time is mostly waiting for the earlier stage: the pipeline bubble). Numbers, not asserts: the machine
is shared (it prints the load average). What it shows honestly: on one CPU a tiny model's TP
adds communication and per-rank overhead and removes no time — the ranks share the same cores.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light",
           "Blessed are the meek", "The LORD is my shepherd", "In the beginning was the Word",
           "Now the serpent was more subtil", "And the earth was without form", "Let us make man in our image"]


def main() -> None:
    import torch
    from _machine import describe_machine  # (bench/ is the script's folder, first on sys.path)

    from minillm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)  # every rank runs one thread: the peer too, for a fair ratio
    prompts = (PROMPTS * 4)[: args.num_prompts]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    knobs = dict(max_num_seqs=len(prompts), max_model_len=320)
    configs = {"uni": {}, "mp tp1": dict(distributed_executor_backend="mp"),
               "mp tp2": dict(tensor_parallel_size=2), "mp pp2": dict(pipeline_parallel_size=2),
               "pp2 mb2": dict(pipeline_parallel_size=2, pipeline_micro_batches=2),
               "pp2 mb4": dict(pipeline_parallel_size=2, pipeline_micro_batches=4)}
    engines, tokens = {}, {}
    for name, extra in configs.items():
        engines[name] = LLM(dtype="float32", **knobs, **extra)
        tokens[name] = [o.outputs[0].token_ids for o in engines[name].generate(prompts, sp, use_tqdm=False)]
    best: dict[str, float] = {}
    steps: dict[str, int] = {}
    cpu_before = time.process_time()
    for _ in range(args.repeats):
        for name, llm in engines.items():
            n0 = llm.engine.num_steps
            start = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            per_step = (time.perf_counter() - start) / (llm.engine.num_steps - n0)
            best[name] = min(best.get(name, float("inf")), per_step)
            steps[name] = llm.engine.num_steps - n0
    print(f"machine: {describe_machine()}")
    print(f"load average {os.getloadavg()[0]:.2f}; {len(prompts)} prompts x {args.max_tokens} tokens, float32, "
          f"{steps['uni']} steps per run, best of {args.repeats} round-robin; driver CPU "
          f"{time.process_time() - cpu_before:.1f} s")
    print(f"{'engine':8s} {'ms/step':>8s} {'x uni':>6s}  same greedy tokens as uni")
    for name in configs:
        print(f"{name:8s} {best[name] * 1e3:8.2f} {best[name] / best['uni']:6.2f}  {tokens[name] == tokens['uni']}")
    for name in ("mp tp2", "mp pp2", "pp2 mb2"):
        executor = engines[name].engine.executor
        stats = executor.collective_stats()
        for rank, s in enumerate(stats):
            n = executor.num_steps
            text = ", ".join(f"{k} {c / n:.1f} calls {s['bytes'][k] / n / 1024:.1f} KiB {s['seconds'][k] / n * 1e3:.2f} ms"
                             for k, c in s["calls"].items())
            print(f"{name} rank {rank}: per step {text}; forward (with them) {s['model_time_s'] / n * 1e3:.2f} ms")
    # One request alone: time to first token (a 256-token prompt's prefill) and time per output token.
    long_prompt = {"prompt_token_ids": list(range(10, 266))}
    one = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    lat: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            m = llm.generate([long_prompt], one, use_tqdm=False)[0].metrics
            ttft, tpot = m.ttft, m.tpot
            old = lat.get(name, (float("inf"), float("inf")))
            lat[name] = (min(old[0], ttft), min(old[1], tpot))
    print(f"{'engine':8s} {'TTFT ms':>8s} {'x uni':>6s} {'TPOT ms':>8s} {'x uni':>6s}   (1 request, 256-token prompt, 16 out)")
    for name in configs:
        ttft, tpot = lat[name]
        print(f"{name:8s} {ttft * 1e3:8.2f} {ttft / lat['uni'][0]:6.2f} {tpot * 1e3:8.2f} {tpot / lat['uni'][1]:6.2f}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
