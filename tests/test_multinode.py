"""A world across nodes: `minillm serve --nnodes 2 --node-rank R --master-addr A --master-port M` (issue 28, item 3).

Two "nodes" on this host (its non-loopback address where it has one), each started by its own
`python -m minillm serve` command: the head (node 0,
the engine, the API server, rank 0) and a `--headless` node (rank 1), one world of TP 1 × PP 2 whose
pipeline crosses the nodes, meeting at the head's TCPStore. The head answers the official `openai`
client token for token as one process does; when it stops, the headless node's rank leaves and its
command exits 0; a rank of the headless node that is killed makes the head's /health name it; a node
that never joins fails the head's start-up within `--node-join-timeout-s`, naming the node and its
ranks; a headless node whose head never comes says so; a master port in use fails the head at once;
a headless node refuses other sizes or another model than the head's. Every process each command
started is counted while it runs and checked gone after.

CI cost, in counts: two worlds of 2 ranks (the two-node test, the killed-rank test), one reference
engine, and failure tests that start one rank at most; the unit tests start none. Marked slow, in the
"distributed" xdist group with the other multi-process tests, so they never run beside each other.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import wait_until_healthy

from minillm.config import EngineConfig
from minillm.distributed.layout import RankLayout
from minillm.distributed.nodes import (
    NodeRendezvous,
    check_node_layout,
    missing_nodes_message,
    node_of_rank,
    ranks_of_node,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
WORLD = ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
SMALL = ["--max-num-seqs", "2", "--max-model-len", "64", "--dtype", "float64"]
PROMPTS = ["In the beginning God created the heaven and the earth.", "Blessed are the meek"]
COMMAND_TIMEOUT_S = 240  # no command here may outlive this (start-up on 2 shared cores included)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "minillm", "serve", *flags], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def descendants(proc: subprocess.Popen) -> list[int]:
    """The command's rank processes (multiprocessing's resource tracker excluded)."""
    pids = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=30)[0]


def wait_for_children(proc: subprocess.Popen, count: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(pids := descendants(proc)) < count:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{count} rank process(es) never started"
        time.sleep(0.2)
    return pids


# ---- layout and knobs (no process) ---------------------------------------------------------------------
def test_tp_stays_inside_a_node_and_pp_crosses_nodes():
    tp, pp, nnodes = 2, 2, 2
    world = tp * pp
    assert [list(ranks_of_node(n, world, nnodes)) for n in range(nnodes)] == [[0, 1], [2, 3]]
    for rank in range(world):
        layout = RankLayout(rank, tp, pp)
        assert {node_of_rank(r, world, nnodes) for r in layout.tp_group_ranks()} == {node_of_rank(rank, world, nnodes)}
        if layout.next_rank is not None:  # the stage-to-stage send is the one that crosses
            assert node_of_rank(layout.next_rank, world, nnodes) != node_of_rank(rank, world, nnodes)


@pytest.mark.parametrize("tp, pp, nnodes, words", [(2, 1, 2, "cut a tensor-parallel group"),
                                                    (1, 3, 2, "do not split evenly"),
                                                    (4, 1, 4, "cut a tensor-parallel group")])
def test_layouts_that_would_cut_a_tp_group_or_split_unevenly_are_refused(tp, pp, nnodes, words):
    with pytest.raises(ValueError, match=words):
        check_node_layout(tp, pp, nnodes)
    with pytest.raises(ValueError, match=words):
        EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=nnodes)


def test_the_engine_is_node_0_with_one_process_per_rank():
    with pytest.raises(ValueError, match="node_rank=1: the engine runs on node 0.*--headless"):
        EngineConfig(pipeline_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one process"):
        EngineConfig(pipeline_parallel_size=2, nnodes=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="node_join_timeout_s must be a number of seconds > 0"):
        EngineConfig(node_join_timeout_s=0)


def test_serve_flags_are_vllms_multinode_names():
    from minillm.cli import build_parser
    from minillm.server.serve import engine_knobs

    args = build_parser().parse_args(["serve", *WORLD, "--node-rank", "1", "--master-port", "29555", "--headless",
                                      "--node-join-timeout-s", "7"])
    assert args.headless
    assert engine_knobs(args) == {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "nnodes": 2, "node_rank": 1,
                                  "master_addr": "127.0.0.1", "master_port": 29555, "node_join_timeout_s": 7.0}


def test_the_missing_node_is_named_with_its_ranks_and_the_command_that_joins_it():
    said = missing_nodes_message([2, 3], 4, NodeRendezvous(2, "10.0.0.1", 29500, 30.0))
    assert said.startswith("node 1 (ranks [2, 3]) did not join the world at 10.0.0.1:29500 within "
                           "node_join_timeout_s=30 s")
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --headless" in said


# ---- two "nodes" on loopback -----------------------------------------------------------------------------
def test_two_nodes_on_this_hosts_address_answer_the_openai_client_as_one_process():
    """The world meets at a non-loopback address of this host where it has one (as two machines would:
    each rank's gloo then listens on the interface that reaches the head, not on the host name's address)."""
    import httpx
    import openai
    from test_external_launcher import host_address

    from minillm import LLM, SamplingParams

    port, master_port, host = free_port(), free_port(), host_address()
    world = [*WORLD[:-1], host]  # --master-addr HOST
    head = serve(*world, "--node-rank", "0", "--master-port", str(master_port), "--port", str(port), *SMALL)
    node1 = serve(*world, "--node-rank", "1", "--master-port", str(master_port), "--headless", *SMALL)
    head_ranks, node1_ranks = [], []
    try:
        wait_until_healthy(head, port, COMMAND_TIMEOUT_S)
        head_ranks, node1_ranks = descendants(head), descendants(node1)
        assert (len(head_ranks), len(node1_ranks)) == (1, 1)  # rank 0 on the head, rank 1 on node 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        texts = [client.completions.create(model="minillm", prompt=p, max_tokens=10, temperature=0).choices[0].text
                 for p in PROMPTS]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        head.send_signal(signal.SIGTERM)  # the head stops the world: node 1's rank leaves, its command exits 0
        node1_out = node1.communicate(timeout=COMMAND_TIMEOUT_S)[0]
        assert node1.returncode == 0, node1_out
        assert "the head stopped the world" in node1_out
    finally:
        head_out, node1_out = stop(head), stop(node1)
    assert gone(head_ranks + node1_ranks), (head_out, node1_out)
    want = LLM(dtype="float64", max_num_seqs=2, max_model_len=64).generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in want] and all(texts)


def test_a_killed_rank_on_the_other_node_is_named_by_the_head():
    import httpx

    port, master_port = free_port(), free_port()
    head = serve(*WORLD, "--node-rank", "0", "--master-port", str(master_port), "--port", str(port), *SMALL)
    node1 = serve(*WORLD, "--node-rank", "1", "--master-port", str(master_port), "--headless", *SMALL)
    pids = []
    try:
        wait_until_healthy(head, port, COMMAND_TIMEOUT_S)
        pids = descendants(head) + descendants(node1)
        os.kill(descendants(node1)[0], signal.SIGKILL)
        node1_out = node1.communicate(timeout=COMMAND_TIMEOUT_S)[0]  # node 1 reports it and exits
        assert node1.returncode == 1 and "rank 1" in node1_out, node1_out
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 503
        assert "rank 1 on node 1" in health.json()["error"]["message"]
        body = {"model": "minillm", "prompt": "In the beginning", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).status_code == 500
        deadline = time.monotonic() + 60  # the head stopped its own rank on that failed step; it keeps serving errors
        while descendants(head) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert descendants(head) == [] and head.poll() is None
    finally:
        head_out, node1_out = stop(head), stop(node1)
    assert gone(pids), (head_out, node1_out)


def test_a_node_that_never_joins_fails_the_heads_start_up_within_the_timeout_naming_it():
    master_port = free_port()
    head = serve(*WORLD, "--node-rank", "0", "--master-port", str(master_port), "--port", str(free_port()),
                 "--node-join-timeout-s", "5", *SMALL)
    try:
        ranks = wait_for_children(head, 1, COMMAND_TIMEOUT_S)  # its own rank 0 runs while it waits
        out = head.communicate(timeout=COMMAND_TIMEOUT_S)[0]
    finally:
        stop(head)
    assert head.returncode != 0
    assert f"node 1 (ranks [1]) did not join the world at 127.0.0.1:{master_port} within node_join_timeout_s=5 s" \
        in out, out
    assert gone(ranks)  # the head's own rank left with it


def test_a_headless_node_whose_head_never_comes_says_so_and_starts_no_rank():
    master_port = free_port()
    node1 = serve(*WORLD, "--node-rank", "1", "--master-port", str(master_port), "--headless",
                  "--node-join-timeout-s", "3")
    out = node1.communicate(timeout=COMMAND_TIMEOUT_S)[0]
    assert node1.returncode == 1
    assert f"the head's rendezvous at 127.0.0.1:{master_port} did not answer within node_join_timeout_s=3 s" in out
    assert "start node 0 first" in out


def test_a_master_port_in_use_fails_the_head_at_once_and_leaves_no_rank():
    from minillm import LLM
    from minillm.distributed.nodes import NodeJoinError

    def ranks() -> set[int]:
        return {c.pid for c in psutil.Process().children() if "resource_tracker" not in " ".join(c.cmdline())}

    before = ranks()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(NodeJoinError, match=f"the head cannot host the world's rendezvous at 127.0.0.1:{port}"):
            LLM(pipeline_parallel_size=2, nnodes=2, master_port=port, max_num_seqs=2, max_model_len=64)
    assert ranks() <= before


def test_a_headless_node_refuses_other_sizes_or_another_model_naming_both(tmp_path):
    """The head's spec, published in a store hosted here (no process): node 1's checks read it."""
    import pickle
    import shutil

    import torch

    from minillm.distributed.headless import fetch_spec
    from minillm.distributed.launch_engine import read_model_config
    from minillm.distributed.nodes import SPEC_KEY, open_store
    from minillm.distributed.worker import WorkerSpec
    from minillm.llm import BUNDLED_DRAFT, BUNDLED_TARGET

    rendezvous = NodeRendezvous(2, "127.0.0.1", free_port(), 5.0)
    spec = WorkerSpec(model_dir=str(BUNDLED_TARGET), model_config=read_model_config(BUNDLED_TARGET),
                      dtype=torch.float32, device="cpu", max_positions=64, cache_spec=None, attention_backend="torch",
                      tp=1, pp=2, init_file="", timeout_s=5.0, rendezvous=rendezvous)
    store = open_store(rendezvous, is_master=True)
    store.set(SPEC_KEY, pickle.dumps(spec))
    copy = shutil.copytree(BUNDLED_TARGET, tmp_path / "same-model-elsewhere")
    assert fetch_spec(rendezvous, 1, 2, copy).model_dir == str(copy)  # the same model at another path is fine
    with pytest.raises(ValueError, match="the head runs --tensor-parallel-size 1 --pipeline-parallel-size 2 --nnodes 2, "
                                         "this node was started with 2, 2, 2"):
        fetch_spec(rendezvous, 2, 2, BUNDLED_TARGET)
    with pytest.raises(ValueError, match="is not the head's .*every node needs the same model files"):
        fetch_spec(rendezvous, 1, 2, BUNDLED_DRAFT)
