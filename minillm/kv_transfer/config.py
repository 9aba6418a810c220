"""`--kv-transfer-config`: which KV connector, and this instance's role in the pair (chapter 13).

The names are vLLM's `KVTransferConfig` fields:

    {"kv_connector": "TorchDistConnector",   # the only connector minillm has (accepted names below)
     "kv_role": "kv_producer",               # the prefill instance; "kv_consumer": the decode instance
     "kv_ip": "127.0.0.1", "kv_port": 14579, # where the producer hosts the pair's rendezvous (TCPStore)
     "kv_rank": 0, "kv_parallel_size": 2,    # optional; if given they must say 0/1 and 2
     "kv_connector_extra_config": {"abort_timeout_s": 30, "connect_timeout_s": 600,
                                   "link_delay_per_block_s": 0}}

`abort_timeout_s`: how long the producer keeps a finished request's blocks pinned for a consumer
that never asks (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`); `link_delay_per_block_s`: a sleep
before each block is sent, to imitate a slow link (teaching, and the test that kills the decode
instance mid-transfer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CONNECTORS = ("TorchDistConnector",)
ROLES = ("kv_producer", "kv_consumer")
KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_rank", "kv_parallel_size", "kv_connector_extra_config")
EXTRA_KEYS = {"abort_timeout_s": 30.0, "connect_timeout_s": 600.0, "link_delay_per_block_s": 0.0}
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    extra: dict = field(default_factory=lambda: dict(EXTRA_KEYS))

    @property
    def kv_rank(self) -> int:
        return 0 if self.kv_role == "kv_producer" else 1

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    def to_json(self) -> str:
        return json.dumps({"kv_connector": self.kv_connector, "kv_role": self.kv_role, "kv_ip": self.kv_ip,
                           "kv_port": self.kv_port, "kv_connector_extra_config": self.extra})


def parse_kv_transfer_config(text: str | dict) -> KVTransferConfig:
    """The config from `--kv-transfer-config` JSON (or a dict); a ValueError names what is wrong and what is accepted."""
    example = '\'{"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"}\''
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--kv-transfer-config must be JSON, e.g. {example}: {err}") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, e.g. {example}; got {data!r}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {unknown}; accepted: {list(KEYS)}")
    connector = data.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector must be one of {list(CONNECTORS)}, got {connector!r}")
    role = data.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of {list(ROLES)} (kv_both is not supported), "
                         f"got {role!r}")
    ip = data.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"--kv-transfer-config: kv_ip must be a host name or address, got {ip!r}")
    port = data.get("kv_port", DEFAULT_KV_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"--kv-transfer-config: kv_port must be an integer in [1, 65535], got {port!r}")
    expected_rank = 0 if role == "kv_producer" else 1
    if "kv_rank" in data and data["kv_rank"] != expected_rank:
        raise ValueError(f"--kv-transfer-config: kv_rank of a {role} is {expected_rank} (producer 0, consumer 1), "
                         f"got {data['kv_rank']!r}")
    if "kv_parallel_size" in data and data["kv_parallel_size"] != 2:
        raise ValueError(f"--kv-transfer-config: kv_parallel_size must be 2 (one producer, one consumer), "
                         f"got {data['kv_parallel_size']!r}")
    extra_in = data.get("kv_connector_extra_config", {}) or {}
    if not isinstance(extra_in, dict):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config must be an object, got {extra_in!r}")
    bad = sorted(set(extra_in) - set(EXTRA_KEYS))
    if bad:
        raise ValueError(f"--kv-transfer-config: unknown kv_connector_extra_config key(s) {bad}; "
                         f"accepted: {list(EXTRA_KEYS)}")
    extra = dict(EXTRA_KEYS)
    for key, value in extra_in.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or \
                (key != "link_delay_per_block_s" and value == 0):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a number "
                             f"{'>= 0' if key == 'link_delay_per_block_s' else '> 0'}, got {value!r}")
        extra[key] = float(value)
    return KVTransferConfig(connector, role, ip, port, extra)
