"""A world that spans nodes: which ranks run where, and how they meet (chapter 12; docs/multinode.md).

`minillm serve --nnodes N --node-rank R --master-addr A --master-port M` (vLLM's multi-node flags):
each node starts its own `world_size / N` ranks, node R holding ranks [R·n, (R+1)·n). Global rank =
stage · tp + tp_rank (`minillm.distributed.layout`), so when n is a multiple of tp a stage's tensor-parallel
group sits inside one node (its all-reduces stay on the node's fast links) and only the pipeline's
stage-to-stage sends cross nodes — the layout the source texts recommend (TP inside a node, PP across).

Rendezvous is torch.distributed's own TCPStore at A:M, hosted by the head's engine process (node 0):
- the head puts the ranks' `WorkerSpec` under `SPEC_KEY`, so every node builds the same KV pool shape
  and dtype from the one engine configuration;
- each rank, once connected, writes `joined/<rank>` = its node, host and pid; the head waits up to
  `node_join_timeout_s` for all of them and otherwise names the node(s) and ranks that never came;
- a headless node that loses a rank writes `failed/<rank>` = why, which the head reads while it waits
  for an answer (and in `check_health`), so a dead node is named instead of timing out;
- `dist.init_process_group(store=PrefixStore("world", store))` then joins the ranks (gloo on a CPU,
  NCCL on CUDA), and each pair of ranks opens its own connections (gloo/NCCL choose those ports).

Plans reach the other nodes over torch.distributed too: rank 0 (on the head, fed by the engine's
pipe) broadcasts each message to the remote ranks over a gloo group and gathers their answers
(`minillm.distributed.worker`). No message layer of minillm's own.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass

SPEC_KEY = "minillm/spec"
JOINED_PREFIX = "minillm/joined/"
FAILED_PREFIX = "minillm/failed/"


@dataclass(frozen=True)
class NodeRendezvous:
    """Where and how long a multi-node world meets (`EngineConfig.nnodes`, `master_addr`, ...)."""

    nnodes: int
    master_addr: str
    master_port: int
    join_timeout_s: float

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def check_node_layout(tp: int, pp: int, nnodes: int) -> None:
    """Raise a ValueError naming the numbers when tp × pp ranks cannot be laid out on `nnodes` nodes
    with every tensor-parallel group inside one node."""
    world = tp * pp
    if nnodes < 1:
        raise ValueError(f"nnodes={nnodes} must be at least 1")
    if world % nnodes:
        raise ValueError(f"tensor_parallel_size × pipeline_parallel_size = {world} ranks do not split evenly over "
                         f"nnodes={nnodes} nodes")
    if (world // nnodes) % tp:
        raise ValueError(f"{world // nnodes} ranks per node (of {world} on {nnodes} nodes) would cut a tensor-parallel "
                         f"group of {tp} across nodes: choose pipeline_parallel_size as a multiple of nnodes "
                         "(TP inside a node, PP across nodes)")


def ranks_of_node(node: int, world_size: int, nnodes: int) -> range:
    per_node = world_size // nnodes
    return range(node * per_node, (node + 1) * per_node)


def node_of_rank(rank: int, world_size: int, nnodes: int) -> int:
    return rank // (world_size // nnodes)


def open_store(rendezvous: NodeRendezvous, is_master: bool):
    """The world's TCPStore: the server (on the head) or a client that waits up to the join timeout
    for the server to answer."""
    from torch.distributed import TCPStore

    return TCPStore(rendezvous.master_addr, rendezvous.master_port, is_master=is_master,
                    wait_for_workers=False, timeout=datetime.timedelta(seconds=rendezvous.join_timeout_s))


def announce_joined(store, rank: int, node: int) -> None:
    store.set(f"{JOINED_PREFIX}{rank}", json.dumps({"node": node, "host": socket.gethostname(), "pid": os.getpid()}))


def joined_ranks(store, world_size: int) -> dict[int, dict]:
    """The ranks that announced themselves so far, with what they said (node, host, pid)."""
    keys = [f"{JOINED_PREFIX}{r}" for r in range(world_size)]
    return {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}


def failed_ranks(store, ranks) -> dict[int, str]:
    """Remote ranks whose node reported them dead, with why."""
    found = {}
    for rank in ranks:
        key = f"{FAILED_PREFIX}{rank}"
        if store.check([key]):
            found[rank] = store.get(key).decode()
    return found


def missing_nodes_message(missing: list[int], world_size: int, rendezvous: NodeRendezvous) -> str:
    """Which node(s) and ranks never joined, and the command that would have joined them."""
    by_node: dict[int, list[int]] = {}
    for rank in missing:
        by_node.setdefault(node_of_rank(rank, world_size, rendezvous.nnodes), []).append(rank)
    said = "; ".join(f"node {node} (ranks {ranks})" for node, ranks in sorted(by_node.items()))
    first = min(by_node)
    return (f"{said} did not join the world at {rendezvous.address} within node_join_timeout_s="
            f"{rendezvous.join_timeout_s:g} s: start `minillm serve MODEL --tensor-parallel-size ... "
            f"--pipeline-parallel-size ... --nnodes {rendezvous.nnodes} --node-rank {first} --master-addr "
            f"{rendezvous.master_addr} --master-port {rendezvous.master_port} --headless` on it, with the "
            "head's address reachable from there")


class NodeJoinError(RuntimeError):
    """A node of a multi-node world never joined within the join timeout, or reported a dead rank."""
