"""Histories written by the code before the operation skeleton (workflows/operation.py) replay on today's
workflows without a nondeterminism error: a worker deployed while operations run picks them up where they are.

``histories/`` holds runs made by the earlier code on the time-skipping server with test activities: a
provisioning whose approved node failed and whose pod went, one whose proposal was rejected by signal, that
node's BurstNode run, a ScaleToZero approved, scaled to zero and woken, and one open in Recommend mode, its
proposal set again each minute (the case ``PHASE_ON_CHANGE`` keeps: that code upserted KubeonPhase at every set).
Two of them were still running when written. ``sharing-*``: TimeSlicing and Mig runs of main at df6e5f1
(histories/record_sharing.py), a time-slicing key written and one found there, a MIG change undone and one
failed. ``pack-*``: PackWorkflow rounds of main at 46d06a2 (histories/record_pack.py), before rounds were audited
and cordoned every planned node first: two nodes emptied, one stopped by a pod not re-placed, one rejected (without
the pack-cordon-all patch the first two fail with a nondeterminism error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from models.converter import DATA_CONVERTER
from worker.main import WORKFLOWS
from worker.main import workflow_runner

HISTORIES = Path(__file__).parent / "histories"
WORKFLOW_IDS: dict[str, str] = json.loads((HISTORIES / "workflow_ids.json").read_text())  # IDs feed batch IDs


@pytest.mark.parametrize("name", sorted(WORKFLOW_IDS))
async def test_a_history_of_the_earlier_code_replays(name: str) -> None:
    history = WorkflowHistory.from_json(WORKFLOW_IDS[name], (HISTORIES / f"{name}.json").read_text())
    replayer = Replayer(workflows=WORKFLOWS, data_converter=DATA_CONVERTER, workflow_runner=workflow_runner())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{name}: {result.replay_failure}"
