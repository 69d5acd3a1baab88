"""`kubeon-gpu ops`: list, show, approve, reject and cancel operations (Temporal visibility, queries, updates)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.service import RPCError

from models.operation import Approval, DecisionResult, OperationView, Rejection
from workflows import search_attributes as sa
from workflows.burst import BurstWorkflow


class OperationNotFound(LookupError):
    pass


class DecisionRefused(ValueError):
    """The workflow's validator refused the approval or rejection; the message says why."""


@dataclass
class OperationRow:
    workflow_id: str
    operation: str
    kind: str
    status: str
    phase: str
    policy: str
    location: str
    started: str

    @classmethod
    def header(cls) -> list[str]:
        return ["OPERATION", "KIND", "PHASE", "STATUS", "POLICY", "LOCATION", "STARTED", "WORKFLOW"]

    def cells(self) -> list[str]:
        return [self.operation, self.kind, self.phase, self.status, self.policy, self.location, self.started,
                self.workflow_id]


async def list_operations(temporal: Client, *, cluster: str | None = None, limit: int = 200) -> list[OperationRow]:
    query = f"{sa.OPERATION_KIND.name} IN ('Burst', 'Drain')"
    if cluster:
        query += f" AND {sa.CLUSTER.name} = '{cluster}'"
    rows = []
    async for wf in temporal.list_workflows(query, limit=limit):
        attrs = wf.typed_search_attributes
        started = wf.start_time.strftime("%Y-%m-%d %H:%M:%S") if isinstance(wf.start_time, datetime) else ""
        rows.append(OperationRow(
            workflow_id=wf.id, operation=attrs.get(sa.OPERATION) or "", kind=attrs.get(sa.OPERATION_KIND) or "",
            status=wf.status.name if wf.status else "", phase=attrs.get(sa.PHASE) or "",
            policy=attrs.get(sa.POLICY) or "", location=attrs.get(sa.LOCATION) or "", started=started,
        ))
    return rows


def render_table(rows: list[OperationRow]) -> str:
    table = [OperationRow.header()] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def rows_json(rows: list[OperationRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


async def resolve(temporal: Client, operation: str) -> WorkflowHandle[BurstWorkflow, object]:
    """A handle from a workflow ID (``burst/...``) or an operation ID (``op-...``)."""
    if not operation.startswith("op-"):
        handle = temporal.get_workflow_handle_for(BurstWorkflow.run, operation)
        try:
            await handle.describe()
        except RPCError as exc:
            raise OperationNotFound(f"no operation with workflow ID {operation}") from exc
        return handle
    async for wf in temporal.list_workflows(f"{sa.OPERATION.name} = '{operation}'", limit=1):
        return temporal.get_workflow_handle_for(BurstWorkflow.run, wf.id, run_id=wf.run_id)
    raise OperationNotFound(f"no operation {operation} (is the search attribute index up to date?)")


async def show(temporal: Client, operation: str) -> OperationView:
    handle = await resolve(temporal, operation)
    return await handle.query(BurstWorkflow.state)


async def _decide(temporal: Client, operation: str, update: Any, decision: Approval | Rejection) -> DecisionResult:
    handle = await resolve(temporal, operation)
    desc = await handle.describe()
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise DecisionRefused(f"operation {operation} is not running ({desc.status.name if desc.status else '?'})")
    try:
        result: DecisionResult = await handle.execute_update(update, decision)
    except WorkflowUpdateFailedError as exc:
        # The workflow's validator refused: its message says why (wrong phase, stale plan).
        raise DecisionRefused(str(getattr(exc.cause, "message", None) or exc)) from None
    return result


async def approve(temporal: Client, operation: str, approval: Approval) -> DecisionResult:
    return await _decide(temporal, operation, BurstWorkflow.approve_update, approval)


async def reject(temporal: Client, operation: str, rejection: Rejection) -> DecisionResult:
    return await _decide(temporal, operation, BurstWorkflow.reject_update, rejection)


async def cancel(temporal: Client, operation: str) -> str:
    handle = await resolve(temporal, operation)
    desc = await handle.describe()
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise DecisionRefused(f"operation {operation} is {desc.status.name if desc.status else '?'}, not running")
    await handle.cancel()
    return handle.id
