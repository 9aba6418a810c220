"""The child side of tests/test_worker_subprocess.py: a worker in a spawned process.

It receives pickled messages over a pipe and answers each with a pickled reply:
("init", model_dir, dtype, max_model_len, cache_spec, attention_backend) builds a fresh worker
(the model is loaded once per directory and dtype), ("plan", SchedulerOutput) runs one step,
("fail_next",) makes the next forward pass raise, ("stop",) ends the loop. Nothing else about
the engine ever reaches this process: no Request, no scheduler, no KV manager.
"""

from __future__ import annotations

import pickle
import traceback


class InjectedFault(RuntimeError):
    pass


def arm_fault(runner) -> None:
    """Make the runner's next forward pass raise (after the plan's diffs and KV moves were applied)."""
    model = runner.model
    real = model.forward

    def failing(*args, **kwargs):
        model.forward = real
        raise InjectedFault("injected: the forward pass failed")

    model.forward = failing


def main(conn) -> None:
    import torch

    from minillm.model.loader import load_model_dir
    from minillm.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    models: dict = {}
    runner = None
    while True:
        message = pickle.loads(conn.recv_bytes())
        kind = message[0]
        try:
            if kind == "stop":
                conn.send_bytes(pickle.dumps(("ok", None)))
                return
            if kind == "init":
                _, model_dir, dtype, max_model_len, cache_spec, backend = message
                key = (model_dir, dtype, max_model_len)
                if key not in models:
                    models[key] = load_model_dir(model_dir, dtype, "cpu", max_model_len)
                runner = ModelRunner(models[key], cache_spec, backend)
                reply = None
            elif kind == "fail_next":
                arm_fault(runner)
                reply = None
            elif kind == "plan":
                reply = runner.execute_model(message[1])
            else:
                raise ValueError(f"unknown message {kind!r}")
            conn.send_bytes(pickle.dumps(("ok", reply)))
        except Exception as err:  # noqa: BLE001 - the driver decides; the worker stays up
            conn.send_bytes(pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc())))
