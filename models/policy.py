"""The ``GpuPolicy`` resource (``gpu.kubeon.io/v1``, cluster-scoped): R3.1-R3.3.

One resource, one ``spec`` per kind: ``Burst`` (``GpuPolicy``, ``GpuPolicySpec``), ``ScaleToZero``
(``ScaleToZeroPolicy``, ``ScaleToZeroSpec``) and ``GpuTypeFit`` (``GpuTypeFitPolicy``, recommendations only).
``parse_policy`` picks the model by ``spec.kind``. ``Sharing`` (``SharingPolicy``, ``SharingSpec``): time-slicing
and MIG through the GPU Operator. ``Packing`` (``PackingPolicy``, ``PackingSpec``): GPU nodes emptied through the
capacity provider.

The CRD's OpenAPI schema in ``charts/kubeon-gpu-optimizer/crds/`` must accept and reject the same documents as
these models; ``tests/models/test_policy.py`` applies one corpus to both. Field types are strict (a string is
not a number) because the apiserver is strict too.
"""

from __future__ import annotations

import re
import zoneinfo
from typing import Annotated
from typing import Any
from typing import ClassVar
from typing import Final
from typing import Generic
from typing import Literal
from typing import TypeVar

from pydantic import AfterValidator
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import StrictBool
from pydantic import StrictFloat
from pydantic import StrictInt
from pydantic import StrictStr
from pydantic import ValidationError
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

API_GROUP: Final = "gpu.kubeon.io"
API_VERSION: Final = f"{API_GROUP}/v1"
KIND: Final = "GpuPolicy"
PLURAL: Final = "gpupolicies"

Mode = Literal["Recommend", "Approve", "Automatic"]
MODES: Final[tuple[str, ...]] = ("Recommend", "Approve", "Automatic")

# R3.2 names these kinds; Burst, ScaleToZero and GpuTypeFit have a spec so far. The others are listed so that an
# error can say "not supported yet" instead of "unknown", and so that adding one is a matter of adding its spec.
SUPPORTED_KINDS: Final[tuple[str, ...]] = ("Burst", "ScaleToZero", "GpuTypeFit", "Sharing", "Packing", "Autoscaling")
PLANNED_KINDS: Final[tuple[str, ...]] = ()

PROVIDERS: Final[tuple[str, ...]] = ("aws", "gcp", "azure", "onprem", "sim")

