"""Kubernetes side of ScaleToZero with the optimizer's own credentials: read Deployments, StatefulSets and pods
(ClusterRole, R5.1), change replicas only through the ``/scale`` subresource (the per-namespace Role, R5.2:
``deployments/scale``, ``statefulsets/scale``: get, patch). The Role cannot annotate workloads, so the replicas a
workload had live in the workflow's state and the policy's status, never on the workload."""

from __future__ import annotations

import zoneinfo
from collections.abc import Callable
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import Any

from kubernetes import client
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.kube import is_live
from activities.clients.policies import enforceable_policies
from activities.clients.policies import patch_policy_status
from activities.clients.prometheus import MetricsError
from activities.clients.prometheus import PrometheusClient
from activities.context import poll
from models.policy import API_GROUP
from models.policy import PLURAL
from models.policy import WEEKDAYS
from models.policy import AnyPolicy
from models.policy import PolicyError
from models.policy import ScaleToZeroPolicy
from models.policy import ScheduleWake
from models.policy import duration_seconds
from models.policy import parse_policy
from models.scale import NO_PROMETHEUS
from models.scale import STATUS_KEY
from models.scale import DemandRequest
from models.scale import DemandValue
from models.scale import Observation
from models.scale import ObserveRequest
from models.scale import ReadyRequest
from models.scale import ReadyResult
from models.scale import ScalePolicyRequest
from models.scale import ScalePolicySnapshot
from models.scale import ScaleRequest
from models.scale import ScaleResult
from models.scale import ScaleStatusUpdate
from models.scale import WakeTime
from models.scale import WakeTimeRequest
from models.scale import WorkloadRef
from planning.idle import judge_idle

# Must match workflows.scale (workflows may not import activities).
SCALE_FORBIDDEN = "ScaleForbidden"
WORKLOAD_GONE = "WorkloadGone"


class ScaleForbidden(Exception):
    pass


def scale_role_missing(namespace: str) -> str:
    return (f"the optimizer may not scale workloads in namespace {namespace}: the chart's scale Role is missing "
            "there (add the namespace to the chart's scaleToZero.namespaces)")


def selector_string(selector: client.V1LabelSelector | None) -> str:
    """A label selector as the API's ``labelSelector`` parameter."""
    if selector is None:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.match_labels or {}).items())]
    for expr in selector.match_expressions or []:
        values = ",".join(expr.values or [])
        if expr.operator == "In":
            parts.append(f"{expr.key} in ({values})")
        elif expr.operator == "NotIn":
            parts.append(f"{expr.key} notin ({values})")
        elif expr.operator == "Exists":
            parts.append(expr.key)
        elif expr.operator == "DoesNotExist":
            parts.append(f"!{expr.key}")
    return ",".join(parts)


def next_wake(schedule: ScheduleWake, after: datetime) -> datetime:
    """The first ``schedule.at`` on one of its weekdays, in its time zone, strictly after ``after`` (UTC)."""
    tz = zoneinfo.ZoneInfo(schedule.time_zone)
    hour, minute = (int(x) for x in schedule.at.split(":"))
    local = after.astimezone(tz)
    for days in range(8):
        day = (local + timedelta(days=days)).date()
        candidate = datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz)
        if WEEKDAYS[candidate.weekday()] in schedule.weekdays and candidate > after:
            return candidate.astimezone(UTC)
    raise ValueError(f"no wake time in the week after {after.isoformat()}")  # weekdays is never empty


def _name(obj: Any) -> str:
    return str(obj.metadata.name)


