"""What the history-recording scripts (record.py, record_sharing.py, record_pack.py) share: writing a run's history
into ``$HISTORIES`` (and its workflow ID into workflow_ids.json, which test_replay reads), waiting for a phase, the
audit and action-gate activities every operation calls (both let it go on), activities that give one fixed answer,
and running on a fresh dev server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.client import WorkflowHandle

from models.audit import AuditRecord
from models.hub import GateRequest
from models.hub import GateState
from tests.harness.temporal import start_dev_server


async def dump(handle: WorkflowHandle[Any, Any], name: str) -> None:
    history = await handle.fetch_history()
    (Path(os.environ["HISTORIES"]) / f"{name}.json").write_text(history.to_json())
    ids = Path(os.environ["HISTORIES"]) / "workflow_ids.json"
    known = json.loads(ids.read_text()) if ids.exists() else {}
    known[name] = handle.id
    ids.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")


async def until_phase(handle: WorkflowHandle[Any, Any], phase: str) -> None:
    for _ in range(400):
        if (await handle.query("state"))["phase"] == phase:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{handle.id} never reached {phase}")


@activity.defn(name="record_audit")
async def record_audit(record: AuditRecord) -> bool:
    return True


@activity.defn(name="action_gate")
async def action_gate(req: GateRequest) -> GateState:
    return GateState(held=False)


def answering(answers: dict[str, Any]) -> list[Callable[..., Awaitable[Any]]]:
    """An activity for each name of ``answers`` that answers every call with its value, whatever it is asked."""
    def answer(name: str, value: Any) -> Callable[..., Awaitable[Any]]:
        @activity.defn(name=name)
        async def fixed(*_: Any) -> Any:
            return value

        return fixed

    return [answer(name, value) for name, value in answers.items()]


def on_dev_server(record: Callable[[Client], Awaitable[None]]) -> None:
    """Run ``record`` with a client of a fresh dev server, which is shut down after."""
    async def main() -> None:
        env = await start_dev_server()
        try:
            await record(env.client)
        finally:
            await env.shutdown()

    asyncio.run(main())
