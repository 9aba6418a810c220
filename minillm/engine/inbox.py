"""The engine's inbox: how other threads talk to an engine that one thread owns (chapter 11).

Every `LLMEngine` has an inbox; whether a thread of its own runs it is the caller's choice:

- **offline** (`LLM.generate`, the benches, the simulator): the caller's thread steps the engine
  until the trace is done. Nothing else submits commands, except a KV connector, whose transfer
  thread hands its events in through `call_soon`; `step()` drains them first.
- **threaded** (the server): one thread runs `run_forever` and is the only one that touches engine
  state. Other threads never call `add_request` or `abort_request`; they `submit_add` /
  `submit_abort` into the inbox, and receive `RequestOutput`s through the callback (`sink`) they
  gave. With nothing to do, the loop blocks on the inbox (no spinning).

Why a thread and not a process, as vLLM V1 does (its EngineCore is a separate process talking ZMQ):
the bundled model is tiny, torch releases the GIL inside its ops, and a thread needs no
serialization of requests and outputs — what is left to teach is the ownership rule, which a
thread shows just as well. The price: the HTTP side and the engine share one interpreter, so
tokenizing or JSON work in the server takes time from the engine loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from minillm.request import CompletionOutput, RequestOutput, SamplingParams

logger = logging.getLogger("minillm.engine")

OutputSink = Callable[[RequestOutput], None]
STEP_FAILED = "engine step failed"  # how RequestOutput.error begins when a step failed (else: a refused prompt)
ADD_FAILED = "engine failed to add the request"  # an unexpected error (not a ValueError) while adding
SERVER_FAULTS = (STEP_FAILED, ADD_FAILED)  # errors that are the server's fault (HTTP 500), not the client's


class EngineInbox:
    """The inbox half of `LLMEngine` (which inherits it): commands from other threads, and the loop
    that serves them when a thread runs the engine (`run_forever`). Uses the engine's `add_request`,
    `abort_request`, `step`, `requests`, `scheduler`, `clock` and `_pending`."""

    def _init_inbox(self) -> None:
        # Commands from other threads: ("add", prompt, params, request_id, sink, priority),
        # ("abort", request_id) or ("call", fn); see submit_add / submit_abort / call_soon.
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.command_observers: list[Callable[[], None]] = []  # called after commands were applied
        # While `run_forever` runs, the thread running it owns all engine state: add_request,
        # abort_request and step refuse any other caller (who should use the inbox instead).
        self.owner_thread: threading.Thread | None = None

    def _check_owner(self, what: str) -> None:
        owner = self.owner_thread
        if owner is not None and threading.current_thread() is not owner:
            raise RuntimeError(f"{what}() called from thread {threading.current_thread().name!r}, but thread "
                               f"{owner.name!r} runs this engine (a server?): from other threads use "
                               "submit_add / submit_abort / call_soon")

    def submit_add(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                   sink: OutputSink, priority: int = 0) -> None:
        """Thread-safe: queue an add for the engine thread. A prompt it refuses reaches `sink` as
        a finished output with `error` set (finish_reason "abort")."""
        self.inbox.put(("add", prompt, params, request_id, sink, priority))

    def submit_abort(self, request_id: str) -> None:
        """Thread-safe: abort `request_id` at the start of the next step (no-op if it is gone)."""
        self.inbox.put(("abort", request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Thread-safe: run `fn()` on the engine thread between steps (a consistent snapshot)."""
        self.inbox.put(("call", fn))

    def _drain_inbox(self, block: bool = False, timeout: float | None = None) -> None:
        """Apply queued commands; with `block`, wait (up to `timeout`) for the first one."""
        try:
            command = self.inbox.get(True, timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
        for fn in self.command_observers:
            fn()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "abort":
            self.abort_request(command[1])
        elif kind == "add":
            _, prompt, params, request_id, sink, priority = command
            try:
                self.add_request(prompt, params, request_id=request_id, sink=sink, priority=priority)
            except ValueError as err:  # a prompt or params the engine refuses: the caller's fault
                self._refuse(request_id, sink, str(err))
            except Exception as err:  # noqa: BLE001 - a bug while adding must not stop the engine thread
                logger.exception("adding request %s failed", request_id)
                self._refuse(request_id, sink, f"{ADD_FAILED}: {type(err).__name__}: {err}")
        elif kind == "call":
            try:
                command[1]()
            except Exception:  # noqa: BLE001 - nor may a failing call_soon function
                logger.exception("a function queued with call_soon failed")
        else:
            logger.error("unknown engine command %r ignored", kind)

    def _refuse(self, request_id: str, sink: OutputSink, error: str) -> None:
        """Answer a failed add with one finished output carrying `error`; undo a half-done add."""
        req = self.requests.get(request_id)
        if req is not None and req.sink is sink:  # it got in before the failure: take it out again
            req.error = error
            try:
                self.abort_request(request_id)  # frees whatever it holds and answers its sink
                return
            except Exception:  # noqa: BLE001 - then at least forget it, so the loop does not wait on it
                logger.exception("aborting the half-added request %s failed", request_id)
                self.requests.pop(request_id, None)
                self._pending_ids.discard(request_id)
        try:
            sink(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")], True, error=error))
        except Exception:  # noqa: BLE001
            logger.exception("output sink of request %s failed", request_id)

    def run_forever(self, stop: threading.Event) -> None:
        """The engine thread's loop: step while there is work, block on the inbox while there is none.

        A step that raises (a bug, out of memory) is rolled back by the scheduler; every request
        is then aborted (its sink sees finish_reason "abort" with the error), so one bad step
        cannot repeat forever, and the loop goes on serving new requests."""
        if self.owner_thread is not None:
            raise RuntimeError(f"thread {self.owner_thread.name!r} already runs this engine")
        self.owner_thread = threading.current_thread()
        try:
            self._serve(stop)
        finally:
            self.owner_thread = None

    def _serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.requests:
                self._wait_for_commands(0.5)
                continue
            steps_before = self.num_steps
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - the loop must survive any one step
                logger.exception("engine step failed; aborting the requests it held")
                self._abort_all(f"{STEP_FAILED}: {type(err).__name__}: {err}")
                continue
            if self.num_steps == steps_before:  # nothing could run: sleep until a timer or a command
                now = self.clock.now()
                times = [t for t in (self._pending[0][0] if self._pending else None,
                                     self.scheduler.next_wakeup(now)) if t is not None]
                timeout = max(0.0, min(times) - now) if times else 0.5
                self._wait_for_commands(timeout)

    def _wait_for_commands(self, timeout: float) -> None:
        """Block on the inbox up to `timeout` s (the 0.5 s cap lets `stop` be seen), then apply what came."""
        try:
            self._drain_inbox(block=True, timeout=timeout)
        except Exception:  # noqa: BLE001 - e.g. a failing command observer; the loop goes on
            logger.exception("applying engine commands failed")

    def _abort_all(self, error: str) -> None:
        for request_id, req in list(self.requests.items()):
            req.error = error
            self.abort_request(request_id)
