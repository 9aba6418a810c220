"""One process per rank (forked where safe), joined by torch.distributed (vLLM's `MultiprocExecutor`; chapter 12).

    LLM(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp")

The driver (the engine's process) holds the scheduler and the KV *accounting*, never a weight nor
a KV pool. It starts tp × pp processes, forked where that is safe and spawned otherwise
(`minillm.executor.start_method` says what it checks, logs which and why; a plain script without a
main guard, `python -c` and a notebook all work), each running `minillm.distributed.worker.rank_main`:
join one torch.distributed group (gloo on a CPU, NCCL on CUDA; a FileStore in a temporary folder
as the rendezvous, so no port to pick), load only its shard, allocate only its KV heads and layers.
A forked rank first closes the driver's ends of the pipes it inherited, so that a pipe still ends
when the driver dies.

A world across nodes (`rendezvous`: `minillm.distributed.nodes`): the driver starts only the head
node's ranks, hosts the world's TCPStore at `master_addr:master_port`, publishes the ranks' spec
there, and waits up to `node_join_timeout_s` for every other node's ranks to announce themselves
(else `NodeJoinError` naming the node and its ranks). Rank 0 relays each message to the other
nodes' ranks and returns their answers with its own; a node that reports a dead rank in the store
is read while waiting for a step, and makes the executor dead like a local rank's death.

Transport of the plan: one `multiprocessing` pipe per rank. Each step the driver pickles the
`SchedulerOutput` once and writes those bytes to every pipe; every rank answers on its pipe — the
sampling rank (TP rank 0 of the last stage) with the `ModelRunnerOutput`, the others with None (or,
TP rank 0 of an earlier stage of an MoE model, with its layers' expert load, joined into the output).
Why a pipe and not nano-vllm's shared-memory broadcast (one pickle written into shared memory,
ranks woken by events): a steady decode plan is ~100 bytes per row, so the copy is not what costs;
a pipe needs no size limit or polling, and it tells the driver at once when a rank is gone (its end
closes, its process sentinel fires) — which is what the fault handling below needs. vLLM's
`MultiprocExecutor` does use a shared-memory ring buffer (`MessageQueue`): at thousands of steps a
second on a GPU, the syscall and wake-up per rank start to show.

Faults. The driver waits for every rank's answer, watching the pipes and the process sentinels
together, up to `execute_model_timeout_s`. A rank that died (sentinel), answered an exception, or
did not answer in time makes the executor dead: every process is killed and joined at once, and
this and every later step raise `EngineDeadError` naming the rank, its pid and what happened
(after a failure the ranks' collectives may be out of step, so no step can be trusted again;
vLLM does the same). A step interrupted in the driver (Ctrl-C while it waits) stops the ranks too: their
answers would no longer match the plans. `shutdown()` (also run by `LLM.shutdown()`, by garbage collection and at
interpreter exit, through `weakref.finalize`) asks every rank to stop, joins it, kills stragglers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import wait

from minillm.distributed.layout import output_rank
from minillm.distributed.worker import WorkerSpec, rank_main
from minillm.executor.abstract import EngineDeadError, WorkerExecutor
from minillm.executor.start_method import check_main_guard, choose_start_method, log_start_method
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.output import SchedulerOutput, SchedulerOutputBuilder
from minillm.worker.model_runner import WorkerStats

STARTUP_TIMEOUT_S = 180.0  # spawn, import torch, join the group, load the shard (on 2 shared cores)
STOP_TIMEOUT_S = 10.0
POLL_S = 0.5  # a multi-node world: how often a wait reads the store for a node's dead ranks


def _rank_entry(rank: int, spec: WorkerSpec, conn, inherited: list) -> None:
    """A rank's target: a forked rank first closes the driver's pipe ends it inherited (its own and the
    earlier ranks'), else a dead driver's pipes would stay open and no rank would notice."""
    for other in inherited:
        other.close()
    rank_main(rank, spec, conn)


def _stop_processes(processes: list, conns: list, folder: str, polite: bool, stores: list) -> None:
    """Ask each rank to stop (if `polite`), join it, kill what is still alive; close pipes, remove the folder,
    drop the world's TCPStore (its port closes). A module-level function: `weakref.finalize` must not hold the
    executor itself."""
    if polite:
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)
    stores.clear()


class MultiprocExecutor(WorkerExecutor):
    def __init__(self, kv, spec_kwargs: dict, tp: int, pp: int, timeout_s: float, rendezvous=None) -> None:
        """`kv`: the driver's KV manager (its block tables are what plans describe); `spec_kwargs`: the
        `WorkerSpec` fields but tp, pp, init_file, timeout_s and rendezvous; `rendezvous`: a
        `minillm.distributed.nodes.NodeRendezvous` for a world across nodes (None: this machine only)."""
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.timeout_s = timeout_s
        self.plans = SchedulerOutputBuilder(kv)
        self.output_rank = output_rank(tp, pp)
        self.dead: str | None = None  # why, once a rank failed
        self.num_steps = 0
        self.rendezvous = rendezvous
        self.placement: dict[int, dict] = {}  # a multi-node world: rank -> {"node", "host", "pid"} as it joined
        nnodes = rendezvous.nnodes if rendezvous is not None else 1
        self.num_local = self.world_size // nnodes  # ranks 0 .. num_local-1 run here, the rest on other nodes
        self.start_method = choose_start_method()
        check_main_guard(self.start_method)  # before any process: a spawned rank would re-run an unguarded script
        log_start_method(self.start_method, f"minillm: {self.num_local} rank(s)")
        ctx = mp.get_context(self.start_method.name)
        self._folder = tempfile.mkdtemp(prefix="minillm-mp-")
        spec = WorkerSpec(tp=tp, pp=pp, init_file=os.path.join(self._folder, "store"), timeout_s=timeout_s,
                          rendezvous=rendezvous, **spec_kwargs)
        self.processes, self.conns, self._stores = [], [], []
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes, self.conns, self._folder, True,
                                           self._stores)
        forked = self.start_method.name == "fork"
        try:
            for rank in range(self.num_local):
                driver_end, rank_end = ctx.Pipe(duplex=True)
                inherited = [*self.conns, driver_end] if forked else []
                process = ctx.Process(target=_rank_entry, args=(rank, spec, rank_end, inherited), daemon=True,
                                      name=f"minillm-rank-{rank}")
                process.start()
                rank_end.close()
                self.processes.append(process)
                self.conns.append(driver_end)
            if rendezvous is not None:  # after the forks: no rank inherits the store's listening socket
                self._open_world(spec)
            self.rank_info = self._gather("start-up", STARTUP_TIMEOUT_S)
        except BaseException:
            self._finalizer.detach()
            _stop_processes(self.processes, self.conns, self._folder, False, self._stores)
            raise

    def _open_world(self, spec: WorkerSpec) -> None:
        """Host the world's TCPStore, publish the ranks' spec, wait for every node's ranks to join."""
        from minillm.distributed import nodes

        rendezvous = self.rendezvous
        try:
            store = nodes.open_store(rendezvous, is_master=True)
        except RuntimeError as error:
            raise nodes.NodeJoinError(f"the head cannot host the world's rendezvous at {rendezvous.address} "
                                f"(master_port in use?): {error}") from None
        self._stores.append(store)
        store.set(nodes.SPEC_KEY, pickle.dumps(spec))
        deadline = time.monotonic() + rendezvous.join_timeout_s
        while True:
            joined = nodes.joined_ranks(store, self.world_size)
            self.placement = joined
            missing = [r for r in range(self.world_size) if r not in joined]
            if not missing:
                return
            local = wait([p.sentinel for p in self.processes] + self.conns, timeout=0.2)
            if local:  # a local rank failed (or answered) early: the start-up gather says which
                return
            if time.monotonic() > deadline:
                raise nodes.NodeJoinError(nodes.missing_nodes_message(missing, self.world_size, rendezvous))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- one step --------------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if self.dead is not None:
            self.check_health()  # raises: the executor failed earlier
        exited = self._exited_rank()
        if exited is not None:  # a rank died between steps: stop the others now
            self._fail(exited)
        try:
            self._broadcast(("plan", plan))
            self.num_steps += 1
            answers = self._gather(f"step {self.num_steps}", self.timeout_s)
            out = answers[self.output_rank]
            if self.pp > 1 and out.expert_load is not None:  # MoE: each stage knows its own layers' expert load
                out.expert_load = [row for s in range(self.pp - 1) for row in answers[s * self.tp]] + out.expert_load
            return out
        except EngineDeadError:
            raise
        except BaseException as err:  # e.g. Ctrl-C while waiting: the ranks' answers would now be out of step
            if self.dead is None:
                self.dead = f"step {self.num_steps} was interrupted ({type(err).__name__})"
                self.shutdown(polite=False)
            raise

    def collective_stats(self, reset: bool = False) -> list[dict]:
        """Per rank: collectives called, bytes handed to them, wall seconds in them (`{"calls": {...},
        "bytes": {...}, "seconds": {...}}`), the rank's time in the forward (`model_time_s`) and its
        worker counters (`"worker"`: a `WorkerStats`; `reset` zeroes those after reading)."""
        self.check_health()
        self._broadcast(("stats", reset))
        return self._gather("stats", self.timeout_s)

    def stats(self, reset: bool = False) -> WorkerStats:
        """The sampling rank's worker counters (its forward time includes waiting on the others)."""
        return self.collective_stats(reset)[self.output_rank]["worker"]

    def _broadcast(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # pickled once, written to every rank
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError) as error:
                self._fail(f"rank {rank} (pid {self.processes[rank].pid}) cannot be reached: {error}")

    def _gather(self, what: str, timeout_s: float) -> list:
        """Every rank's answer, or EngineDeadError (all processes stopped) naming the first rank that failed."""
        answers: dict[int, object] = {}
        closed: set[int] = set()  # ranks whose pipe reached its end
        rank_of = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinel_of = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            pending = [r for r in range(self.num_local) if r not in answers]
            watched = [self.conns[r] for r in pending if r not in closed] + [self.processes[r].sentinel for r in pending]
            wait_s = max(0.0, deadline - time.monotonic())
            ready = wait(watched, timeout=wait_s if self.rendezvous is None else min(wait_s, POLL_S))
            if self.rendezvous is not None:
                self._check_remote(what)
                if not ready and time.monotonic() < deadline:
                    continue
            if not ready:
                pending = [r for r in range(self.world_size) if r not in answers]
                pids = [self.processes[r].pid for r in pending if r < self.num_local]
                self._fail(f"rank(s) {pending} (local pid {pids}) did not answer {what} within {timeout_s:g} s "
                           "(execute_model_timeout_s): a hung worker")
            conns_first = sorted(ready, key=lambda obj: obj not in rank_of)  # read answers before deaths
            for obj in conns_first:
                if obj in rank_of:
                    rank = rank_of[obj]
                    try:
                        payload = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        closed.add(rank)  # its end closed: the sentinel says how it ended
                        continue
                    if payload[0] == "error":  # a collective's error on one rank is most often another's death:
                        dead = self._exited_rank(wait_s=1.0)  # name that first (its sentinel may lag the answer)
                        self._fail(f"{dead + '; ' if dead else ''}rank {rank} (pid {self.processes[rank].pid}) failed "
                                   f"in {what}: {payload[1]}\n{payload[2]}")
                    answers[rank] = payload[1]
                    if payload[0] == "relayed":  # rank 0 of a multi-node world: the other nodes' answers too
                        for remote, reply in payload[2].items():
                            if reply[0] == "error":
                                self._fail(f"rank {remote} (on node {self._node_of(remote)}) failed in {what}: "
                                           f"{reply[1]}\n{reply[2]}")
                            answers[remote] = reply[1]
                else:
                    rank = sentinel_of[obj]
                    if rank in answers:
                        continue
                    if rank not in closed and self.conns[rank].poll():  # an answer still to read first
                        continue
                    self.processes[rank].join(timeout=1.0)  # (for its exit code)
                    self._fail(f"rank {rank} (pid {self.processes[rank].pid}) died during {what} "
                               f"(exit code {self.processes[rank].exitcode})")
        return [answers[r] for r in range(self.world_size)]

    def _node_of(self, rank: int) -> int:
        return rank // self.num_local

    def _remote_failures(self) -> str | None:
        """What a headless node reported about its dead ranks, said in words; None if nothing."""
        from minillm.distributed.nodes import failed_ranks

        if self.rendezvous is None or not self._stores:
            return None
        try:
            failed = failed_ranks(self._stores[0], range(self.num_local, self.world_size))
        except RuntimeError:
            return None
        if not failed:
            return None
        return "; ".join(f"rank {rank} on node {self._node_of(rank)}: {why}" for rank, why in sorted(failed.items()))

    def _check_remote(self, what: str) -> None:
        failed = self._remote_failures()
        if failed is not None:
            self._fail(f"a node lost its rank(s) during {what}: {failed}")

    def _fail(self, why: str) -> None:
        self.dead = why
        self.shutdown(polite=False)
        raise EngineDeadError(f"a distributed worker failed, the engine cannot continue: {why}")

    # ---- health and shutdown -------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise EngineDeadError if a rank failed or is no longer alive. Only reads (any thread may call
        it, the server's /health does); the engine's thread stops the processes at its next step."""
        if self.dead is not None:
            raise EngineDeadError(f"a distributed worker failed, the engine cannot continue: {self.dead}")
        exited = self._exited_rank() or self._remote_failures()
        if exited is not None:
            raise EngineDeadError(f"a distributed worker failed: {exited}")

    def _exited_rank(self, wait_s: float = 0.0) -> str | None:
        """The first rank whose process has ended (within `wait_s`), said in words; None while all run."""
        exited = wait([p.sentinel for p in self.processes], timeout=wait_s)  # ready once its process ended
        for rank, process in enumerate(self.processes):
            if process.sentinel in exited:
                return f"rank {rank} (pid {process.pid}) is no longer running (exit code {process.exitcode})"
        return None

    def shutdown(self, polite: bool = True) -> None:
        """Stop and join every rank (idempotent)."""
        if self._finalizer.detach() is not None:
            _stop_processes(self.processes, self.conns, self._folder, polite and self.dead is None, self._stores)
        if self.dead is None:
            self.dead = "the executor was shut down"
