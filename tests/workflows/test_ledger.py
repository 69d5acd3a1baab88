"""The per-policy ledger under the time-skipping server: maxNodes across operations, idempotent reservations,
and nothing lost across continue-as-new (updates can run before run() starts)."""

from __future__ import annotations

import uuid

import pytest
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.operation import LedgerInput, ReservationRequest, ReservationResult
from worker.main import workflow_runner
from workflows.ledger import PolicyLedgerWorkflow

pytestmark = pytest.mark.temporal


async def _reserve(client: Client, wf_id: str, queue: str, op: str, max_nodes: int = 2,
                   continue_after: int = 500) -> ReservationResult:
    start: WithStartWorkflowOperation[PolicyLedgerWorkflow, None] = WithStartWorkflowOperation(
        PolicyLedgerWorkflow.run, LedgerInput(cluster="c", policy="p", continue_after_updates=continue_after),
        id=wf_id, task_queue=queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING)
    return await client.execute_update_with_start_workflow(
        PolicyLedgerWorkflow.reserve, ReservationRequest(operation=op, nodes=1, max_nodes=max_nodes),
        start_workflow_operation=start)


async def test_reservations_hold_max_nodes_and_are_idempotent(temporal_time_skipping: WorkflowEnvironment) -> None:
    client = temporal_time_skipping.client
    queue, wf_id = f"q-{uuid.uuid4().hex[:6]}", f"ledger-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[PolicyLedgerWorkflow], workflow_runner=workflow_runner()):
        assert (await _reserve(client, wf_id, queue, "op-a")).granted
        assert (await _reserve(client, wf_id, queue, "op-b")).granted
        refused = await _reserve(client, wf_id, queue, "op-c")
        assert not refused.granted and refused.holders == ["op-a", "op-b"]
        assert (await _reserve(client, wf_id, queue, "op-a")).granted  # a retry, not a third node
        handle = client.get_workflow_handle_for(PolicyLedgerWorkflow.run, wf_id)
        await handle.execute_update(PolicyLedgerWorkflow.release, "op-a")
        assert (await _reserve(client, wf_id, queue, "op-c")).granted


async def test_continue_as_new_keeps_reservations(temporal_time_skipping: WorkflowEnvironment) -> None:
    client = temporal_time_skipping.client
    queue, wf_id = f"q-{uuid.uuid4().hex[:6]}", f"ledger-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[PolicyLedgerWorkflow], workflow_runner=workflow_runner()):
        for i in range(12):  # many continue-as-new cycles, with refusals in between
            result = await _reserve(client, wf_id, queue, f"op-{i}", max_nodes=2, continue_after=3)
            assert result.granted == (i < 2), result
            assert result.in_use <= 2
        handle = client.get_workflow_handle_for(PolicyLedgerWorkflow.run, wf_id)
        final = await handle.query(PolicyLedgerWorkflow.current)
        assert final.holders == ["op-0", "op-1"]
        # It really continued as new: the run in progress is not the first run.
        info = (await handle.describe()).raw_description.workflow_execution_info
        assert info.first_run_id and info.first_run_id != info.execution.run_id

