"""The engine thread and the asyncio side that talks to it (chapter 11).

One thread runs `LLMEngine.run_forever` and is the only one that touches engine state (see the
docstring of `minillm.engine` for why a thread and not a process). The HTTP handlers run on
uvicorn's event loop; they never call the engine, they `submit_add` / `submit_abort` into its
inbox. Outputs come back through a per-request sink that the engine thread calls; it hops onto
the event loop with `call_soon_threadsafe` and lands in that request's `asyncio.Queue`.

Bookkeeping lives on the event loop only: `num_in_flight` (requests submitted and not yet
finished — what the engine holds as waiting + running, plus what is still in its inbox) is what
`--max-num-queued-reqs` is checked against, and a request's queue is dropped when its final
output arrives, so nothing here grows with uptime.

A consumer that stops early (a client that disconnected: Starlette cancels the streaming task)
leaves `generate` through its `finally`, which submits an abort for every sample not yet
finished; the engine applies it at the start of its next step and frees the request's KV.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator

from minillm.request import RequestOutput, SamplingParams


class EngineOverloaded(Exception):
    """Full for now (answer 503 + Retry-After): the same request may succeed later."""


class RequestTooLarge(ValueError):
    """Needs more sequences than --max-num-queued-reqs allows at all: no retry can succeed."""


class EngineClient:
    def __init__(self, llm, max_num_queued_reqs: int | None = None, max_step_records: int = 256) -> None:
        self.llm = llm
        self.engine = llm.engine
        # A long-running server keeps no finished request's record and only the last few step records.
        self.engine.metrics.retain(finished_requests=False, max_steps=max_step_records)
        self.max_num_queued_reqs = max_num_queued_reqs
        self.num_in_flight = 0
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self.engine.run_forever, args=(self._stop,), daemon=True,
                                        name="minillm-engine")
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.engine.call_soon(lambda: None)  # wake the loop if it blocks on the inbox
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests -----------------------------------------------------------------------------------
    def check_capacity(self, num_new: int) -> None:
        """Refuse at once (before anything is queued) if `num_new` more requests would exceed the cap
        (`EngineOverloaded`), or could never fit under it (`RequestTooLarge`)."""
        cap = self.max_num_queued_reqs
        if cap is not None and num_new > cap:
            raise RequestTooLarge(f"this request needs {num_new} sequences (prompts × n) and the server holds at "
                                  f"most --max-num-queued-reqs={cap} requests at once: send at most {cap} "
                                  "(fewer prompts or a smaller n)")
        if cap is not None and self.num_in_flight + num_new > cap:
            raise EngineOverloaded(f"the server holds {self.num_in_flight} requests (waiting + running) and "
                                   f"accepts at most --max-num-queued-reqs={cap}; this one needs {num_new}. "
                                   "Retry later")

    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str | None = None) -> Stream:
        """Queue each prompt with `params.n` samples, at once (or refuse: see `check_capacity`), and
        return the stream of their outputs. Choice index = prompt index × n + sample index."""
        n = params.n
        request_id = request_id or uuid.uuid4().hex
        self.check_capacity(len(prompts) * n)
        stream = Stream(self, len(prompts) * n)
        for p, ids in enumerate(prompts):
            for i in range(n):
                child_id = f"{request_id}-{p}-{i}"
                self._streams[child_id] = (stream.queue, p * n + i)
                self.num_in_flight += 1
                stream.remaining.add(child_id)
                self.engine.submit_add({"prompt_token_ids": ids}, params.for_child(i) if n > 1 else params,
                                       child_id, self._sink(child_id))
        return stream

    def _sink(self, child_id: str):
        loop = self.loop

        def sink(out: RequestOutput) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(self._deliver, child_id, out)

        return sink

    def _deliver(self, child_id: str, out: RequestOutput) -> None:  # runs on the event loop
        entry = self._streams.get(child_id)
        if entry is None:
            return
        if out.finished:
            del self._streams[child_id]
            self.num_in_flight -= 1
        q, index = entry
        q.put_nowait((child_id, index, out))

    def snapshot(self) -> dict:
        """Loop-side counters (for tests and /health): in flight, open streams."""
        return {"num_in_flight": self.num_in_flight, "num_streams": len(self._streams)}


class Stream:
    """The outputs of one HTTP request's choices: `async for index, output in stream`, then (always,
    e.g. in a `finally`) `close()`, which aborts every choice that has not finished."""

    def __init__(self, client: EngineClient, num_choices: int) -> None:
        self.client = client
        self.num_choices = num_choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining: set[str] = set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.remaining:
            child_id, index, out = await self.queue.get()
            if out.finished:
                self.remaining.discard(child_id)
            yield index, out

    async def next(self, timeout: float) -> tuple[int, RequestOutput] | None:
        """The next output, or None after `timeout` seconds without one (cancelling a queue read is safe)."""
        try:
            child_id, index, out = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None
        if out.finished:
            self.remaining.discard(child_id)
        return index, out

    def close(self) -> None:
        for child_id in self.remaining:
            self.client.engine.submit_abort(child_id)
        self.remaining.clear()
