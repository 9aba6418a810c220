"""Run one function on several processes joined by torch.distributed (chapter 12, exercise 12).

`run_ranks(fn, world_size)` starts `world_size` processes, joins them in one gloo process group on
this machine (a FileStore in a fresh temporary folder: no port to pick, none to collide), calls
`fn(rank, world_size, *args)` on each, and returns what each returned, in rank order. It never
hangs and never leaves a process behind: collectives time out after `timeout_s`, the whole run is
bounded by `timeout_s` too, and whatever is still alive at the end is killed and joined.

Processes are forked by default, so `fn` may be anything this process can call, a function defined
in a notebook cell included (spawn would have to pickle it by name, and a cell's functions have
none). Each rank runs torch on one thread: two ranks on a laptop's cores is the point, not speed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any


class RankError(RuntimeError):
    """A rank raised, died or did not answer in time; the message says which and why."""


def _rank_main(fn: Callable, rank: int, world_size: int, init_file: str, args: Sequence, conn,
               backend: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # Every rank's connections are up before any rank runs fn: a rank that finishes fn at once
            # and leaves must not break another rank still connecting.
            dist.barrier()
            payload = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001  (reported to the parent, which decides)
        payload = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as error:  # noqa: BLE001  (an answer that does not pickle)
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}'s result cannot be sent back: {error}", "")))
    conn.close()


def run_ranks(fn: Callable, world_size: int = 2, args: Sequence = (), timeout_s: float = 60.0,
              backend: str = "gloo", start_method: str = "fork") -> list[Any]:
    """`[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`, each on its own
    process in one `backend` group. Raises RankError naming the first rank that failed (its
    traceback in the message), died, or did not answer within `timeout_s`."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: a positive number of ranks")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be positive")
    ctx = mp.get_context(start_method)
    processes, readers, finished = [], {}, False
    with tempfile.TemporaryDirectory(prefix="minillm-ranks-") as folder:
        init_file = os.path.join(folder, "store")
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_rank_main, daemon=True, name=f"minillm-rank-{rank}",
                                      args=(fn, rank, world_size, init_file, args, writer, backend, timeout_s))
                process.start()
                writer.close()
                processes.append(process)
                readers[reader] = rank
            results: dict[int, Any] = {}
            deadline = time.monotonic() + timeout_s
            while len(results) < world_size:
                ready = wait(list(readers), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankError(f"rank(s) {missing} did not answer within {timeout_s:g} s "
                                    "(a collective that not every rank calls waits forever)")
                for reader in ready:
                    rank = readers.pop(reader)
                    try:
                        payload = pickle.loads(reader.recv_bytes())
                    except EOFError:
                        raise RankError(f"rank {rank} died without an answer (exit code "
                                        f"{processes[rank].exitcode})") from None
                    if payload[0] == "error":
                        raise RankError(f"rank {rank}: {payload[1]}\n{payload[2]}")
                    results[rank] = payload[1]
            finished = True
            return [results[rank] for rank in range(world_size)]
        finally:
            for process in processes:  # after a failure the others may wait in a collective: kill them now
                process.join(timeout=5 if finished else 0)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
            for reader in readers:
                reader.close()
