"""A policy's provisioning: its waiting pods, batches, plans and the nodes it holds (``ProvisionWorkflow``)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Final
from typing import Literal

from pydantic import Field

from models.base import Model
from models.policy import Mode


class ProvisionPhase(StrEnum):
    """A policy's provisioning (``ProvisionWorkflow``): what it is doing now, across its batches."""

    IDLE = "Idle"  # no pod waits, or every waiting pod is planned
    PLANNING = "Planning"
    AWAITING_APPROVAL = "AwaitingApproval"
    WAITING_FOR_CAPACITY = "WaitingForCapacity"  # maxNodes reached, or the gateway's address slots all held


class BatchPhase(StrEnum):
    """One batch of a provisioning: planned, then proposed, decided and launched."""

    PLANNING = "Planning"
    PROPOSED = "Proposed"  # Recommend mode: the plan is the result
    AWAITING_APPROVAL = "AwaitingApproval"
    LAUNCHING = "Launching"  # its nodes started (each a BurstNode workflow)
    COMPLETED = "Completed"  # its nodes ended (one at least served), or it was withdrawn
    REJECTED = "Rejected"
    EXPIRED = "Expired"
    FAILED = "Failed"  # its nodes ended, none served: each failed (or was cancelled), at least one failed


class NodeRequirement(Model):
    """One match expression of a pod's required node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``,
    ``Gt``, ``Lt``), judged against the labels a burst node would carry."""

    key: str
    operator: str
    values: list[str] = Field(default_factory=list)


class PendingPod(Model):
    namespace: str
    name: str
    uid: str = ""
    gpus: int = Field(ge=0, default=1)
    # nodeSelector entries the burst node must carry for this pod to land there (e.g. the GPU product).
    node_selector: dict[str, str] = Field(default_factory=dict)
    # Required node affinity: the node must match one of these terms (each a list of requirements, all of which
    # hold). Empty: no affinity.
    affinity_terms: list[list[NodeRequirement]] = Field(default_factory=list)
    # Keys of NoSchedule taints the pod tolerates; "*" tolerates every key.
    tolerations: list[str] = Field(default_factory=list)
    unschedulable_since: datetime | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def tolerates(self, taint_key: str) -> bool:
        return "*" in self.tolerations or taint_key in self.tolerations


class OperationSettings(Model):
    approval_timeout_seconds: int = 3600
    join_timeout_seconds: int = 900
    verify_timeout_seconds: int = 300
    serve_check_seconds: int = 30
    # A serving burst node's tunnel transfer is read from the gateway this often (issue 27).
    transfer_check_seconds: int = 300
    drain_timeout_seconds: int = 3600
    # Batching: a policy's waiting pods are planned together once no new one arrived for the idle window (0: at
    # once; pods arriving meanwhile go into the next plan), and at the latest this long after the first arrived.
    batch_idle_seconds: float = 0.0
    # Under load (pods arrived while the last plan was being made, or within this long of others), a trickle of
    # pods would otherwise be planned a few at a time, each few on small nodes: the next plan then gathers until
    # none came for this long, at most batch_load_max_seconds after the first of them turned Unschedulable (a
    # trickle never pauses; the benchmark chose 4 s: see bench/README.md).
    batch_load_idle_seconds: float = 1.0
    batch_load_max_seconds: float = 4.0
    batch_max_seconds: float = 10.0
    # A proposal is read by a person: it gathers a rollout's pods for at least this long before it is made.
    proposal_idle_seconds: float = 2.0
    # Automatic, where the waiting pods could take every node maxNodes leaves: a rollout's stragglers are gathered
    # this long first, or the nodes planned for the first of its pods would leave none for the rest.
    limit_idle_seconds: float = 1.0
    # Pods of a rejected, expired or recommended batch are planned again only after this long (if still waiting);
    # pods whose node failed after a back-off from retry_seconds, doubling, up to this.
    recheck_seconds: float = 600.0
    retry_seconds: float = 30.0
    # A location whose node failed (launch, join, burn-in) is left out of the plans for this long, while another
    # of the policy's locations remains: its pods are planned again elsewhere (issue 27).
    location_avoid_seconds: float = 600.0
    # While pods wait that no plan could serve (maxNodes, no offering), they are planned again this often.
    replan_seconds: float = 30.0


