"""A TCP forwarder on loopback in front of a real server that can be made to stall: while stalled it holds every
byte in either direction, so calls through it hang as they do on an overloaded or unreachable dependency."""

from __future__ import annotations

import asyncio
import contextlib


class StallingProxy:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host or "127.0.0.1", int(port))
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.address = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stall(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for task in (asyncio.create_task(self._pipe(reader, up_writer)),
                     asyncio.create_task(self._pipe(up_reader, writer))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
