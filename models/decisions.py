"""Approvals and rejections of an operation's proposal, and the answer to one."""

from __future__ import annotations

from models.base import Model


class Approval(Model):
    approver: str = "temporal-ui"
    # When set, the approval is for this plan only: a stale approval of an older plan is refused.
    plan_id: str | None = None
    reason: str = ""
    # When set, the approval is for this batch only (the operation ID the proposal was reported under).
    operation: str | None = None


class Rejection(Model):
    approver: str = "temporal-ui"
    reason: str = ""
    operation: str | None = None


class DecisionResult(Model):
    operation: str
    # The operation's phase after the decision (a batch's or a scale operation's; the same strings).
    phase: str
    message: str


class OperatorRequest(Model):
    """A person's request to a running operation beyond approving it (wake a workload, undo a sharing change),
    from the Temporal UI (a signal or an update) or the CLI."""

    by: str = "temporal-ui"
    reason: str = ""


class OperatorResult(Model):
    """The answer to an ``OperatorRequest``; each operation adds its phase after the request."""

    operation: str
    message: str
