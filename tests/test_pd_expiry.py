"""A prefill instance whose decode side never asks: its pinned blocks are freed after abort_timeout_s (issue 17).

In-process (no second instance joins the pair): a request with `do_remote_decode` computes its
prompt and one token (the cap the producer applies), its blocks stay pinned — KV usage above 0 —
and the expiry frees them: usage back to 0, `expired` counted. ~10 s, most of it the 8 s expiry.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from minillm import LLM
from minillm.kv_transfer import parse_kv_transfer_config
from minillm.router.launch import free_port
from minillm.server.app import create_app


def _metrics(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.timeout(120)
def test_pinned_blocks_nobody_pulls_are_freed_after_the_timeout():
    config = parse_kv_transfer_config({"kv_connector": "TorchDistConnector", "kv_role": "kv_producer",
                                       "kv_port": free_port(), "kv_connector_extra_config": {
                                           "abort_timeout_s": 8.0, "connect_timeout_s": 30}})
    llm = LLM(max_model_len=256, max_num_seqs=4, kv_transfer_config=config)
    usage = 'vllm:kv_cache_usage_perc{model_name="minillm"}'
    try:
        with TestClient(create_app(llm)) as client:
            prompt = "In the beginning God created the heaven and the earth. And the earth was without form"
            r = client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-1"}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 1  # the prefill instance stops after one token
            assert _metrics(client)['minillm:kv_transfer_pinned_requests{role="kv_producer"}'] == 1
            # the prompt's blocks are held for the decode side (the gauge is refreshed just after the
            # step that answered, so it may lag the answer by a moment)
            deadline = time.monotonic() + 7.0  # (the blocks expire 8 s after the finish: room under load)
            while _metrics(client)[usage] == 0:
                assert time.monotonic() < deadline, "the finished prefill's blocks were not kept"
                time.sleep(0.01)
            deadline = time.monotonic() + 30
            while _metrics(client)[usage] > 0:
                assert time.monotonic() < deadline, "the pinned blocks were never freed"
                time.sleep(0.1)
            m = _metrics(client)
            assert m['minillm:kv_transfer_pinned_requests{role="kv_producer"}'] == 0
            assert m['minillm:kv_transfer_requests_total{result="expired",role="kv_producer"}'] == 1
            # a malformed transfer is the client's error, named
            r = client.post("/v1/completions", json={"prompt": "In", "max_tokens": 2,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
            assert r.status_code == 400 and "transfer_id" in r.json()["error"]["message"]
    finally:
        llm.shutdown()
