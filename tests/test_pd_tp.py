"""Prefill/decode disaggregation with tensor parallelism on both sides (issue 25, point 3).

One `minillm serve --pd-disaggregation --tensor-parallel-size 2` is started for the module: a
prefill and a decode instance, each an engine process with two worker ranks (spawned processes,
gloo), behind a PD router. The KV connector's scheduler side runs in each engine process; its
worker side in each rank, and rank r of the decode instance reads its own KV heads' share of every
block from rank r of the prefill instance (four data links' worth of ranks, one pair per rank).
Checked: greedy outputs through the pair equal a plain one-process server's (official `openai`
client; completions and chat, streamed and not); the decode instance computes no prompt token and
the bytes moved are the whole blocks' (both ranks' shares); each instance runs its two rank
processes, and every process started here is gone afterwards (psutil); killing the decode
instance mid-transfer ends the client's request with an error, the prefill instance frees its
pinned blocks (KV usage back to 0), and the router answers 503. CI cost: ~1-2 min on 2 shared
cores, most of it six processes importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from test_pd import _kv, _wait, kill_decode_mid_transfer
from test_router import _four_answers, _openai, launched, scrape
from test_server import running_server

from minillm.router.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pd")]

MAX_MODEL_LEN = 512
DELAY_PER_BLOCK_S = 0.05
TRACKER = "multiprocessing.resource_tracker"  # a spawn helper, not a rank (ranks are forked or spawned: issue 28)


def _ranks_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if not any(TRACKER in part for part in p.cmdline())]


@pytest.fixture(scope="module")
def pd_tp():
    """{"url": the router, "prefill"/"decode": (URL, pid), "ranks": {role: [rank pids]}, "seen": every pid}."""
    port = free_port()
    extra = json.dumps({"kv_connector_extra_config": {"link_delay_per_block_s": DELAY_PER_BLOCK_S,
                                                      "abort_timeout_s": 60}})
    argv = ["--pd-disaggregation", "--tensor-parallel-size", "2", "--port", str(port), "--max-model-len",
            str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--enable-prefix-caching", "--health-check-interval-secs", "0.5",
            "--kv-transfer-config", extra]
    seen: set[int] = set()
    with launched(argv, "minillm serve --pd-disaggregation --tensor-parallel-size 2") as (proc, _):
        found, ranks = {}, {}
        for child in psutil.Process(proc.pid).children():
            cmd = child.cmdline()
            role = "prefill" if "kv_producer" in cmd[cmd.index("--kv-transfer-config") + 1] else "decode"
            found[role] = (f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", child.pid)
            ranks[role] = [p.pid for p in _ranks_of(child.pid)]
        seen = {proc.pid, *(pid for _, pid in found.values()), *(pid for pids in ranks.values() for pid in pids)}
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "ranks": ranks, "seen": seen, **found}
    # (launched has checked that no child of this process is left; the grandchildren must be gone too)
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes still running after the launcher stopped: {left}"


def test_pd_with_tp2_on_both_sides_gives_a_plain_servers_greedy_outputs(pd_tp):
    assert set(pd_tp["ranks"]) == {"prefill", "decode"}
    assert [len(pids) for pids in pd_tp["ranks"].values()] == [2, 2], pd_tp["ranks"]  # two rank processes each
    assert len(pd_tp["seen"]) == 1 + 2 + 4  # the launcher, two engine processes, four ranks
    with running_server(max_model_len=MAX_MODEL_LEN) as (plain, _):
        expected = _four_answers(_openai(plain))
    assert all(answer[0] for answer in expected)
    assert _four_answers(_openai(pd_tp["url"])) == expected
    prefill, decode = pd_tp["prefill"][0], pd_tp["decode"][0]
    d, p = scrape(decode), scrape(prefill)
    assert d["minillm:prompt_tokens_computed_total"] == 0  # every prompt token's K/V came from the prefill ranks
    assert d["minillm:kv_transfer_external_prompt_tokens_total"] == d['vllm:prompt_tokens_total{model_name="minillm"}']
    assert p["minillm:prompt_tokens_computed_total"] == p['vllm:prompt_tokens_total{model_name="minillm"}'] > 0
    assert d['minillm:kv_transfer_requests_total{result="ok",role="kv_consumer"}'] == len(expected)
    cfg = json.loads((Path(__file__).parents[1] / "models/minillm-target/config.json").read_text())
    bytes_per_block = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    blocks = d['minillm:kv_transfer_blocks_total{role="kv_consumer"}']
    assert blocks == p['minillm:kv_transfer_blocks_total{role="kv_producer"}'] >= len(expected)
    assert d['minillm:kv_transfer_bytes_total{role="kv_consumer"}'] == blocks * bytes_per_block  # both halves
    _wait(lambda: _kv(prefill, "pinned_requests", "kv_producer") == 0, "the prefill side to unpin")
    _wait(lambda: scrape(prefill)['vllm:kv_cache_usage_perc{model_name="minillm"}'] == 0, "prefill KV usage 0")
    _wait(lambda: scrape(decode)['vllm:kv_cache_usage_perc{model_name="minillm"}'] == 0, "decode KV usage 0")


def test_decode_killed_mid_transfer_frees_the_prefill_sides_blocks_with_tp2(pd_tp):
    """Last: it breaks the pair."""
    kill_decode_mid_transfer(pd_tp["url"], pd_tp["prefill"][0], pd_tp["decode"][1])
    # the dead decode instance's ranks leave once their pipe to it closes
    _wait(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                          for pid in pd_tp["ranks"]["decode"]), "the dead decode instance's ranks to leave", 30)
