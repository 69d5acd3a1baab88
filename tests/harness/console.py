"""The Temporal UI behind `kubeon-gpu console`, for the browser tests: a dev server with its UI and the
project's search attributes, and the console in-process on a loopback port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from temporalio.testing import WorkflowEnvironment

from tests.harness.controlplane import free_port
from tests.harness.temporal import start_dev_server
from worker.console import ConsoleSettings
from worker.console import create_app


@asynccontextmanager
async def ui_dev_server() -> AsyncIterator[tuple[WorkflowEnvironment, str]]:
    """The CLI dev server with its Web UI: (the environment, the UI's URL)."""
    ui_port = free_port()
    env = await start_dev_server(ui_port=ui_port)
    try:
        yield env, f"http://127.0.0.1:{ui_port}"
    finally:
        await env.shutdown()


@asynccontextmanager
async def console_server(upstream: str) -> AsyncIterator[str]:
    """`kubeon-gpu console` in front of ``upstream``: its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ConsoleSettings(upstream=upstream)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
