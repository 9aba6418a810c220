"""The router's HTTP/1.1 client to its workers: kept-alive connections, answers as raw bytes (chapter 13).

    pool = UpstreamPool("http://127.0.0.1:8001")              # one per worker, for the router's life
    response = await pool.request(b"POST", b"/v1/completions", headers, body, timeout_s)
    response.status, response.headers                          # once the status line and headers are in
    chunk = await response.read_chunk()   # the body as it arrives, chunked framing removed; b"" at its end
    content = await response.read_all()   # (a plain answer)
    response.close()                      # the connection back to the pool if the answer was read whole

A hop is one request read and one written, and on a machine whose cores the engines also need,
every microsecond of the router's CPU per request is taken from them. A general-purpose client
(httpx) builds and checks URL, header, cookie and timeout objects for each request and parses the
answer in pure Python (h11); here the request head is one bytes join, the answer is parsed by
`httptools` (the C parser uvicorn already uses for the router's own side), and each body chunk goes
from the socket's callback into a queue the relay reads without copying. `bench/router.py stub`
measures the router's CPU per request.

Why our own and not a library's: measured on the course's 2-core VM, quiet (2026-12-02, `python
bench/router.py hops --rate 2 --num-prompts 60 --output-len 64`, one run each, streamed answers of 64
tokens), the router process spent 37.0 ms of CPU per request with FastAPI routes + httpx and 13.8 ms
with plain ASGI routes + this client (--data-parallel-size 2; PD 41.8 → 15.5 ms), and the TTFT it added
fell from 10.1 to 3.0 ms (DP) and from 5.5 to 3.1 ms (PD, two hops). Against aiohttp's client (the
well-kept alternative: a `ClientSession` on a kept-alive `TCPConnector`, the body streamed through with
`iter_any`), in one process, the two alternately against the stub worker (2026-12-02 18:12, 6 rounds of
15 sequential streamed answers of 64 chunks, under load: load average 3.7-5.1 from other jobs):
process CPU per request 7.67 ms with aiohttp, 5.10 ms with this client; aiohttp / this, round by round,
x1.53 [1.41-1.67], +2.7 ms [+2.0 to +3.0] per request. That is the reason this file exists.

Where the router's CPU goes per streamed request (cProfile of `minillm router` over 20 stub answers of
64 chunks): about 28 Python calls per chunk relayed, and over half the profiled time inside uvicorn's
`send`, i.e. the write of each chunk to the client's socket (a system call that also wakes the
client); what is left to cut per chunk is small.

Timeout: one timer per answer, not one per read (a stream waits once per chunk): it fires every
`timeout_s`, and expires the answer only if the router has been waiting that long since the last byte.

Connections: a request takes the most recently used idle connection to the worker (or opens one);
the answer read to its end and kept alive by the worker returns the connection to the pool, any
other end closes it (a worker whose client closes the connection aborts the request: a client
hanging up reaches the worker that way). Idle connections are not reused after `IDLE_S` (uvicorn
closes its side after 5 s), and a reused connection that closes before a byte of the answer (the
worker closed it idle just as the request went out) is retried once on a fresh connection.

Errors are `UpstreamError`s: `ConnectFailed` (refused or timed out: the worker saw nothing),
`ClosedBeforeAnswer` (the connection closed with no byte of answer), `UpstreamTimeout` (no byte for
`timeout_s`), and the plain class for a connection lost mid-answer or an answer that is not HTTP.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0  # an idle connection older than this is closed instead of reused (below uvicorn's 5 s)
MAX_IDLE = 64  # idle connections kept per worker
PAUSE_BYTES = 1 << 20  # answer bytes queued unread before the socket stops being read (a slow client)


class UpstreamError(Exception):
    """The worker's answer did not arrive whole: the connection was lost, or the bytes were not HTTP."""


class ConnectFailed(UpstreamError):
    """The connection was refused or timed out: the worker has seen nothing of the request."""


class ClosedBeforeAnswer(UpstreamError):
    """The connection closed before a byte of the answer (a worker dying as it took the request)."""


class UpstreamTimeout(UpstreamError):
    """No byte of the answer for the request's timeout."""


