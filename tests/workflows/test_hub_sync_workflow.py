"""The HubSync workflow's own logic under the time-skipping server: the report queue (order, dedup, kept while
the hub is down), the etag and approval cursor handed from poll to poll and over continue-as-new, and a new poll
interval from a restarted worker. The poll activity here is a script under the production name; the real one
is tested end to end in test_hub_sync.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models import search_attributes as sa
from models.hub import ActionReport
from models.hub import HubPollRequest
from models.hub import HubPollResult
from models.hub import HubState
from models.hub import HubSyncConfig
from models.hub import HubSyncInput
from models.hub import HubSyncStatus
from tests.harness.temporal import skip_time
from worker.main import workflow_runner
from workflows.hub_sync import HubSyncWorkflow

pytestmark = pytest.mark.temporal


@dataclass
class ScriptedHub:
    """Answers polls as a hub would: in ``state``; delivers every report while connected."""

    state: HubState = "connected"
    requests: list[HubPollRequest] = field(default_factory=list)
    delivered: list[str] = field(default_factory=list)
    cursor: int = 0

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="hub_poll")
        async def hub_poll(req: HubPollRequest) -> HubPollResult:
            self.requests.append(req)
            if self.state != "connected":
                return HubPollResult(state=self.state, message="hub down", etag=req.etag,
                                     approvals_cursor=req.approvals_cursor)
            keys = [r.idempotency_key for r in req.reports]
            self.delivered += keys
            self.cursor += 1
            return HubPollResult(state="connected", etag=f'"e{self.cursor}"', approvals_cursor=self.cursor,
                                 delivered_reports=keys)

        return [hub_poll]


Env = tuple[WorkflowEnvironment, str, ScriptedHub]


@pytest.fixture
async def env(temporal_time_skipping: WorkflowEnvironment) -> AsyncIterator[Env]:
    hub = ScriptedHub()
    queue = f"q-{uuid.uuid4().hex[:6]}"
    async with Worker(temporal_time_skipping.client, task_queue=queue, workflows=[HubSyncWorkflow],
                      activities=hub.activities(), workflow_runner=workflow_runner()):
        yield temporal_time_skipping, queue, hub


def report(key: str) -> ActionReport:
    return ActionReport(idempotency_key=key, operation="op-0123456789ab", policy="p", action="launched",
                        occurred_at=datetime(2026, 1, 1, tzinfo=UTC))


async def start(client: Client, queue: str, **inp: Any) -> WorkflowHandle[HubSyncWorkflow, None]:
    return await client.start_workflow(
        HubSyncWorkflow.run, HubSyncInput(cluster="c", poll_interval_seconds=60, **inp),
        id=f"hub-sync/{uuid.uuid4().hex[:8]}", task_queue=queue)


async def status_when(handle: WorkflowHandle[HubSyncWorkflow, None],
                      check: Callable[[HubSyncStatus], bool]) -> HubSyncStatus:
    for _ in range(400):
        status = await handle.query(HubSyncWorkflow.status)
        if check(status):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"hub sync status never matched: {status}")


async def test_reports_wait_while_the_hub_is_down_and_go_once_in_order(env: Env) -> None:
    server, queue, hub = env
    hub.state = "unreachable"
    handle = await start(server.client, queue)
    await status_when(handle, lambda s: s.polls >= 1 and s.state == "unreachable")
    for key in ("a", "b", "a", "c"):  # "a" twice: a retried activity signals it again
        await handle.signal(HubSyncWorkflow.report, report(key))
    status = await status_when(handle, lambda s: s.pending_reports == 3)
    assert hub.delivered == [] and status.state == "unreachable"

    # Down, new reports wait for the next interval (no hammering); an interval later the hub is back.
    hub.state = "connected"
    await skip_time(server, timedelta(seconds=150))
    await status_when(handle, lambda s: s.pending_reports == 0 and s.state == "connected")
    assert hub.delivered == ["a", "b", "c"]
    await handle.signal(HubSyncWorkflow.report, report("a"))  # delivered already: not queued again
    await handle.signal(HubSyncWorkflow.report, report("d"))
    # Until the workflow has the poll's result (ending with a poll in flight would hold the test server's clock).
    await status_when(handle, lambda s: s.pending_reports == 0 and "d" in hub.delivered)
    assert hub.delivered == ["a", "b", "c", "d"]
    await handle.terminate("test over")


async def test_etag_cursor_and_reports_carry_over_continue_as_new(env: Env) -> None:
    server, queue, hub = env
    handle = await start(server.client, queue, polls_before_continue=2)
    await status_when(handle, lambda s: s.polls >= 1)
    first_run = (await handle.describe()).run_id
    hub.state = "unreachable"
    await handle.signal(HubSyncWorkflow.report, report("kept"))
    await skip_time(server, timedelta(seconds=150))  # the second poll: the run then continues as new
    status = await status_when(handle, lambda s: s.polls >= 1)
    assert (await handle.describe()).run_id != first_run
    assert status.pending_reports == 1 and status.etag == '"e1"' and status.approvals_cursor == 1
    hub.state = "connected"
    await skip_time(server, timedelta(seconds=150))
    await status_when(handle, lambda s: s.pending_reports == 0)
    assert "kept" in hub.delivered
    later = [r for r in hub.requests if r.reports]
    assert later[-1].etag == '"e1"' and later[-1].approvals_cursor == 1
    await handle.terminate("test over")


async def test_a_restarted_worker_sets_a_new_poll_interval(env: Env) -> None:
    server, queue, hub = env
    handle = await start(server.client, queue)
    await status_when(handle, lambda s: s.polls >= 1)
    await handle.signal(HubSyncWorkflow.configure, HubSyncConfig(poll_interval_seconds=300))
    # The new settings wake the sync: one poll at once, then every 300 s.
    polls = (await status_when(handle, lambda s: s.poll_interval_seconds == 300 and s.polls == 2)).polls
    await skip_time(server, timedelta(seconds=200))  # more than the old interval, less than the new one
    assert (await handle.query(HubSyncWorkflow.status)).polls == polls
    await skip_time(server, timedelta(seconds=200))
    await status_when(handle, lambda s: s.polls == polls + 1)
    assert len(hub.requests) == polls + 1
    await handle.terminate("test over")


async def test_a_five_second_poll_for_ten_minutes_keeps_each_run_short(env: Env) -> None:
    server, queue, hub = env
    handle = await start(server.client, queue)
    await handle.signal(HubSyncWorkflow.configure, HubSyncConfig(poll_interval_seconds=5))
    await skip_time(server, timedelta(minutes=10))
    status = await status_when(handle, lambda s: s.total_polls >= 100)
    limit = HubSyncInput(cluster="c").history_events_before_continue
    run_id: str | None = handle.first_execution_run_id
    lengths: list[int] = []
    while run_id:  # follow the chain of runs (the test server has no list API)
        events = [e async for e in server.client.get_workflow_handle(handle.id, run_id=run_id)
                  .fetch_history_events()]
        lengths.append(len(events))
        last = events[-1]
        run_id = (last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                  if last.HasField("workflow_execution_continued_as_new_event_attributes") else None)
    assert len(lengths) >= 2, "no continue-as-new within 10 minutes of 5 s polls"
    # The check runs after each poll; one poll cycle adds about a dozen events past the limit at most.
    assert max(lengths) < limit + 20, lengths
    # The total survives continue-as-new, the per-run count does not.
    assert status.total_polls > status.polls and status.poll_interval_seconds == 5
    assert 100 <= len(hub.requests) <= 135  # 10 minutes / 5 s (±10 % jitter), plus the first polls
    assert status.last_success_at is not None and status.last_error == ""
    await handle.terminate("test over")


async def test_the_last_error_and_last_success_are_kept_and_the_phase_is_camel_case(env: Env) -> None:
    server, queue, hub = env
    hub.state = "unreachable"
    handle = await start(server.client, queue)
    status = await status_when(handle, lambda s: s.polls >= 1)
    assert status.last_success_at is None and status.last_error == "Unreachable: hub down"
    assert (await handle.describe()).typed_search_attributes.get(sa.PHASE) == "Unreachable"
    hub.state = "connected"
    await skip_time(server, timedelta(seconds=150))
    status = await status_when(handle, lambda s: s.state == "connected")
    assert status.last_success_at is not None and status.last_error == "Unreachable: hub down"
    assert status.last_error_at is not None and status.last_error_at < status.last_success_at
    assert (await handle.describe()).typed_search_attributes.get(sa.PHASE) == "Connected"
    await handle.terminate("test over")