# These patterns are written into the CRD schema verbatim (the corpus test compares them).
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LOCATION_PATTERN: Final = rf"^({'|'.join(PROVIDERS)})/{DNS_LABEL}$"
# A taint key is a qualified name: an optional DNS-subdomain prefix and "/", then a name of up to 63 chars.
TAINT_KEY_PATTERN: Final = (
    rf"^({DNS_LABEL}(\.{DNS_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)
RESOURCE_NAME_PATTERN: Final = rf"^{DNS_LABEL}(\.{DNS_LABEL})*$"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class _KindSpec(_Spec):
    """A policy's spec: its ``kind`` must be the spec's ``KIND`` (a planned or unknown kind named as such)."""

    KIND: ClassVar[str]
    kind: StrictStr

    @field_validator("kind")
    @classmethod
    def _policy_kind(cls, kind: str) -> str:
        return _known_kind(kind, cls.KIND)


class Workloads(_Spec):
    tolerate: Annotated[StrictStr, Field(pattern=TAINT_KEY_PATTERN, max_length=316)]


class Limits(_Spec):
    max_nodes: Annotated[StrictInt, Field(ge=1, le=1000)]
    # USD per GPU-hour, data transfer included (R4.8).
    max_gpu_hour: Annotated[StrictFloat, Field(gt=0, le=10000)]  # strict float takes ints, not strings
    # issue 27: a node whose cost on actuals exceeds maxGpuHour is reported (Report) or also drained (Drain).
    on_over_budget: Literal["Report", "Drain"] = "Report"


# issue 27: what a burst node must pass after it registers and before any workload lands (it keeps its taint).
# Gpus: allocatable nvidia.com/gpu equals the offering's GPUs. Tunnel: the node's tunnel carries a packet of its full
# MTU (Don't Fragment, from the gateway; a node without a tunnel passes, saying so). GpuHealth: the node's DCGM
# diagnostic (`dcgmi diag -r 1`, run by its node program, node/health.py) passed; chosen per policy, not by default:
# it needs DCGM on the node image, and a node without it fails the check.
BURN_IN_CHECKS = ("Gpus", "Tunnel", "GpuHealth")
BurnInCheck = Literal["Gpus", "Tunnel", "GpuHealth"]


def _each_once(what: str) -> Any:
    """A list field's validator: each item at most once, else ``duplicate <what> <item>`` (on the field)."""
    def check(items: list[Any]) -> list[Any]:
        seen: list[Any] = []
        for item in items:
            if item in seen:
                raise ValueError(f"duplicate {what} {item!r}")
            seen.append(item)
        return items
    return AfterValidator(check)


def _default_checks() -> list[BurnInCheck]:
    return ["Gpus", "Tunnel"]


class BurnIn(_Spec):
    """The burn-in gate: which checks run (empty: none, the node serves once verified) and how long a check may
    wait for the node to show what it must (a device plugin takes a while to advertise the GPUs)."""

    checks: Annotated[list[BurnInCheck], Field(max_length=len(BURN_IN_CHECKS)), _each_once("burn-in check")] = Field(
        default_factory=_default_checks)
    # 15 minutes, as the join: on a fresh node the GPU Operator's driver container installs (minutes) before the device
    # plugin advertises any GPU; a shorter default would terminate healthy nodes.
    timeout_seconds: Annotated[StrictInt, Field(ge=1, le=3600)] = 900


class Location(str):
    """``<provider>/<region or pool>``; the label form replaces ``/`` with ``.`` (label values cannot hold ``/``)."""

    @property
    def provider(self) -> str:
        return self.split("/", 1)[0]

    @property
    def region(self) -> str:
        return self.split("/", 1)[1]

    @property
    def label_value(self) -> str:
        return self.replace("/", ".")


def _check_location(value: str) -> str:
    provider, sep, region = value.partition("/")
    if not sep:
        raise ValueError(f"location {value!r} must be <provider>/<region or pool>, e.g. aws/eu-central-1")
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r} in location {value!r} (one of {', '.join(PROVIDERS)})")
    if not re.fullmatch(DNS_LABEL, region):
        raise ValueError(f"region or pool {region!r} in location {value!r} must be lowercase letters, digits, '-'")
    return value


LocationName = Annotated[StrictStr, Field(max_length=80), AfterValidator(_check_location)]


class GpuPolicySpec(_KindSpec):
    KIND = "Burst"
    mode: Mode | None = None
    workloads: Workloads
    locations: Annotated[list[LocationName], Field(min_length=1, max_length=64), _each_once("location")]
    limits: Limits
    return_home: StrictBool = False
    burn_in: BurnIn = Field(default_factory=BurnIn)

    def effective_mode(self, default_mode: Mode) -> Mode:
        """The mode in force: the policy's own, else the installation's ``defaultMode`` (R1.2)."""
        return self.mode or default_mode

    @property
    def location_names(self) -> list[Location]:
        return [Location(loc) for loc in self.locations]


def _known_kind(kind: str, expected: str) -> str:
    if kind == expected:
        return kind
    if kind in PLANNED_KINDS:
        raise ValueError(f"kind {kind!r} is not supported yet by this version (supported: "
                         f"{', '.join(SUPPORTED_KINDS)})")
    raise ValueError(f"unknown kind {kind!r} (supported: {', '.join(SUPPORTED_KINDS)})")


# --- ScaleToZero -----------------------------------------------------------------------------------------------

