"""The operation workflows' skeleton (workflows/operation.py): the approval handlers a workflow inherits from
Approvable are registered and answer on the real (time-skipping) server, refusals carry no stack trace, the phase
bookkeeping writes KubeonPhase, history lines and details only on change; the names a running history may hold
are all still registered; a batch's phase follows its nodes."""

from __future__ import annotations

import asyncio
import uuid
from enum import StrEnum
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import FailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.workflow import _Definition

from models import search_attributes as sa
from models.decisions import Approval
from models.decisions import Rejection
from models.provisioning import BatchPhase
from models.provisioning import BatchPlan
from models.provisioning import BatchRecord
from worker.main import WORKFLOWS
from worker.main import workflow_runner
from workflows.burst import BurstNodeWorkflow
from workflows.drain import DrainWorkflow
from workflows.gpu_products import GpuProductsWorkflow
from workflows.hub_sync import HubSyncWorkflow
from workflows.operation import Approvable
from workflows.operation import Proposal
from workflows.pack import PackWorkflow
from workflows.provision import ProvisionWorkflow
from workflows.scale import ScaleWorkflow
from workflows.sharing import MigWorkflow
from workflows.sharing import TimeSlicingWorkflow


class ToyPhase(StrEnum):
    AWAITING_APPROVAL = "AwaitingApproval"
    DONE = "Done"
    REJECTED = "Rejected"


@workflow.defn(name="ToyOperation", sandboxed=False)
class ToyOperation(Approvable[ToyPhase, None]):
    """The least an operation kind writes: what awaits, its details, its run. Every handler is the base's."""

    KIND = "Toy"

    def __init__(self) -> None:
        super().__init__(ToyPhase.AWAITING_APPROVAL)
        self.operation = "op-toy"

    def _awaiting(self) -> Proposal | None:
        if self.phase != ToyPhase.AWAITING_APPROVAL:
            return None
        return Proposal(operation=self.operation, plan_id="plan-1", summary="doing the toy thing")

    def _details(self) -> str:
        decided = "approved" if self.approval else "rejected" if self.rejection else "open"
        return f"**Phase:** {self.phase.value} — {self._message()} ({decided})"

    @workflow.query(name="state")
    def state(self) -> dict[str, Any]:
        return {"phase": self.phase.value, "message": self._message(), "history": list(self.history)}

    @workflow.run
    async def run(self) -> str:
        self._start(sa.OPERATION_KIND.value_set(self.KIND), sa.OPERATION.value_set(self.operation))
        for _ in range(3):  # set again and again, as a loop does: written once
            self._set_phase(ToyPhase.AWAITING_APPROVAL, "proposed")
        await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None)
        if self.rejection is not None:
            self._set_phase(ToyPhase.REJECTED, f"rejected by {self.rejection.approver}")
        else:
            assert self.approval is not None
            self._set_phase(ToyPhase.DONE, f"approved by {self.approval.approver}")
        await workflow.sleep(60)  # a decision after the phase moved on is refused
        return self.phase.value


def _names(cls: type) -> dict[str, Any]:
    defn = _Definition.must_from_class(cls)
    return {"type": defn.name, "signals": set(defn.signals), "queries": set(defn.queries),
            "updates": set(defn.updates)}


def test_every_name_a_running_history_may_hold_is_still_registered() -> None:
    """Workflow types, signals, queries and updates as running histories (and the CLI, hub and watchers) name them;
    the approval handlers now come from Approvable for Provision and Scale alike."""
    decisions = {"approve", "reject"}
    assert _names(ProvisionWorkflow) == {
        "type": "Provision", "signals": {"pods_waiting", "pods_gone", "node_finished", *decisions},
        "queries": {"state"}, "updates": {"approve_plan", "reject_plan"}}
    assert _names(ScaleWorkflow) == {
        "type": "ScaleWorkflow", "signals": {"wake", *decisions}, "queries": {"state"},
        "updates": {"approve_plan", "reject_plan", "wake"}}
    assert _names(BurstNodeWorkflow) == {"type": "BurstNode", "signals": set(), "queries": {"state"},
                                         "updates": set()}
    assert _names(DrainWorkflow) == {"type": "DrainWorkflow", "signals": set(), "queries": {"status"},
                                     "updates": set()}
    assert _names(HubSyncWorkflow) == {"type": "HubSync", "signals": {"report", "sync_now", "configure"},
                                       "queries": {"status"}, "updates": set()}
    assert _names(TimeSlicingWorkflow) == {
        "type": "TimeSlicing", "signals": {"undo", "policy_mode", *decisions}, "queries": {"state"},
        "updates": {"approve_plan", "reject_plan", "undo"}}
    assert _names(MigWorkflow) == {
        "type": "Mig", "signals": {"undo", "policy_mode", *decisions}, "queries": {"state"},
        "updates": {"approve_plan", "reject_plan", "undo"}}
    assert _names(PackWorkflow) == {
        "type": "PackWorkflow", "signals": set(decisions), "queries": {"state"},
        "updates": {"approve_plan", "reject_plan"}}
    assert _names(GpuProductsWorkflow) == {
        "type": "GpuProducts", "signals": set(decisions), "queries": {"state"},
        "updates": {"approve_plan", "reject_plan"}}
    assert {_Definition.must_from_class(w).name for w in WORKFLOWS} == {
        "Provision", "BurstNode", "DrainWorkflow", "ScaleWorkflow", "HubSync", "TimeSlicing", "Mig", "PackWorkflow",
        "GpuProducts"}


