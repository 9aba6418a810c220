"""A node that only runs ranks: `minillm serve ... --nnodes N --node-rank R --headless` (chapter 12; docs/multinode.md).

No engine, no API server: this node's ranks of a world whose engine runs on node 0 (vLLM's
`--headless`). The steps, each bounded by `node_join_timeout_s`:

1. reach the head's TCPStore at `--master-addr:--master-port` and read the ranks' spec the head
   published there (so every node builds the same pool shape and dtype); refuse, naming the flag, a
   world whose sizes differ from this command's, or a model whose config differs from the head's;
2. start this node's ranks (fork where safe, as the engine does) with this node's model path;
3. watch them: a rank that exits with an error is written to the store (`failed/<rank>`, which the
   head reads at once) and the other ranks here are stopped; when the head stops the world the ranks
   leave cleanly and so does this command. SIGINT / SIGTERM stop the ranks too.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import signal
import sys
from multiprocessing.connection import wait
from pathlib import Path

from minillm.distributed import nodes
from minillm.distributed.worker import rank_main
from minillm.executor.start_method import check_main_guard, choose_start_method, log_start_method

STOP_TIMEOUT_S = 10.0


def _say(text: str) -> None:
    print(f"minillm serve --headless: {text}", file=sys.stderr, flush=True)


def fetch_spec(rendezvous: nodes.NodeRendezvous, tp: int, pp: int, model_dir: Path):
    """The head's `WorkerSpec`, checked against this command and re-pointed at this node's model path."""
    from minillm.distributed.launch_engine import read_model_config

    try:
        store = nodes.open_store(rendezvous, is_master=False)
        spec = pickle.loads(store.get(nodes.SPEC_KEY))
    except RuntimeError as error:  # TCPStore's connect or get timed out
        raise ConnectionError(f"the head's rendezvous at {rendezvous.address} did not answer within "
                              f"node_join_timeout_s={rendezvous.join_timeout_s:g} s: start node 0 first (`minillm serve "
                              f"... --nnodes {rendezvous.nnodes} --node-rank 0`), and check --master-addr/--master-port "
                              f"and that the port is reachable from here ({type(error).__name__}: "
                              f"{str(error).splitlines()[0]})") from None
    head = (spec.tp, spec.pp, spec.rendezvous.nnodes)
    if head != (tp, pp, rendezvous.nnodes):
        raise ValueError(f"the head runs --tensor-parallel-size {head[0]} --pipeline-parallel-size {head[1]} --nnodes "
                         f"{head[2]}, this node was started with {tp}, {pp}, {rendezvous.nnodes}: give every node the "
                         "same sizes")
    mine = read_model_config(model_dir)
    if mine != spec.model_config:
        raise ValueError(f"the model at {model_dir} on this node is not the head's ({spec.model_dir}): every node needs "
                         "the same model files")
    return dataclasses.replace(spec, model_dir=str(model_dir), rendezvous=rendezvous)


def run_headless(model_dir: Path, tp: int, pp: int, rendezvous: nodes.NodeRendezvous, node_rank: int) -> int:
    """Run this node's ranks until the world ends; 0 when the head stopped it, 1 on a failure (said on stderr)."""
    nodes.check_node_layout(tp, pp, rendezvous.nnodes)
    if not 1 <= node_rank < rendezvous.nnodes:
        raise ValueError(f"--node-rank {node_rank} with --headless: a headless node is 1 .. nnodes-1 = "
                         f"{rendezvous.nnodes - 1} (node 0 runs the engine and the API server)")
    try:
        spec = fetch_spec(rendezvous, tp, pp, model_dir)
    except (ConnectionError, ValueError) as error:
        _say(str(error))
        return 1
    ranks = nodes.ranks_of_node(node_rank, tp * pp, rendezvous.nnodes)
    method = choose_start_method()
    check_main_guard(method)
    log_start_method(method, f"minillm node {node_rank}: {len(ranks)} rank(s)")
    ctx = mp.get_context(method.name)
    processes = [ctx.Process(target=rank_main, args=(rank, spec), daemon=True, name=f"minillm-rank-{rank}")
                 for rank in ranks]
    stop = []
    previous = {sig: signal.signal(sig, lambda *_: stop.append(True)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for process in processes:
            process.start()
        _say(f"node {node_rank} of {rendezvous.nnodes}: ranks {list(ranks)} (pids {[p.pid for p in processes]}) "
             f"joining the world at {rendezvous.address}")
        return _watch(processes, list(ranks), rendezvous, stop)
    finally:
        for process in processes:
            if process.pid is not None and process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join(timeout=STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(processes: list, ranks: list[int], rendezvous: nodes.NodeRendezvous, stop: list) -> int:
    running = dict(zip(ranks, processes, strict=True))
    while running:
        if stop:
            _say("stopped by a signal: stopping this node's ranks")
            return 1
        for sentinel in wait([p.sentinel for p in running.values()], timeout=0.5):
            rank = next(r for r, p in running.items() if p.sentinel == sentinel)
            process = running.pop(rank)
            process.join(timeout=1.0)
            if process.exitcode != 0:
                why = f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                _report_failure(rendezvous, rank, why)
                _say(f"{why} (its error is above; if the head stopped or died, the world is gone): stopping this "
                     f"node's other ranks {sorted(running)}")
                return 1
    _say("the head stopped the world; this node's ranks have left")
    return 0


def _report_failure(rendezvous: nodes.NodeRendezvous, rank: int, why: str) -> None:
    """Tell the head (if it is still there) which rank died, so it fails at once, naming it."""
    try:
        store = nodes.open_store(dataclasses.replace(rendezvous, join_timeout_s=2.0), is_master=False)
        store.set(f"{nodes.FAILED_PREFIX}{rank}", why)
    except RuntimeError:
        pass  # the head is gone too