# Go-style durations the apiserver's CEL ``duration()`` also reads: 30m, 1h30m, 45s.
DURATION_PATTERN: Final = r"^([0-9]{1,4}h)?([0-9]{1,4}m)?([0-9]{1,6}s)?$"
# A label key (qualified name) and value, as Kubernetes accepts them.
LABEL_KEY_PATTERN: Final = TAINT_KEY_PATTERN
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
NAMESPACE_PATTERN: Final = rf"^{DNS_LABEL}$"
TIME_OF_DAY_PATTERN: Final = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
WORKLOAD_KINDS: Final[tuple[str, ...]] = ("Deployment", "StatefulSet")
WEEKDAYS: Final[tuple[str, ...]] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
IDLE_FOR_MIN_SECONDS: Final = 5 * 60
IDLE_FOR_MAX_SECONDS: Final = 7 * 24 * 3600
WorkloadKind = Literal["Deployment", "StatefulSet"]
Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def _all_workload_kinds() -> list[WorkloadKind]:
    return ["Deployment", "StatefulSet"]


def _all_weekdays() -> list[Weekday]:
    return ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def duration_seconds(text: str) -> int:
    """Seconds in a duration matching ``DURATION_PATTERN`` (``1h30m`` -> 5400)."""
    match = re.fullmatch(DURATION_PATTERN, text)
    if not match or not text:
        raise ValueError(f"{text!r} is not a duration such as 30m, 1h30m or 45s")
    h, m, s = (int(g[:-1]) if g else 0 for g in match.groups())
    return h * 3600 + m * 60 + s


def _duration_between(low: int, high: int) -> Any:
    def check(text: str) -> str:
        seconds = duration_seconds(text)
        if not low <= seconds <= high:
            raise ValueError(f"{text!r} must be between {low}s and {high}s")
        return text
    return AfterValidator(check)


Duration = Annotated[StrictStr, Field(min_length=2, max_length=20, pattern=DURATION_PATTERN)]
IdleFor = Annotated[Duration, _duration_between(IDLE_FOR_MIN_SECONDS, IDLE_FOR_MAX_SECONDS)]
PollInterval = Annotated[Duration, _duration_between(5, 3600)]
Namespace = Annotated[StrictStr, Field(max_length=63, pattern=NAMESPACE_PATTERN)]
LabelKey = Annotated[StrictStr, Field(max_length=316, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[StrictStr, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]


class WorkloadSelector(_Spec):
    """Which Deployments and StatefulSets of the named namespaces the policy scales: all of them by default."""

    match_labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=32)] = Field(default_factory=dict)
    kinds: Annotated[list[WorkloadKind], Field(min_length=1, max_length=2), _each_once("kind")] = Field(
        default_factory=_all_workload_kinds)


class IdleRule(_Spec):
    """Idle: every GPU of every pod of the workload at or below ``threshold`` (fraction of time the graphics
    engine is active, 0-1) for ``idleFor``, with samples covering at least ``minCoverage`` of that window."""

    threshold: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.05
    idle_for: IdleFor = "30m"
    min_coverage: Annotated[StrictFloat, Field(ge=0.5, le=1)] = 0.9

    @property
    def idle_for_seconds(self) -> int:
        return duration_seconds(self.idle_for)


class Exclusion(_Spec):
    """A workload never scaled: by name, in one namespace or (without ``namespace``) in all of the policy's."""

    name: Annotated[StrictStr, Field(max_length=253, pattern=RESOURCE_NAME_PATTERN)]
    namespace: Namespace | None = None

    def matches(self, namespace: str, name: str) -> bool:
        return self.name == name and self.namespace in (None, namespace)


def _check_time_zone(value: str) -> str:
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r} (an IANA name such as Europe/Berlin or UTC)") from None
    return value


class ScheduleWake(_Spec):
    """Wake at a time of day (kube-green's ``wakeUpAt``), on the given weekdays, in a time zone."""

    at: Annotated[StrictStr, Field(pattern=TIME_OF_DAY_PATTERN)]
    weekdays: Annotated[list[Weekday], Field(min_length=1, max_length=7), _each_once("weekday")] = Field(
        default_factory=_all_weekdays)
    time_zone: Annotated[StrictStr, Field(max_length=64), AfterValidator(_check_time_zone)] = "UTC"


