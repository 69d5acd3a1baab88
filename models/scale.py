"""Inputs, outputs and state of ScaleToZero operations (one ``ScaleWorkflow`` per workload scaled to zero), and
GPU type fit recommendations. One model per workflow/activity argument; new fields need defaults."""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Final
from typing import Literal

from pydantic import Field

from models.base import Model
from models.base import OperationViewBase
from models.decisions import OperatorRequest
from models.decisions import OperatorResult
from models.policy import Mode
from models.policy import ScheduleWake

WorkloadKind = Literal["Deployment", "StatefulSet"]
# The R1.3 reason a ScaleToZero policy is enforced as Recommend.
NO_PROMETHEUS: Final = "prometheus.url is not set: ScaleToZero stays in Recommend mode (R1.3)"
STATUS_KEY: Final = "scaleToZero"


class ScalePhase(StrEnum):
    OBSERVING = "Observing"
    PROPOSED = "Proposed"  # Recommend: the proposal stays open while the workload stays idle
    AWAITING_APPROVAL = "AwaitingApproval"
    HELD = "Held"  # the hub rejects this cluster's token (R2.3)
    SCALING_DOWN = "ScalingDown"
    SCALED_TO_ZERO = "ScaledToZero"
    WAKING = "Waking"
    VERIFYING = "Verifying"
    COMPLETED = "Completed"  # woken back to its replicas, Ready
    WITHDRAWN = "Withdrawn"  # no longer idle, policy gone or switched: nothing done
    LEFT_ALONE = "LeftAlone"  # something else (HPA, KEDA, GitOps, a person) scaled it: not touched again
    REJECTED = "Rejected"
    EXPIRED = "Expired"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class WorkloadRef(Model):
    namespace: str
    kind: WorkloadKind
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.kind}/{self.name}"


def scale_workflow_id(cluster: str, policy: str, workload: WorkloadRef) -> str:
    """One operation per (policy, workload) at a time: every watcher replica and restart names the same one."""
    digest = hashlib.sha256(workload.key.encode()).hexdigest()[:12]
    return f"scale/{cluster}/{policy}/{digest}"


class ScaleSettings(Model):
    approval_timeout_seconds: int = 3600
    # Re-observe an open proposal this often (a workload that turns busy withdraws it).
    observe_seconds: int = 60
    # While at zero: how often to check whether something else scaled the workload.
    rescale_check_seconds: int = 30
    ready_timeout_seconds: int = 900
    # After a rejection the workload is not proposed again for this long (0: the policy's idleFor).
    snooze_seconds: int = 0
    # Long waits at zero continue as new after this many checks, so histories stay short.
    checks_before_continue: int = 500


class ScaledState(Model):
    """Carried over continue-as-new while the workload is at zero."""

    operation: str
    replicas_before: int
    scaled_at: datetime
    approver: str | None = None
    history: list[str] = Field(default_factory=list)


class ScaleInput(Model):
    cluster: str
    policy: str
    workload: WorkloadRef
    default_mode: Mode = "Recommend"
    prometheus_configured: bool = False
    settings: ScaleSettings = Field(default_factory=ScaleSettings)
    resume: ScaledState | None = None


class ScalePolicyRequest(Model):
    policy: str
    default_mode: Mode
    prometheus_configured: bool
    workload: WorkloadRef


class ScalePolicySnapshot(Model):
    name: str
    exists: bool = True
    generation: int = 0
    mode: Mode = "Recommend"
    mode_reason: str = ""  # why the enforced mode differs from the policy's (R1.3)
    applies: bool = True  # the workload is still in the policy's namespaces, selector and not excluded
    not_applying_reason: str = ""
    threshold: float = 0.05
    idle_for_seconds: int = 1800
    min_coverage: float = 0.9
    schedule: ScheduleWake | None = None
    demand_query: str = ""
    activation_threshold: float = 0.0
    demand_poll_seconds: int = 30


class ObserveRequest(Model):
    workload: WorkloadRef
    threshold: float
    idle_for_seconds: int
    min_coverage: float


class Observation(Model):
    replicas: int
    idle: bool
    reason: str
    pods: list[str] = Field(default_factory=list)
    peak: float | None = None


class ScaleRequest(Model):
    operation: str
    workload: WorkloadRef
    replicas: int = Field(ge=0)
    # The replicas the operation last saw; anything else means someone else scaled the workload.
    expect: int = Field(ge=0)


class ScaleResult(Model):
    done: bool
    found: int  # replicas before this call
    message: str = ""


class ReadyRequest(Model):
    workload: WorkloadRef
    replicas: int
    timeout_seconds: int


class ReadyResult(Model):
    ready: int
    replicas: int


class WakeTimeRequest(Model):
    schedule: ScheduleWake
    after: datetime


class WakeTime(Model):
    at: datetime


class DemandRequest(Model):
    query: str


class DemandValue(Model):
    value: float | None = None
    error: str = ""


class ScaleStatusUpdate(Model):
    """One workload's entry in the policy's ``status.scaleToZero.workloads`` (None removes it)."""

    policy: str
    workload: WorkloadRef
    entry: dict[str, str | int | None] | None = None


class WakeRequest(OperatorRequest):
    pass


class WakeResult(OperatorResult):
    phase: ScalePhase


class ScaleView(OperationViewBase):
    """What `ops show` and the workflow's ``state`` query return for a scale operation."""

    workload: str
    mode: Mode | None = None
    phase: ScalePhase
    replicas_before: int | None = None
    woken_by: str | None = None


class ScaleOutcome(Model):
    operation: str
    phase: ScalePhase
    message: str
    replicas_before: int | None = None