class UpstreamResponse:
    """One answer being read: its status and headers once in, then its body chunks."""

    __slots__ = ("_conn", "_loop", "_timeout_s", "status", "headers", "keep_alive", "done", "_headers_in",
                 "_any_bytes", "_framed", "_chunks", "_queued", "_error", "_waiter", "_timer", "_quiet_since")

    def __init__(self, conn: _Connection, timeout_s: float) -> None:
        self._conn = conn
        self._loop = conn.loop
        self._timeout_s = timeout_s
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.done = False  # the whole answer has been received
        self._headers_in = self._any_bytes = self._framed = False
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        # One timer for the whole answer, not one per wait (a streamed answer waits once per chunk): it fires
        # every `timeout_s` and expires the answer only if the router has been waiting for a byte that long.
        self._quiet_since = self._loop.time()  # the later of the last byte in and the start of the current wait
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(timeout_s, self._check_quiet)

    # ---- fed by the connection ---------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headers_done(self, status: int, keep_alive: bool) -> None:
        self.status, self.keep_alive, self._headers_in = status, keep_alive, True
        self._framed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.headers)
        self._wake()

    def _data(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if self._queued > PAUSE_BYTES:
            self._conn.pause()
        waiter = self._waiter  # (`_wake`, inlined: this runs once per chunk of every stream)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _complete(self) -> None:
        self.done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self.done and self._error is None:
            self._error = error
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        if self._headers_in and not self._framed and not self.done:
            self.done = True  # an answer with neither length nor chunks ends where the connection does
        elif not self._any_bytes:
            self._fail(ClosedBeforeAnswer(f"the connection closed before any answer ({exc or 'EOF'})"))
        else:
            self._fail(UpstreamError(f"the connection closed in the middle of the answer ({exc or 'EOF'})"))
        self._wake()

    def _check_quiet(self) -> None:
        if self.done or self._error is not None:
            self._timer = None
            return
        now = self._loop.time()
        if self._waiter is None:  # the router is not waiting for the worker (a slow client): not a timeout
            self._quiet_since = now
        elif now - self._quiet_since >= self._timeout_s:
            self._timer = None
            self._fail(UpstreamTimeout(f"no answer for {self._timeout_s:g} s"))
            if self._conn is not None:
                self._conn.abort()  # a half-read answer leaves the connection unusable
            return
        self._timer = self._loop.call_at(self._quiet_since + self._timeout_s, self._check_quiet)

    # ---- read by the router ------------------------------------------------------------------------
    async def _wait(self) -> None:
        self._quiet_since = self._loop.time()
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def _wait_headers(self) -> None:
        while not self._headers_in:
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def at_end(self) -> bool:
        """The answer is complete and every byte of it has been read."""
        return self.done and not self._chunks

    async def read_chunk(self) -> bytes:
        """The body bytes received since the last call (waits for some), as the worker sent them less the
        chunked framing; b"" once the answer is complete and read."""
        chunks = self._chunks
        while not chunks:
            if self.done:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join([chunks.popleft() for _ in range(len(chunks))])
        self._queued = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return chunk

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """The connection back to its pool if the answer was read to its end and may be kept alive; else closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.response = None
        if self.done and self.keep_alive and self._error is None and not conn.closed:
            conn.resume()
            conn.pool._put_back(conn)
        else:
            conn.abort()


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker; httptools parses what arrives and feeds the current response."""

    __slots__ = ("pool", "loop", "parser", "transport", "response", "closed", "paused", "_interim", "idle_since")

    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.loop = pool, loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = self.paused = self._interim = False
        self.idle_since = 0.0

    def send(self, data: bytes, response: UpstreamResponse) -> None:
        self.response = response
        self.transport.write(data)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # ---- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        response._any_bytes = True
        response._quiet_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            response._fail(UpstreamError(f"the worker's answer is not HTTP/1.1 ({type(err).__name__}: {err})"))
            self.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.response is not None:
            self.response._lost(exc)

    # ---- httptools callbacks -------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._interim = True
            self.response.headers.clear()
            return
        self.response._headers_done(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response._data(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.response._complete()


class UpstreamPool:
    """Kept-alive connections to one worker (its root URL: http:// or https://, host, port, a path prefix)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a worker URL is http://host:port or https://host:port, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/").encode()
        self.host_header = parts.netloc.encode()
        self.idle: list[_Connection] = []  # most recently used last
        self.opened = 0  # connections made so far

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.abort()
        return None

    def _put_back(self, conn: _Connection) -> None:
        if len(self.idle) >= MAX_IDLE:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    async def _connect(self, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, loop), self.host, self.port, ssl=self.ssl),
                timeout_s)
        except (OSError, asyncio.TimeoutError) as err:
            raise ConnectFailed(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        self.opened += 1
        return conn

    async def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                      timeout_s: float) -> UpstreamResponse:
        """Send one request (`headers` without host, content-length or hop-by-hop ones); its response once the
        status line and headers are in. The caller reads the body and must `close()` the response."""
        lines = [method, b" ", self.prefix, path, b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n"]
        if body or method == b"POST":
            lines += [b"content-length: ", b"%d" % len(body), b"\r\n"]
        for name, value in headers:
            lines += [name, b": ", value, b"\r\n"]
        lines += [b"\r\n", body]
        data = b"".join(lines)
        for attempt in range(2):
            conn = self._take()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(timeout_s)
            response = UpstreamResponse(conn, timeout_s)
            conn.send(data, response)
            try:
                await response._wait_headers()
            except ClosedBeforeAnswer:
                response.close()
                if reused and attempt == 0:
                    continue  # the worker closed an idle connection as the request went out: a fresh one
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the idle connections (at the router's shutdown)."""
        while self.idle:
            self.idle.pop().abort()