class DemandWake(_Spec):
    """Wake when a Prometheus query's value rises above ``activationThreshold`` (KEDA's activation model), e.g.
    a request queue's length. Polled every ``pollInterval``."""

    query: Annotated[StrictStr, Field(min_length=1, max_length=2000)]
    activation_threshold: Annotated[StrictFloat, Field(ge=0)] = 0.0
    poll_interval: PollInterval = "30s"


class Wake(_Spec):
    """How a workload scaled to zero comes back. Manual (``kubeon-gpu ops wake``, the ``wake`` update or signal)
    always works; a schedule and a demand query are optional and may be combined: the first to fire wakes it."""

    schedule: ScheduleWake | None = None
    demand: DemandWake | None = None


class WorkloadPolicySpec(_KindSpec):
    """What every policy over workloads has: its kind (``KIND``), its namespaces (each once), a selector of the
    workloads in them, and exclusions."""

    namespaces: Annotated[list[Namespace], Field(min_length=1, max_length=64), _each_once("namespace")]
    selector: WorkloadSelector = Field(default_factory=WorkloadSelector)
    exclude: Annotated[list[Exclusion], Field(max_length=100)] = Field(default_factory=list)

    def excluded(self, namespace: str, name: str) -> bool:
        return any(e.matches(namespace, name) for e in self.exclude)


class ScaleToZeroSpec(WorkloadPolicySpec):
    """Each namespace must have the chart's scale Role (values scaleToZero.namespaces); the worker refuses others."""

    KIND = "ScaleToZero"
    mode: Mode | None = None
    idle: IdleRule = Field(default_factory=IdleRule)
    wake: Wake = Field(default_factory=Wake)

    def effective_mode(self, default_mode: Mode) -> Mode:
        return self.mode or default_mode


# --- GpuTypeFit (Recommend only) ----------------------------------------------------------------------------

FitWindow = Annotated[Duration, _duration_between(3600, 30 * 24 * 3600)]
HOURS_PER_MONTH: Final = 730.0


class GpuOffering(_Spec):
    """A GPU type (or a MIG slice of one) a workload could run on: its memory as the system reports it (e.g. GFD's
    ``nvidia.com/gpu.memory``, not the nominal GB), its price per GPU-hour and its compute relative to the
    current type (1.0: the same). ``product``: the ``nvidia.com/gpu.product`` label value its nodes carry (e.g.
    ``NVIDIA-L4``), so a recommendation of it can be expressed as a NodePool requirement; never on a MIG slice,
    which is made by sharing a GPU (kind Sharing), not by a NodePool."""

    name: Annotated[StrictStr, Field(min_length=1, max_length=63)]
    memory_mib: Annotated[StrictInt, Field(ge=1024, le=1_048_576, alias="memoryMiB")]
    usd_per_hour: Annotated[StrictFloat, Field(gt=0, le=10000)]
    relative_compute: Annotated[StrictFloat, Field(gt=0, le=100)] = 1.0
    mig: StrictBool = False
    product: Annotated[LabelValue, Field(min_length=1)] | None = None

    @field_validator("product")
    @classmethod
    def _no_product_on_a_mig_slice(cls, product: str | None, info: ValidationInfo) -> str | None:
        # ``mig`` is declared before ``product``: validated (or failed, then absent) by now.
        if product is not None and info.data.get("mig"):
            raise ValueError("product is not for a MIG candidate (mig: true): a MIG slice is made by sharing a "
                             "GPU (kind Sharing), not by a NodePool; name the product on a whole GPU type")
        return product


