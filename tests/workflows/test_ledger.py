"""The per-policy ledger on the dev server (real continue-as-new semantics: a signal that races the
continue-as-new is kept for the next run): maxNodes across operations, first come first served,
idempotent requests, grants to whoever is next when a node frees, and nothing lost across continue-as-new
(signals can be handled before run() starts)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.burst import signal_ledger
from models.operation import ReservationRequest, ReservationResult, ledger_workflow_id
from worker.main import workflow_runner
from workflows.ledger import GRANTED_SIGNAL, PolicyLedgerWorkflow

pytestmark = pytest.mark.temporal


@workflow.defn(name="LedgerTestRequester", sandboxed=False)
class Requester:
    """Stands in for a BurstWorkflow: waits for its grant, then runs until told it is done."""

    def __init__(self) -> None:
        self.grant: ReservationResult | None = None
        self.done = False

    @workflow.signal(name=GRANTED_SIGNAL)
    def granted(self, grant: ReservationResult) -> None:
        self.grant = grant

    @workflow.signal(name="done")
    def finish(self) -> None:
        self.done = True

    @workflow.query(name="grant")
    def current(self) -> ReservationResult | None:
        return self.grant

    @workflow.run
    async def run(self) -> ReservationResult:
        await workflow.wait_condition(lambda: self.grant is not None and self.done)
        assert self.grant is not None
        return self.grant


@pytest.fixture
async def ledger_env(temporal_dev_server: WorkflowEnvironment) -> AsyncIterator[tuple[Client, str, str]]:
    client = temporal_dev_server.client
    queue, policy = f"q-{uuid.uuid4().hex[:6]}", f"p-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[PolicyLedgerWorkflow, Requester],
                      workflow_runner=workflow_runner()):
        yield client, queue, policy


async def _request(client: Client, queue: str, policy: str, op: str, max_nodes: int = 2
                   ) -> WorkflowHandle[Requester, ReservationResult]:
    handle = await client.start_workflow(Requester.run, id=f"req-{policy}-{op}", task_queue=queue)
    req = ReservationRequest(operation=op, nodes=1, max_nodes=max_nodes, reply_to=handle.id)
    await signal_ledger(client, queue, "c", policy, "request", req)
    return handle


async def _granted(handle: WorkflowHandle[Requester, ReservationResult]) -> bool:
    return await handle.query(Requester.current) is not None


async def _grant(handle: WorkflowHandle[Requester, ReservationResult]) -> ReservationResult:
    async def wait() -> ReservationResult:
        while (grant := await handle.query(Requester.current)) is None:
            await asyncio.sleep(0.05)
        return grant

    return await asyncio.wait_for(wait(), 30)


async def test_max_nodes_first_come_first_served(ledger_env: tuple[Client, str, str]) -> None:
    client, queue, policy = ledger_env
    a, b = await _request(client, queue, policy, "op-a"), await _request(client, queue, policy, "op-b")
    c, d = await _request(client, queue, policy, "op-c"), await _request(client, queue, policy, "op-d")
    assert (await _grant(a)).granted and (await _grant(b)).granted
    ledger = client.get_workflow_handle(ledger_workflow_id("c", policy))
    state = await ledger.query(PolicyLedgerWorkflow.current)
    assert state.holders == ["op-a", "op-b"] and state.waiting == ["op-c", "op-d"]
    assert state.in_use == 2
    assert not await _granted(c) and not await _granted(d)

    # A retried request is granted again, not twice.
    await signal_ledger(client, queue, "c", policy, "request",
                        ReservationRequest(operation="op-a", nodes=1, max_nodes=2, reply_to=a.id))
    assert (await ledger.query(PolicyLedgerWorkflow.current)).in_use == 2

    # Releasing a node grants it to the first in line, by signal: nobody polls.
    await ledger.signal("release", "op-a")
    grant = await _grant(c)
    assert grant.granted and grant.operation == "op-c" and grant.holders == ["op-b", "op-c"]
    assert not await _granted(d)

    # A requester that has finished cannot use its grant: the node goes to the next in line.
    await b.signal(Requester.finish)
    await b.result()
    await signal_ledger(client, queue, "c", policy, "request",
                        ReservationRequest(operation="op-b", nodes=1, max_nodes=2, reply_to=b.id))
    assert (await _grant(d)).holders == ["op-c", "op-d"]


async def test_continue_as_new_keeps_reservations_and_queue(temporal_dev_server: WorkflowEnvironment) -> None:
    client = temporal_dev_server.client
    queue, policy = f"q-{uuid.uuid4().hex[:6]}", f"p-{uuid.uuid4().hex[:6]}"
    from models.operation import LedgerInput

    async with Worker(client, task_queue=queue, workflows=[PolicyLedgerWorkflow, Requester],
                      workflow_runner=workflow_runner()):
        # A ledger that continues as new after every 3 signals.
        await client.start_workflow(PolicyLedgerWorkflow.run,
                                    LedgerInput(cluster="c", policy=policy, continue_after_signals=3),
                                    id=ledger_workflow_id("c", policy), task_queue=queue)
        handles = [await _request(client, queue, policy, f"op-{i}") for i in range(8)]
        assert (await _grant(handles[0])).granted and (await _grant(handles[1])).granted
        ledger = client.get_workflow_handle(ledger_workflow_id("c", policy))
        state = await ledger.query(PolicyLedgerWorkflow.current)
        assert state.holders == ["op-0", "op-1"]
        assert state.waiting == [f"op-{i}" for i in range(2, 8)]
        info = (await ledger.describe()).raw_description.workflow_execution_info
        assert info.first_run_id and info.first_run_id != info.execution.run_id  # it did continue as new
        await ledger.signal("release", "op-0")
        assert (await _grant(handles[2])).holders == ["op-1", "op-2"]