@pytest.mark.temporal
async def test_inherited_approval_handlers_refuse_without_a_stack_trace_and_bookkeeping_writes_on_change(
        temporal_time_skipping: WorkflowEnvironment) -> None:
    client = temporal_time_skipping.client
    queue = f"toy-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[ToyOperation], workflow_runner=workflow_runner()):
        handle = await client.start_workflow(ToyOperation.run, id=f"toy/{uuid.uuid4().hex[:6]}", task_queue=queue)
        for _ in range(200):
            state = await handle.query(ToyOperation.state)
            if state["history"]:
                break
            await asyncio.sleep(0.05)

        async def refused(approval: Approval) -> str:
            with pytest.raises(WorkflowUpdateFailedError) as err:
                await handle.execute_update(ToyOperation.approve_update, approval)
            cause = err.value.cause
            assert isinstance(cause, FailureError)
            assert cause.failure is not None and cause.failure.stack_trace == ""  # an answer, not a crash
            return cause.message

        assert "plan plan-0 is stale: operation op-toy now proposes plan-1 (doing the toy thing)" in await refused(
            Approval(approver="dave", plan_id="plan-0"))
        assert "operation op-other is not awaiting approval (operation op-toy is)" in await refused(
            Approval(approver="dave", operation="op-other"))
        assert "approver must name who approves" in await refused(Approval(approver=" "))
        await handle.signal(ToyOperation.approve_signal, Approval(approver="eve", plan_id="plan-0"))  # stale: ignored
        decided = await handle.execute_update(ToyOperation.approve_update,
                                              Approval(approver="alice", plan_id="plan-1", operation="op-toy"))
        assert decided.operation == "op-toy" and decided.message == "approved by alice: doing the toy thing"
        assert "not awaiting approval" in await refused(Approval(approver="dave"))
        with pytest.raises(WorkflowUpdateFailedError) as late:
            await handle.execute_update(ToyOperation.reject_update, Rejection(approver="dave"))
        assert "operation op-toy is Done, not awaiting approval" in str(late.value.cause)
        assert await handle.result() == "Done"

        state = await handle.query(ToyOperation.state)
        assert [line.split(" ", 1)[1] for line in state["history"]] == [
            "AwaitingApproval: proposed", "Done: approved by alice"]
        events = [e async for e in handle.fetch_history_events()]
        upserts = [e for e in events if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES]
        # The start, then KubeonPhase once per phase: AwaitingApproval (set three times), Done.
        assert len(upserts) == 3, upserts
        desc = await handle.describe()
        assert desc.typed_search_attributes.get(sa.PHASE) == "Done"
        meta = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
        assert meta.current_details == "**Phase:** Done — approved by alice (approved)"


def test_a_batch_ends_with_what_became_of_its_nodes() -> None:
    """Launching while any node runs; then Completed (one served at least) or Failed (none did, one failed)."""
    plan = BatchPlan(plan_id="plan-1", batch="op-1", policy="p")
    record = BatchRecord(batch="op-1", phase=BatchPhase.PLANNING, plan=plan, nodes=["n0", "n1"])
    record.launched()
    assert (record.phase, record.message) == (BatchPhase.LAUNCHING, "2 node(s) started")
    assert not record.node_ended("elsewhere", "Failed")
    assert not record.node_ended("n0", "Failed")
    assert (record.phase, record.message) == (BatchPhase.LAUNCHING, "2 node(s) started; 1 ended: 1 Failed")
    assert record.node_ended("n1", "Completed")
    assert (record.phase, record.message) == (BatchPhase.COMPLETED, "its 2 node(s) ended: 1 Completed, 1 Failed")
    assert not record.node_ended("n1", "Completed")  # told twice: counted once

    failed = BatchRecord(batch="op-2", phase=BatchPhase.PLANNING, plan=plan, nodes=["n0", "n1"])
    failed.launched()
    failed.node_ended("n0", "Cancelled")
    assert failed.node_ended("n1", "Failed")
    assert (failed.phase, failed.message) == (BatchPhase.FAILED, "its 2 node(s) ended: 1 Cancelled, 1 Failed")

    empty = BatchRecord(batch="op-3", phase=BatchPhase.PLANNING, plan=plan)
    empty.launched()  # every pod went while it was approved: no node started
    assert empty.phase == BatchPhase.COMPLETED
