"""Approve or reject an operation: one code path for the CLI (`kubeon-gpu ops approve`) and for approvals pulled
from the hub, so both are refused for the same reasons (the workflow's update validator: wrong phase, stale plan).
"""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.client import WorkflowExecutionStatus
from temporalio.client import WorkflowHandle
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError
from temporalio.service import RPCStatusCode

from models import search_attributes as sa
from models.decisions import Approval
from models.decisions import DecisionResult
from models.decisions import Rejection

APPROVE_UPDATE = "approve_plan"
REJECT_UPDATE = "reject_plan"


class OperationNotFound(LookupError):
    pass


class DecisionRefused(ValueError):
    """The workflow's validator refused the approval or rejection; the message says why."""


async def resolve(temporal: Client, operation: str) -> WorkflowHandle[Any, Any]:
    """A handle from a workflow ID (``burst/...``) or an operation ID (``op-...``)."""
    if not operation.startswith("op-"):
        handle = temporal.get_workflow_handle(operation)
        try:
            await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise OperationNotFound(f"no operation with workflow ID {operation}") from exc
            raise
        return handle
    async for wf in temporal.list_workflows(f"{sa.OPERATION.name} = '{operation}'", limit=1):
        return temporal.get_workflow_handle(wf.id, run_id=wf.run_id)
    raise OperationNotFound(f"no operation {operation} (is the search attribute index up to date?)")


async def decide(temporal: Client, operation: str, decision: Approval | Rejection) -> DecisionResult:
    handle = await resolve(temporal, operation)
    desc = await handle.describe()
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise DecisionRefused(f"operation {operation} is not running ({desc.status.name if desc.status else '?'})")
    if operation.startswith("op-") and decision.operation is None:
        # Named by its batch (operation) ID: the approval is for that batch only, never a later proposal.
        decision = decision.model_copy(update={"operation": operation})
    update = APPROVE_UPDATE if isinstance(decision, Approval) else REJECT_UPDATE
    try:
        return await handle.execute_update(update, decision, result_type=DecisionResult)
    except WorkflowUpdateFailedError as exc:
        # The workflow's validator refused: its message says why (wrong phase, stale plan).
        raise DecisionRefused(str(getattr(exc.cause, "message", None) or exc)) from None
