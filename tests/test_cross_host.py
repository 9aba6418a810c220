"""A PD pair and a router whose parts are separate commands with addresses passed in (issue 28, item 4).

Every part is started as a reader on another host would start it (docs/multinode.md), with this
host's non-loopback address A (127.0.0.1 only where the host has no other) in every `--host`,
URL and `kv_ip`, and each server bound to A alone. Then a part that dialled 127.0.0.1 instead of
the address it was given would find nothing there, and the tests check that none did:
- a PD pair (prefill and decode `minillm serve --kv-transfer-config` with `kv_ip` A) and a
  `minillm router --pd` given their URLs: greedy completions through the router equal one
  process's, the decode instance computed no prompt token (the K/V crossed the link), and every
  TCP connection the two servers hold is on A — the KV links' gloo sockets included, which
  before this issue advertised the address the host *name* resolves to (127.0.0.1 here);
- `minillm router --worker URL --worker URL` in front of two stub servers (no model: the test is
  about addresses, not tokens) started as their own commands: round robin reaches both.
Nothing answers on 127.0.0.1 at the servers' ports; every process started is stopped and counted.

CI cost: the PD pair's two model loads (~30 s on 2 shared cores) and two stub servers (~5 s).
Same xdist group as the router tests: all probe ports free and then take them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import psutil
import pytest
from test_external_launcher import free_port, host_address, left_behind
from test_router import _openai, scrape

from minillm import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("router")]

START_TIMEOUT_S = 240.0
PROMPTS = ["And God said, Let there be light", "In the beginning God created the heaven and the earth."]
MAX_MODEL_LEN = 256


def start(argv: list[str], stack: ExitStack, procs: list) -> subprocess.Popen:
    """`python -m ARGV` in its own session, stopped (the whole session) when `stack` closes."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen([sys.executable, "-m", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs.append(proc)
    stack.callback(stop, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[2:]} exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} was not healthy within {START_TIMEOUT_S:.0f} s"
        time.sleep(0.3)


def not_on_loopback(port: int) -> bool:
    """Nothing answers at 127.0.0.1:port (the server is bound to the address it was given)."""
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def tcp_connections(pid: int) -> list:
    """The established TCP connections of a process and its children."""
    found = []
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        found += [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
    return found


def bare(ip: str) -> str:
    return ip.removeprefix("::ffff:")  # an IPv4 peer of an IPv6 socket (the TCPStore listens on ::)


def test_pd_pair_and_pd_router_as_separate_commands_on_the_host_address():
    host = host_address()
    prefill_port, decode_port, router_port, kv_port = (free_port(host) for _ in range(4))
    kv = {"kv_connector": "TorchDistConnector", "kv_ip": host, "kv_port": kv_port}
    serve = ["minillm", "serve", "--host", host, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    want = [o.outputs[0].text for o in LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=4).generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)]
    procs: list = []
    with ExitStack() as stack:
        prefill = start([*serve, "--port", str(prefill_port), "--kv-transfer-config",
                         json.dumps({**kv, "kv_role": "kv_producer"})], stack, procs)
        decode = start([*serve, "--port", str(decode_port), "--kv-transfer-config",
                        json.dumps({**kv, "kv_role": "kv_consumer"})], stack, procs)
        prefill_url, decode_url = f"http://{host}:{prefill_port}", f"http://{host}:{decode_port}"
        router = start(["minillm", "router", "--pd", "--prefill", prefill_url, "--decode", decode_url,
                        "--host", host, "--port", str(router_port)], stack, procs)
        for proc, url in ((prefill, prefill_url), (decode, decode_url), (router, f"http://{host}:{router_port}")):
            wait_healthy(proc, url)
        client = _openai(f"http://{host}:{router_port}")
        got = [client.completions.create(model="minillm", prompt=p, max_tokens=8, temperature=0.0).choices[0].text
               for p in PROMPTS]
        assert got == want
        d = scrape(decode_url)
        assert d["minillm:prompt_tokens_computed_total"] == 0  # the prompts' K/V came over the link
        assert d['minillm:kv_transfer_requests_total{result="ok",role="kv_consumer"}'] == len(PROMPTS)
        links = tcp_connections(prefill.pid) + tcp_connections(decode.pid)
        ends = {(bare(c.laddr.ip), bare(c.raddr.ip)) for c in links}
        assert ends == {(host, host)}, f"connections not on {host}: {sorted(ends)}"
        assert any(c.raddr.port == kv_port for c in links)  # the decode side joined the pair's store at kv_ip
        # the gloo links: connections on ports that are neither the servers' HTTP ones nor the store's
        gloo = [c for c in links if {c.laddr.port, c.raddr.port}.isdisjoint({kv_port, prefill_port, decode_port})]
        assert gloo, f"no KV link connection among {links}"
        if host != "127.0.0.1":
            assert all(not_on_loopback(port) for port in (prefill_port, decode_port, router_port))
    assert not left_behind(procs)


def test_router_in_front_of_servers_started_as_separate_commands_on_the_host_address():
    host = host_address()
    ports = [free_port(host) for _ in range(3)]
    procs: list = []
    with ExitStack() as stack:
        workers = []
        for name, port in zip(("a", "b"), ports):
            proc = start(["minillm.benchmark.stub_server", "--host", host, "--port", str(port), "--model", name,
                          "--ttft-ms", "1", "--tpot-ms", "1"], stack, procs)
            workers.append((proc, f"http://{host}:{port}"))
        router = start(["minillm", "router", *[a for _, url in workers for a in ("--worker", url)],
                        "--policy", "round_robin", "--host", host, "--port", str(ports[2])], stack, procs)
        for proc, url in [*workers, (router, f"http://{host}:{ports[2]}")]:
            wait_healthy(proc, url)
        client = _openai(f"http://{host}:{ports[2]}")
        served_by = {chunk.model for _ in range(4)
                     for chunk in client.completions.create(model="stub", prompt="hi", max_tokens=2, stream=True)}
        assert served_by == {"a", "b"}
        if host != "127.0.0.1":
            assert all(not_on_loopback(port) for port in ports)
    assert not left_behind(procs)
