"""Both Temporal servers from the wheels run a workflow that waits on a signal, with the pydantic converter."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from pydantic import BaseModel
from temporalio import workflow
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models import search_attributes

pytestmark = pytest.mark.temporal


class Decision(BaseModel):
    approver: str
    approved: bool


class Outcome(BaseModel):
    decision: Decision | None
    timed_out: bool


@workflow.defn(sandboxed=True)
class WaitForSignal:
    def __init__(self) -> None:
        self.decision: Decision | None = None

    @workflow.signal
    def decide(self, decision: Decision) -> None:
        self.decision = decision

    @workflow.run
    async def run(self, deadline_seconds: int) -> Outcome:
        try:
            await workflow.wait_condition(lambda: self.decision is not None,
                                          timeout=timedelta(seconds=deadline_seconds))
        except TimeoutError:
            return Outcome(decision=None, timed_out=True)
        return Outcome(decision=self.decision, timed_out=False)


async def _signal_round_trip(client: Client) -> Outcome:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[WaitForSignal]):
        handle = await client.start_workflow(WaitForSignal.run, 3600, id=f"wf-{uuid.uuid4().hex[:8]}",
                                             task_queue=queue)
        await handle.signal(WaitForSignal.decide, Decision(approver="alice@acme", approved=True))
        return await handle.result()


async def test_signal_completes_under_time_skipping_server(temporal_time_skipping: WorkflowEnvironment) -> None:
    outcome = await _signal_round_trip(temporal_time_skipping.client)
    assert outcome == Outcome(decision=Decision(approver="alice@acme", approved=True), timed_out=False)


async def test_deadline_is_skipped_not_waited_for(temporal_time_skipping: WorkflowEnvironment) -> None:
    client = temporal_time_skipping.client
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[WaitForSignal]):
        # A one-day deadline completes at once: the test server skips time while the workflow only waits.
        outcome = await client.execute_workflow(WaitForSignal.run, 86400, id=f"wf-{uuid.uuid4().hex[:8]}",
                                                task_queue=queue)
    assert outcome.timed_out is True


async def test_signal_completes_under_dev_server(temporal_dev_server: WorkflowEnvironment) -> None:
    outcome = await _signal_round_trip(temporal_dev_server.client)
    assert outcome.decision is not None and outcome.decision.approver == "alice@acme"


async def test_dev_server_has_the_project_search_attributes(temporal_dev_server: WorkflowEnvironment) -> None:
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    resp = await temporal_dev_server.client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=temporal_dev_server.client.namespace))
    for key in search_attributes.ALL:
        assert key.name in resp.custom_attributes
