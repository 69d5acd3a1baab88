"""The worker's background loops (the pending-pod watcher, the scale watcher) run beside the Temporal worker and
stop with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol
from typing import TypeVar


class Loop(Protocol):
    resync_seconds: float

    async def run(self) -> None: ...

    def stop(self) -> None: ...


L = TypeVar("L", bound=Loop)


@contextlib.asynccontextmanager
async def running(loop: L, *, name: str = "background-loop", cancel: bool = True,
                  grace_seconds: float = 5) -> AsyncIterator[L]:
    """Run ``loop`` as a task while the block runs; then stop it and wait for it, bounded: the loop also ends on
    its stop flag, at the latest one resync period (plus ``grace_seconds``) later. ``cancel`` interrupts it at
    once (a watch); without it, the pass under way finishes (a metrics pass that writes policy status)."""
    task = asyncio.create_task(loop.run(), name=name)
    try:
        yield loop
    finally:
        loop.stop()
        if cancel:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait([task], timeout=loop.resync_seconds + grace_seconds)