class FitRule(_Spec):
    """A candidate fits when the workload's peak framebuffer plus ``headroom`` fits its memory and its p95
    activity, scaled by the candidate's relative compute, stays at or below ``maxActivity``."""

    current: GpuOffering
    candidates: Annotated[list[GpuOffering], Field(min_length=1, max_length=32)]
    headroom: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.2
    window: FitWindow = "168h"
    min_coverage: Annotated[StrictFloat, Field(ge=0.5, le=1)] = 0.9
    max_activity: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.7

    @property
    def window_seconds(self) -> int:
        return duration_seconds(self.window)


class GpuTypeFitSpec(WorkloadPolicySpec):
    KIND = "GpuTypeFit"
    # Recommend only: GPU type fit never acts.
    mode: Literal["Recommend"] | None = None
    fit: FitRule

    def effective_mode(self, default_mode: Mode) -> Mode:
        return "Recommend"


# --- Sharing (time-slicing and MIG through the NVIDIA GPU Operator) --------------------------------------------

# A MIG geometry as the MIG manager's config names it: all-disabled, all-balanced, all-<g>g.<mem>gb.
MIG_GEOMETRY_PATTERN: Final = r"^all-(disabled|balanced|[1-7]g\.[0-9]{1,3}gb)$"
SharingWindow = Annotated[Duration, _duration_between(3600, 30 * 24 * 3600)]


class NodeSelector(_Spec):
    """Which GPU nodes the policy may share, by their labels (e.g. GFD's ``nvidia.com/gpu.product``)."""

    match_labels: Annotated[dict[LabelKey, LabelValue], Field(min_length=1, max_length=32)]


class TimeSlicingRule(_Spec):
    """Time-slicing: at most ``maxReplicas`` pods per GPU (the device plugin requires at least 2)."""

    max_replicas: Annotated[StrictInt, Field(ge=2, le=64)] = 4
    fail_requests_greater_than_one: StrictBool = True


class MigRule(_Spec):
    """MIG: the geometries the policy may choose; a slice must hold the pods' peak framebuffer plus headroom."""

    allowed: Annotated[list[Annotated[StrictStr, Field(pattern=MIG_GEOMETRY_PATTERN)]],
                       Field(min_length=1, max_length=16), _each_once("geometry")]
    headroom: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.1


class SharingIdle(_Spec):
    """Share only GPUs whose pods' summed p95 activity (0-1) over ``window`` stays under ``threshold``."""

    threshold: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.4
    window: SharingWindow = "168h"
    min_coverage: Annotated[StrictFloat, Field(ge=0.5, le=1)] = 0.9

    @field_validator("window", mode="before")
    @classmethod
    def _no_days(cls, value: object) -> object:
        if isinstance(value, str) and re.fullmatch(r"[0-9]+d", value):
            raise ValueError(f"{value!r}: a duration has no days here (as the apiserver's), write "
                             f"{int(value[:-1]) * 24}h")
        return value

    @property
    def window_seconds(self) -> int:
        return duration_seconds(self.window)


class SharingSpec(_KindSpec):
    KIND = "Sharing"
    mode: Mode | None = None
    nodes: NodeSelector
    time_slicing: TimeSlicingRule | None = None
    mig: MigRule | None = None
    idle: SharingIdle = Field(default_factory=SharingIdle)
    # What one GPU-hour of these nodes costs (USD): the saving of a proposal is the GPUs it frees at this price.
    usd_per_gpu_hour: Annotated[StrictFloat, Field(gt=0, le=10000)] | None = None
    # The disruption budget: at most this many of the policy's nodes changing at once (an operation cordoning,
    # evicting, reconfiguring, labelling, verifying or restoring, or awaiting an approval that would start it);
    # the others wait, said in status.sharing. MIG evicts every GPU pod of its node: 1 unless raised.
    max_nodes_at_once: Annotated[StrictInt, Field(ge=1, le=50)] = 1

    @model_validator(mode="after")
    def _some_sharing(self) -> SharingSpec:
        if self.time_slicing is None and self.mig is None:
            raise PydanticCustomError("sharing_missing", "spec.timeSlicing or spec.mig is required for kind Sharing")
        return self

    def effective_mode(self, default_mode: Mode) -> Mode:
        return self.mode or default_mode

    def mig_mode(self, default_mode: Mode) -> Mode:
        """MIG evicts every GPU pod of the node: without a mode of its own, never Automatic."""
        if self.mode is not None:
            return self.mode
        return "Approve" if default_mode == "Automatic" else default_mode


