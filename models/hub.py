"""The optimizer's side of the hub: names on the cluster, and the inputs and outputs of the hub sync workflow.

The hub never connects to the optimizer (R2.5): one ``HubSync`` workflow per cluster pulls policies and
approvals every ``hub.pollInterval`` and delivers the action reports queued in its own state, so a report
survives a worker crash and an unreachable hub, and the hub's idempotency keys make delivery exactly once.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Final
from typing import Literal

from pydantic import Field

from models.base import Model
from models.provisioning import BatchPlan

# Server-side apply field manager of everything the sync writes (spec and status).
FIELD_MANAGER: Final = "kubeon-gpu-optimizer"
# GpuPolicies the sync owns carry this label; only they are pruned when the hub no longer lists them.
LABEL_SOURCE: Final = "gpu.kubeon.io/source"
SOURCE_HUB: Final = "hub"
ANNOTATION_HUB_REVISION: Final = "gpu.kubeon.io/hub-revision"

# Status conditions on each hub-synced GpuPolicy.
CONDITION_READY: Final = "Ready"
CONDITION_HUB_CONNECTED: Final = "HubConnected"
REASON_SYNCED: Final = "Synced"
REASON_INVALID: Final = "InvalidPolicy"
# The policy names a location this installation does not configure (burst.locations): nothing launches there.
REASON_UNKNOWN_LOCATION: Final = "UnknownLocation"
REASON_CONNECTED: Final = "Connected"
# The hub answered 401: the token is revoked or unknown. The optimizer takes no action until a valid one arrives.
REASON_UNAUTHORIZED: Final = "Unauthorized"
# The hub did not answer: the last synced policies stay enforced and reports queue.
REASON_UNREACHABLE: Final = "Unreachable"

# Actions reported to the hub (R2.8), plus the other ends an operation can have.
ReportAction = Literal["proposed", "approved", "launched", "joined", "verified", "drained", "removed", "failed",
                       "rejected", "expired", "withdrawn", "cancelled", "held", "resumed", "scaled", "woken"]
REPORT_ACTIONS: Final[frozenset[str]] = frozenset(ReportAction.__args__)  # type: ignore[attr-defined]
HubState = Literal["starting", "connected", "unauthorized", "unreachable", "error"]
# KubeonPhase of the HubSync workflow: CamelCase like every other operation's phase.
HUB_PHASES: Final[dict[str, str]] = {"starting": "Starting", "connected": "Connected",
                                     "unauthorized": "Unauthorized", "unreachable": "Unreachable", "error": "Error"}


REPORT_DETAIL_LIMIT: Final = 8192  # the hub's limit on a report's detail


def hub_sync_workflow_id(cluster: str) -> str:
    return f"hub-sync/{cluster}"


# Characters the hub refuses in a report's detail (control characters but tab, newline, CR; lone surrogates).
_DETAIL_REFUSED: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def report_detail(text: str) -> str:
    """A detail the hub accepts: within its limit, control characters replaced by U+FFFD."""
    text = _DETAIL_REFUSED.sub("\ufffd", text)
    return text if len(text) <= REPORT_DETAIL_LIMIT else text[: REPORT_DETAIL_LIMIT - 1] + "…"


def proposal_detail(plan: BatchPlan, batch: str) -> str:
    """A batch proposal as the hub reads it (hub/plans.py): the plan as one JSON object, so the hub shows each node
    (location, instance type, $/h compute and estimated transfer, pods) and binds a decision to ``plan_id``. Kept
    within the hub's limit: the pods of each node are cut first (the count stays in the summary), then nodes."""
    def doc(pods_each: int | None, nodes: int | None) -> str:
        return json.dumps({
            "plan_id": plan.plan_id, "batch": batch, "summary": plan.summary(),
            "total_usd_per_hour": plan.total_usd_per_hour,
            "nodes": [{"location": n.offering.location, "instance_type": n.offering.instance_type,
                       "gpus": n.offering.gpus, "gpu_product": n.offering.gpu_product,
                       "compute_usd_per_hour": n.offering.instance_usd_per_hour,
                       "transfer_usd_per_hour": round(n.offering.transfer_usd_per_hour, 6),
                       "transfer_basis": n.offering.transfer_basis,
                       "pods": n.pods[:pods_each]} for n in plan.new_nodes[:nodes]],
        }, separators=(",", ":"))

    for pods_each, nodes in ((None, None), (8, None), (1, None), (0, 64), (0, 16), (0, 0)):
        text = doc(pods_each, nodes)
        if len(text) <= REPORT_DETAIL_LIMIT:
            return text
    return report_detail(plan.summary())


def _within_limit(doc: dict[str, object], cut: tuple[str, ...], fallback: str) -> str:
    """``doc`` as one JSON object within the hub's limit: the texts of ``cut`` kept within the hub's 2,000
    characters each, then shortened in turn (the plan id and the figures stay whole), else the plain summary."""
    for keep in (2000, 1000, 200, 0):
        shown = {k: (v[:keep] if k in cut and isinstance(v, str) else v) for k, v in doc.items()}
        text = json.dumps(shown, separators=(",", ":"))
        if len(text) <= REPORT_DETAIL_LIMIT:
            return text
    return report_detail(fallback)


def sharing_proposal_detail(*, plan_id: str, node: str, gpus: int, change: str, summary: str, reason: str,
                            risk: str, saving_usd_per_hour: float) -> str:
    """A Sharing proposal as the hub reads it (hub/plans.py): the node, the change (time-slicing replicas or a MIG
    geometry), what it saves and what it risks, with the plan id a decision binds to."""
    return _within_limit({"plan_id": plan_id, "summary": summary, "node": node, "gpus": gpus, "change": change,
                          "saving_usd_per_hour": round(saving_usd_per_hour, 6), "reason": reason, "risk": risk},
                         cut=("summary", "reason", "risk"), fallback=summary)


