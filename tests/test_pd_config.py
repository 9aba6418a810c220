"""`--kv-transfer-config` and the PD flags: bad input gets a clear error naming what is accepted (issue 17, point 3).

No server, no model: the parser in-process, and one real `minillm serve` command line that must
fail before it loads anything (~3 s, most of it importing torch).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minillm.cli import main
from minillm.kv_transfer import parse_kv_transfer_config
from minillm.router.pd import pd_refusal

OK = {"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"}


def test_a_good_config_and_its_defaults():
    cfg = parse_kv_transfer_config('{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer", "kv_port": 15000,'
                                   ' "kv_rank": 1, "kv_parallel_size": 2,'
                                   ' "kv_connector_extra_config": {"abort_timeout_s": 5}}')
    assert (cfg.kv_role, cfg.kv_rank, cfg.kv_ip, cfg.kv_port, cfg.is_producer) == ("kv_consumer", 1, "127.0.0.1",
                                                                                   15000, False)
    assert cfg.extra == {"abort_timeout_s": 5.0, "connect_timeout_s": 600.0, "link_delay_per_block_s": 0.0}
    assert parse_kv_transfer_config(cfg.to_json()) == cfg
    assert parse_kv_transfer_config(OK).kv_rank == 0


@pytest.mark.parametrize("config, fragments", [
    ("{kv_role: kv_producer", ["must be JSON", "TorchDistConnector"]),
    ('["kv_producer"]', ["JSON object"]),
    ({**OK, "kv_role": "kv_both"}, ["kv_role", "'kv_producer', 'kv_consumer'", "kv_both"]),
    ({**OK, "kv_role": "prefill"}, ["kv_role", "'kv_producer', 'kv_consumer'", "'prefill'"]),
    ({"kv_role": "kv_producer"}, ["kv_connector must be one of ['TorchDistConnector']", "None"]),
    ({**OK, "kv_connector": "NixlConnector"}, ["kv_connector", "TorchDistConnector", "NixlConnector"]),
    ({**OK, "kv_buffer_size": 1e9}, ["unknown key", "kv_buffer_size", "accepted", "kv_port"]),
    ({**OK, "kv_port": "14579"}, ["kv_port", "[1, 65535]"]),
    ({**OK, "kv_port": 70000}, ["kv_port", "70000"]),
    ({**OK, "kv_rank": 1}, ["kv_rank of a kv_producer is 0"]),
    ({**OK, "kv_parallel_size": 4}, ["kv_parallel_size must be 2"]),
    ({**OK, "kv_connector_extra_config": {"timeout": 3}}, ["unknown kv_connector_extra_config", "abort_timeout_s"]),
    ({**OK, "kv_connector_extra_config": {"abort_timeout_s": 0}}, ["abort_timeout_s", "> 0"]),
    ({**OK, "kv_connector_extra_config": {"link_delay_per_block_s": -1}}, ["link_delay_per_block_s", ">= 0"]),
])
def test_bad_configs_are_refused_naming_what_is_accepted(config, fragments):
    with pytest.raises(ValueError) as err:
        parse_kv_transfer_config(config)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_serve_with_a_bad_config_fails_before_loading_the_model():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "minillm", "serve", "--kv-transfer-config",
                        '{"kv_connector": "TorchDistConnector", "kv_role": "kv_both"}'],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert "minillm serve: error: --kv-transfer-config: kv_role must be one of ['kv_producer', 'kv_consumer']" \
        in r.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["router", "--prefill", "http://127.0.0.1:1"], "--prefill and --decode need --pd"),
    (["router", "--pd", "--prefill", "http://127.0.0.1:1"], "--pd needs both --prefill URL and --decode URL"),
    (["router", "--pd", "--worker", "http://127.0.0.1:1"], "--pd takes --prefill URL and --decode URL, not --worker"),
    (["router"], "give the workers: --worker URL"),
    (["serve", "--pd-disaggregation", "--data-parallel-size", "2"], "cannot be combined with --data-parallel-size"),
    (["serve", "--data-parallel-size", "2", "--kv-transfer-config", "{}"], "cannot be combined with --data-parallel"),
    (["serve", "--pd-disaggregation", "--kv-transfer-config", "{oops"], "--kv-transfer-config must be JSON"),
    (["serve", "--pd-disaggregation", "--kv-transfer-config", '{"kv_connector_extra_config": {"x": 1}}'],
     "unknown kv_connector_extra_config key(s) ['x']"),
    (["router", "--pd", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--policy", "round_robin"],
     "--pd sends each request to its prefill and then its decode instance: ['--policy'] choose among replicas"),
    (["serve", "--pd-disaggregation", "--cache-threshold=0.5", "--max-tree-size", "9"],
     "--pd-disaggregation sends each request to its prefill and then its decode instance: ['--cache-threshold', "
     "'--max-tree-size']"),
    (["serve", "--pd-disaggregation", "--kv-transfer-config", '{"kv_port": 15000, "kv_role": "kv_consumer"}'],
     "takes only kv_connector_extra_config (and kv_connector); the launcher sets ['kv_port', 'kv_role'] itself"),
])
def test_router_and_launcher_flags_are_checked(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "x", "n": 2}, False, "n"),
    ({"prompt": "x", "logprobs": 0}, False, "logprobs"),
    ({"messages": [], "logprobs": True}, True, "logprobs"),
    ({"prompt": ["a", "b"]}, False, "prompt"),
    ({"prompt": [[1, 2], [3]]}, False, "prompt"),
    ({"prompt": "x", "kv_transfer_params": {}}, False, "kv_transfer_params"),
])
def test_what_one_transfer_cannot_carry_is_refused(body, chat, field):
    refusal = pd_refusal(body, chat)
    assert refusal is not None and refusal[1] == field


@pytest.mark.parametrize("body, chat", [
    ({"prompt": "x"}, False), ({"prompt": [1, 2, 3]}, False), ({"prompt": ["only one"]}, False),
    ({"prompt": "x", "n": 1, "logprobs": None}, False), ({"messages": [], "logprobs": False}, True),
    ({"prompt": "x", "n": "two"}, False), ({"prompt": "x", "logprobs": 99}, False),  # malformed: the server's error
    ({"prompt": ["a", ""]}, False),
])
def test_what_one_transfer_carries_or_a_server_judges_passes(body, chat):
    assert pd_refusal(body, chat) is None


def test_the_servers_bad_input_is_left_to_the_server():
    """Every malformed body of the server's bad-input table passes the PD router's own checks, so the
    client gets the server's error, as from a plain server (tests/test_pd.py compares the answers)."""
    from test_server_errors import BAD_INPUT

    for case, path, body, _, _, _ in BAD_INPUT:
        if isinstance(body, dict) and "queue cap" not in case:
            assert pd_refusal(body, path.startswith("chat")) is None, case


def test_read_transfer_stats_refuses_a_server_without_a_connector(monkeypatch):
    """A plain server's (or a router's) /metrics has no minillm:kv_transfer_* series: a clear error, not a KeyError."""
    import httpx

    from minillm.kv_transfer.metrics import read_transfer_stats

    plain = "# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"minillm\"} 0.0\n"
    monkeypatch.setattr(httpx, "get", lambda url, timeout: type("R", (), {"text": plain})())
    with pytest.raises(ValueError, match="needs a server started with --kv-transfer-config"):
        read_transfer_stats("http://127.0.0.1:1")
