"""Inputs, outputs and state of Sharing operations (one ``TimeSlicingWorkflow`` or ``MigWorkflow`` per node whose
time-slicing or MIG config changes). One model per workflow/activity argument; new fields need defaults."""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Final

from pydantic import Field

from models.base import Model
from models.base import OperationViewBase
from models.decisions import OperatorRequest
from models.decisions import OperatorResult
from models.policy import Mode

NO_PROMETHEUS: Final = "prometheus.url is not set: Sharing stays in Recommend mode (R1.3)"
STATUS_KEY: Final = "sharing"
CONFIG_LABEL: Final = "nvidia.com/device-plugin.config"
REPLICAS_LABEL: Final = "nvidia.com/gpu.replicas"
PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
STRATEGY_LABEL: Final = "nvidia.com/gpu.sharing-strategy"
COUNT_LABEL: Final = "nvidia.com/gpu.count"
MIG_CONFIG_LABEL: Final = "nvidia.com/mig.config"
# Keys the optimizer writes into the time-slicing ConfigMap; only these are ever removed.
KEY_PREFIX: Final = "kubeon-ts-"
# While an operation brings a key to its node (written, propagating, not yet named by the node's label), the
# ConfigMap carries the annotation <PENDING_PREFIX><hash of the node>=<key>: no other operation's cleanup removes it.
PENDING_PREFIX: Final = "sharing.gpu.kubeon.io/pending-"
# When the optimizer wrote a key (the ConfigMap's annotation <WRITTEN_PREFIX><key>=<ISO time>): its propagation
# is counted from then, whichever operation (or which attempt of one, cut off by a crash) wrote it.
WRITTEN_PREFIX: Final = "sharing.gpu.kubeon.io/written-"


def pending_annotation(node: str) -> str:
    return PENDING_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:16]


class SharingPhase(StrEnum):
    PROPOSED = "Proposed"  # Recommend: shown, never acted on
    AWAITING_APPROVAL = "AwaitingApproval"
    HELD = "Held"
    CORDONING = "Cordoning"
    EVICTING = "Evicting"  # the node's GPU pods, through the Eviction API (PDBs honoured: a blocked one waits)
    RECONFIGURING = "Reconfiguring"  # nvidia.com/mig.config set; waiting for nvidia.com/mig.config.state
    UNCORDONING = "Uncordoning"
    WRITING_CONFIG = "WritingConfig"
    PROPAGATING = "Propagating"
    LABELLING = "Labelling"
    VERIFYING = "Verifying"
    SHARED = "Shared"  # in force; undo restores the previous config
    RESTORING = "Restoring"
    UNDONE = "Undone"
    REJECTED = "Rejected"
    EXPIRED = "Expired"
    FAILED = "Failed"


def time_slicing_key(replicas: int, fail_requests_greater_than_one: bool) -> str:
    """The content-addressed ConfigMap key of a time-slicing config: the same config, the same key."""
    body = time_slicing_config(replicas, fail_requests_greater_than_one)
    return f"{KEY_PREFIX}r{replicas}-{hashlib.sha256(body.encode()).hexdigest()[:10]}"


def time_slicing_config(replicas: int, fail_requests_greater_than_one: bool) -> str:
    """A device-plugin config file (``version: v1``) sharing every GPU ``replicas`` ways."""
    return ("version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    renameByDefault: false\n"
            f"    failRequestsGreaterThanOne: {str(fail_requests_greater_than_one).lower()}\n    resources:\n"
            f"      - name: nvidia.com/gpu\n        replicas: {replicas}\n")


def sharing_workflow_id(cluster: str, node: str) -> str:
    """One sharing operation per node at a time."""
    return f"sharing/{cluster}/{node}"


class SharingSettingsBase(Model):
    approval_timeout_seconds: int = 3600


class SharingSettings(SharingSettingsBase):
    # How long a new ConfigMap key takes to reach the device plugin's mounted volume (kubelet sync period + the
    # ConfigMap cache TTL, 60-90 s by default): waited before the node label names it.
    propagation_seconds: int = 90
    # How long the node's allocatable and labels get to show the new config after the label is set.
    verify_timeout_seconds: int = 300


