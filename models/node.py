"""One burst node's life: launch, join, verify, serve, return home (``BurstNodeWorkflow``)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from models.base import Model
from models.base import OperationViewBase
from models.cost import ActualCost
from models.cost import TransferReading
from models.join import NodeIdentity
from models.labels import Taint
from models.policy import Mode
from models.provisioning import MeasuredEgress
from models.provisioning import Offering
from models.provisioning import OperationSettings
from models.provisioning import PendingPod
from models.provisioning import PlannedNode


class NodePhase(StrEnum):
    """A burst node's state machine (``BurstNodeWorkflow``): the values are the ``KubeonPhase`` search attribute
    and what histories hold, shared with the other operations' phases where the meaning is the same."""

    LAUNCHING = "Launching"
    PROPOSED = "Proposed"  # the policy switched to Recommend before launch: nothing launched
    JOINING = "Joining"
    VERIFYING = "Verifying"
    SERVING = "Serving"
    DRAINING = "Draining"
    HELD = "Held"  # the hub rejected this cluster's token (R2.3): no action until a valid one is mounted
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class NodeInput(Model):
    """One new burst node of a batch: launch -> join -> verify -> serve -> return home."""

    cluster: str
    policy: str
    batch: str
    provision_workflow_id: str
    node: PlannedNode
    default_mode: Mode = "Recommend"
    settings: OperationSettings = Field(default_factory=OperationSettings)


class LaunchRequest(Model):
    operation: str
    cluster: str
    policy: str
    allowed_locations: list[str]
    offering: Offering
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]


class Instance(Model):
    provider: str
    location: str
    instance_id: str
    instance_type: str = ""
    state: str = ""
    tags: dict[str, str] = Field(default_factory=dict)
    node_name: str = ""
    launched_at: datetime | None = None
    # The ID its cloud signs into the instance's attested identity where that is not instance_id (Azure: the VM's
    # vmId; empty elsewhere, or not known): what the node's join identity is bound to (issue 27).
    attested_id: str = ""


class InstanceRef(Model):
    location: str
    instance_id: str
    policy: str


class NodeWaitRequest(Model):
    operation: str
    node_name: str
    timeout_seconds: int


class NodeIdentityCheck(Model):
    """A joined node's attested identity against the instance launched for its operation (issue 27)."""

    operation: str
    node_name: str
    instance: Instance


class NodeIdentityResult(Model):
    identity: NodeIdentity
    detail: str  # for the node's "joined" audit record: what was attested, and that it is the launched instance


class NodeExpectation(Model):
    node_name: str
    taint_key: str
    labels: dict[str, str]
    pods: list[PendingPod]
    timeout_seconds: int


class VerifyResult(Model):
    node_name: str
    pods_on_node: list[str]


class BurnInRequest(Model):
    """issue 27: the checks a registered node (still tainted) must pass before it serves."""

    node_name: str
    gpus: int  # the offering's GPUs: allocatable nvidia.com/gpu must equal it
    checks: list[str]
    timeout_seconds: int
    # The node's operation: the gateway probes the tunnel of that operation's node only.
    operation: str = ""


class BurnInResult(Model):
    node_name: str
    passed: list[str]  # one line per check that passed, what it saw


class ServeCheckRequest(Model):
    node_name: str
    return_home: bool
    check_seconds: float = 30
    # An empty node is idle only when no waiting pod tolerating this taint could take it (burst nodes are shared).
    taint_key: str = ""
    # What home nodes must carry to take the node's pods back (returnHome).
    node_selector: dict[str, str] = Field(default_factory=dict)
    # The node's tunnel transfer is read from the gateway this often while it serves (0: never; issue 27).
    operation: str = ""
    location: str = ""
    transfer_check_seconds: float = 0
    # The budget on actuals: a reading that puts the node's cost per GPU-hour over max_gpu_hour ends the serve
    # (on_over_budget Drain) or is returned once to be recorded (Report; over_budget_reported: done already).
    offering: Offering | None = None
    launched_at: datetime | None = None
    max_gpu_hour: float = 0
    on_over_budget: str = "Report"
    over_budget_reported: bool = False


class ServeCheckResult(Model):
    done: bool
    reason: str = ""
    pods_on_node: int = 0
    transfer: TransferReading | None = None  # the last reading while serving
    over_budget: str = ""  # why the cost on actuals is over maxGpuHour (empty: it is not)


class TransferRequest(Model):
    """Read a burst node's tunnel transfer from the gateway, priced by its location's egress rate."""

    node_name: str
    operation: str
    location: str


class OperationView(OperationViewBase):
    """What `ops show` and a node workflow's query return."""

    batch: str = ""
    phase: NodePhase
    node: PlannedNode | None = None
    location: str | None = None
    instance: Instance | None = None
    node_name: str | None = None
    # Cost on actuals (compute hours, measured egress) beside the proposal's estimate; None before launch.
    cost: ActualCost | None = None
    launched_at: datetime | None = None  # when the launch returned (the workflow's clock)
    over_budget: str = ""  # the cost on actuals went over maxGpuHour: when, by how much, what was done


class BurstResult(Model):
    operation: str
    phase: NodePhase
    message: str
    node: PlannedNode | None = None
    instance: Instance | None = None
    node_name: str | None = None


class CleanupRequest(Model):
    """Compensation: everything an operation may have made, found by its tag, not by what the workflow saw."""

    operation: str
    policy: str
    locations: list[str]
    node_name: str


class CleanupResult(Model):
    terminated: list[str] = Field(default_factory=list)
    node_removed: bool = False


class NodeFinished(Model):
    """A node workflow's signal to its provisioning: the node is gone home, failed or was cancelled."""

    workflow_id: str
    phase: NodePhase
    message: str = ""
    launched: bool = False
    pods: list[str] = Field(default_factory=list)
    # The egress measured at the gateway over the node's GPU-hours (None: not measured): the estimate learns.
    egress: MeasuredEgress | None = None
