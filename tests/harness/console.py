"""The Temporal UI behind `kubeon-gpu console`, for the browser tests: a dev server with its UI and the
project's search attributes, and the console in-process on a loopback port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from temporalio.testing import WorkflowEnvironment

from models import search_attributes as sa
from models.converter import DATA_CONVERTER
from tests.harness.controlplane import free_port
from tests.harness.temporal import dev_server_path
from worker.console import ConsoleSettings, create_app


@asynccontextmanager
async def ui_dev_server() -> AsyncIterator[tuple[WorkflowEnvironment, str]]:
    """The CLI dev server with its Web UI: (the environment, the UI's URL)."""
    ui_port = free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(dev_server_path()), data_converter=DATA_CONVERTER, ui=True, ui_port=ui_port,
        search_attributes=list(sa.ALL), dev_server_log_level="error")
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