class SharingInputBase(Model):
    """What every sharing operation's input says: the node, the proposal and why (the workflows' shared steps read
    these)."""

    cluster: str
    policy: str
    node: str
    gpus: int
    mode: Mode = "Recommend"
    mode_reason: str = ""
    plan_id: str = ""
    summary: str = ""
    reason: str = ""
    risk: str = ""
    saving_usd_per_hour: float = 0.0
    settings: SharingSettingsBase = Field(default_factory=SharingSettingsBase)


class PolicyModeChange(Model):
    """The watcher tells a running Recommend operation that its policy now acts (Approve or Automatic), for the
    proposal it made (``plan_id``): it goes on in that mode instead of waiting out its recommendation."""

    mode: Mode
    plan_id: str


class TimeSlicingInput(SharingInputBase):
    replicas: int
    fail_requests_greater_than_one: bool = True
    namespace: str = "gpu-operator"
    config_map: str = "time-slicing-config"
    settings: SharingSettings = Field(default_factory=SharingSettings)


class WriteKeyRequest(Model):
    namespace: str
    config_map: str
    replicas: int
    fail_requests_greater_than_one: bool
    node: str = ""  # the node it is for: the key is marked pending for it until released


class WriteKeyResult(Model):
    key: str
    written: bool  # False: it was there already (never edited)
    # When the key was written (this call or an earlier one); None: no record of it (an admin's key, or one
    # written before the record was kept).
    written_at: datetime | None = None


class NodeConfig(Model):
    """What the node's config label says now (None: no label)."""

    node: str
    label: str | None = None
    replicas: int = 1
    gpus: int = 0


class LabelRequest(Model):
    node: str
    key: str | None  # None removes the label (the default config, or none)


class VerifyRequest(Model):
    node: str
    replicas: int
    gpus: int
    timeout_seconds: int


class VerifyResult(Model):
    ok: bool
    allocatable: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    reason: str = ""


class CleanupRequest(Model):
    namespace: str
    config_map: str
    release: str = ""  # the node whose pending mark to drop first


class CleanupResult(Model):
    removed: list[str] = Field(default_factory=list)


class UnservableRequest(Model):
    node: str


class UnservableResult(Model):
    """GPU pods bound to the node beyond what it now advertises: left running, never silently evicted."""

    allocatable: int
    requested: int
    pods: list[str] = Field(default_factory=list)


class UndoRequest(OperatorRequest):
    pass


class UndoResult(OperatorResult):
    phase: SharingPhase


class SharingView(OperationViewBase):
    node: str
    mode: Mode | None = None
    phase: SharingPhase
    replicas: int
    previous_label: str | None = None
    key: str = ""
    unservable: list[str] = Field(default_factory=list)
    undone_by: str | None = None


MIG_STATE_LABEL: Final = "nvidia.com/mig.config.state"


class MigSettings(SharingSettingsBase):
    # Evicting the node's GPU pods (PDBs honoured) and the MIG manager's reconfiguration (it may reboot the node).
    drain_timeout_seconds: int = 1800
    mig_timeout_seconds: int = 1800
    # After the MIG manager's success: how long the node gets to advertise the geometry's resources.
    verify_timeout_seconds: int = 300


class MigInput(SharingInputBase):
    geometry: str
    slices: dict[str, int] = Field(default_factory=dict)  # per GPU: profile -> count
    mode: Mode = "Approve"
    settings: MigSettings = Field(default_factory=MigSettings)


class MigLabelRequest(Model):
    node: str
    geometry: str | None


class MigStateRequest(Model):
    node: str
    geometry: str
    timeout_seconds: int


class MigStateResult(Model):
    state: str  # success | failed | timeout
    previous: str | None = None


class MigVerifyRequest(Model):
    node: str
    expected: dict[str, int]  # resource name -> count
    # How long the node gets to advertise them after the MIG manager's success (the device plugin restarts and
    # registers the new resources after it); 0: one look.
    timeout_seconds: int = 0


class SharingOutcome(Model):
    operation: str
    phase: SharingPhase
    message: str
    unservable: list[str] = Field(default_factory=list)
