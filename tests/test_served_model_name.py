"""The model's names in the API, as vLLM's `--served-model-name` (issue 29, item 6).

The names a server accepts follow from its command line (no model loaded for that); a running
server answers to each of them, reports the first in answers and lists them all in /v1/models, and a
name it does not know gets a 404 that lists the ones it does.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import running_server
from test_server_cli import parse

from minillm.server.app import create_app
from minillm.server.serve import served_model_names


def test_with_no_model_argument_minillm_comes_first_and_the_bundled_directory_name_is_accepted():
    assert served_model_names(parse()) == ["minillm", "minillm-target"]


def test_the_model_argument_as_typed_comes_first_then_its_directory_name_then_minillm():
    assert served_model_names(parse("models/minillm-target")) == ["models/minillm-target", "minillm-target", "minillm"]
    assert served_model_names(parse("--model", "/srv/ckpt/my-llama/")) == ["/srv/ckpt/my-llama/", "my-llama", "minillm"]
    assert served_model_names(parse("models/minillm-draft", "--port", "8001"))[0] == "models/minillm-draft"


def test_given_names_are_exactly_the_served_ones_in_order():
    assert served_model_names(parse("--served-model-name", "toy")) == ["toy"]
    assert served_model_names(parse("models/minillm-target", "--served-model-name", "gpt-4-0613", "gpt-4")) == \
        ["gpt-4-0613", "gpt-4"]


def test_no_name_is_refused_before_anything_starts():
    with pytest.raises(SystemExit):
        parse("--served-model-name")  # argparse: expected at least one argument
    for bad in ([], "", ["ok", ""]):
        with pytest.raises(ValueError, match="served_model_name must be a non-empty name or list of names"):
            create_app(None, served_model_name=bad)


NAMES = ["models/minillm-target", "minillm-target", "minillm"]


@pytest.fixture(scope="module")
def server():
    with running_server(served_model_name=NAMES, max_num_seqs=4, max_model_len=128) as (url, app):
        yield url, app


def test_models_lists_every_name_the_first_first(server):
    url, _ = server
    data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == NAMES
    assert {m["root"] for m in data} == {NAMES[0]} and all(m["max_model_len"] == 128 for m in data)


def test_every_name_is_answered_and_the_answer_names_the_first(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = set()
    for name in NAMES:
        c = client.completions.create(model=name, prompt="In the beginning", max_tokens=4, temperature=0.0)
        assert c.model == NAMES[0] and c.usage.completion_tokens == 4
        texts.add(c.choices[0].text)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.model == NAMES[0]
    assert len(texts) == 1  # one model behind every name: the same greedy text


def test_an_unknown_name_gets_a_404_listing_the_accepted_ones(server):
    url, _ = server
    for path, body in (("/v1/completions", {"prompt": "In", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        r = httpx.post(url + path, json={**body, "model": "models/minillm-draft"}, timeout=30)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["param"] == "model" and err["code"] == 404
        assert "`models/minillm-draft` does not exist" in err["message"]
        for name in NAMES:
            assert f"`{name}`" in err["message"]
        assert "--served-model-name" in err["message"]
