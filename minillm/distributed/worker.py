"""One rank's process: join the group, load the shard, then run every plan the driver sends (chapter 12).

`rank_main` is what `minillm.executor.multiproc` spawns, once per rank. It joins the
torch.distributed group (gloo on a CPU, NCCL on CUDA), creates every stage's tensor-parallel group
(every rank must create every group, in the same order), loads this rank's shard, and answers
"ready". Then, per step, it receives the pickled `SchedulerOutput` from its pipe, applies it to
its own input batch and KV pool (the same plan on every rank: block tables are the same, only the
heads and layers in the pool differ), runs its part of the forward, and answers: the rank that
samples with the `ModelRunnerOutput`, the others with None. An exception is answered, never
swallowed; the driver decides (it treats it as fatal: the ranks' collectives may be out of step).
When the driver's end of the pipe closes (it exited, or was killed) the rank leaves.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minillm.distributed.layout import RankLayout
from minillm.distributed.nodes import announce_joined, node_of_rank, open_store
from minillm.kv.base import KVCacheSpec
from minillm.model.config import ModelConfig
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.output import SchedulerOutput
from minillm.worker.model_runner import ModelRunner, StepInputs


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build itself: plain values, pickled once per rank at start-up."""

    model_dir: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: str  # "cpu" or "cuda" (rank r uses cuda:r, or its rank within its node on several nodes)
    max_positions: int
    cache_spec: KVCacheSpec  # the whole model's pool; each rank allocates its layers and heads of it
    attention_backend: str
    tp: int
    pp: int
    init_file: str  # torch.distributed's FileStore rendezvous
    timeout_s: float  # collectives time out after this
    micro_batches: int = 1  # pipeline stages: micro-batches per step (EngineConfig.pipeline_micro_batches)
    expert_parallel: bool = False  # MoE: whole experts per rank (all-to-all) instead of sliced ones (all-reduce)
    num_threads: int = 1
    kv_transfer_config: Any = None  # a prefill/decode pair: this rank builds the KV connector's worker side
    max_num_seqs: int = 0  # warm up at start-up for decode batches up to this (0: no warm-up)
    # A world across nodes (minillm.distributed.nodes.NodeRendezvous): meet at its TCPStore instead of init_file
    rendezvous: Any = None


class ParallelWorker(ModelRunner):
    """A `ModelRunner` on one rank: every rank runs the forward; only the sampling rank samples.

    With pipeline stages and `micro_batches` > 1, a step's rows are cut into that many contiguous
    micro-batches of about equal tokens, run one after another through this rank's layers: stage 0
    starts on micro-batch 2 while stage 1 still works on micro-batch 1 (GPipe's schedule within
    one step). Every rank cuts the same plan the same way, so sends and receives pair up."""

    def __init__(self, model, cache_spec: KVCacheSpec, attention_backend: str, layout: RankLayout,
                 micro_batches: int = 1, kv_connector=None) -> None:
        super().__init__(model, cache_spec, attention_backend, kv_connector)
        self.layout = layout
        self.micro_batches = micro_batches if layout.pp > 1 else 1
        self.relay = None  # a multi-node world: the gloo group of rank 0 and the other nodes' ranks (build_rank)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.layout.samples:
            return super().execute_model(plan)
        self.update_state(plan)
        if plan.padded is not None:  # static / dynamic batching's padded rectangle
            _, load = self.compute_padded_logits(plan)
        else:
            load = self.compute_logits(plan)[1].expert_load  # this rank's part of the forward and the logits gather
        # An earlier stage of an MoE model answers with its layers' expert load (the driver joins the stages').
        return load if self.layout.tp_rank == 0 else None

    def compute_logits(self, plan: SchedulerOutput) -> tuple[torch.Tensor | None, StepInputs]:
        groups = micro_batch_rows(plan.num_scheduled_tokens, self.micro_batches)
        if len(groups) <= 1:
            return super().compute_logits(plan)
        parts, sampled, spans, sampled_rows, inputs, first, load = [], [], [], [], None, 0, None
        for start, end in groups:
            logits, inputs = super().compute_logits(rows_of_plan(plan, start, end))
            if inputs.expert_load is not None:  # MoE: the step's load is the micro-batches' sum
                part = torch.tensor(inputs.expert_load)
                load = part if load is None else load + part
            if logits is not None:
                parts.append(logits)
            sampled += [start + i for i in inputs.sampled]
            spans += [(first + j, width) for j, width in inputs.spans]  # (1+k logits rows for a speculative row)
            first += len(inputs.logits_rows)
            sampled_rows.append(inputs.sampled_rows)
        whole = dataclasses.replace(inputs, sampled=sampled, spans=spans, sampled_rows=np.concatenate(sampled_rows),
                                    expert_load=None if load is None else load.tolist())
        return (torch.cat(parts) if parts else None), whole