class Offering(Model):
    """One instance type in one location, priced per GPU-hour with data transfer back home included (R4.9)."""

    location: str
    instance_type: str
    gpus: int
    gpu_product: str
    instance_usd_per_hour: float
    transfer_usd_per_gpu_hour: float
    # "estimate": the location's configured egress GB per GPU-hour; "measured": what this policy's earlier nodes
    # there measured at the gateway (``LearnedEgress``), so a plan says which it priced.
    transfer_basis: Literal["estimate", "measured"] = "estimate"

    @property
    def compute_usd_per_gpu_hour(self) -> float:
        return self.instance_usd_per_hour / self.gpus

    @property
    def usd_per_gpu_hour(self) -> float:
        return round(self.compute_usd_per_gpu_hour + self.transfer_usd_per_gpu_hour, 4)

    @property
    def transfer_usd_per_hour(self) -> float:
        return self.transfer_usd_per_gpu_hour * self.gpus

    @property
    def usd_per_hour(self) -> float:
        """What the node costs per hour: the instance and the estimated transfer of all its GPUs."""
        return round(self.instance_usd_per_hour + self.transfer_usd_per_hour, 6)

    def describe(self) -> str:
        basis = "measured transfer" if self.transfer_basis == "measured" else "est. transfer"
        return (f"{self.instance_type} ({self.gpus}x {self.gpu_product}) in {self.location} at "
                f"${self.usd_per_hour:.2f}/h (compute ${self.instance_usd_per_hour:.2f} + {basis} "
                f"${self.transfer_usd_per_hour:.2f})")


# Each finished node's measurement weighs in at full weight, the earlier ones at this fraction of theirs: the
# estimate follows a workload whose traffic changes within a few nodes, and one odd node does not rule it.
EGRESS_DECAY: Final = 0.7


class MeasuredEgress(Model):
    """What one finished burst node moved out of its location (the gateway's rx bytes) over its GPU-hours."""

    location: str
    egress_gb: float = Field(ge=0)
    gpu_hours: float = Field(gt=0)


class LearnedEgress(Model):
    """A policy's egress per GPU-hour in one location as its finished nodes measured it, decayed (EGRESS_DECAY):
    the next plan prices transfer at ``gb_per_gpu_hour`` instead of the location's configured estimate."""

    egress_gb: float = 0.0
    gpu_hours: float = 0.0
    nodes: int = 0

    @property
    def gb_per_gpu_hour(self) -> float:
        return self.egress_gb / self.gpu_hours if self.gpu_hours > 0 else 0.0

    def learn(self, measured: MeasuredEgress) -> LearnedEgress:
        return LearnedEgress(egress_gb=self.egress_gb * EGRESS_DECAY + measured.egress_gb,
                             gpu_hours=self.gpu_hours * EGRESS_DECAY + measured.gpu_hours, nodes=self.nodes + 1)


class NodeRecord(Model):
    """A burst node of the policy that is launching, joining, verifying or serving (the provisioning state)."""

    workflow_id: str
    node_name: str
    batch: str
    offering: Offering
    pods: list[str] = Field(default_factory=list)  # the pods (namespace/name) it was launched for


class PlannedNode(Model):
    offering: Offering
    # Other offerings its pods fit, dearer first-choice last: tried in order when a location has no capacity.
    alternatives: list[Offering] = Field(default_factory=list)
    pods: list[str] = Field(default_factory=list)
    gpus_used: int = 0


class Unplaced(Model):
    pod: str
    why: str
    # It fits an offering but waits for a burst node to free up (maxNodes, the gateway's address slots).
    waits_for_capacity: bool = False


class HomeScale(Model):
    """A home managed node group grown for waiting pods it can serve (capacity.provider eks-nodegroups,
    gke-nodepools, aks-nodepools, with nothing else owning its size): part of the batch's plan, approved with it."""

    group: str
    from_size: int
    to_size: int
    pods: list[str]

    def describe(self) -> str:
        return (f"home node group {self.group} from {self.from_size} to {self.to_size} node(s) for "
                f"{len(self.pods)} pod(s)")


