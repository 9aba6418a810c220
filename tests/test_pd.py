"""Prefill/decode disaggregation as real processes (issue 17, points 3-5).

One `minillm serve --pd-disaggregation` is started for the module (the real command: a prefill and
a decode instance joined by a gloo pair, behind a PD router; prefix caching and chunked prefill on
so their paths are crossed too), with a slow link (0.05 s per block)
so that the last test can kill the decode instance mid-transfer. Checked: greedy outputs through
PD equal a plain server's (official `openai` client; streamed and not, completions and chat); the
decode instance computes no prompt token (its own counter) and the K/V bytes moved are the
blocks' size; what one transfer cannot carry is refused with 400 and bad input gets the server's
own errors; killing the decode instance mid-transfer ends the client's request with an error and
the prefill instance frees its pinned blocks (KV usage back to 0). Every process started here is
stopped here (counted with psutil). CI cost: ~30-40 s on 2 shared cores, most of it the two
instances' start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_router import _four_answers, _openai, launched, scrape
from test_server import running_server
from test_server_errors import BAD_INPUT

from minillm.kv_transfer.metrics import read_transfer_stats
from minillm.router.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pd")]

MAX_MODEL_LEN = 512
DELAY_PER_BLOCK_S = 0.05


def _wait(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pd():
    """{"url": the router, "prefill"/"decode": (URL, pid), "proc": the launcher}."""
    port = free_port()
    extra = json.dumps({"kv_connector_extra_config": {"link_delay_per_block_s": DELAY_PER_BLOCK_S,
                                                      "abort_timeout_s": 60}})
    argv = ["--pd-disaggregation", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
            "--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "64",
            "--health-check-interval-secs", "0.5", "--kv-transfer-config", extra]
    with launched(argv, "minillm serve --pd-disaggregation") as (proc, _):
        found = {}
        for child in psutil.Process(proc.pid).children():
            cmd = child.cmdline()
            role = "prefill" if "kv_producer" in cmd[cmd.index("--kv-transfer-config") + 1] else "decode"
            found[role] = (f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", child.pid)
        assert set(found) == {"prefill", "decode"}
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, **found}


def _kv(url: str, name: str, role: str) -> float:
    return scrape(url)[f'minillm:kv_transfer_{name}{{role="{role}"}}']


def test_pd_gives_a_plain_servers_greedy_outputs_and_never_recomputes_the_prompt(pd):
    def usages(client) -> list:
        prompt = "And God called the light Day, and the darkness he called Night. " * 4  # > 2 blocks: cached twice
        kw = {"model": "minillm", "prompt": prompt, "max_tokens": 9, "temperature": 0.0}
        plain_usage = client.completions.create(**kw).usage
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        return [plain_usage.model_dump(), chunks[-1].usage.model_dump()]

    with running_server(max_model_len=MAX_MODEL_LEN) as (plain, _):
        expected = _four_answers(_openai(plain))
        expected_usage = usages(_openai(plain))
    assert all(answer[0] for answer in expected)
    prefill, decode = pd["prefill"][0], pd["decode"][0]
    assert _four_answers(_openai(pd["url"])) == expected
    assert usages(_openai(pd["url"])) == expected_usage  # the first token (from the prefill) is counted once
    d, p = scrape(decode), scrape(prefill)
    prompt_tokens = d['vllm:prompt_tokens_total{model_name="minillm"}']
    assert prompt_tokens > 0
    hits = 'vllm:prefix_cache_hits_total{model_name="minillm"}'
    assert d["minillm:prompt_tokens_computed_total"] == 0  # the decode side computed no prompt token: ...
    assert d[hits] > 0 and p[hits] > 0  # (each prompt comes twice: the second time partly prefix-cached)
    assert d["minillm:kv_transfer_external_prompt_tokens_total"] + d[hits] == prompt_tokens  # ... loaded or cached
    assert p["minillm:prompt_tokens_computed_total"] + p[hits] == prompt_tokens  # the prefill side computed them
    assert d['minillm:kv_transfer_requests_total{result="ok",role="kv_consumer"}'] == len(expected) + 2
    # what moved: whole blocks of 16 slots, K and V of every layer (the bundled model's shapes, float32)
    cfg = json.loads((Path(__file__).parents[1] / "models/minillm-target/config.json").read_text())
    bytes_per_block = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    blocks = p['minillm:kv_transfer_blocks_total{role="kv_producer"}']
    assert blocks == d['minillm:kv_transfer_blocks_total{role="kv_consumer"}'] >= len(expected)
    assert p['minillm:kv_transfer_bytes_total{role="kv_producer"}'] == blocks * bytes_per_block
    assert d['minillm:kv_transfer_bytes_total{role="kv_consumer"}'] == blocks * bytes_per_block
    stats = read_transfer_stats(prefill)  # the chapter's reader of the same counters
    assert stats["role"] == "kv_producer" and stats["blocks"] == blocks
    assert stats["bytes_per_request"] == blocks * bytes_per_block / stats["requests"]
    assert read_transfer_stats(decode)["prompt_tokens_computed"] == 0
    # every pinned block was freed once its K/V had moved: nothing held on either side
    _wait(lambda: _kv(prefill, "pinned_requests", "kv_producer") == 0, "the prefill side to unpin")
    _wait(lambda: scrape(prefill)['vllm:kv_cache_usage_perc{model_name="minillm"}'] == 0, "prefill KV usage 0")
    _wait(lambda: scrape(decode)['vllm:kv_cache_usage_perc{model_name="minillm"}'] == 0, "decode KV usage 0")
    # a prompt whose first blocks the decode instance holds in its prefix cache: only the rest cross the link
    before = _kv(decode, "blocks_total", "kv_consumer")
    prompt = "And God called the light Day, and the darkness he called Night. " * 4
    c = _openai(pd["url"]).completions.create(model="minillm", prompt=prompt, max_tokens=2, temperature=0.0)
    moved = _kv(decode, "blocks_total", "kv_consumer") - before
    assert 1 <= moved < -(-c.usage.prompt_tokens // 16), (moved, c.usage.prompt_tokens)
    assert scrape(decode)["minillm:prompt_tokens_computed_total"] == 0
    assert httpx.get(pd["url"] + "/health", timeout=30).status_code == 200
    models = httpx.get(pd["url"] + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "minillm"


def test_pd_refuses_what_one_transfer_cannot_carry_and_passes_bad_input_to_the_server(pd):
    url, prefill = pd["url"], pd["prefill"][0]
    refused = [({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"prompt": ["a", "b"]}, "prompt"),
               ({"kv_transfer_params": {"transfer_id": "x"}}, "kv_transfer_params")]
    for over, field in refused:
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "minillm", "prompt": "In the beginning", "max_tokens": 4, **over})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (over, r.text)
    compared = 0
    for case, path, body, _, _, _ in BAD_INPUT:
        if "queue cap" in case or "api key" in case.lower():
            continue
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        direct = httpx.post(f"{prefill}/v1/{path}", timeout=60, **kw)
        if direct.status_code == 200:
            continue  # fine on a server; (a valid n > 1 or logprobs is refused by the PD router, above)
        routed = httpx.post(f"{url}/v1/{path}", timeout=60, **kw)
        assert (routed.status_code, routed.json()) == (direct.status_code, direct.json()), case
        compared += 1
    assert compared >= 30
    assert _wait(lambda: _kv(prefill, "pinned_requests", "kv_producer") == 0, "nothing pinned")


def test_decode_killed_mid_transfer_frees_the_prefill_sides_blocks(pd):
    """Last: it breaks the pair."""
    kill_decode_mid_transfer(pd["url"], pd["prefill"][0], pd["decode"][1])


def kill_decode_mid_transfer(url: str, prefill: str, decode_pid: int) -> None:
    """Start a long streamed request through the PD router at `url`, SIGKILL the decode instance while
    its blocks cross, and check: the client gets an error, the prefill instance frees the blocks (KV
    usage 0, link down, a failed transfer counted, nothing running), and the router answers 503.
    (tests/test_pd_tp.py runs it with tensor parallelism on both sides.)"""
    sent_before = _kv(prefill, "blocks_total", "kv_producer")
    prompt = " ".join(["And the earth was without form, and void;"] * 30)  # ~300 tokens: ~19 blocks, ~1 s of link
    result: dict = {}

    def client():
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "minillm", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
                result["status"] = r.status_code
                result["body"] = r.read().decode()
        except httpx.HTTPError as err:
            result["error"] = err

    thread = threading.Thread(target=client)
    thread.start()
    _wait(lambda: _kv(prefill, "blocks_total", "kv_producer") > sent_before, "the transfer to start", 60)
    assert _kv(prefill, "pinned_requests", "kv_producer") == 0  # taken out of the table: being sent
    _wait(lambda: scrape(prefill)['vllm:kv_cache_usage_perc{model_name="minillm"}'] > 0, "blocks held", 5)
    os.kill(decode_pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "the client hung"
    # the client got an error (502 before the stream, or an error event in it), not an answer
    assert "error" in result or result["status"] >= 500 or '"error"' in result["body"], result
    # the prefill side saw the link break and freed the blocks it was sending
    _wait(lambda: scrape(prefill)['vllm:kv_cache_usage_perc{model_name="minillm"}'] == 0, "prefill KV usage 0")
    p = scrape(prefill)
    assert p['minillm:kv_transfer_link_up{role="kv_producer"}'] == 0
    assert p['minillm:kv_transfer_requests_total{result="failed",role="kv_producer"}'] >= 1
    assert p['vllm:num_requests_running{model_name="minillm"}'] == 0
    # the router stops sending to the dead decode instance: a request now gets 503 at once, no hang
    _wait(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, "the router to see the decode died")
    r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "minillm", "prompt": "In", "max_tokens": 2})
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
    assert re.search(r"unhealthy", r.json()["error"]["message"])
