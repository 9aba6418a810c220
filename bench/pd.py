"""Prefill/decode disaggregation vs one colocated engine, measured with `minillm bench serve` (chapter 13).

    python bench/pd.py                          # mixed trace with long prompts, Poisson 4 req/s
    python bench/pd.py --rate 2 --input-len 512

Same load, same two cores, two setups, each a real process tree: one `minillm serve` with 2
OpenMP threads (colocated: prefills and decodes share every step), and `minillm serve
--pd-disaggregation` (a prefill and a decode instance with 1 thread each, KV moved over their gloo
pair, behind the PD router). The trace is the random dataset with prompt lengths spread over
input_len x [0.1, 1.9] (a mix of short and long prompts). Printed: the bench's report lines, the
K/V moved per request (from the instances' own minillm:kv_transfer_* counters), and the ratios
PD / colocated for p99 ITL (decode no longer waits behind prefills) and TTFT (which pays the hop
and the transfer).
"""

from __future__ import annotations

import argparse
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
import psutil  # noqa: E402
from _machine import describe_machine  # noqa: E402
from router import HEADER, bench, colocated, row  # noqa: E402

from minillm.kv_transfer.metrics import read_transfer_stats  # noqa: E402
from minillm.router.launch import free_port, stop_replicas  # noqa: E402


def start_pd(flags: list[str]) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """`minillm serve --pd-disaggregation`: (launcher, router URL, {"prefill"/"decode": URL})."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--pd-disaggregation", "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_replicas([(proc, url)])  # (the launcher stops the pair it started)
            raise RuntimeError("minillm serve --pd-disaggregation did not start")
        time.sleep(0.5)
    roles = {}
    for child in psutil.Process(proc.pid).children():
        cmd = child.cmdline()
        role = "prefill" if "kv_producer" in cmd[cmd.index("--kv-transfer-config") + 1] else "decode"
        roles[role] = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    return proc, url, roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=384)
    parser.add_argument("--range-ratio", type=float, default=0.9)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    flags = ["--max-model-len", "1024", "--max-num-seqs", "16"]
    load = ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate), "--random-input-len",
            str(args.input_len), "--random-range-ratio", str(args.range_ratio), "--random-output-len",
            str(args.output_len), "--seed", "0"]
    print(f"load: random dataset, {args.num_prompts} prompts of {args.input_len} x [{1 - args.range_ratio:.1f}, "
          f"{1 + args.range_ratio:.1f}] tokens -> {args.output_len} tokens, Poisson {args.rate} req/s; "
          f"{describe_machine()}", flush=True)
    results = {"colocated 1 x 2 threads": colocated(flags, load)}
    proc, url, roles = start_pd(flags)
    try:
        results["PD 1+1 x 1 thread"] = bench(url, load)
        p, d = read_transfer_stats(roles["prefill"]), read_transfer_stats(roles["decode"])
    finally:
        stop_replicas([(proc, url)], timeout_s=60)  # terminate, then kill if it does not stop
    print(HEADER + f" {'mean TTFT':>9} {'mean ITL':>8}")
    for name, r in results.items():
        print(row(name, r, f"{r['mean_ttft_ms']:>9.1f} {r['mean_itl_ms']:>8.1f}"))
    print(f"PD transfers: {p['requests']:.0f} ok, {p['blocks']:.0f} blocks, {p['bytes_per_request'] / 2**20:.2f} MiB "
          f"per request, {1000 * d['seconds'] / max(d['requests'], 1):.1f} ms per transfer (decode side, header to "
          f"ack); prompt tokens computed: prefill {p['prompt_tokens_computed']:.0f}, decode "
          f"{d['prompt_tokens_computed']:.0f}")
    a, b = results["PD 1+1 x 1 thread"], results["colocated 1 x 2 threads"]
    print(f"PD / colocated: p99 ITL x{a['p99_itl_ms'] / b['p99_itl_ms']:.2f}, mean ITL x"
          f"{a['mean_itl_ms'] / b['mean_itl_ms']:.2f}, p99 TTFT x{a['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}, "
          f"median TTFT x{a['median_ttft_ms'] / b['median_ttft_ms']:.2f}, "
          f"throughput x{a['output_throughput'] / b['output_throughput']:.2f}; load average now "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