class BatchPlan(Model):
    """One plan for a policy's waiting pods: onto nodes already there, then the cheapest new nodes."""

    plan_id: str
    batch: str
    policy: str
    new_nodes: list[PlannedNode] = Field(default_factory=list)
    # pod -> the burst node (launching, joining or serving) with room that it is expected on.
    on_existing: dict[str, str] = Field(default_factory=dict)
    unplaced: list[Unplaced] = Field(default_factory=list)
    # uids of the pods asked about that no longer wait (bound, deleted).
    gone: list[str] = Field(default_factory=list)
    # Offerings seen but refused, with why (outside the policy, over maxGpuHour, location unavailable).
    refused: list[str] = Field(default_factory=list)
    # capacity.provider karpenter: pod -> why home capacity cannot serve it (so it is burst), e.g. "home NodePool
    # gpu at its limit (8 of 8 GPUs)". Pods home capacity is serving are among ``unplaced``, with why.
    home: dict[str, str] = Field(default_factory=dict)
    # Home managed node groups grown for pods they can serve (those pods are not burst: among ``unplaced``).
    home_scale: list[HomeScale] = Field(default_factory=list)
    planned_at: datetime | None = None

    @property
    def acts(self) -> bool:
        """Whether carrying the plan out changes capacity (new burst nodes, a home group grown)."""
        return bool(self.new_nodes or self.home_scale)

    @property
    def planned_pods(self) -> set[str]:
        """The pods the plan gives capacity to: on its new nodes and in the home groups it grows."""
        return {pod for n in self.new_nodes for pod in n.pods} | {pod for h in self.home_scale for pod in h.pods}

    @property
    def total_usd_per_hour(self) -> float:
        return round(sum((n.offering.usd_per_hour for n in self.new_nodes), 0.0), 4)  # a float with no nodes too

    def summary(self) -> str:
        parts = [h.describe() for h in self.home_scale]
        if not self.new_nodes and not parts:
            parts = [f"no new node: {len(self.on_existing)} pod(s) on nodes already there"]
        elif self.new_nodes:
            counts: dict[str, int] = {}
            for n in self.new_nodes:
                what = f"{n.offering.instance_type} in {n.offering.location}"
                counts[what] = counts.get(what, 0) + 1
            parts += [f"{len(self.new_nodes)} node(s) for {sum(len(n.pods) for n in self.new_nodes)} pod(s): "
                     + ", ".join(f"{c}x {w}" for w, c in counts.items())
                     + f", total ${self.total_usd_per_hour:.2f}/h"]
            if self.on_existing:
                parts.append(f"{len(self.on_existing)} pod(s) on nodes already there")
        if self.unplaced:
            parts.append(f"{len(self.unplaced)} pod(s) not placed ({self.unplaced[0].why})")
        if self.home:
            parts.append(f"burst because {sorted(self.home.values())[0]}")
        return "; ".join(parts)

    def lines(self) -> list[str]:
        """The plan in full, as the proposal shows it."""
        out = [f"plan {self.plan_id} (batch {self.batch}): total ${self.total_usd_per_hour:.2f}/h"]
        out += [f"- {h.describe()}: {', '.join(h.pods)}" for h in self.home_scale]
        for i, n in enumerate(self.new_nodes):
            out.append(f"- node {i}: {n.offering.describe()}; pods: {', '.join(n.pods)}")
        out += [f"- {pod} on {node} (already there)" for pod, node in sorted(self.on_existing.items())]
        out += [f"- not placed: {u.pod}: {u.why}" for u in self.unplaced]
        out += [f"- {pod} burst: {why}" for pod, why in sorted(self.home.items())]
        return out


class PolicySnapshot(Model):
    name: str
    generation: int = 0
    mode: Mode
    tolerate: str
    locations: list[str]
    max_nodes: int
    max_gpu_hour: float
    return_home: bool
    on_over_budget: str = "Report"  # issue 27: Report | Drain, when the cost on actuals exceeds max_gpu_hour
    # issue 27: the burn-in checks a new node must pass before it serves, and how long each may wait.
    burn_in_checks: list[str] = Field(default_factory=list)
    burn_in_timeout_seconds: int = 300


class LoadPolicyRequest(Model):
    policy: str
    default_mode: Mode


class PodsWaiting(Model):
    """The watcher's signal to a policy's provisioning: these pods wait for a node (sent again on resync)."""

    pods: list[PendingPod]


class PodsGone(Model):
    """The watcher's signal: these pods (uids) no longer wait (bound, deleted)."""

    uids: list[str]


