"""Approval under the time-skipping server: an unapproved proposal expires (without waiting an hour), a
rejection launches nothing, and the update validator refuses a decision in the wrong phase.

The side effects here are test activities under the production activity names (the workflow is what is
tested; the real activities are tested on the real parts elsewhere)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.hub import GateRequest, GateState
from models.operation import (
    SERVE_QUEUE_SUFFIX,
    Approval,
    AuditRecord,
    BurstInput,
    BurstResult,
    CleanupRequest,
    CleanupResult,
    GroupPlacement,
    LaunchRequest,
    LedgerReserve,
    LoadPolicyRequest,
    Offering,
    OperationSettings,
    PendingPod,
    Phase,
    PlacementRequest,
    Plan,
    PlanRequest,
    PolicySnapshot,
    Rejection,
    ReservationResult,
    WorkloadGroup,
)
from worker import ops
from worker.main import workflow_runner
from workflows.burst import BurstWorkflow

pytestmark = pytest.mark.temporal


@dataclass
class Recorded:
    audit: list[AuditRecord] = field(default_factory=list)
    launches: list[LaunchRequest] = field(default_factory=list)
    cleanups: list[CleanupRequest] = field(default_factory=list)
    # The hub's hold (R2.3): set while "the hub rejects the token"; cleared to let held operations go on.
    hold: str = ""
    released: asyncio.Event = field(default_factory=asyncio.Event)
    gate_checks: list[str] = field(default_factory=list)

    def serve_activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="await_actions_allowed")
        async def await_actions_allowed(req: GateRequest) -> GateState:
            await self.released.wait()
            return GateState(held=False)

        return [await_actions_allowed]

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="action_gate")
        async def action_gate(req: GateRequest) -> GateState:
            self.gate_checks.append(req.policy)
            return GateState(held=bool(self.hold), reason=self.hold)

        @activity.defn(name="load_policy")
        async def load_policy(req: LoadPolicyRequest) -> PolicySnapshot:
            return PolicySnapshot(name=req.policy, mode="Approve", tolerate="gpu.kubeon.io/burst",
                                  locations=["sim/eu-west"], max_nodes=2, max_gpu_hour=4.5, return_home=True)

        @activity.defn(name="plan_burst")
        async def plan_burst(req: PlanRequest) -> Plan:
            offer = Offering(location="sim/eu-west", instance_type="sim.l4.1", gpus=1, gpu_product="NVIDIA-L4",
                             instance_usd_per_hour=0.9, transfer_usd_per_gpu_hour=0.01)
            return Plan(plan_id="plan-1", policy=req.policy, gpus_needed=1, candidates=[offer])

        @activity.defn(name="record_audit")
        async def record_audit(record: AuditRecord) -> bool:
            self.audit.append(record)
            return True

        @activity.defn(name="launch_instance")
        async def launch_instance(req: LaunchRequest) -> None:
            self.launches.append(req)
            raise RuntimeError("must not launch")

        @activity.defn(name="request_capacity")
        async def request_capacity(req: LedgerReserve) -> None:
            # Stands in for the ledger: grants at once, by the same signal.
            await activity.client().get_workflow_handle(req.request.reply_to).signal(
                "capacity_granted", ReservationResult(granted=True, in_use=1, max_nodes=2,
                                                      operation=req.request.operation))

        @activity.defn(name="group_placement")
        async def group_placement(req: PlacementRequest) -> GroupPlacement:
            return GroupPlacement(pending=len(req.group.pods))

        @activity.defn(name="cleanup_operation")
        async def cleanup_operation(req: CleanupRequest) -> CleanupResult:
            self.cleanups.append(req)
            return CleanupResult()

        return [load_policy, plan_burst, record_audit, launch_instance, request_capacity, group_placement,
                cleanup_operation, action_gate]


@pytest.fixture
async def env(temporal_time_skipping: WorkflowEnvironment) -> AsyncIterator[tuple[Client, str, Recorded]]:
    recorded = Recorded()
    queue = f"q-{uuid.uuid4().hex[:6]}"
    async with (
        Worker(temporal_time_skipping.client, task_queue=queue, workflows=[BurstWorkflow],
               activities=recorded.activities(), workflow_runner=workflow_runner()),
        Worker(temporal_time_skipping.client, task_queue=queue + SERVE_QUEUE_SUFFIX,
               activities=recorded.serve_activities()),
    ):
        yield temporal_time_skipping.client, queue, recorded


async def _start(client: Client, queue: str) -> WorkflowHandle[BurstWorkflow, BurstResult]:
    group = WorkloadGroup(namespace="ml", owner_kind="Deployment", owner_name="infer",
                          pods=[PendingPod(namespace="ml", name="infer-1", gpus=1)])
    return await client.start_workflow(
        BurstWorkflow.run,
        BurstInput(cluster="c", policy="p", group=group, settings=OperationSettings(approval_timeout_seconds=3600)),
        id=f"burst/c/p/{uuid.uuid4().hex[:8]}", task_queue=queue)


async def _awaiting(handle: WorkflowHandle[BurstWorkflow, BurstResult]) -> None:
    while (await handle.query(BurstWorkflow.state)).phase != Phase.AWAITING_APPROVAL:
        await asyncio.sleep(0.05)


async def test_unapproved_proposal_expires(env: tuple[Client, str, Recorded]) -> None:
    client, queue, recorded = env
    handle = await _start(client, queue)
    result = await handle.result()  # an hour of workflow time, skipped
    assert result.phase == Phase.EXPIRED
    assert recorded.launches == []
    assert [r.action for r in recorded.audit] == ["proposed", "expired"]


async def test_rejection_launches_nothing(env: tuple[Client, str, Recorded]) -> None:
    client, queue, recorded = env
    handle = await _start(client, queue)
    await _awaiting(handle)
    with pytest.raises(WorkflowUpdateFailedError) as stale:
        await handle.execute_update(BurstWorkflow.approve_update, Approval(approver="dave", plan_id="plan-0"))
    assert "plan plan-0 is stale" in str(stale.value.cause)
    decided = await handle.execute_update(BurstWorkflow.reject_update, Rejection(approver="carol", reason="cost"))
    assert "carol" in decided.message
    result = await handle.result()
    assert result.phase == Phase.REJECTED
    assert recorded.launches == []
    # A decision after the fact is refused with a clear message.
    with pytest.raises(ops.DecisionRefused, match="not running"):
        await ops.approve(client, handle.id, Approval(approver="dave"))


async def test_signal_approval_from_the_ui_needs_no_payload(env: tuple[Client, str, Recorded]) -> None:
    client, queue, recorded = env
    handle = await _start(client, queue)
    await _awaiting(handle)
    await handle.signal("approve")  # what `temporal workflow signal --name approve` sends
    result = await handle.result()
    # Approved, then the (test) launch refuses: the operation fails after compensation, with the approval kept.
    assert result.phase == Phase.FAILED
    assert recorded.launches and recorded.launches[0].offering.location == "sim/eu-west"
    assert "approved" in [r.action for r in recorded.audit]
    # Compensation looked for anything the failed launch might have left, by operation tag.
    assert [c.operation for c in recorded.cleanups] == [recorded.launches[0].operation]


async def test_hub_hold_keeps_an_approved_operation_from_launching_until_released(
        env: tuple[Client, str, Recorded]) -> None:
    client, queue, recorded = env
    recorded.hold = "hub rejected this cluster's token (revoked or unknown)"
    handle = await _start(client, queue)
    await _awaiting(handle)
    await ops.approve(client, handle.id, Approval(approver="erin"))
    while (view := await handle.query(BurstWorkflow.state)).phase != Phase.HELD:
        await asyncio.sleep(0.05)
    assert "revoked" in view.message
    assert recorded.launches == [] and recorded.gate_checks == ["p"]
    # A valid token again: the operation goes on where it was, to the (test) launch.
    recorded.hold = ""
    recorded.released.set()
    result = await handle.result()
    assert recorded.launches  # the test launch refuses (and is retried); compensation follows as usual
    assert result.phase == Phase.FAILED
    actions = [r.action for r in recorded.audit]
    assert actions.index("approved") < actions.index("held") < actions.index("resumed")
