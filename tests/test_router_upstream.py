"""The router's HTTP/1.1 client (`minillm.router.upstream`) against raw asyncio servers that write exact bytes.

Checked: a connection is kept alive and reused for sequential requests; a chunked body comes back as the
server's pieces (framing removed), a sized one and one that ends with the connection too; a reused
connection the server closes before answering is retried once on a fresh one, while a fresh one closed
that way is `ClosedBeforeAnswer`; a refused connection is `ConnectFailed`, a silent server
`UpstreamTimeout` (a worker silent for the timeout, not one whose answer takes longer, nor a router that
reads late), a connection lost mid-answer a plain `UpstreamError`; an answer not read to its end closes its
connection. No model, no uvicorn: about two seconds.
"""

from __future__ import annotations

import asyncio

import pytest

from minillm.router.launch import free_port
from minillm.router.upstream import (
    ClosedBeforeAnswer,
    ConnectFailed,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)

CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"7\r\ndata: a\r\n" b"b\r\n\n\ndata: b\n\n\r\n" b"0\r\n\r\n")
SIZED = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """(head, body) of one request, or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


async def server(script):
    """A server on a free port whose connection handler is `script(reader, writer, index of the connection)`."""
    count = [0]

    async def handle(reader, writer):
        count[0] += 1
        try:
            await script(reader, writer, count[0])
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", count


def test_kept_alive_and_the_three_ways_a_body_ends():
    seen = []

    async def script(reader, writer, _):
        while (request := await read_request(reader)) is not None:
            seen.append(request)
            answer = {b"/chunked": CHUNKED, b"/sized": SIZED, b"/close": UNTIL_CLOSE}[request[0].split(b" ")[1]]
            writer.write(answer)
            if answer is UNTIL_CLOSE:
                return

    async def main():
        srv, url, connections = await server(script)
        pool = UpstreamPool(url)
        r = await pool.request(b"POST", b"/chunked", [(b"x-custom", b"kept")], b'{"p": "\xc3\xa9"}', 5)
        assert r.status == 200 and (b"content-type", b"text/event-stream") in r.headers
        assert await r.read_all() == b"data: a\n\ndata: b\n\n" and r.at_end
        r.close()
        r = await pool.request(b"POST", b"/sized", [], b"{}", 5)
        assert (r.status, await r.read_all()) == (201, b'{"a":1}')
        r.close()
        assert connections[0] == 1 and pool.opened == 1  # the same connection, kept alive
        r = await pool.request(b"POST", b"/close", [], b"", 5)
        assert await r.read_all() == b"all of it"
        r.close()
        assert not pool.idle  # the server said close: not kept
        srv.close()
        head, body = seen[0]
        assert body == b'{"p": "\xc3\xa9"}' and b"\r\nx-custom: kept\r\n" in head
        assert b"\r\ncontent-length: %d\r\n" % len(body) in head

    asyncio.run(main())


def test_a_reused_connection_closed_before_an_answer_is_retried_once_a_fresh_one_is_not():
    async def closes_its_second_request(reader, writer, _):
        await read_request(reader)
        writer.write(SIZED)
        await read_request(reader)  # the second request on this connection: closed unanswered

    async def closes_at_once(reader, writer, _):
        await read_request(reader)

    async def main():
        srv, url, connections = await server(closes_its_second_request)
        pool = UpstreamPool(url)
        for _ in range(2):
            r = await pool.request(b"POST", b"/", [], b"{}", 5)
            assert await r.read_all() == b'{"a":1}'
            r.close()
        assert connections[0] == pool.opened == 2  # the second request went out again, on a new connection
        pool.close()
        srv.close()
        srv, url, _ = await server(closes_at_once)
        with pytest.raises(ClosedBeforeAnswer):
            await UpstreamPool(url).request(b"POST", b"/", [], b"{}", 5)
        srv.close()

    asyncio.run(main())


def test_refused_silent_and_cut_off_workers():
    async def silent(reader, writer, _):
        await read_request(reader)
        await asyncio.sleep(5)

    async def cut_off(reader, writer, _):
        await read_request(reader)
        writer.write(CHUNKED[:CHUNKED.index(b"b\r\n")])  # the first piece, then the connection ends

    async def main():
        with pytest.raises(ConnectFailed):
            await UpstreamPool(f"http://127.0.0.1:{free_port()}").request(b"POST", b"/", [], b"", 5)
        srv, url, _ = await server(silent)
        with pytest.raises(UpstreamTimeout):
            await UpstreamPool(url).request(b"POST", b"/", [], b"", 0.2)
        srv.close()
        srv, url, _ = await server(cut_off)
        r = await UpstreamPool(url).request(b"POST", b"/", [], b"", 5)
        assert await r.read_chunk() == b"data: a"
        with pytest.raises(UpstreamError) as err:
            await r.read_chunk()
        assert type(err.value) is UpstreamError and "middle of the answer" in str(err.value)
        r.close()
        srv.close()

    asyncio.run(main())


def test_the_timeout_is_for_a_silent_worker_not_a_long_answer_or_a_slow_reader():
    async def trickle(reader, writer, _):  # a chunk every 0.1 s for 0.8 s in all, then silence
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
        await asyncio.sleep(5)

    async def late_body(reader, writer, _):  # the head at once, the body 0.7 s later
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        await asyncio.sleep(0.7)
        writer.write(b"late")

    async def main():
        srv, url, _ = await server(trickle)
        r = await UpstreamPool(url).request(b"POST", b"/", [], b"", 0.5)
        got = b""
        with pytest.raises(UpstreamTimeout):
            while True:
                got += await r.read_chunk()
        assert got == b"x" * 8  # the whole trickle (longer than the timeout), then the silence timed out
        r.close()
        srv.close()
        srv, url, _ = await server(late_body)
        r = await UpstreamPool(url).request(b"POST", b"/", [], b"", 0.3)
        await asyncio.sleep(0.6)  # the router not reading (a slow client) is not the worker's silence
        assert await r.read_all() == b"late"
        r.close()
        srv.close()

    asyncio.run(main())


def test_an_answer_not_read_to_its_end_closes_its_connection():
    async def script(reader, writer, _):
        while await read_request(reader) is not None:
            writer.write(CHUNKED[:CHUNKED.index(b"0\r\n")])  # a stream that has not ended yet

    async def main():
        srv, url, connections = await server(script)
        pool = UpstreamPool(url)
        for _ in range(2):
            r = await pool.request(b"POST", b"/", [], b"", 5)
            assert await r.read_chunk()
            r.close()  # (a client hung up): the worker must see its connection close
        assert not pool.idle and pool.opened == connections[0] == 2
        srv.close()

    asyncio.run(main())
