"""One rank of a world that `torchrun` started: every process is a whole engine (vLLM's
`ExecutorWithExternalLauncher`; chapter 12, docs/multinode.md "Under torchrun").

    torchrun --nproc-per-node 2 script.py      # script.py, the same in every process:
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    outs = llm.generate(prompts, params)       # the same outputs on every rank

The multi-process executor has one driver that schedules and N ranks that only compute. Here the
launcher starts the N processes, and each one is both: it runs its own scheduler and KV
accounting on the same prompts, so every process plans the same steps (the scheduler is
deterministic: no clock and no randomness decide a continuous-batching plan of `LLM.generate`),
and each hands its plan to the one worker it holds — its rank's shard. No plan crosses between
processes; the collectives of the forward are the only traffic, as in the multi-process engine.

Two collectives are added per step, both on the whole world:
- before the forward, every rank's plan fingerprint is gathered and compared: ranks that planned
  differently (a script that gave them different prompts, or a different order) would otherwise
  pair mismatched collectives and hang or compute garbage; here they stop with an error naming
  the ranks and the step;
- after it, what every rank answered is gathered, so every process returns the sampling rank's
  tokens (TP rank 0 of the last stage samples, as in the multi-process engine) and its engine
  updates its requests exactly as that rank's does.

The world comes from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`) through torch.distributed's `env://` rendezvous (torch's threads per process are
torchrun's `OMP_NUM_THREADS`: 1 unless set); `WORLD_SIZE` must equal
tensor_parallel_size × pipeline_parallel_size. Ranks are laid out as everywhere in minillm
(`minillm.distributed.layout`): consecutive ranks form a stage's TP group, so with
`--nproc-per-node` = tensor_parallel_size a stage's TP group stays on one node and pipeline stages
cross nodes. Faults are torchrun's to handle: a rank that dies makes its peers' next collective
fail (within `execute_model_timeout_s`), and torchrun stops the others.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import os

import torch
import torch.distributed as dist

from minillm.distributed.host_address import gloo_interface_towards
from minillm.distributed.layout import output_rank
from minillm.distributed.worker import WorkerSpec, build_rank
from minillm.executor.abstract import EngineDeadError, WorkerExecutor
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder
from minillm.worker.model_runner import WorkerStats

logger = logging.getLogger("minillm.external_launcher")

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_rank(world_size: int) -> int:
    """This process's global rank from torchrun's environment; a ValueError saying what is missing or wrong."""
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise ValueError(f"distributed_executor_backend='external_launcher' joins a world that a launcher set up, "
                         f"but {', '.join(missing)} is not set: start the script with "
                         f"`torchrun --nproc-per-node {world_size} script.py` (or use 'mp', which starts the ranks)")
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world_size:
        raise ValueError(f"torchrun started WORLD_SIZE={launched} processes, but tensor_parallel_size × "
                         f"pipeline_parallel_size = {world_size}: launch {world_size} processes in all "
                         f"(--nnodes × --nproc-per-node) or change the sizes")
    return int(os.environ["RANK"])


def plan_fingerprint(plan: SchedulerOutput) -> int:
    """A number that two ranks' plans share only if they schedule the same requests, the same tokens,
    at the same places (Python's `hash` of a str differs per process: not usable here)."""
    key = repr((plan.req_ids, plan.num_scheduled_tokens, plan.num_computed_tokens, plan.new_token_ids,
                plan.finished_req_ids, sorted(plan.spec_token_ids.items())))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


class ExternalLauncherExecutor(WorkerExecutor):
    def __init__(self, kv, spec: WorkerSpec) -> None:
        """`kv`: this process's KV manager (accounting only; its rank's pool lives in the worker).
        `spec.init_file` is unused: the rendezvous is torchrun's `env://`."""
        from minillm.worker.warm_up import warm_up

        self.tp, self.pp = spec.tp, spec.pp
        self.rank = launcher_rank(spec.tp * spec.pp)
        self.output_rank = output_rank(spec.tp, spec.pp)
        self.plans = SchedulerOutputBuilder(kv)
        self.num_steps = 0
        self.dead: str | None = None
        on_cuda = spec.device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # gloo's sockets (the world on a CPU; plans and answers beside NCCL on CUDA) on the interface that
        # reaches the master, not on the address the host's name resolves to
        interface = gloo_interface_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        logger.info("rank %d: gloo on interface %s", self.rank, interface or os.environ.get("GLOO_SOCKET_IFNAME"))
        join_world(spec, self.rank, on_cuda)
        self.worker = build_rank(spec, self.rank)  # the world exists: build_rank only adds the TP groups
        # Plans and answers are Python objects: on CUDA they travel over a gloo group beside NCCL's.
        self.control = dist.new_group(backend="gloo") if on_cuda else dist.group.WORLD
        self.warm_up_report = warm_up(self.worker, spec.max_num_seqs) if spec.max_num_seqs else None

    # ---- one step --------------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if self.dead is not None:
            raise EngineDeadError(f"this rank's engine cannot continue: {self.dead}")
        self.num_steps += 1
        try:
            self._check_same_plan(plan)
            answers = self._gather(self.worker.execute_model(plan))
        except EngineDeadError:
            raise
        except Exception as error:  # a peer died or timed out: the world's collectives are out of step for good
            self.dead = f"step {self.num_steps} failed on rank {self.rank}: {type(error).__name__}: {error}"
            raise EngineDeadError(self.dead) from error
        out = answers[self.output_rank]
        if self.pp > 1 and out.expert_load is not None:  # MoE: each stage knows its own layers' expert load
            out.expert_load = [row for s in range(self.pp - 1) for row in answers[s * self.tp]] + out.expert_load
        return out

    def _gather(self, answer) -> list:
        answers: list = [None] * (self.tp * self.pp)
        dist.all_gather_object(answers, answer, group=self.control)
        return answers

    def _check_same_plan(self, plan: SchedulerOutput) -> None:
        fingerprints = self._gather(plan_fingerprint(plan))
        if len(set(fingerprints)) > 1:
            groups: dict[int, list[int]] = {}
            for rank, value in enumerate(fingerprints):
                groups.setdefault(value, []).append(rank)
            self.dead = (f"the ranks planned different steps at step {self.num_steps} (ranks grouped by plan: "
                         f"{sorted(groups.values())}): every process must give generate the same prompts and "
                         f"SamplingParams, in the same order")
            raise EngineDeadError(self.dead)

    def stats(self, reset: bool = False) -> WorkerStats:
        """This rank's worker counters (on the sampling rank, the sampler's too)."""
        return self.worker.stats(reset)

    def shutdown(self) -> None:
        """No more steps (idempotent). The world stays: a later `LLM` in this process joins it again, and
        the process leaves it at exit (`join_world`)."""
        if self.dead is None:
            self.dead = "the executor was shut down"


def join_world(spec: WorkerSpec, rank: int, on_cuda: bool) -> None:
    """Join torchrun's world once per process (env:// rendezvous), or use the one the script or an earlier
    `LLM` joined: a world left and joined again on the same store would meet the first one's keys."""
    world_size = spec.tp * spec.pp
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"this process already belongs to a torch.distributed world as rank {dist.get_rank()} "
                             f"of {dist.get_world_size()}, not rank {rank} of {world_size}")
        return
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    atexit.register(_leave_world)


def _leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
