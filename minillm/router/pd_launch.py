"""`minillm serve --pd-disaggregation` and `minillm router --pd`: start the PD router, and the pair (chapter 13).

    minillm serve --pd-disaggregation --port 8000 --max-num-seqs 16   # prefill + decode + router on :8000
    minillm serve --port 8001 --kv-transfer-config '{"kv_connector": "TorchDistConnector", "kv_role": "kv_producer", "kv_port": 14579}' &
    minillm serve --port 8002 --kv-transfer-config '{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer", "kv_port": 14579}' &
    minillm router --pd --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

How the pair meets: the launcher takes a free loopback port for the KV link and gives both
instances the same `kv_ip`/`kv_port`; the prefill instance (rank 0) hosts the rendezvous there,
the decode instance (rank 1) connects, and torch.distributed builds their 2-rank group. Both get
the same engine flags, each its own free HTTP port and `OMP_NUM_THREADS` = cores // 2 unless set;
the router starts once both answer /health. Stopping the launcher stops both.
"""

from __future__ import annotations

import argparse
import json
import sys

from minillm.router.launch import (
    free_port,
    refuse_policy_flags,
    router_configs,
    serve_in_front_of,
    start_replicas,
)
from minillm.router.pd import PDRouter

# serve flags the instances do not get from the launcher's command line
_LAUNCHER_FLAGS = ("--pd-disaggregation", "--data-parallel-size", "--host", "--port", "--kv-transfer-config")


def pair_argv(argv: list[str]) -> list[str]:
    """The `serve` flags both instances get: the command line after `serve`, less the launcher's own."""
    from minillm.router.launch import add_policy_arguments

    tokens = argv[argv.index("serve") + 1:]
    strip = argparse.ArgumentParser(add_help=False)
    strip.add_argument("--pd-disaggregation", action="store_true")
    for flag in _LAUNCHER_FLAGS[1:]:
        strip.add_argument(flag)
    add_policy_arguments(strip)
    return strip.parse_known_args(tokens)[1]


def kv_configs(kv_port: int, extra: dict | None = None) -> list[list[str]]:
    """The two instances' --kv-transfer-config: same address, producer and consumer."""
    out = []
    for role in ("kv_producer", "kv_consumer"):
        cfg = {"kv_connector": "TorchDistConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": kv_port}
        if extra:
            cfg["kv_connector_extra_config"] = extra
        out.append(["--kv-transfer-config", json.dumps(cfg)])
    return out


def run_pd_disaggregation(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:
        raise ValueError("--pd-disaggregation starts one prefill and one decode instance; "
                         "it cannot be combined with --data-parallel-size")
    refuse_policy_flags(args.argv, "--pd-disaggregation")
    extra = None
    if args.kv_transfer_config is not None:  # only its extra settings are taken (roles and ports are the launcher's)
        from minillm.kv_transfer import parse_kv_transfer_config

        try:
            given = json.loads(args.kv_transfer_config)
        except json.JSONDecodeError as err:
            raise ValueError(f"--kv-transfer-config must be JSON, e.g. "
                             f"'{{\"kv_connector_extra_config\": {{\"abort_timeout_s\": 30}}}}': {err}") from None
        if not isinstance(given, dict):
            raise ValueError(f"--kv-transfer-config must be a JSON object, got {given!r}")
        set_here = sorted(set(given) - {"kv_connector", "kv_connector_extra_config"})
        if set_here:  # (the launcher picks roles, ranks and the pair's address itself: not silently overridden)
            raise ValueError(f"with --pd-disaggregation, --kv-transfer-config takes only kv_connector_extra_config "
                             f"(and kv_connector); the launcher sets {set_here} itself")
        parse_kv_transfer_config(dict(given, kv_role="kv_producer", kv_connector="TorchDistConnector"))
        extra = given.get("kv_connector_extra_config")
    router_configs(args)  # a bad flag fails before anything starts
    try:
        procs = start_replicas(pair_argv(args.argv), 2, per_replica_argv=kv_configs(free_port(), extra))
    except RuntimeError as err:
        print(f"minillm serve: error: {err}", file=sys.stderr)
        return 1
    return serve_in_front_of(procs, lambda: PDRouter(procs[0][1], procs[1][1], router_configs(args)[1]), args)