class BatchRecord(Model):
    """One batch as `ops show` lists it: its plan, what became of it, and the node workflows it started."""

    batch: str
    phase: BatchPhase
    plan: BatchPlan
    message: str = ""
    approver: str | None = None
    nodes: list[str] = Field(default_factory=list)  # node workflow IDs
    # node workflow ID -> the NodePhase value it ended in (told by node_finished)
    ended: dict[str, str] = Field(default_factory=dict)

    def launched(self) -> None:
        """Its nodes were started: Launching until each has ended, then what became of them."""
        self.phase = BatchPhase.LAUNCHING
        self._progress()

    def node_ended(self, workflow_id: str, phase: str) -> bool:
        """One of its nodes ended in ``phase``; True when that ended the batch (all its nodes have)."""
        if workflow_id not in self.nodes or workflow_id in self.ended:
            return False
        self.ended[workflow_id] = phase
        return self.phase == BatchPhase.LAUNCHING and self._progress()

    def _progress(self) -> bool:
        if self.phase != BatchPhase.LAUNCHING:
            return False
        counts: dict[str, int] = {}
        for phase in self.ended.values():
            counts[phase] = counts.get(phase, 0) + 1
        what = ", ".join(f"{n} {phase}" for phase, n in sorted(counts.items()))
        if not self.nodes:
            self.phase, self.message = BatchPhase.COMPLETED, "no node started: none of its pods waits any more"
            return True
        if len(self.ended) < len(self.nodes):
            self.message = f"{len(self.nodes)} node(s) started" + (f"; {len(self.ended)} ended: {what}"
                                                                   if self.ended else "")
            return False
        # NodePhase values: the same strings (models.node imports this module)
        served = counts.get(BatchPhase.COMPLETED.value, 0) > 0
        failed = counts.get(BatchPhase.FAILED.value, 0) > 0
        self.phase = BatchPhase.FAILED if failed and not served else BatchPhase.COMPLETED
        self.message = f"its {len(self.nodes)} node(s) ended: {what}"
        return True


class ProvisionInput(Model):
    cluster: str
    policy: str
    default_mode: Mode = "Recommend"
    settings: OperationSettings = Field(default_factory=OperationSettings)
    # Carried over continue-as-new.
    chain: str = ""
    seq: int = 0
    waiting: list[PendingPod] = Field(default_factory=list)
    nodes: list[NodeRecord] = Field(default_factory=list)
    # uid -> ISO time before which the pod is not planned again (declined, or its node failed).
    not_before: dict[str, str] = Field(default_factory=dict)
    failures: dict[str, int] = Field(default_factory=dict)
    batches: list[BatchRecord] = Field(default_factory=list)
    # location -> the egress this policy's finished nodes measured there (issue 27: the estimate learns).
    learned_egress: dict[str, LearnedEgress] = Field(default_factory=dict)
    home_scaled: dict[str, datetime] = Field(default_factory=dict)
    avoided_locations: dict[str, AvoidedLocation] = Field(default_factory=dict)
    # History stays short: the workflow continues as new after this many events.
    continue_after_events: int = 4000


class AvoidedLocation(Model):
    """A location left out of a provisioning's plans until ``until``, and why (its node failed)."""

    until: datetime
    why: str


class BatchPlanRequest(Model):
    policy: PolicySnapshot
    batch: str
    pods: list[PendingPod]
    nodes: list[NodeRecord]
    max_new_nodes: int
    # location -> measured egress GB per GPU-hour: priced instead of the location's configured estimate.
    egress_gb_per_gpu_hour: dict[str, float] = Field(default_factory=dict)
    # home node group -> when this provisioning last grew it: its nodes not registered after register_seconds
    # no longer hold pods back from burst.
    home_scaled: dict[str, datetime] = Field(default_factory=dict)
    # location -> why the plan leaves it out (its node failed), unless it is the only location left.
    avoid_locations: dict[str, str] = Field(default_factory=dict)


class HomeScaleRequest(Model):
    """Grow a home managed node group to ``to_size`` nodes (absolute: a retry asks for the same size)."""

    group: str
    to_size: int


class ProvisionView(Model):
    """What `ops show` and the provisioning workflow's query return."""

    workflow_id: str
    cluster: str
    policy: str
    mode: Mode | None = None
    phase: ProvisionPhase
    message: str = ""
    proposal: BatchRecord | None = None
    waiting: list[str] = Field(default_factory=list)  # pods waiting, with why where known
    nodes: list[NodeRecord] = Field(default_factory=list)
    max_nodes: int = 0
    batches: list[BatchRecord] = Field(default_factory=list)
    learned_egress: dict[str, LearnedEgress] = Field(default_factory=dict)
    history: list[str] = Field(default_factory=list)
