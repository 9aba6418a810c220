"""Replicas behind the router, measured with `minillm bench serve` (chapter 13).

    python bench/router.py dp         # 2 replicas x 1 thread vs 1 replica x 2 threads, equal offered load
    python bench/router.py policies   # cache_aware vs round_robin vs least_load on a multi-tenant trace
    python bench/router.py policies --policies cache_aware --router-flags "--balance-abs-threshold 8"
    python bench/router.py hops --rate 2 --num-prompts 60 --output-len 64   # what each router hop adds to TTFT
    python bench/router.py stub --num-prompts 300   # the hop alone: a stub worker, direct vs through the router

Every server is a real `python -m minillm serve` process on a loopback port, every router a real
`python -m minillm router`, and every load the `python -m minillm bench serve` command line (its
result JSON read back). `dp` plays the random dataset at one request rate against one replica
with 2 OpenMP threads (directly) and against 2 replicas with 1 thread each behind a round-robin
router. `policies` replays a seeded `minillm.traces.tenant` (Zipf-popular tenants, each with its
own system prompt) against 2 replicas with prefix caching and a KV pool too small to keep every
tenant's prompt, behind each policy in turn (fresh replicas each time), and reads the replicas'
own prefix-cache counters (vllm:prefix_cache_hits / queries, tokens) and the router's per-worker
request counts. Printed: ratios against the named peer (1 replica; round_robin). `hops` measures
what a hop adds to TTFT: `minillm serve --data-parallel-size 2` and `--pd-disaggregation` (the real
launchers), each with one paired `minillm bench serve --paired-base-url` run (`minillm.benchmark.paired`):
every prompt goes through the router and directly to an instance (the replicas in turn; the PD prefill
instance, which streams a plain request itself), the two sends neighbours in one Poisson stream at
`--rate`, in a seeded order per pair, so both meet the same moment of the machine's load. Printed: the
median per-pair TTFT difference (routed − direct) with a 95% bootstrap interval, the verdict against
2 ms per hop in words, the router's own histograms (its TTFT less its worker's TTFT), and the router
process's CPU time and run-queue wait per routed request. `stub` isolates the hop: a stub worker (no
model, `minillm.benchmark.stub_server`, 0 ms to its first chunk) and a `minillm router` in front of it,
sequential streamed requests sent alternately to each, so that a change in the machine's load hits
both of a pair alike; printed: the paired difference in time to the first chunk (quartiles) and
the CPU time per request of the router and of the stub.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _machine import describe_machine, results_path  # noqa: E402

from minillm.benchmark.paired import PairedDifference  # noqa: E402
from minillm.router.launch import free_port, start_replicas, stop_replicas  # noqa: E402
from minillm.traces.tenant import make_tenant_trace  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def bench(url: str, extra: list[str]) -> dict:
    """`minillm bench serve` against `url` with `extra` flags; its result JSON."""
    out = results_path(f"bench-serve-{os.getpid()}.json")
    cmd = [sys.executable, "-m", "minillm", "bench", "serve", "--base-url", url, "--model", "minillm",
           "--disable-tqdm", "--ignore-eos", "--metric-percentiles", "50,99", "--save-result", str(out), *extra]
    print("  $", " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
        raise RuntimeError("minillm bench serve failed")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def start_router(workers: list[str], policy: str, flags: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "router", "--policy", policy, "--port", str(port), *flags]
    for w in workers:
        cmd += ["--worker", w]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "the router")
    return proc, url


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    """Until `url`/health answers 200; raises if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
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


def hist(metrics: dict[str, float], name: str, labels: str) -> tuple[float, float]:
    """(sum, count) of one histogram series in a scrape."""
    return metrics.get(f"{name}_sum{{{labels}}}", 0.0), metrics.get(f"{name}_count{{{labels}}}", 0.0)


def mean_ms(before: dict, after: dict, name: str, labels: list[str]) -> float:
    """The mean of a histogram over a run, from scrapes before and after, summed over the label sets."""
    total = count = 0.0
    for label in labels:
        (s0, n0), (s1, n1) = hist(before, name, label), hist(after, name, label)
        total, count = total + s1 - s0, count + n1 - n0
    return total / count * 1e3 if count else float("nan")


