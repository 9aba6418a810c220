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
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minillm.distributed.layout import RankLayout
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
    device: str  # "cpu" or "cuda" (rank r uses cuda:r)
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
    device = f"cuda:{rank % max(1, torch.cuda.device_count())}" if on_cuda else "cpu"
    if on_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # (under torchrun the executor has joined torchrun's world already)
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"file://{spec.init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=spec.timeout_s))
    layout = RankLayout(rank, spec.tp, spec.pp)
    groups = [dist.new_group(layout.tp_group_ranks(s)) if 1 < spec.tp < world else None for s in range(spec.pp)]
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
    return ParallelWorker(model, rank_cache_spec(spec.cache_spec, model), spec.attention_backend, layout,
                          spec.micro_batches, kv_connector)


def rank_main(rank: int, spec: WorkerSpec, conn) -> None:
    """The spawned process's body (see the module docstring)."""
    torch.set_num_threads(spec.num_threads)
    try:
        worker = build_rank(spec, rank)
        if spec.max_num_seqs:  # every rank runs the same dummy plans, so their collectives pair up
            from minillm.worker.warm_up import warm_up

            warm_up(worker, spec.max_num_seqs)
            for counts in (worker.model.comm.calls, worker.model.comm.bytes, worker.model.comm.seconds):
                counts.clear()  # chapter 12 and the tests count the collectives of real steps only
        conn.send_bytes(pickle.dumps(("ready", {"pid": os.getpid(), "weight_bytes": worker.model.weight_bytes,
                                                "kv_pool_shape": worker.cache_spec.shape})))
    except BaseException as error:  # noqa: BLE001 - reported to the driver, which refuses to start
        conn.send_bytes(pickle.dumps(("error", f"{type(error).__name__}: {error}", traceback.format_exc())))
        return
    try:
        serve(worker, conn)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def serve(worker: ParallelWorker, conn) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone: nobody will read an answer
            return
        kind = message[0]
        if kind == "stop":
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            if kind == "plan":
                reply = worker.execute_model(message[1])
            elif kind == "stats":
                comm = worker.model.comm
                reply = {"calls": dict(comm.calls), "bytes": dict(comm.bytes), "seconds": dict(comm.seconds),
                         "model_time_s": worker.model_time_s, "worker": worker.stats(reset=message[1])}
            else:
                raise ValueError(f"unknown message {kind!r}")
            payload = ("ok", reply)
        except Exception as error:  # noqa: BLE001 - the driver decides
            payload = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(payload))
        except (BrokenPipeError, OSError):
            return


__all__ = ["ParallelWorker", "WorkerSpec", "rank_main"]
