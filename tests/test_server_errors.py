"""Bad input, overload and auth against a real server: each answer has its HTTP status and vLLM's
error body {"error": {"message", "type", "param", "code"}} naming the problem; nothing kills it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_server import running_server

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server():
    with running_server(api_key=KEY, max_num_queued_reqs=2, max_model_len=MAX_MODEL_LEN) as (url, app):
        yield url, app


def ok_completion(**over):
    return {"model": "minillm", "prompt": "In the beginning", "max_tokens": 4, **over}


def ok_chat(**over):
    return {"model": "minillm", "messages": [{"role": "user", "content": "Speak"}], "max_tokens": 4, **over}


# (case, path, body (dict or raw bytes), status, param, fragments the message must contain)
BAD_INPUT = [
    ("malformed JSON", "completions", b'{"prompt": "x",', 400, None, ["not valid JSON"]),
    ("body not an object", "completions", b'["x"]', 400, None, ["valid dictionary"]),
    ("max_tokens wrong type", "completions", ok_completion(max_tokens="ten"), 400, "max_tokens",
     ["max_tokens", "integer"]),
    ("temperature wrong type", "completions", ok_completion(temperature="hot"), 400, "temperature",
     ["temperature", "number"]),
    ("stream wrong type", "completions", ok_completion(stream="yes"), 400, "stream", ["stream", "boolean"]),
    ("missing prompt", "completions", {"model": "minillm", "max_tokens": 4}, 400, "prompt",
     ["prompt: field required"]),
    ("missing messages", "chat/completions", {"model": "minillm"}, 400, "messages", ["messages: field required"]),
    ("unknown model", "completions", ok_completion(model="gpt-5"), 404, "model", ["gpt-5", "does not exist"]),
    ("unknown model (chat)", "chat/completions", ok_chat(model="gpt-5"), 404, "model", ["gpt-5"]),
    ("negative max_tokens", "completions", ok_completion(max_tokens=-5), 400, "max_tokens",
     ["max_tokens", "greater than or equal to 1"]),
    ("zero max_tokens (chat)", "chat/completions", ok_chat(max_tokens=0), 400, "max_tokens",
     ["max_tokens", "greater than or equal to 1"]),
    ("huge max_tokens", "completions", ok_completion(max_tokens=10**9), 400, "max_tokens",
     [f"maximum context length is {MAX_MODEL_LEN}", "max_tokens must be at most"]),
    ("huge max_tokens (chat)", "chat/completions", ok_chat(max_tokens=10**6), 400, "max_tokens",
     [f"{MAX_MODEL_LEN}", "max_tokens"]),
    ("top_p zero", "completions", ok_completion(top_p=0.0), 400, "top_p", ["top_p", "greater than 0"]),
    ("top_p above one", "completions", ok_completion(top_p=1.5), 400, "top_p", ["top_p", "less than or equal to 1"]),
    ("negative temperature", "completions", ok_completion(temperature=-0.1), 400, "temperature",
     ["temperature", "greater than or equal to 0"]),
    ("negative temperature (chat)", "chat/completions", ok_chat(temperature=-1), 400, "temperature",
     ["temperature"]),
    ("prompt longer than max_model_len", "completions", ok_completion(prompt=[5] * (MAX_MODEL_LEN + 10)), 400,
     "prompt", [f"maximum context length is {MAX_MODEL_LEN}", f"{MAX_MODEL_LEN + 10} tokens"]),
    ("messages longer than max_model_len", "chat/completions",
     ok_chat(messages=[{"role": "user", "content": "and " * 400}]), 400, "messages",
     [f"maximum context length is {MAX_MODEL_LEN}", "messages"]),
    ("stream_options without stream", "completions", ok_completion(stream_options={"include_usage": True}), 400,
     "stream_options", ["stream_options", "stream is true"]),
    ("stream_options without stream (chat)", "chat/completions", ok_chat(stream_options={"include_usage": True}),
     400, "stream_options", ["stream_options"]),
    ("stream_options with stream false", "completions", ok_completion(stream=False, stream_options={}), 400,
     "stream_options", ["stream is true"]),
    ("token id outside the vocabulary", "completions", ok_completion(prompt=[5, 999999]), 400, "prompt",
     ["999999", "vocabulary"]),
    ("n zero", "completions", ok_completion(n=0), 400, "n", ["n", "greater than or equal to 1"]),
    ("logprobs too many", "completions", ok_completion(logprobs=50), 400, "logprobs", ["logprobs", "20"]),
    ("bad role", "chat/completions", ok_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages",
     ["role"]),
    ("presence_penalty out of range", "completions", ok_completion(presence_penalty=3), 400, "presence_penalty",
     ["presence_penalty", "less than or equal to 2"]),
    ("repetition_penalty zero", "completions", ok_completion(repetition_penalty=0), 400, "repetition_penalty",
     ["repetition_penalty", "greater than 0"]),
    ("empty prompt", "completions", ok_completion(prompt=""), 400, "prompt", ["prompt is empty"]),
    ("empty token list in a batch", "completions", ok_completion(prompt=[[5, 6], []]), 400, "prompt",
     ["prompt is empty"]),
    # More sequences than --max-num-queued-reqs=2 could ever hold: 400 (a 503 would invite retries forever).
    ("n above the queue cap", "completions", ok_completion(n=3), 400, "n", ["needs 3 sequences",
                                                                          "--max-num-queued-reqs=2"]),
    ("prompts x n above the queue cap", "completions", ok_completion(prompt=["a", "b"], n=2), 400, "n",
     ["needs 4 sequences"]),
    ("n above the queue cap (chat)", "chat/completions", ok_chat(n=3), 400, "n", ["--max-num-queued-reqs=2"]),
    ("min_tokens above max_tokens", "completions", ok_completion(min_tokens=10), 400, "min_tokens",
     ["min_tokens", "max_tokens=4", "got 10"]),
    ("seed beyond 64 bits", "completions", ok_completion(seed=2**70), 400, "seed", ["seed", "less than"]),
    ("temperature a boolean", "completions", ok_completion(temperature=True), 400, "temperature",
     ["temperature", "number"]),
    ("top_p a string", "completions", ok_completion(top_p="0.5"), 400, "top_p", ["top_p", "number"]),
    # Fields minillm does not implement are refused by name rather than ignored.
    ("echo", "completions", ok_completion(echo=True), 400, "echo", ["echo is not supported"]),
    ("logit_bias", "completions", ok_completion(logit_bias={"5": 1.0}), 400, "logit_bias", ["logit_bias"]),
    ("best_of above n", "completions", ok_completion(best_of=2), 400, "best_of", ["best_of must equal n"]),
    ("prompt_logprobs", "completions", ok_completion(prompt_logprobs=1), 400, "prompt_logprobs",
     ["prompt_logprobs is not supported"]),
    ("top_logprobs without logprobs", "chat/completions", ok_chat(top_logprobs=2), 400, "top_logprobs",
     ["top_logprobs needs logprobs"]),
    ("tools", "chat/completions", ok_chat(tools=[{"type": "function"}]), 400, "tools", ["tools are not supported"]),
]


@pytest.mark.parametrize("case, path, body, status, param, fragments", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_its_status_and_a_message_naming_the_problem(server, case, path, body, status, param,
                                                                    fragments):
    url, _ = server
    kwargs = {"content": body, "headers": {**AUTH, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH}
    r = httpx.post(f"{url}/v1/{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    if param is not None:
        assert err["param"] == param, err


def test_the_server_still_answers_after_every_bad_request(server):
    """...and nothing the bad requests touched is left behind: no request held, no KV reserved."""
    url, app = server
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0), headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    client = app.state.client
    deadline = time.monotonic() + 30
    while client.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.snapshot() == {"num_in_flight": 0, "num_streams": 0}
    done = threading.Event()
    state = {}

    def look():  # on the engine thread, which owns this state
        state.update(requests=len(client.engine.requests), reserved=client.engine.kv.usage().reserved_tokens,
                     running=client.engine.scheduler.num_running, waiting=client.engine.scheduler.num_waiting)
        done.set()

    client.engine.call_soon(look)
    assert done.wait(30) and state == {"requests": 0, "reserved": 0, "running": 0, "waiting": 0}


def test_api_key_is_required_on_v1_routes(server):
    import openai

    url, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/completions", json=ok_completion(), headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, headers
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="minillm", prompt="In", max_tokens=2).usage.completion_tokens >= 1


def test_overload_answers_503_with_retry_after_at_once(server):
    """Cap 2 (waiting + running). The engine thread is held between steps (a command that waits on
    an event), so two requests stay in flight whatever the machine's speed; a third is refused at
    once, and with the openai client it surfaces only with max_retries=0 (the default retries twice)."""
    import openai

    url, app = server
    client = app.state.client
    gate = threading.Event()
    client.engine.call_soon(lambda: gate.wait(60))
    results = []

    def post():
        results.append(httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0), headers=AUTH,
                                  timeout=60))

    threads = [threading.Thread(target=post) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while client.num_in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json=ok_completion(), headers=AUTH, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        err = refused.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        assert "--max-num-queued-reqs=2" in err["message"]
        n2 = httpx.post(url + "/v1/chat/completions", json=ok_chat(n=2), headers=AUTH, timeout=30)
        assert n2.status_code == 503
        with pytest.raises(openai.APIStatusError) as info:
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="minillm", prompt="In", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    assert [r.status_code for r in results] == [200, 200]  # the two held requests were served
    assert client.num_in_flight == 0
    r = httpx.post(url + "/v1/completions", json=ok_completion(), headers=AUTH, timeout=30)
    assert r.status_code == 200


def test_a_failing_engine_step_fails_its_requests_not_the_server(server):
    """A step that raises (a bug, out of memory) is rolled back; the requests it held end with an
    error in their answer, and the next request is served normally."""
    url, app = server
    engine = app.state.client.engine
    real_execute = engine.executor.execute
    calls = []

    def fail_once(plan):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_execute(plan)

    engine.call_soon(lambda: setattr(engine.executor, "execute", fail_once))
    try:
        r = httpx.post(url + "/v1/completions", json=ok_completion(), headers=AUTH, timeout=30)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0), headers=AUTH, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        engine.call_soon(lambda: setattr(engine.executor, "execute", real_execute))


def test_a_stream_hung_up_behind_the_api_key_is_aborted(server):
    """The same cancel path with the auth middleware in front of the route."""
    url, app = server
    client = app.state.client

    def aborts():
        text = httpx.get(url + "/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith('vllm:request_success_total{finished_reason="abort"'))
        return float(line.rsplit(" ", 1)[1])

    before = aborts()
    body = ok_completion(max_tokens=200, temperature=0.0, stream=True, ignore_eos=True)
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body,
                                                       headers=AUTH) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while client.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.num_in_flight == 0 and aborts() == before + 1
    assert client.engine.kv.usage().reserved_tokens == 0


def test_an_unexpected_error_while_adding_answers_500_and_the_engine_goes_on(server):
    """Not a ValueError (a bug): the engine thread must neither die nor abort what else it runs."""
    url, app = server
    engine, client = app.state.client.engine, app.state.client
    real_add = engine.add_request

    def add_once_broken(*args, **kwargs):
        engine.add_request = real_add
        raise RuntimeError("injected add failure")

    engine.call_soon(lambda: setattr(engine, "add_request", add_once_broken))
    r = httpx.post(url + "/v1/completions", json=ok_completion(), headers=AUTH, timeout=30)
    assert r.status_code == 500 and "injected add failure" in r.json()["error"]["message"]
    engine.call_soon(lambda: 1 / 0)  # a failing call_soon function is logged, not fatal either
    ok = httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0), headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert client.is_alive and httpx.get(url + "/health").status_code == 200
    assert client.num_in_flight == 0 and not engine.requests


def test_a_half_added_request_is_taken_out_again(server):
    """An add that fails after the request was registered (here: the scheduler refuses it) must not
    leave it behind: the engine would wait on it forever."""
    url, app = server
    engine, client = app.state.client.engine, app.state.client
    real = engine.scheduler.add_request

    def refuse_once(req):
        engine.scheduler.add_request = real
        raise RuntimeError("injected scheduler failure")

    engine.call_soon(lambda: setattr(engine.scheduler, "add_request", refuse_once))
    r = httpx.post(url + "/v1/completions", json=ok_completion(), headers=AUTH, timeout=30)
    assert r.status_code == 500 and "injected scheduler failure" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0), headers=AUTH, timeout=30)
    assert ok.status_code == 200
    assert client.num_in_flight == 0 and not engine.requests and engine.kv.usage().reserved_tokens == 0


def test_a_speculative_server_refuses_penalties_before_streaming():
    """With --speculative-config the engine cannot apply penalties or min_tokens; the server says so
    with a 400 naming the field, instead of a 200 stream that then carries an error event."""
    with running_server(max_num_seqs=2, max_model_len=128,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as (url, app):
        for extra, param in (({"presence_penalty": 0.5}, "presence_penalty"), ({"min_tokens": 2}, "min_tokens"),
                             ({"repetition_penalty": 1.2, "frequency_penalty": 0.1}, "frequency_penalty")):
            for stream in (False, True):
                r = httpx.post(url + "/v1/completions", json=ok_completion(stream=stream, **extra), timeout=30)
                assert r.status_code == 400, (extra, stream, r.text)
                err = r.json()["error"]
                assert err["param"] == param and "--speculative-config" in err["message"]
        r = httpx.post(url + "/v1/completions", json=ok_completion(temperature=0.0, max_tokens=6), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
