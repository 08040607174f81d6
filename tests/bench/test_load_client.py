"""bench/_http.py: the benchmarks' plain HTTP client goes on after a server closes its connection."""

from __future__ import annotations

import asyncio

from bench._http import Connection


def test_a_response_that_closes_the_connection_is_followed_by_a_new_one() -> None:
    # A server that, like nginx past keepalive_requests, answers every second request of a connection with
    # "Connection: close" and then closes it.
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for n in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(v) for k, _, v in (x.partition(b":") for x in head.split(b"\r\n")) if k == b"Content-Length"
            )
            await reader.readexactly(length)
            body = b'{"n": %d}' % connections
            close = b"Connection: close\r\n" if n == 1 else b""
            writer.write(b"HTTP/1.1 200 OK\r\n" + close + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        writer.close()

    async def main() -> list[object]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            conn = await Connection.open("127.0.0.1", port)
            answers = [await conn.json("POST", "/sample", {"i": i}) for i in range(5)]
            await conn.close()
        return answers

    answers = asyncio.run(main())
    assert answers == [{"n": 1}, {"n": 1}, {"n": 2}, {"n": 2}, {"n": 3}]
    assert connections == 3