# --- Packing (GPU nodes emptied through the capacity provider, capacity.provider: karpenter) -------------------

PackingInterval = Annotated[Duration, _duration_between(10, 7 * 24 * 3600)]


class PackingPods(_Spec):
    """Which pods the policy may move: those of ``namespaces`` (all when empty) carrying ``matchLabels``. A node
    holding any other pod (DaemonSet pods aside) is not emptied."""

    namespaces: Annotated[list[Namespace], Field(max_length=64), _each_once("namespace")] = Field(
        default_factory=list)
    match_labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=32)] = Field(default_factory=dict)


class PackingProtect(_Spec):
    """Pods that hold their node: younger than ``minPodAgeMinutes``, or carrying any of ``annotations`` (keys)."""

    min_pod_age_minutes: Annotated[StrictInt, Field(ge=0, le=7 * 24 * 60)] = 0
    annotations: Annotated[list[LabelKey], Field(max_length=32), _each_once("annotation")] = Field(
        default_factory=list)


class PackingSpec(_KindSpec):
    """Empty GPU nodes whose pods fit on the others' free GPUs: of ``nodePools`` (every GPU NodePool when
    unset), their nodes matching ``nodeSelector``; a round at most every ``interval``."""

    KIND = "Packing"
    mode: Mode | None = None
    node_pools: Annotated[list[Annotated[StrictStr, Field(max_length=253, pattern=RESOURCE_NAME_PATTERN)]],
                          Field(min_length=1, max_length=32), _each_once("NodePool")] | None = None
    node_selector: NodeSelector | None = None
    pods: PackingPods = Field(default_factory=PackingPods)
    min_savings_usd_per_hour: Annotated[StrictFloat, Field(ge=0, le=100000)] = 0.0
    max_nodes_at_once: Annotated[StrictInt, Field(ge=1, le=50)] = 1
    protect: PackingProtect = Field(default_factory=PackingProtect)
    interval: PackingInterval = "1h"

    def effective_mode(self, default_mode: Mode) -> Mode:
        return self.mode or default_mode

    @property
    def interval_seconds(self) -> int:
        return duration_seconds(self.interval)


# --- Autoscaling (home GPU capacity through the capacity provider's NodePool limits) ---------------------------

NodePoolName = Annotated[StrictStr, Field(max_length=253, pattern=RESOURCE_NAME_PATTERN)]


class AutoscalingSpec(_KindSpec):
    """Hold each of ``nodePools`` under its GPU budget (``limits["nvidia.com/gpu"]``): at most ``maxGpus`` GPUs
    each, and all of them together at most ``maxUsdPerHour`` valued at the highest $/GPU-hour each pool may
    launch (planning/autoscaling.py); at least one of the two. A limit stops new nodes, it never removes one.
    Automatic holds it; Recommend (and, without a mode, any defaultMode but Automatic) only reports what it would
    set."""

    KIND = "Autoscaling"
    mode: Literal["Recommend", "Automatic"] | None = None
    node_pools: Annotated[list[NodePoolName], Field(min_length=1, max_length=32), _each_once("NodePool")]
    max_gpus: Annotated[StrictInt, Field(ge=0, le=100000)] | None = None
    # USD per hour for all of nodePools together (strict float takes ints, not strings).
    max_usd_per_hour: Annotated[StrictFloat, Field(gt=0, le=1_000_000)] | None = None
    # issue 23: the GPU products nodePools may launch, held as their requirement nvidia.com/gpu.product In [...]. A
    # requirement change drifts the pool's nodes of other products (Karpenter replaces them), so it is proposed as
    # an operation and made only when approved, whatever the mode (Recommend reports it). None: left as it is.
    gpu_products: Annotated[list[LabelValue], Field(min_length=1, max_length=16),
                            _each_once("GPU product")] | None = None

    @model_validator(mode="after")
    def _some_budget(self) -> AutoscalingSpec:
        if self.max_gpus is None and self.max_usd_per_hour is None:
            raise PydanticCustomError("autoscaling_budget_missing",
                                      "spec.maxGpus or spec.maxUsdPerHour is required for kind Autoscaling")
        return self

    def effective_mode(self, default_mode: Mode) -> Mode:
        return self.mode or ("Automatic" if default_mode == "Automatic" else "Recommend")


