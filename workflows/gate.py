"""The hub's hold (R2.3), shared by burst and drain operations: while the hub rejects this cluster's token a
policy's operations take no action (no launch, no drain started, no eviction) and hold where they are. The
hub sync marks the policies; an operation checks just before acting and waits, in one heartbeating activity
on the serve queue (a short history, no worker slot), until a valid token is mounted."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

from models.hub import GateRequest
from models.hub import GateState
from models.ids import SERVE_QUEUE_SUFFIX
from workflows.failures import RETRY


async def action_gate(policy: str) -> GateState:
    # Local: one read of the policy's status just before acting, in the worker that runs the operation (no
    # round-trip through the task queue, one marker event instead of three). The wait, when held, is not local.
    return await workflow.execute_local_activity(
        "action_gate", GateRequest(policy=policy), result_type=GateState,
        start_to_close_timeout=timedelta(seconds=10), retry_policy=RETRY, summary="hub hold check")


async def wait_until_allowed(policy: str) -> None:
    await workflow.execute_activity(
        "await_actions_allowed", GateRequest(policy=policy), result_type=GateState,
        task_queue=workflow.info().task_queue + SERVE_QUEUE_SUFFIX, start_to_close_timeout=timedelta(days=365),
        heartbeat_timeout=timedelta(seconds=60), retry_policy=RETRY)
