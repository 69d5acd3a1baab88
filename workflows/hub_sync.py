"""The hub sync loop (R2.5-R2.8) as one long-running workflow per cluster, visible in the Temporal UI.

Every ``poll_interval`` (with jitter) one ``hub_poll`` activity pulls the policy set (conditionally) and syncs it
into GpuPolicy resources, applies new approvals exactly as the CLI would, and delivers queued action reports.
Reports arrive as signals and are kept in this workflow's state until the hub has them, so they survive worker
crashes and hub outages; the hub's idempotency keys make delivery exactly once. The etag, approval cursor and
undelivered reports are carried over continue-as-new.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from models import search_attributes as sa
from models.hub import (
    ActionReport,
    HubPollRequest,
    HubPollResult,
    HubState,
    HubSyncConfig,
    HubSyncInput,
    HubSyncStatus,
)

# A report batch per poll; the rest go in the next polls (an immediate one when the hub keeps up).
REPORT_BATCH = 100
# Undelivered reports kept at most (oldest dropped, counted and shown): a hub down for days must not grow the
# history without bound.
MAX_PENDING_REPORTS = 20_000
# Recently delivered keys: a report signalled twice (a retried activity) is queued once.
RECENT_KEYS = 5_000
# Reports wake the loop early, but at most this often.
MIN_GAP = timedelta(seconds=1)
POLL_TIMEOUT = timedelta(minutes=5)
POLL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10),
                         maximum_attempts=3)


@workflow.defn(name="HubSync")
class HubSyncWorkflow:
    @workflow.init
    def __init__(self, inp: HubSyncInput) -> None:
        # Read here, not in run(): signals delivered before run() starts (after continue-as-new) see the state.
        self.inp = inp
        self.reports: list[ActionReport] = list(inp.pending_reports)
        self.queued_keys = {r.idempotency_key for r in self.reports}
        self.recent: deque[str] = deque(maxlen=RECENT_KEYS)
        self.dropped = inp.dropped_reports
        self.etag = inp.etag
        self.cursor = inp.approvals_cursor
        self.state: HubState = inp.state
        self.message = ""
        self.polls = 0
        self.last_poll_at: datetime | None = None
        self.last: HubPollResult | None = None
        self.wake = False
        self.poll_interval = inp.poll_interval_seconds

    @workflow.signal(name="report")
    def report(self, report: ActionReport) -> None:
        key = report.idempotency_key
        if key in self.queued_keys or key in self.recent:
            return
        self.reports.append(report)
        self.queued_keys.add(key)
        if len(self.reports) > MAX_PENDING_REPORTS:
            gone = self.reports.pop(0)
            self.queued_keys.discard(gone.idempotency_key)
            self.dropped += 1
        self.wake = True

    @workflow.signal(name="sync_now")
    def sync_now(self) -> None:
        self.wake = True

    @workflow.signal(name="configure")
    def configure(self, config: HubSyncConfig) -> None:
        """A worker started with other settings (a new hub.pollInterval) tells the running sync."""
        self.poll_interval = config.poll_interval_seconds
        self.wake = True

    @workflow.query(name="status")
    def status(self) -> HubSyncStatus:
        return HubSyncStatus(
            cluster=self.inp.cluster, poll_interval_seconds=self.poll_interval, state=self.state,
            message=self.message, polls=self.polls,
            last_poll_at=self.last_poll_at, etag=self.etag, approvals_cursor=self.cursor,
            pending_reports=len(self.reports), dropped_reports=self.dropped,
            last_sync=self.last.sync if self.last else None)

    def _details(self) -> str:
        lines = [f"**Hub sync** of cluster `{self.inp.cluster}` every {self.poll_interval:g}s",
                 f"**State:** {self.state}" + (f" — {self.message}" if self.message else ""),
                 f"polls {self.polls}, approvals cursor {self.cursor}, reports queued {len(self.reports)}"
                 + (f", dropped {self.dropped}" if self.dropped else "")]
        if self.last and self.last.sync:
            lines.append(f"**Policies** (hub revision {self.last.sync.revision}): {self.last.sync.summary()}")
            lines += [f"- invalid {name}: {why}" for name, why in sorted(self.last.sync.invalid.items())[:10]]
        if self.last:
            lines += [f"- approval {a.hub_id} of {a.operation}: {a.result} {a.message}".rstrip()
                      for a in self.last.approvals[:10]]
        return "\n".join(lines)

    async def _poll(self) -> None:
        batch = self.reports[:REPORT_BATCH]
        try:
            result = await workflow.execute_activity(
                "hub_poll", HubPollRequest(cluster=self.inp.cluster, etag=self.etag, approvals_cursor=self.cursor,
                                           reports=batch),
                result_type=HubPollResult, start_to_close_timeout=POLL_TIMEOUT,
                heartbeat_timeout=timedelta(seconds=60), retry_policy=POLL_RETRY)
        except ActivityError as exc:
            # Kubernetes or Temporal trouble inside the poll: say so and try again next interval; nothing moves.
            self.state, self.message = "error", str(exc.cause or exc)
            return
        self.last = result
        self.state, self.message = result.state, result.message
        self.etag = result.etag
        self.cursor = max(self.cursor, result.approvals_cursor)
        done = set(result.delivered_reports) | set(result.refused_reports)
        if done:
            self.reports = [r for r in self.reports if r.idempotency_key not in done]
            self.queued_keys -= done
            self.recent.extend(done)

    def _interval(self) -> timedelta:
        jitter = self.inp.jitter * (2 * workflow.random().random() - 1)
        return timedelta(seconds=max(0.1, self.poll_interval * (1 + jitter)))

    @workflow.run
    async def run(self, inp: HubSyncInput) -> None:
        workflow.upsert_search_attributes([sa.CLUSTER.value_set(inp.cluster),
                                           sa.OPERATION_KIND.value_set("HubSync")])
        for _ in range(inp.polls_before_continue):
            self.wake = False
            await self._poll()
            self.polls += 1
            self.last_poll_at = workflow.now()
            workflow.upsert_search_attributes([sa.PHASE.value_set(self.state)])
            workflow.set_current_details(self._details())
            if workflow.info().is_continue_as_new_suggested():
                break
            backlog = (self.state == "connected" and
                       (bool(self.last and self.last.more_approvals) or len(self.reports) > 0))
            if backlog:
                await workflow.sleep(MIN_GAP)
                continue
            try:
                await workflow.wait_condition(lambda: self.wake, timeout=self._interval())
            except TimeoutError:
                continue
            if self.state == "connected":
                await workflow.sleep(MIN_GAP)
            else:
                # Hub down or token rejected: new reports wait for the next interval instead of hammering it.
                await workflow.sleep(self._interval())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(HubSyncInput(
            cluster=inp.cluster, poll_interval_seconds=self.poll_interval, jitter=inp.jitter,
            etag=self.etag, approvals_cursor=self.cursor, pending_reports=self.reports,
            dropped_reports=self.dropped, state=self.state, polls_before_continue=inp.polls_before_continue))