class ObjectMeta(BaseModel):
    # Metadata read back from the apiserver carries uid, resourceVersion, managedFields...: keep them all.
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Annotated[StrictStr, Field(pattern=RESOURCE_NAME_PATTERN, max_length=253)]
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


SpecT = TypeVar("SpecT", bound=BaseModel)


class _PolicyEnvelope(BaseModel, Generic[SpecT]):
    """The Kubernetes envelope every kind of GpuPolicy shares; ``spec`` is what the kind says."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["gpu.kubeon.io/v1"] = Field(alias="apiVersion")
    kind: Literal["GpuPolicy"]
    metadata: ObjectMeta
    spec: SpecT
    status: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.metadata.name


class GpuPolicy(_PolicyEnvelope[GpuPolicySpec]):
    """A Burst policy."""


class ScaleToZeroPolicy(_PolicyEnvelope[ScaleToZeroSpec]):
    pass


class GpuTypeFitPolicy(_PolicyEnvelope[GpuTypeFitSpec]):
    pass


class SharingPolicy(_PolicyEnvelope[SharingSpec]):
    pass


class PackingPolicy(_PolicyEnvelope[PackingSpec]):
    pass


class AutoscalingPolicy(_PolicyEnvelope[AutoscalingSpec]):
    pass


AnyPolicy = GpuPolicy | ScaleToZeroPolicy | GpuTypeFitPolicy | SharingPolicy | PackingPolicy | AutoscalingPolicy


class PolicyError(ValueError):
    """A policy document is invalid; ``errors`` lists (field path, message), the first named in ``str()``."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in errors))

    @property
    def fields(self) -> list[str]:
        return [path for path, _ in self.errors]


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic's internal validator and union-member steps
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_policy(document: Any) -> AnyPolicy:
    """Validate a GpuPolicy document (a dict as read from YAML or the apiserver) with the model of its
    ``spec.kind``. Raises ``PolicyError``."""
    if not isinstance(document, dict):
        raise PolicyError([("(document)", f"a GpuPolicy must be a mapping, got {type(document).__name__}")])
    spec = document.get("spec")
    model: type[AnyPolicy] = GpuPolicy
    if isinstance(spec, dict) and spec.get("kind") == "ScaleToZero":
        model = ScaleToZeroPolicy
    elif isinstance(spec, dict) and spec.get("kind") == "GpuTypeFit":
        model = GpuTypeFitPolicy
    elif isinstance(spec, dict) and spec.get("kind") == "Sharing":
        model = SharingPolicy
    elif isinstance(spec, dict) and spec.get("kind") == "Packing":
        model = PackingPolicy
    elif isinstance(spec, dict) and spec.get("kind") == "Autoscaling":
        model = AutoscalingPolicy
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        errors: list[tuple[str, str]] = []
        for err in exc.errors(include_url=False):
            path = _path(tuple(err["loc"]))
            msg = err["msg"].removeprefix("Value error, ")
            if (path, msg) not in errors:
                errors.append((path, msg))
        raise PolicyError(errors) from None


def location_label_value(location: str) -> str:
    return location.replace("/", ".")


def location_of_label_value(value: str) -> str:
    """The location a node's location label names: ``aws.eu-central-1`` -> ``aws/eu-central-1`` (a label value
    cannot hold "/"; the provider's name holds no ".")."""
    provider, _, rest = value.partition(".")
    return f"{provider}/{rest}" if rest else value