def launch(argv: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """`python -m minillm serve ARGV` (a launcher: replicas or a PD pair behind its router), once its router
    printed its URL; (the process, its output lines so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("minillm router:"):
            threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()  # drained: a full pipe blocks
            return proc, lines
    raise RuntimeError("the launcher exited:\n" + "".join(lines))


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 without one)."""
    import psutil

    return sum(psutil.Process(pid).cpu_times()[:2]) if pid is not None else 0.0


def run_queue(pid: int | None) -> tuple[float, int]:
    """(seconds spent runnable but waiting for a core, turns on a core) of a process's main thread so far, from
    Linux's /proc/PID/schedstat; (nan, 0) elsewhere or without a process. The router's event loop is its main
    thread: each wake-up (a request in, a worker's chunk in) waits there while the cores are taken."""
    try:
        _, wait_ns, runs = Path(f"/proc/{pid}/schedstat").read_text().split()
    except (OSError, TypeError, ValueError):
        return float("nan"), 0
    return int(wait_ns) / 1e9, int(runs)


HOP_LIMIT_MS = 2.0  # issue 29: each hop adds at most this to TTFT at 2 req/s


def hop_run(router_url: str, direct: list[str], load: list[str], router_pid: int, first_token_from: list[str]) -> dict:
    """One paired `minillm bench serve` run: every prompt through the router and directly to an instance
    (`direct`, in turn), neighbours in the arrival order; its result JSON, plus the router process's CPU time
    and run-queue wait per routed request and its own TTFT histograms for the workers that sent the first
    token."""
    labels = [f'worker="{w}"' for w in first_token_from]
    before = scrape(router_url)
    cpu_before, queue_before = cpu_s(router_pid), run_queue(router_pid)
    paired = [flag for url in direct for flag in ("--paired-base-url", url)]
    result = bench(router_url, [*load, *paired])
    cpu, queue_after = cpu_s(router_pid) - cpu_before, run_queue(router_pid)
    after = scrape(router_url)
    routed = result["completed"] + 1  # (and the initial test request)
    return {**result, "router_cpu_ms": cpu / routed * 1e3,
            "router_wait_ms": (queue_after[0] - queue_before[0]) / routed * 1e3,
            "router_wait_per_run_us": (queue_after[0] - queue_before[0]) / max(1, queue_after[1] - queue_before[1]) * 1e6,
            "router_ttft": mean_ms(before, after, "minillm_router_time_to_first_token_seconds", labels),
            "router_worker_ttft": mean_ms(before, after, "minillm_router_worker_time_to_first_token_seconds", labels)}


def run_hops(args) -> None:
    flags = ["--max-model-len", "512", "--max-num-seqs", "16"]
    load = ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate), "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len), "--seed", "0"]
    print(f"load: random dataset, {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len} tokens, "
          f"each sent twice, through the router and directly to an instance, neighbours in one Poisson stream of "
          f"{args.rate:g} req/s (order per pair a seeded coin); {describe_machine()}")
    rows = []
    port = free_port()
    proc, lines = launch(["--data-parallel-size", "2", "--port", str(port), "--policy", "round_robin", *flags])
    try:
        workers = [m.group(1) for line in lines if (m := re.match(r"minillm serve: (http://[\d.:]+)/v1", line))]
        # the direct half goes to the replicas in turn, as the round-robin router sends its half
        rows.append(("--data-parallel-size 2", 1,
                     hop_run(f"http://127.0.0.1:{port}", workers, load, proc.pid, workers)))
    finally:
        stop_replicas([(proc, "launcher")], 60)
    import psutil

    port = free_port()
    proc, _ = launch(["--pd-disaggregation", "--port", str(port), *flags])
    try:
        pair = {}
        for child in psutil.Process(proc.pid).children():
            cmd = child.cmdline()
            role = "prefill" if "kv_producer" in cmd[cmd.index("--kv-transfer-config") + 1] else "decode"
            pair[role] = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        # the direct half: the prefill instance alone (it serves plain requests too, and streams them itself)
        rows.append(("--pd-disaggregation", 2,
                     hop_run(f"http://127.0.0.1:{port}", [pair["prefill"]], load, proc.pid, [pair["prefill"]])))
    finally:
        stop_replicas([(proc, "launcher")], 60)
    print(f"{'TTFT, ms':<24} {'pairs':>5} {'routed p50':>10} {'direct p50':>10} {'routed - direct, per pair':>37} "
          f"{'hops':>4} {'in router':>9}")
    for name, _, r in rows:
        if r["paired_ttft_ms"] is None:
            print(f"{name}: fewer than 2 pairs where both requests succeeded ({len(r['errors'])} failures): no difference")
    rows = [row for row in rows if row[2]["paired_ttft_ms"] is not None]
    for name, hops, r in rows:
        d = r["paired_ttft_ms"]
        interval = f"{d['median_ms']:+.2f} [{d['low_ms']:+.2f}, {d['high_ms']:+.2f}]"
        print(f"{name:<24} {d['pairs']:>5} {d['median_a_ms']:>10.2f} {d['median_b_ms']:>10.2f} {interval:>37} "
              f"{hops:>4} {r['router_ttft'] - r['router_worker_ttft']:>9.2f}")
    print("routed - direct: the median of the per-pair TTFT differences, [95% bootstrap interval of that median]; "
          "direct: a replica (DP; the two in turn) or the prefill instance streaming the request itself (PD). "
          "in router: the router's mean TTFT histogram less its worker-TTFT histogram (its own clock).")
    for name, hops, r in rows:
        limit = HOP_LIMIT_MS * hops
        print(f"{name}: {hops} hop{'s' if hops > 1 else ''}, limit {limit:g} ms ({HOP_LIMIT_MS:g} ms per hop): "
              f"{PairedDifference(**r['paired_ttft_ms']).verdict(limit)}")
    print("(PD: the issue counts two hops, to the prefill and to the decode instance; the first token crosses "
          "the router once, as the prefill's answer, so the decode hop is off the TTFT path)")
    print("router CPU per routed request (the launcher's process, which runs the router; streamed answers of "
          f"{args.output_len} tokens): " + ", ".join(f"{name} {r['router_cpu_ms']:.2f} ms" for name, _, r in rows))
    print("router waiting for a core (its main thread runnable, the cores taken; /proc/PID/schedstat): " +
          ", ".join(f"{name} {r['router_wait_ms']:.2f} ms per routed request ({r['router_wait_per_run_us']:.0f} µs "
                    f"per turn on a core)" for name, _, r in rows))


