"""The hub sync loop (R2.5-R2.8) as one long-running workflow per cluster, visible in the Temporal UI.

Every ``poll_interval`` (with jitter) one ``hub_poll`` activity pulls the policy set (conditionally) and syncs it
into GpuPolicy resources, applies new approvals exactly as the CLI would, and delivers queued action reports.
Reports arrive as signals and are kept in this workflow's state until the hub has them, so they survive worker
crashes and hub outages; the hub's idempotency keys make delivery exactly once. The etag, approval cursor and
undelivered reports are carried over continue-as-new.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from models import search_attributes as sa
from models.hub import HUB_PHASES
from models.hub import ActionReport
from models.hub import HubPollRequest
from models.hub import HubPollResult
from models.hub import HubState
from models.hub import HubSyncConfig
from models.hub import HubSyncInput
from models.hub import HubSyncStatus
from models.ui_text import Details
from models.ui_text import code
from models.ui_text import md
from workflows.observe import hub_poll_trace

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
        self.last_success_at = inp.last_success_at
        self.last_error, self.last_error_at = inp.last_error, inp.last_error_at
        self.total_polls = inp.total_polls
        self.phase = ""

    @workflow.signal(name="report", description=(
        "Internal: an operation's action report, queued here until the hub has it (sent by the record_audit "
        "activity). Not for operators."))
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

    @workflow.signal(name="sync_now", description="Poll the hub now instead of at the next interval (no input).")
    def sync_now(self) -> None:
        self.wake = True

    @workflow.signal(name="configure", description=(
        "Internal: a restarted worker's settings (poll interval). Sent by every worker replica at start-up."))
    def configure(self, config: HubSyncConfig) -> None:
        """A worker started with other settings (a new hub.pollInterval) tells the running sync."""
        self.poll_interval = config.poll_interval_seconds
        self.wake = True

    @workflow.query(name="status", description=(
        "The sync's state: connection, last successful sync and last error, policies, approvals cursor and the "
        "reports waiting for the hub."))
    def status(self) -> HubSyncStatus:
        return HubSyncStatus(
            cluster=self.inp.cluster, poll_interval_seconds=self.poll_interval, state=self.state,
            message=self.message, polls=self.polls,
            last_poll_at=self.last_poll_at, etag=self.etag, approvals_cursor=self.cursor,
            pending_reports=len(self.reports), dropped_reports=self.dropped,
            last_sync=self.last.sync if self.last else None, last_success_at=self.last_success_at,
            last_error=self.last_error, last_error_at=self.last_error_at, total_polls=self.total_polls)

    def _details(self) -> str:
        d = Details()
        d.para(f"**Hub sync** of cluster {code(self.inp.cluster)} every {self.poll_interval:g} s:",
               f"**{HUB_PHASES[self.state]}**" + (f" — {md(self.message)}" if self.message else ""))
        d.para(f"**Last successful sync:** {_when(self.last_success_at)}",
               f"· **last poll:** {_when(self.last_poll_at)}")
        if self.last_error:
            d.para(f"**Last error** ({_when(self.last_error_at)}): {md(self.last_error)}")
        d.para(f"**Reports waiting for the hub:** {len(self.reports)}"
               + (f" ({self.dropped} dropped: the queue was full)" if self.dropped else ""),
               f"· approvals cursor {self.cursor} · polls {self.total_polls}")
        if self.last and self.last.sync:
            d.para(f"**Policies** (hub revision {md(self.last.sync.revision)}): {md(self.last.sync.summary())}")
            d.bullets(f"invalid {code(name)}: {md(why)}" for name, why in sorted(self.last.sync.invalid.items()))
        if self.last and self.last.approvals:
            d.para("**Approvals applied in the last poll**")
            d.bullets(f"{md(a.hub_id)} of {code(a.operation)}: {md((a.result + ' ' + a.message).strip())}"
                      for a in self.last.approvals)
        return d.render()

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
            self.last_error, self.last_error_at = self.message, workflow.now()
            return
        self.last = result
        self.state, self.message = result.state, result.message
        if result.state == "connected":
            self.last_success_at = workflow.now()
        else:
            self.last_error, self.last_error_at = f"{HUB_PHASES[result.state]}: {result.message}", workflow.now()
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
        self.phase = HUB_PHASES[self.state]
        workflow.upsert_search_attributes([sa.CLUSTER.value_set(inp.cluster), sa.OPERATION_KIND.value_set("HubSync"),
                                           sa.PHASE.value_set(self.phase)])
        for _ in range(inp.polls_before_continue):
            self.wake = False
            with hub_poll_trace(inp.cluster, f"{workflow.info().workflow_id}/{workflow.info().run_id}/{self.polls}"):
                await self._poll()
            self.polls += 1
            self.total_polls += 1
            self.last_poll_at = workflow.now()
            if HUB_PHASES[self.state] != self.phase:  # an upsert is a history event: only on change
                self.phase = HUB_PHASES[self.state]
                workflow.upsert_search_attributes([sa.PHASE.value_set(self.phase)])
            workflow.set_current_details(self._details())
            info = workflow.info()
            if (info.is_continue_as_new_suggested()
                    or info.get_current_history_length() >= inp.history_events_before_continue):
                break
            backlog = (self.state == "connected" and
                       (bool(self.last and self.last.more_approvals) or len(self.reports) > 0))
            if backlog:
                await workflow.sleep(MIN_GAP, summary="more approvals or reports: poll again shortly")
                continue
            try:
                await workflow.wait_condition(lambda: self.wake, timeout=self._interval(),
                                              timeout_summary="next hub poll")
            except TimeoutError:
                continue
            if self.state == "connected":
                await workflow.sleep(MIN_GAP, summary="woken by a report: gather others for a moment")
            else:
                # Hub down or token rejected: new reports wait for the next interval instead of hammering it.
                await workflow.sleep(self._interval(), summary=f"hub {self.state}: wait a full interval")
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(HubSyncInput(
            cluster=inp.cluster, poll_interval_seconds=self.poll_interval, jitter=inp.jitter,
            etag=self.etag, approvals_cursor=self.cursor, pending_reports=self.reports,
            dropped_reports=self.dropped, state=self.state, polls_before_continue=inp.polls_before_continue,
            history_events_before_continue=inp.history_events_before_continue,
            last_success_at=self.last_success_at, last_error=self.last_error, last_error_at=self.last_error_at,
            total_polls=self.total_polls))


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S UTC") if at else "never"
