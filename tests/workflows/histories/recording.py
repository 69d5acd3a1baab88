"""What the history-recording scripts (record_sharing.py, record_pack.py) share: writing a run's history into
``$HISTORIES`` (and its workflow ID into workflow_ids.json, which test_replay reads), and waiting for a phase."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle


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


