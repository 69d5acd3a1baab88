"""The hub poll: one activity that pulls the policy set and approvals, syncs GpuPolicies and delivers reports.

Idempotent by construction: the sync applies a desired state, approvals already applied are refused by the
operation's validator (not awaiting approval), and the hub stores a report key once.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from dataclasses import field

from temporalio import activity
from temporalio.client import Client

from activities.clients.decisions import DecisionRefused
from activities.clients.decisions import OperationNotFound
from activities.clients.decisions import decide
from activities.clients.hub import HubClient
from activities.clients.hub import HubRefused
from activities.clients.hub import HubUnauthorized
from activities.clients.hub import HubUnreachable
from activities.clients.hub import PolicySet
from activities.clients.policies import PolicySyncer
from models.decisions import Approval
from models.decisions import Rejection
from models.hub import REASON_UNAUTHORIZED
from models.hub import REASON_UNREACHABLE
from models.hub import ActionReport
from models.hub import ApprovalOutcome
from models.hub import HubPollRequest
from models.hub import HubPollResult
from models.hub import HubState
from models.hub import report_detail
from models.policy import RESOURCE_NAME_PATTERN

log = logging.getLogger("kubeon.hub")
APPROVAL_PAGE = 100


@dataclass
class HubActivities:
    hub: HubClient
    syncer: PolicySyncer
    temporal: Client | None = None
    # The last policy set pulled: a 304 re-asserts it (a kubectl edit is undone even when the hub is unchanged).
    _policies: PolicySet | None = None
    _state: HubState = "starting"
    _reported_invalid: set[str] = field(default_factory=set)
    # What the last "policies synced" line at INFO said: a poll that changes nothing logs at DEBUG (every
    # pollInterval, forever, it was most of the worker's log).
    _last_sync_logged: str | None = None

    def _transition(self, state: HubState, message: str) -> None:
        """Log once per change of state, with why: a hub down for an hour is one warning, not sixty."""
        if state != self._state:
            if state == "connected":
                log.info("hub %s: connected%s", self.hub.url, " again" if self._state != "starting" else "")
            elif state == "unauthorized":
                log.error("hub %s rejected this cluster's token: %s. No further actions (launches, approvals, "
                          "drains) until a valid token is mounted; operations in flight hold where they are",
                          self.hub.url, message)
            else:
                log.warning("hub %s: %s; the last synced policies stay enforced and reports queue", self.hub.url,
                            message)
            self._state = state

    async def _disconnected(self, req: HubPollRequest, state: HubState, reason: str, message: str) -> HubPollResult:
        marked = await asyncio.to_thread(self.syncer.mark_connection, False, reason, message)
        self._transition(state, message + (f" ({marked} policies marked)" if marked else ""))
        return HubPollResult(state=state, message=message, etag=req.etag, approvals_cursor=req.approvals_cursor)

    @activity.defn(name="hub_poll")
    async def hub_poll(self, req: HubPollRequest) -> HubPollResult:
        cached = self._policies if self._policies and self._policies.etag == req.etag else None
        try:
            pulled = await asyncio.to_thread(self.hub.policies, cached.etag if cached else None)
        except HubUnauthorized as exc:
            return await self._disconnected(req, "unauthorized", REASON_UNAUTHORIZED, str(exc))
        except HubUnreachable as exc:
            return await self._disconnected(req, "unreachable", REASON_UNREACHABLE, str(exc))
        except HubRefused as exc:
            self._transition("error", str(exc))
            return HubPollResult(state="error", message=str(exc), etag=req.etag, approvals_cursor=req.approvals_cursor)
        policy_set = pulled or cached
        assert policy_set is not None  # a 304 only answers the etag we hold
        self._policies = policy_set
        activity.heartbeat("syncing policies")
        outcome = await asyncio.to_thread(self.syncer.sync, policy_set.documents, policy_set.revision)
        said = f"{outcome.summary()} (hub revision {policy_set.revision})"
        log.log(logging.INFO if said != self._last_sync_logged else logging.DEBUG, "policies synced: %s%s", said,
                "" if pulled else ", not modified on the hub")
        self._last_sync_logged = said
        self._transition("connected", "")
        result = HubPollResult(state="connected", etag=policy_set.etag, approvals_cursor=req.approvals_cursor,
                               sync=outcome)
        try:
            await self._invalid_reports(outcome.invalid, outcome.not_ready, policy_set.revision)
            await self._approvals(req, result)
            await self._deliver(req.reports, result)
        except HubUnauthorized as exc:
            # Revoked between two calls of this poll: keep what was done (approvals applied, reports delivered).
            await self._disconnected(req, "unauthorized", REASON_UNAUTHORIZED, str(exc))
            result.state, result.message = "unauthorized", str(exc)
        except HubUnreachable as exc:
            result.state, result.message = "unreachable", str(exc)
            self._transition("unreachable", str(exc))
        return result

    async def _invalid_reports(self, invalid: dict[str, str], not_ready: dict[str, str], revision: int) -> None:
        """Tell the hub which of its policies this optimizer refused or cannot fully act on, once per policy and
        revision."""
        problems = [(f"policy-invalid/{name}/r{revision}", name,
                     f"invalid policy (hub revision {revision}); the last good version stays enforced: {why}")
                    for name, why in sorted(invalid.items())]
        problems += [(f"policy-not-ready/{name}/r{revision}", name,
                      f"policy not ready (hub revision {revision}): {why}") for name, why in sorted(not_ready.items())]
        for key, name, detail in problems:
            if key in self._reported_invalid or not re.match(RESOURCE_NAME_PATTERN, name):
                continue
            log.warning("policy %s from the hub: %s", name, detail)
            try:
                await asyncio.to_thread(self.hub.report, ActionReport(
                    idempotency_key=key, operation=f"policy/{name}", policy=name, action="failed",
                    detail=report_detail(detail), occurred_at=activity.info().current_attempt_scheduled_time))
            except HubRefused as exc:
                log.warning("hub refused the report on policy %s: %s", name, exc)
            self._reported_invalid.add(key)

    async def _approvals(self, req: HubPollRequest, result: HubPollResult) -> None:
        page = await asyncio.to_thread(self.hub.approvals, req.approvals_cursor, APPROVAL_PAGE)
        for a in page.approvals:
            activity.heartbeat(f"approval {a.id}")
            decision: Approval | Rejection
            if a.decision == "approve":
                decision = Approval(approver=f"hub:{a.decided_by}", plan_id=a.plan_id, reason=a.reason)
            else:
                decision = Rejection(approver=f"hub:{a.decided_by}", reason=a.reason)
            outcome = ApprovalOutcome(hub_id=a.id, operation=a.operation,
                                      decision="approve" if a.decision == "approve" else "reject",
                                      result="applied")
            try:
                if self.temporal is None:
                    raise OperationNotFound("the worker has no Temporal client")
                done = await decide(self.temporal, a.operation, decision)
                outcome.message = done.message
                log.info("hub %s of %s by %s applied", a.decision, a.operation, a.decided_by)
            except OperationNotFound as exc:
                outcome.result, outcome.message = "not_found", str(exc)
                log.warning("hub %s of %s by %s: %s", a.decision, a.operation, a.decided_by, exc)
            except DecisionRefused as exc:
                outcome.result, outcome.message = "refused", str(exc)
                log.warning("hub %s of %s by %s refused: %s", a.decision, a.operation, a.decided_by, exc)
            result.approvals.append(outcome)
            result.approvals_cursor = a.id
        result.approvals_cursor = max(result.approvals_cursor, page.cursor)
        result.more_approvals = page.more

    async def _deliver(self, reports: list[ActionReport], result: HubPollResult) -> None:
        for report in reports:
            activity.heartbeat(f"report {report.idempotency_key}")
            try:
                await asyncio.to_thread(self.hub.report, report)
            except HubRefused as exc:
                # Never deliverable as it is: keeping it would block the queue behind it forever.
                log.error("hub refused report %s for good, dropped: %s", report.idempotency_key, exc)
                result.refused_reports[report.idempotency_key] = str(exc)
                continue
            result.delivered_reports.append(report.idempotency_key)

