"""`minillm serve` through the official `openai` client: a real uvicorn on a free loopback port.

Streamed text equals non-streamed text for greedy requests (completions and chat); `n`,
`logprobs` and `stream_options.include_usage` behave as the OpenAI API documents them.
`running_server` is imported by the other tests/test_server_*.py files.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from minillm import LLM, SamplingParams


@contextlib.contextmanager
def running_server(api_key: str | None = None, max_num_queued_reqs: int | None = None,
                   served_model_name: str | list[str] = "minillm", **knobs):
    """uvicorn serving the bundled model on 127.0.0.1:<free port>, in a thread; yields
    (base_url, app). The socket is bound before uvicorn starts, so the port cannot be taken."""
    import uvicorn

    from minillm.server.app import create_app

    knobs = {"max_num_seqs": 16, "max_model_len": 256, **knobs}
    llm = LLM(**knobs)
    app = create_app(llm, served_model_name=served_model_name, api_key=api_key, max_num_queued_reqs=max_num_queued_reqs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this; without it a keep-alive response written as headers + body
    # waits ~40 ms for the client's delayed ACK (Nagle), which would land in every measured latency.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="module")
def server():
    with running_server() as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


PROMPT = "And God said, Let there be light"


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and the finish reason per choice index, and every chunk."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


@pytest.mark.parametrize("with_stop", [False, True])
def test_completion_stream_equals_non_stream_for_greedy(client, with_stop):
    kw = dict(model="minillm", prompt=PROMPT, max_tokens=40, temperature=0.0)
    stop = None
    if with_stop:  # a stop string that straddles tokens in the middle of the greedy text
        full = client.completions.create(**kw).choices[0].text
        stop = [full[20:27]]
        kw["stop"] = stop
    whole = client.completions.create(**kw)
    texts, reasons, chunks = collect_stream(client.completions.create(stream=True, **kw))
    assert len(chunks) > 3  # really streamed, not one blob
    assert texts[0] == whole.choices[0].text and reasons[0] == whole.choices[0].finish_reason
    if stop:
        assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == full[: full.find(stop[0])]
    # The same engine offline gives the same text.
    offline = LLM(max_num_seqs=2, max_model_len=256).generate(
        [PROMPT], SamplingParams(max_tokens=40, temperature=0.0, stop=stop), use_tqdm=False)[0].outputs[0]
    assert offline.text == whole.choices[0].text


def test_chat_stream_equals_non_stream_for_greedy(client):
    messages = [{"role": "system", "content": "Thou art a scribe."}, {"role": "user", "content": "Who made light?"}]
    kw = dict(model="minillm", messages=messages, max_tokens=30, temperature=0.0)
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    texts, reasons, chunks = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == whole.choices[0].message.content and reasons[0] == whole.choices[0].finish_reason
    offline = LLM(max_num_seqs=2, max_model_len=256).chat(messages, SamplingParams(max_tokens=30, temperature=0.0),
                                                          use_tqdm=False)[0]
    assert offline.outputs[0].text == whole.choices[0].message.content
    assert whole.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_n_gives_n_indexed_choices_and_usage_counts_them(client):
    kw = dict(model="minillm", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3)
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1  # different samples
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]  # seeded
    texts, _, _ = collect_stream(client.completions.create(stream=True, **kw))
    assert texts == {c.index: c.text for c in whole.choices}
    # usage counts every choice's tokens (none of these seeded samples meets EOS within 12 tokens)
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 3 * 12
    # A batch of two prompts × n=2: choices ordered prompt-major, prompt tokens counted once per prompt.
    batch = client.completions.create(model="minillm", prompt=[PROMPT, "In the beginning"], max_tokens=4,
                                      temperature=0.0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text != batch.choices[2].text == batch.choices[3].text


def test_completion_logprobs_as_openai_documents(client):
    out = client.completions.create(model="minillm", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # "up to logprobs + 1 elements": the 3 most likely, and the sampled token if it is not among them.
        assert 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())  # greedy: the sampled token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    streamed = list(client.completions.create(model="minillm", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                              logprobs=3, stream=True))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    values = [v for ch in streamed for c in ch.choices if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_as_openai_documents(client):
    out = client.chat.completions.create(model="minillm", messages=[{"role": "user", "content": "Speak"}],
                                         max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 2  # exactly top_logprobs alternatives
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == item.top_logprobs[0].logprob and item.token == item.top_logprobs[0].token
        assert bytes(item.bytes).decode() == item.token
    plain = client.chat.completions.create(model="minillm", messages=[{"role": "user", "content": "Speak"}],
                                           max_tokens=6, temperature=0.0)
    assert plain.choices[0].logprobs is None


def test_include_usage_sends_one_final_chunk_without_choices(client):
    chunks = list(client.completions.create(model="minillm", prompt=PROMPT, max_tokens=10, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(c.usage is None and c.choices for c in body)
    chat = list(client.chat.completions.create(model="minillm", messages=[{"role": "user", "content": "Speak"}],
                                               max_tokens=5, temperature=0.0, stream=True,
                                               stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model="minillm", messages=[{"role": "user", "content": "Speak"}],
                                           max_tokens=5, temperature=0.0)
    assert chat[-1].choices == [] and chat[-1].usage == whole.usage
    assert sum(1 for c in chat if not c.choices) == 1
    without = list(client.completions.create(model="minillm", prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.choices and c.usage is None for c in without)
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    running = list(client.completions.create(model="minillm", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in running]
    assert so_far == sorted(so_far) and so_far[-1] == 6 and running[-1].choices == []


def test_vllm_extra_parameters_and_stop_reason(client):
    base = dict(model="minillm", prompt=PROMPT, temperature=0.0)
    long = client.completions.create(max_tokens=60, extra_body={"ignore_eos": True}, **base)
    assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"
    word = long.choices[0].text.split()[3]
    cut = client.completions.create(max_tokens=60, stop=[word], **base)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == word
    assert cut.choices[0].text == long.choices[0].text[: long.choices[0].text.find(word)]
    penalized = client.completions.create(max_tokens=30, extra_body={"repetition_penalty": 1.5, "top_k": 5,
                                                                      "min_p": 0.1, "ignore_eos": True}, **base)
    assert penalized.choices[0].text != long.choices[0].text[: len(penalized.choices[0].text)]


def test_models_health_and_prometheus_metrics(server, client):
    import httpx

    url, _ = server
    assert [m.id for m in client.models.list().data] == ["minillm"]
    assert httpx.get(url + "/health").status_code == 200
    client.completions.create(model="minillm", prompt=PROMPT, max_tokens=3, temperature=0.0)
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:iteration_tokens_total_bucket"):
        assert f"\n{name}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['vllm:request_success_total{finished_reason="length",model_name="minillm"}'] >= 1
    assert values['vllm:generation_tokens_total{model_name="minillm"}'] >= 3


def sse_events(url: str, path: str, body: dict) -> tuple[str, list[str]]:
    """The raw server-sent events of one streamed request: its content type and each event's text."""
    import httpx

    with httpx.stream("POST", f"{url}/v1/{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
        content_type = r.headers["content-type"]
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    return content_type, raw[:-2].split("\n\n")


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": PROMPT, "n": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Speak"}], "n": 2}),
])
def test_raw_sse_framing_ends_with_done_and_usage_matches_the_non_streamed_answer(server, path, body):
    """What the openai client hides: it stops quietly at the end of the body with or without
    `data: [DONE]`. Every event is one `data: {json}`; [DONE] comes last; one choice per chunk (as
    vLLM sends them), each index finishing once; the include_usage chunk equals the non-streamed usage."""
    import httpx

    url, _ = server
    body = {"model": "minillm", "max_tokens": 7, "temperature": 0.8, "seed": 3, **body}
    whole = httpx.post(f"{url}/v1/{path}", json=body, timeout=60).json()
    content_type, events = sse_events(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert content_type.startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: {"), event
        chunks.append(json.loads(event[len("data: "):]))
    *body_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in body_chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != whole["id"]
    finishes = [c["choices"][0]["index"] for c in body_chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1]
    key = "text" if path == "completions" else "delta"
    texts = {0: "", 1: ""}
    for c in body_chunks:
        piece = c["choices"][0][key]
        texts[c["choices"][0]["index"]] += piece if key == "text" else (piece.get("content") or "")
    expected = {c["index"]: c["text"] if key == "text" else c["message"]["content"] for c in whole["choices"]}
    assert texts == expected  # seeded samples: streamed equals non-streamed for sampling too


def test_x_request_id_names_the_answer_as_vllm_does(server):
    """The PD router sends one X-Request-Id to its prefill and decode instance: both answers carry its id."""
    import httpx

    url = server[0]
    body = {"model": "minillm", "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "pair-7"}, timeout=60)
    assert r.json()["id"] == "cmpl-pair-7"
    chat = {"model": "minillm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "pair-8"},
                      timeout=60) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-pair-8"}
    unnamed = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["id"] for _ in range(2)]
    assert unnamed[0] != unnamed[1] and all(i.startswith("cmpl-") for i in unnamed)


def test_prometheus_types_are_vllms(server):
    """Counters are exposed as counters named *_total, gauges as gauges, histograms with buckets."""
    import httpx

    text = httpx.get(server[0] + "/metrics").text
    types = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert types[f"vllm:{name}"] == "gauge", name
    for name in ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "request_success", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        assert types[f"vllm:{name}_total"] == "counter", name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "iteration_tokens_total"):
        assert types[f"vllm:{name}"] == "histogram", name
        assert f'vllm:{name}_bucket{{le="+Inf",model_name="minillm"}}' in text


@pytest.fixture(scope="module")
def offline():
    return LLM(max_num_seqs=2, max_model_len=256)


# vLLM's extra parameters over HTTP, each against the same SamplingParams offline: a field the
# server dropped or misnamed would change the tokens. Seeded sampling, so top_k/min_p matter.
EXTRA_PARAMS = [
    {"top_k": 3},
    {"min_p": 0.3},
    {"top_p": 0.5},
    {"repetition_penalty": 1.4},
    {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    {"min_tokens": 5, "stop_token_ids": [592]},  # 592 (" him") comes 4th in this seed's sample
    {"stop_token_ids": [592], "include_stop_str_in_output": True},
    {"ignore_eos": True, "skip_special_tokens": False},
]


@pytest.mark.parametrize("extra", EXTRA_PARAMS, ids=[",".join(e) for e in EXTRA_PARAMS])
def test_extra_sampling_parameters_reach_the_engine(client, offline, extra):
    base = dict(max_tokens=16, temperature=0.9, seed=11)
    got = client.completions.create(model="minillm", prompt=PROMPT, logprobs=0, extra_body=extra, **base).choices[0]
    want = offline.generate([PROMPT], SamplingParams(**base, **extra), use_tqdm=False)[0].outputs[0]
    assert got.text == want.text and got.finish_reason == want.finish_reason
    assert len(got.logprobs.tokens) == len(want.token_ids)
    plain = offline.generate([PROMPT], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    if not extra.get("ignore_eos"):
        assert want.token_ids != plain.token_ids, "this parameter changes nothing here: the check would be empty"


def test_stop_token_text_is_left_out_unless_asked_for(client):
    """vLLM's rule: the EOS or stop token that ended a request is in its tokens, not in its text
    (unless include_stop_str_in_output); streamed and non-streamed agree."""
    base = dict(model="minillm", prompt=PROMPT, max_tokens=30, temperature=0.0)
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    assert "," in full
    cut = client.completions.create(**base, extra_body={"stop_token_ids": [17]}).choices[0]  # 17 is ","
    assert cut.finish_reason == "stop" and cut.stop_reason == 17
    assert cut.text == full[: full.index(",")]
    texts, _, _ = collect_stream(client.completions.create(stream=True, **base, extra_body={"stop_token_ids": [17]}))
    assert texts[0] == cut.text
    kept = client.completions.create(**base, extra_body={"stop_token_ids": [17], "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(",") + 1]
    texts, _, _ = collect_stream(client.completions.create(stream=True, **base, extra_body={
        "stop_token_ids": [17], "include_stop_str_in_output": True}))
    assert texts[0] == kept.choices[0].text


def test_shutdown_stops_the_engine_thread():
    """Leaving the server (uvicorn's lifespan shutdown) stops and joins the engine thread."""
    with running_server(max_num_seqs=2, max_model_len=128) as (url, app):
        import httpx

        assert httpx.post(url + "/v1/completions", json={"prompt": "In", "max_tokens": 2}, timeout=30).status_code == 200
        engine_thread = app.state.client._thread
        assert engine_thread.is_alive()
    assert not engine_thread.is_alive()
    assert not any(t.name == "minillm-engine" and t is engine_thread for t in threading.enumerate())
