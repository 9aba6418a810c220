"""Replicas behind the router, measured with `minillm bench serve` (chapter 13).

    python bench/router.py dp         # 2 replicas x 1 thread vs 1 replica x 2 threads, equal offered load
    python bench/router.py policies   # cache_aware vs round_robin vs least_load on a multi-tenant trace
    python bench/router.py policies --policies cache_aware --router-flags "--balance-abs-threshold 8"

Every server is a real `python -m minillm serve` process on a loopback port, every router a real
`python -m minillm router`, and every load the `python -m minillm bench serve` command line (its
result JSON read back). `dp` plays the random dataset at one request rate against one replica
with 2 OpenMP threads (directly) and against 2 replicas with 1 thread each behind a round-robin
router. `policies` replays a seeded `minillm.traces.tenant` (Zipf-popular tenants, each with its
own system prompt) against 2 replicas with prefix caching and a KV pool too small to keep every
tenant's prompt, behind each policy in turn (fresh replicas each time), and reads the replicas'
own prefix-cache counters (vllm:prefix_cache_hits / queries, tokens) and the router's per-worker
request counts. Printed: ratios against the named peer (1 replica; round_robin).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _machine import describe_machine, results_path  # noqa: E402

from minillm.router.launch import free_port, start_replicas, stop_replicas  # noqa: E402
from minillm.traces.tenant import make_tenant_trace  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def bench(url: str, extra: list[str]) -> dict:
    out = str(results_path(f"bench-serve-{os.getpid()}.json"))
    cmd = [sys.executable, "-m", "minillm", "bench", "serve", "--base-url", url, "--model", "minillm",
           "--disable-tqdm", "--ignore-eos", "--metric-percentiles", "50,99", "--save-result", out, *extra]
    print("  $", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def start_router(workers: list[str], policy: str, flags: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "router", "--policy", policy, "--port", str(port), *flags]
    for w in workers:
        cmd += ["--worker", w]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the router did not start")
        time.sleep(0.2)


def replicas(n: int, threads: int, serve_flags: list[str]):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        return start_replicas(serve_flags, n)
    finally:
        del os.environ["OMP_NUM_THREADS"]


def row(name: str, r: dict, extra: str = "") -> str:
    return (f"{name:<26} {r['completed']:>4} {r['request_throughput']:>8.2f} {r['output_throughput']:>9.1f} "
            f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} {r['p99_itl_ms']:>8.1f}  {extra}")


HEADER = f"{'':<26} {'done':>4} {'req/s':>8} {'out tok/s':>9} {'p50 TTFT':>9} {'p99 TTFT':>9} {'p99 ITL':>8}"


def colocated(flags: list[str], load: list[str]) -> dict:
    """One server with both threads (the baseline every multi-process layout is set against), benched
    with `load` and stopped."""
    procs = replicas(1, 2, flags)
    try:
        return bench(procs[0][1], load)
    finally:
        stop_replicas(procs)


def run_dp(args) -> None:
    flags = ["--max-model-len", "512", "--max-num-seqs", "16"]
    load = ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate), "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len), "--seed", "0"]
    print(f"load: random dataset, {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len} "
          f"tokens, Poisson {args.rate} req/s; {describe_machine()}")
    results = {"1 replica x 2 threads": colocated(flags, load)}
    procs = replicas(2, 1, flags)
    router = None
    try:
        router, url = start_router([u for _, u in procs], "round_robin")
        results["2 replicas x 1 thread"] = bench(url, load)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        stop_replicas(procs)
    print(HEADER)
    for name, r in results.items():
        print(row(name, r))
    a, b = results["2 replicas x 1 thread"], results["1 replica x 2 threads"]
    print(f"2 replicas / 1 replica: throughput x{a['output_throughput'] / b['output_throughput']:.2f}, "
          f"p99 TTFT x{a['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}")


def run_policies(args) -> None:
    trace = make_tenant_trace(args.num_prompts, num_tenants=args.tenants, system_prompt_len=args.system_len,
                              question_len=16, output_len=args.output_len, zipf_s=1.0, seed=0)
    path = results_path("tenant-trace.jsonl")
    trace.save_jsonl(path)
    flags = ["--max-model-len", "512", "--max-num-seqs", "8", "--enable-prefix-caching",
             "--num-gpu-blocks-override", str(args.kv_blocks)]
    load = ["--dataset-name", "jsonl", "--dataset-path", str(path), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.rate), "--seed", "0"]
    print(f"load: minillm.traces.tenant, {args.num_prompts} requests, {args.tenants} tenants (Zipf s=1), system "
          f"prompt {args.system_len} + question 16 tokens -> {args.output_len} tokens, Poisson {args.rate} req/s; "
          f"2 replicas x 1 thread, {args.kv_blocks} KV blocks of 16 tokens each; {describe_machine()}")
    results = {}
    for policy in args.policies:
        procs = replicas(2, 1, flags)
        router = None
        try:
            workers = [u for _, u in procs]
            router, url = start_router(workers, policy, args.router_flags.split())
            r = bench(url, load)
            hits = sum(scrape(w)['vllm:prefix_cache_hits_total{model_name="minillm"}'] for w in workers)
            queries = sum(scrape(w)['vllm:prefix_cache_queries_total{model_name="minillm"}'] for w in workers)
            routed = scrape(url)
            per_worker = [int(routed[f'minillm_router_requests_total{{worker="{w}"}}']) for w in workers]
            r["hit_rate"] = hits / queries if queries else 0.0
            results[policy] = (r, per_worker, routed["minillm_router_prefix_match_rate"])
        finally:
            if router is not None:
                router.terminate()
                router.wait(30)
            stop_replicas(procs)
    print(HEADER + "  prefix hit rate, requests per worker")
    for policy, (r, per_worker, _) in results.items():
        print(row(policy, r, f"{r['hit_rate']:.1%}  {per_worker}"))
    if "round_robin" not in results or "cache_aware" not in results:
        return
    rr, ca = results["round_robin"][0], results["cache_aware"][0]
    print(f"cache_aware / round_robin: prefix hit rate {ca['hit_rate']:.1%} vs {rr['hit_rate']:.1%}, "
          f"p99 TTFT x{ca['p99_ttft_ms'] / rr['p99_ttft_ms']:.2f}, mean TTFT x{ca['mean_ttft_ms'] / rr['mean_ttft_ms']:.2f}, "
          f"throughput x{ca['output_throughput'] / rr['output_throughput']:.2f}; "
          f"router's own match rate {results['cache_aware'][2]:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["dp", "policies"])
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=192)
    parser.add_argument("--kv-blocks", type=int, default=160)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "least_load", "cache_aware"])
    parser.add_argument("--router-flags", default="", help="more `minillm router` flags, e.g. '--balance-abs-threshold 8'")
    args = parser.parse_args()
    run_dp(args) if args.what == "dp" else run_policies(args)


if __name__ == "__main__":
    main()
