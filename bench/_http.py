"""A minimal HTTP/1.1 keep-alive client for load generation.

The load generator shares the machine's two cores with the server; a full-featured client (httpx costs
about 0.6 ms of CPU per request here) would measure mostly itself. This one writes a request and reads one
Content-Length-delimited response, which is all proctor's JSON endpoints send, and connects again after a
response that closes the connection (a load balancer's limit of requests a connection, say).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

__all__ = ["Connection"]


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int) -> None:
        self._reader = reader
        self._writer = writer
        self._host = host.encode()
        self._address = (host, port)

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, host, port)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        return await self.send(method, path, b"" if body is None else json.dumps(body).encode())

    async def send(self, method: str, path: str, payload: bytes) -> tuple[int, bytes]:
        """A request whose body is already encoded (or deliberately not valid JSON)."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: ".encode()
            + self._host
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
        )
        self._writer.write(head + payload)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length: int | None = None
        closes = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                closes = value.strip().lower() == b"close"
        if length is None:
            raise RuntimeError(f"{method} {path}: response without Content-Length")
        data = await self._reader.readexactly(length)
        if closes:
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(*self._address)
        return status, data

    async def json(self, method: str, path: str, body: Any = None) -> Any:
        status, data = await self.request(method, path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path} -> {status}: {data[:300]!r}")
        return json.loads(data)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