def pack_proposal_detail(*, plan_id: str, summary: str, remove: list[str], moves: list[str],
                         saving_usd_per_hour: float) -> str:
    """A Packing round's proposal as the hub reads it: the nodes it empties and removes, the pods it moves and
    what it saves. Within the hub's limit the moves are cut first (their count stays in the summary)."""
    for shown in (moves, moves[:64], moves[:8], []):
        text = json.dumps({"plan_id": plan_id, "summary": summary[:2000], "remove": remove[:64], "moves": shown,
                           "saving_usd_per_hour": round(saving_usd_per_hour, 6)}, separators=(",", ":"))
        if len(text) <= REPORT_DETAIL_LIMIT:
            return text
    return report_detail(summary)


def scale_proposal_detail(*, plan_id: str, summary: str, workload: str, replicas: int, idle_evidence: str) -> str:
    """A ScaleToZero proposal as the hub reads it: the workload, its replicas now and why it counts as idle."""
    return _within_limit({"plan_id": plan_id, "summary": summary, "workload": workload, "replicas": replicas,
                          "idle_evidence": idle_evidence}, cut=("summary", "idle_evidence"), fallback=summary)


class ActionReport(Model):
    """One action of an operation, as the hub's ``POST /v1/cluster/reports`` takes it."""

    idempotency_key: str
    operation: str
    policy: str
    action: ReportAction
    location: str | None = None
    instance: str | None = None
    node: str | None = None
    detail: str = ""
    occurred_at: datetime
    # The audit record's place in the worker's audit log chain (models.audit_chain): all four or none.
    audit_chain: str | None = None
    audit_seq: int | None = None
    audit_hash: str | None = None
    audit_prev: str | None = None


class HubSyncRecord(Model):
    """The sync's record across its runs: carried over continue-as-new in its input, shown in its status."""

    last_success_at: datetime | None = None
    last_error: str = ""
    last_error_at: datetime | None = None
    total_polls: int = 0


class HubSyncInput(HubSyncRecord):
    cluster: str
    poll_interval_seconds: float = 60.0
    # Each wait is the interval times a random factor in [1 - jitter, 1 + jitter], so clusters spread out.
    jitter: float = 0.1
    # Carried over continue-as-new.
    etag: str | None = None
    approvals_cursor: int = 0
    pending_reports: list[ActionReport] = Field(default_factory=list)
    dropped_reports: int = 0
    state: HubState = "starting"
    polls_before_continue: int = 500
    # Continue as new once the run's history has this many events (Temporal warns at 10,240 and stops at
    # 51,200): at a 5 s poll a run is about 7 minutes, at the default 60 s about 90.
    history_events_before_continue: int = 1_000


class HubSyncConfig(Model):
    poll_interval_seconds: float


class HubPollRequest(Model):
    cluster: str
    etag: str | None = None
    approvals_cursor: int = 0
    # Delivered in this order; delivery stops at the first failure so the rest stay queued, in order.
    reports: list[ActionReport] = Field(default_factory=list)


class PolicySyncOutcome(Model):
    revision: int | None = None
    created: list[str] = Field(default_factory=list)
    updated: list[str] = Field(default_factory=list)
    unchanged: list[str] = Field(default_factory=list)
    pruned: list[str] = Field(default_factory=list)
    # name -> why: kept at its last good version (or not created), said in its status and reported to the hub.
    invalid: dict[str, str] = Field(default_factory=dict)
    # name -> why: applied, but Ready=False because this installation cannot act on all of it (e.g. a location
    # not in burst.locations); said in its status and reported to the hub.
    not_ready: dict[str, str] = Field(default_factory=dict)

    def summary(self) -> str:
        text = (f"{len(self.created)} created, {len(self.updated)} updated, {len(self.unchanged)} unchanged, "
                f"{len(self.pruned)} pruned, {len(self.invalid)} invalid")
        return text + (f", {len(self.not_ready)} not ready" if self.not_ready else "")


class ApprovalOutcome(Model):
    hub_id: int
    operation: str
    decision: Literal["approve", "reject"]
    # applied, refused (the workflow's validator said why), not_found (no such running operation)
    result: Literal["applied", "refused", "not_found"]
    message: str = ""


class HubPollResult(Model):
    state: HubState
    message: str = ""
    etag: str | None = None
    approvals_cursor: int = 0
    # More approvals are waiting on the hub: poll again at once.
    more_approvals: bool = False
    sync: PolicySyncOutcome | None = None
    approvals: list[ApprovalOutcome] = Field(default_factory=list)
    delivered_reports: list[str] = Field(default_factory=list)
    # Reports the hub refused for good (422, 409): never deliverable, dropped with the reason logged.
    refused_reports: dict[str, str] = Field(default_factory=dict)


class HubSyncStatus(HubSyncRecord):
    cluster: str
    poll_interval_seconds: float = 0.0
    state: HubState
    message: str
    polls: int
    last_poll_at: datetime | None
    etag: str | None
    approvals_cursor: int
    pending_reports: int
    dropped_reports: int
    last_sync: PolicySyncOutcome | None = None


class GateRequest(Model):
    policy: str
    check_seconds: float = 5.0


class GateState(Model):
    """Whether an operation of the policy may act now (launch, start a drain, evict)."""

    held: bool
    reason: str = ""