def run_stub(args) -> None:
    import statistics

    import psutil

    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "minillm.benchmark.stub_server", "--port", str(stub_port),
                             "--ttft-ms", "0", "--tpot-ms", "1"])
    worker = f"http://127.0.0.1:{stub_port}"
    router = None
    try:
        wait_healthy(worker, stub, "the stub worker")  # (the first direct request was once refused: it came too early)
        router, url = start_router([worker], "round_robin")
        body = {"model": "stub", "prompt": "hello " * 100, "max_tokens": 4, "stream": True}
        first_chunk = {worker: [], url: []}
        cpu = [psutil.Process(p.pid) for p in (router, stub)]
        with httpx.Client(timeout=30) as client:
            for i in range(args.num_prompts + 20):  # the first 20 pairs warm up (connections, imports)
                if i == 20:
                    cpu_before = [sum(p.cpu_times()[:2]) for p in cpu]
                for target in (worker, url):
                    t0 = time.perf_counter()
                    with client.stream("POST", target + "/v1/completions", json=body) as r:
                        seen = False
                        for chunk in r.iter_raw():
                            if not seen and b"word" in chunk:
                                seen = True
                                if i >= 20:
                                    first_chunk[target].append(time.perf_counter() - t0)
        cpu_ms = [(sum(p.cpu_times()[:2]) - b) / args.num_prompts * 1e3 for p, b in zip(cpu, cpu_before)]
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        stub.terminate()
        stub.wait(30)
    diffs = sorted(b - a for a, b in zip(first_chunk[worker], first_chunk[url]))
    q = statistics.quantiles(diffs, n=4)
    print(f"{args.num_prompts} pairs of streamed requests, stub worker (0 ms to its first chunk); {describe_machine()}")
    print(f"time to first chunk, median: direct {statistics.median(first_chunk[worker]) * 1e3:.2f} ms, through the "
          f"router {statistics.median(first_chunk[url]) * 1e3:.2f} ms; router - direct, pair by pair: "
          f"p25 / median / p75 {q[0] * 1e3:.2f} / {q[1] * 1e3:.2f} / {q[2] * 1e3:.2f} ms")
    print(f"CPU per request: router {cpu_ms[0]:.2f} ms (it serves one request and sends one), stub {cpu_ms[1] / 2:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["dp", "policies", "hops", "stub"])
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
    {"dp": run_dp, "policies": run_policies, "hops": run_hops, "stub": run_stub}[args.what](args)


if __name__ == "__main__":
    main()