def micro_batch_rows(num_tokens: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut rows into at most `parts` contiguous, non-empty runs [start, end) of about total/parts tokens:
    a run closes before a row that would take it past that (a long prefill row stays whole)."""
    target, groups, start, acc = sum(num_tokens) / max(parts, 1), [], 0, 0
    for i, n in enumerate(num_tokens):
        if acc and acc + n > target and len(groups) < parts - 1:
            groups.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(num_tokens):
        groups.append((start, len(num_tokens)))
    return groups


def rows_of_plan(plan: SchedulerOutput, start: int, end: int) -> SchedulerOutput:
    """The plan's rows [start, end) (per-row fields only: its diffs were applied already)."""
    return dataclasses.replace(plan, req_ids=plan.req_ids[start:end],
                               num_scheduled_tokens=plan.num_scheduled_tokens[start:end],
                               num_computed_tokens=plan.num_computed_tokens[start:end],
                               new_token_ids=plan.new_token_ids[start:end], is_decode=plan.is_decode[start:end],
                               samples=plan.samples[start:end])


def rank_cache_spec(spec: KVCacheSpec, model) -> KVCacheSpec:
    """The pool this rank holds: its stage's layers, the KV heads its query heads read."""
    return dataclasses.replace(spec, num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads,
                               device=str(model.device), allocate=True)


def build_rank(spec: WorkerSpec, rank: int) -> ParallelWorker:
    import torch.distributed as dist

    from minillm.distributed.linear import ParallelState
    from minillm.model.checkpoint import SafetensorsCheckpoint
    from minillm.model.loader import Placement, load_weights
    from minillm.model.registry import model_class

    world = spec.tp * spec.pp
    on_cuda = spec.device.startswith("cuda")
    nnodes = spec.rendezvous.nnodes if spec.rendezvous is not None else 1
    local_rank = rank % (world // nnodes)  # a node's ranks use its devices 0, 1, ...
    device = f"cuda:{local_rank % max(1, torch.cuda.device_count())}" if on_cuda else "cpu"
    if on_cuda:
        torch.cuda.set_device(device)
    backend, timeout = "nccl" if on_cuda else "gloo", datetime.timedelta(seconds=spec.timeout_s)
    if dist.is_initialized():  # (under torchrun the executor has joined torchrun's world already)
        pass
    elif spec.rendezvous is None:  # one machine: a FileStore in the driver's temporary folder
        dist.init_process_group(backend, init_method=f"file://{spec.init_file}", rank=rank, world_size=world,
                                timeout=timeout)
    else:  # several nodes: the head's TCPStore (minillm.distributed.nodes)
        from minillm.distributed.host_address import gloo_interface_towards

        # gloo's sockets on the interface that reaches the head, not on the address the host's name resolves to
        gloo_interface_towards(spec.rendezvous.master_addr, spec.rendezvous.master_port)
        store = open_store(spec.rendezvous, is_master=False)
        announce_joined(store, rank, node_of_rank(rank, world, nnodes))
        dist.init_process_group(backend, store=dist.PrefixStore("world", store), rank=rank, world_size=world,
                                timeout=timeout)
    layout = RankLayout(rank, spec.tp, spec.pp)
    groups = [dist.new_group(layout.tp_group_ranks(s)) if 1 < spec.tp < world else None for s in range(spec.pp)]
    relay = None
    if nnodes > 1:  # rank 0 and the other nodes' ranks: plans go out and answers come back over it (gloo, on the
        # CPU even beside NCCL). Its timeout is long: a remote rank waits in it while the server idles; a peer
        # that dies breaks it at once ("Connection closed by peer").
        remote = [r for r in range(world) if node_of_rank(r, world, nnodes) != 0]
        relay = dist.new_group([0, *remote], backend="gloo", timeout=datetime.timedelta(days=365))
    tp_state = ParallelState(layout.tp_rank, spec.tp, groups[layout.stage])
    placement = Placement.of_rank(spec.model_config, layout, spec.expert_parallel)
    with SafetensorsCheckpoint(spec.model_dir) as checkpoint:
        weights = load_weights(checkpoint, spec.model_config, placement, spec.dtype, device)
    model = model_class(spec.model_config.model_type)(spec.model_config, weights, spec.max_positions, layout, tp_state)
    if spec.expert_parallel:  # expert parallel over the stage's TP group (ranks hold their experts already)
        from minillm.distributed.moe import shard_model_experts

        shard_model_experts(model, groups[layout.stage] if groups[layout.stage] is not None else dist.group.WORLD)
    kv_connector = None
    if spec.kv_transfer_config is not None:  # rank r moves its own layers' and heads' K/V, to/from rank r
        from minillm.kv_transfer import make_worker_connector

        kv_connector = make_worker_connector(spec.kv_transfer_config, rank, world)
    worker = ParallelWorker(model, rank_cache_spec(spec.cache_spec, model), spec.attention_backend, layout,
                            spec.micro_batches, kv_connector)
    worker.relay = relay
    return worker


def rank_main(rank: int, spec: WorkerSpec, conn=None) -> None:
    """The rank process's body (see the module docstring). `conn`: the pipe to the engine, or None for a
    rank of a headless node, which hears the engine through rank 0 (`serve_remote`)."""
    torch.set_num_threads(spec.num_threads)
    worker = None
    try:
        worker = build_rank(spec, rank)
        if spec.max_num_seqs:  # every rank runs the same dummy plans, so their collectives pair up
            from minillm.worker.warm_up import warm_up

            warm_up(worker, spec.max_num_seqs)
            for counts in (worker.model.comm.calls, worker.model.comm.bytes, worker.model.comm.seconds):
                counts.clear()  # chapter 12 and the tests count the collectives of real steps only
        ready = ("ok", {"pid": os.getpid(), "weight_bytes": worker.model.weight_bytes,
                        "kv_pool_shape": worker.cache_spec.shape, "host": socket.gethostname()})
    except BaseException as error:  # noqa: BLE001 - reported to the driver, which refuses to start
        ready = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
    try:
        if conn is None:
            if worker is None or worker.relay is None:  # it never reached the relay: its node reports the exit
                print(f"minillm rank {rank}: {ready[1]}\n{ready[2]}", file=sys.stderr, flush=True)
                sys.exit(1)
            serve_remote(worker, ready)
        else:
            if worker is not None and worker.relay is not None:
                ready = relay_answers(worker, ready)
            conn.send_bytes(pickle.dumps(ready))
            if worker is not None and ready[0] != "error":
                serve(worker, conn)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def answer(worker: ParallelWorker, message: tuple) -> tuple:
    """One message's answer: ("ok", reply) or ("error", what, traceback)."""
    try:
        kind = message[0]
        if kind == "plan":
            reply = worker.execute_model(message[1])
        elif kind == "stats":
            comm = worker.model.comm
            reply = {"calls": dict(comm.calls), "bytes": dict(comm.bytes), "seconds": dict(comm.seconds),
                     "model_time_s": worker.model_time_s, "worker": worker.stats(reset=message[1])}
        elif kind == "stop":
            reply = None
        else:
            raise ValueError(f"unknown message {kind!r}")
        return ("ok", reply)
    except Exception as error:  # noqa: BLE001 - the driver decides
        return ("error", f"{type(error).__name__}: {error}", traceback.format_exc())


def relay_answers(worker: ParallelWorker, own: tuple) -> tuple:
    """Rank 0 of a multi-node world: gather the other nodes' ranks' answers to the message just handled
    and send them with its own: ("relayed", own, {rank: answer}) (an "error" of its own stays one)."""
    import torch.distributed as dist

    group = worker.relay
    answers = [None] * dist.get_world_size(group)
    try:
        dist.gather_object(own, answers, dst=0, group=group)
    except Exception as error:  # noqa: BLE001 - a remote rank is gone: the driver stops the world
        return ("error", f"the other nodes' ranks {dist.get_process_group_ranks(group)[1:]} stopped answering: "
                         f"{type(error).__name__}: {error}", "")
    if own[0] == "error":
        return own
    ranks = dist.get_process_group_ranks(group)
    return ("relayed", own[1], {rank: answers[i] for i, rank in enumerate(ranks) if rank != 0})


def serve(worker: ParallelWorker, conn) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone: nobody will read an answer
            return
        if worker.relay is not None:  # a multi-node world: the remote ranks get every message from rank 0
            import torch.distributed as dist

            try:
                dist.broadcast_object_list([message], src=0, group=worker.relay)
            except Exception as error:  # noqa: BLE001
                conn.send_bytes(pickle.dumps(("error", f"the other nodes cannot be reached: {error}", "")))
                return
        payload = answer(worker, message)
        if worker.relay is not None:
            payload = relay_answers(worker, payload)
        try:
            conn.send_bytes(pickle.dumps(payload))
        except (BrokenPipeError, OSError):
            return
        if message[0] == "stop":
            return


def serve_remote(worker: ParallelWorker, ready: tuple) -> None:
    """A rank on a headless node: answer the start-up, then every message rank 0 relays, until "stop".
    If rank 0 goes away (its node died or stopped), the relay breaks and this rank exits with an error."""
    import torch.distributed as dist

    dist.gather_object(ready, None, dst=0, group=worker.relay)
    if ready[0] == "error":
        sys.exit(1)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=worker.relay)
        message = box[0]
        dist.gather_object(answer(worker, message), None, dst=0, group=worker.relay)
        if message[0] == "stop":
            return


__all__ = ["ParallelWorker", "WorkerSpec", "rank_main"]