class ScaleOps:
    """Workload reads, scale patches and policy status writes: the watcher's, and ScaleWorkflow's activities."""

    def __init__(self, api: client.ApiClient, metrics: PrometheusClient | None) -> None:
        self.api = api
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.authz = client.AuthorizationV1Api(api)
        self.metrics = metrics

    # -- permission ----------------------------------------------------------------------------------------
    def can_scale(self, namespace: str) -> bool:
        """Whether this identity may patch ``deployments/scale`` and ``statefulsets/scale`` in the namespace
        (SelfSubjectAccessReview: allowed to every authenticated user)."""
        for resource in ("deployments", "statefulsets"):
            for verb in ("get", "patch"):
                review: Any = self.authz.create_self_subject_access_review(client.V1SelfSubjectAccessReview(
                    spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=client.V1ResourceAttributes(
                        namespace=namespace, verb=verb, group="apps", resource=resource, subresource="scale"))))
                if not review.status.allowed:
                    return False
        return True

    # -- workloads -----------------------------------------------------------------------------------------
    def read_workload(self, ref: WorkloadRef) -> Any:
        try:
            if ref.kind == "Deployment":
                return self.apps.read_namespaced_deployment(ref.name, ref.namespace)
            return self.apps.read_namespaced_stateful_set(ref.name, ref.namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                raise ApplicationError(f"{ref.key} no longer exists", type=WORKLOAD_GONE, non_retryable=True
                                       ) from None
            raise

    def list_workloads(self, namespace: str, kinds: list[str], match_labels: dict[str, str]
                       ) -> list[tuple[WorkloadRef, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        out: list[tuple[WorkloadRef, Any]] = []
        found: list[Any]
        if "Deployment" in kinds:
            found = self.apps.list_namespaced_deployment(namespace, label_selector=selector).items
            out += [(WorkloadRef(namespace=namespace, kind="Deployment", name=_name(w)), w) for w in found]
        if "StatefulSet" in kinds:
            found = self.apps.list_namespaced_stateful_set(namespace, label_selector=selector).items
            out += [(WorkloadRef(namespace=namespace, kind="StatefulSet", name=_name(w)), w) for w in found]
        return out

    def pods_of(self, workload: Any, pods: list[Any] | None = None) -> list[Any]:
        """The workload's live pods (not finished, not terminating), by its selector."""
        namespace = workload.metadata.namespace
        found: list[Any]
        if pods is None:
            found = self.core.list_namespaced_pod(namespace, label_selector=selector_string(
                workload.spec.selector)).items
        else:
            wanted = (workload.spec.selector.match_labels or {}) if workload.spec.selector else {}
            found = [p for p in pods if all((p.metadata.labels or {}).get(k) == v for k, v in wanted.items())]
        return [p for p in found if is_live(p)]

    @activity.defn(name="observe_workload")
    def observe(self, req: ObserveRequest) -> Observation:
        workload = self.read_workload(req.workload)
        replicas = int(workload.spec.replicas if workload.spec.replicas is not None else 1)
        pods = sorted(str(p.metadata.name) for p in self.pods_of(workload))
        if self.metrics is None:
            return Observation(replicas=replicas, idle=False, reason=NO_PROMETHEUS, pods=pods)
        try:
            activity_ = self.metrics.pod_activity([req.workload.namespace], req.idle_for_seconds)
        except MetricsError as exc:
            return Observation(replicas=replicas, idle=False, reason=f"not measured: {exc}", pods=pods)
        verdict = judge_idle([(req.workload.namespace, p) for p in pods], activity_, threshold=req.threshold,
                             idle_for_s=req.idle_for_seconds, min_coverage=req.min_coverage)
        return Observation(replicas=replicas, idle=verdict.idle, reason=verdict.reason, pods=pods,
                           peak=verdict.peak)

    def _scale_api(self, ref: WorkloadRef) -> tuple[Callable[..., Any], Callable[..., Any]]:
        if ref.kind == "Deployment":
            return self.apps.read_namespaced_deployment_scale, self.apps.patch_namespaced_deployment_scale
        return self.apps.read_namespaced_stateful_set_scale, self.apps.patch_namespaced_stateful_set_scale

    def read_scale(self, ref: WorkloadRef) -> Any:
        read, _ = self._scale_api(ref)
        try:
            return read(ref.name, ref.namespace)
        except client.ApiException as exc:
            if exc.status == 403:
                raise ScaleForbidden(scale_role_missing(ref.namespace)) from None
            if exc.status == 404:
                raise ApplicationError(f"{ref.key} no longer exists", type=WORKLOAD_GONE, non_retryable=True
                                       ) from None
            raise

    def scale(self, req: ScaleRequest) -> ScaleResult:
        """Set the replicas through ``/scale`` if they are still what the operation saw (the patch carries the
        resourceVersion read, so a concurrent change fails it). Already at the target: done (a retry)."""
        ref = req.workload
        _, patch = self._scale_api(ref)
        for _ in range(5):
            current = self.read_scale(ref)
            found = int(current.spec.replicas or 0)
            if found == req.replicas:
                return ScaleResult(done=True, found=found, message=f"{ref.key} is at {found} replica(s)")
            if found != req.expect:
                return ScaleResult(done=False, found=found, message=(
                    f"{ref.key} was scaled to {found} replica(s) by something else (HPA, KEDA, GitOps or a "
                    f"person) while the optimizer expected {req.expect}: left alone"))
            body = {"metadata": {"resourceVersion": current.metadata.resource_version},
                    "spec": {"replicas": req.replicas}}
            try:
                patch(ref.name, ref.namespace, body)
            except client.ApiException as exc:
                if exc.status == 409:
                    continue  # changed between read and patch: look again
                if exc.status == 403:
                    raise ScaleForbidden(scale_role_missing(ref.namespace)) from None
                raise
            return ScaleResult(done=True, found=found, message=f"{ref.key} scaled from {found} to {req.replicas}")
        raise RuntimeError(f"{ref.key} kept changing while scaling it")

    def ready(self, ref: WorkloadRef) -> int:
        workload = self.read_workload(ref)
        return int((workload.status.ready_replicas if workload.status else 0) or 0)

    # -- the policy ----------------------------------------------------------------------------------------
    def read_policy(self, name: str) -> ScaleToZeroPolicy | None:
        try:
            doc = self.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        try:
            policy = parse_policy(doc)
        except PolicyError:
            return None
        return policy if isinstance(policy, ScaleToZeroPolicy) else None

    def list_all_policies(self) -> list[AnyPolicy]:
        return enforceable_policies(self.custom)

    def list_policies(self) -> list[ScaleToZeroPolicy]:
        return [p for p in self.list_all_policies() if isinstance(p, ScaleToZeroPolicy)]

    def patch_status(self, policy: str, scale_status: dict[str, Any], key: str = STATUS_KEY) -> None:
        patch_policy_status(self.custom, policy, key, scale_status)

    @activity.defn(name="load_scale_policy")
    def snapshot(self, req: ScalePolicyRequest) -> ScalePolicySnapshot:
        policy = self.read_policy(req.policy)
        if policy is None:
            return ScalePolicySnapshot(name=req.policy, exists=False)
        spec = policy.spec
        mode = spec.effective_mode(req.default_mode)
        reason = ""
        if not req.prometheus_configured and mode != "Recommend":
            mode, reason = "Recommend", NO_PROMETHEUS
        ref = req.workload
        applies, why = True, ""
        if ref.namespace not in spec.namespaces:
            applies, why = False, f"namespace {ref.namespace} is no longer one of the policy's"
        elif ref.kind not in spec.selector.kinds or spec.excluded(ref.namespace, ref.name):
            applies, why = False, f"{ref.key} is excluded by the policy"
        else:
            labels = self.read_workload(ref).metadata.labels or {}
            if any(labels.get(k) != v for k, v in spec.selector.match_labels.items()):
                applies, why = False, f"{ref.key} no longer matches the policy's selector"
        demand = spec.wake.demand
        return ScalePolicySnapshot(
            name=policy.name, generation=policy.metadata.generation or 0, mode=mode, mode_reason=reason,
            applies=applies, not_applying_reason=why, threshold=spec.idle.threshold,
            idle_for_seconds=spec.idle.idle_for_seconds, min_coverage=spec.idle.min_coverage,
            schedule=spec.wake.schedule, demand_query=demand.query if demand else "",
            activation_threshold=demand.activation_threshold if demand else 0.0,
            demand_poll_seconds=duration_seconds(demand.poll_interval) if demand else 30)

    # -- activities (and snapshot, observe above); their names are what histories hold ---------------------
    @activity.defn(name="scale_workload")
    def scale_workload(self, req: ScaleRequest) -> ScaleResult:
        try:
            return self.scale(req)
        except ScaleForbidden as exc:
            raise ApplicationError(str(exc), type=SCALE_FORBIDDEN, non_retryable=True) from None

    @activity.defn(name="read_replicas")
    def read_replicas(self, ref: WorkloadRef) -> int:
        try:
            return int(self.read_scale(ref).spec.replicas or 0)
        except ScaleForbidden as exc:
            raise ApplicationError(str(exc), type=SCALE_FORBIDDEN, non_retryable=True) from None

    @activity.defn(name="wait_workload_ready")
    async def wait_workload_ready(self, req: ReadyRequest) -> ReadyResult:
        """Until the workload has ``replicas`` Ready pods; heartbeats, so a killed worker's wait moves on."""
        ready, done = await poll(lambda: self.ready(req.workload), lambda n: n >= req.replicas,
                                 timeout_seconds=req.timeout_seconds, describe=lambda n: f"{n}/{req.replicas} ready")
        if not done:
            raise ApplicationError(f"{req.workload.key}: only {ready} of {req.replicas} pod(s) Ready after "
                                   f"{req.timeout_seconds}s", non_retryable=True)
        return ReadyResult(ready=ready, replicas=req.replicas)

    @activity.defn(name="next_wake_time")
    def next_wake_time(self, req: WakeTimeRequest) -> WakeTime:
        return WakeTime(at=next_wake(req.schedule, req.after))

    @activity.defn(name="demand_value")
    def demand_value(self, req: DemandRequest) -> DemandValue:
        if self.metrics is None:
            return DemandValue(error=NO_PROMETHEUS)
        try:
            return DemandValue(value=self.metrics.scalar(req.query))
        except MetricsError as exc:
            return DemandValue(error=str(exc))

    @activity.defn(name="update_scale_status")
    def update_scale_status(self, req: ScaleStatusUpdate) -> None:
        self.patch_status(req.policy, {"workloads": {req.workload.key: req.entry}})

    def all(self) -> list[Callable[..., Any]]:
        return [self.snapshot, self.observe, self.scale_workload, self.read_replicas, self.wait_workload_ready,
                self.next_wake_time, self.demand_value, self.update_scale_status]
