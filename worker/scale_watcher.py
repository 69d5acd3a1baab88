"""The metrics loop for ScaleToZero and GpuTypeFit policies. Every resync, each ScaleToZero policy's workloads
are measured (two Prometheus queries per policy, whatever the number of pods) and every idle one gets its
ScaleWorkflow (one per workload: a running one is left as it is). What was decided, and why not for the others,
goes into the policy's ``status.scaleToZero``: the mode enforced (R1.3), namespaces refused for lack of the
chart's scale Role (R5.2), metrics problems, and one line per workload. GpuTypeFit policies get their
recommendations in ``status.gpuTypeFit`` (no action is taken), each with the NodePool requirement that would serve
it when its candidate names a product and the workload's GPU pods run on nodes of Karpenter NodePools."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import TypeVar

from temporalio.client import Client

from activities.clients.kube import gpus_requested
from activities.clients.prometheus import MetricsError
from activities.clients.prometheus import PrometheusClient
from activities.scale import ScaleOps
from activities.scale import scale_role_missing
from models.capacity import NODEPOOL_LABEL
from models.policy import AnyPolicy
from models.policy import FitRule
from models.policy import GpuTypeFitPolicy
from models.policy import Mode
from models.policy import ScaleToZeroPolicy
from models.scale import NO_PROMETHEUS
from models.scale import ScaleInput
from models.scale import ScaleSettings
from models.scale import WorkloadRef
from models.scale import scale_workflow_id
from planning.fit import FitRecommendation
from planning.fit import recommend
from planning.idle import PodActivity
from planning.idle import PodMemory
from planning.idle import judge_idle
from worker.doctor import Prerequisite
from worker.doctor import PrerequisiteLog
from worker.metrics_loop import ResyncLoop
from worker.metrics_loop import condition
from worker.metrics_loop import each_policy
from worker.metrics_loop import evaluated_at
from worker.metrics_loop import metrics_condition
from worker.metrics_loop import prometheus_condition

log = logging.getLogger("kubeon.scale")
M = TypeVar("M")
# (namespace, pod) -> what Prometheus says of it
PodSeries = dict[tuple[str, str], M]
MAX_DECISIONS = 100
FIT_STATUS_KEY = "gpuTypeFit"
NO_PROMETHEUS_FIT = "prometheus.url is not set: GPU type fit needs DCGM metrics"


@dataclass
class Candidate:
    policy: str
    workload: WorkloadRef
    reason: str


class ScaleWatcher(ResyncLoop):
    NAME = "ScaleToZero"
    log = log

    def __init__(self, ops: ScaleOps, temporal: Client, *, cluster: str, task_queue: str,
                 default_mode: Callable[[], Mode], settings: ScaleSettings, resync_seconds: float = 60.0,
                 prerequisites: Callable[[], list[Prerequisite]] | None = None,
                 prerequisites_every: float = 600.0) -> None:
        super().__init__(temporal, cluster=cluster, task_queue=task_queue, resync_seconds=resync_seconds)
        self.ops = ops
        self.default_mode = default_mode
        self.settings = settings
        self.prerequisites = prerequisites
        self.prerequisites_every = prerequisites_every
        self._prereq_log = PrerequisiteLog()
        self._prereq_checked = -1e18

    @property
    def prometheus_configured(self) -> bool:
        return self.ops.metrics is not None

    def _measured(self, wanted: bool, unconfigured: str,
                  fetch: Callable[[PrometheusClient], PodSeries[M]]) -> tuple[PodSeries[M], str]:
        """What ``fetch`` reads from Prometheus (nothing when not ``wanted``), or the problem that stopped it:
        none configured (``unconfigured`` says what that disables), or the query's error."""
        if self.ops.metrics is None:
            return {}, unconfigured
        if not wanted:
            return {}, ""
        try:
            return fetch(self.ops.metrics), ""
        except MetricsError as exc:
            return {}, str(exc)

    # -- evaluation (blocking: runs in a thread) ------------------------------------------------------------
    def evaluate(self) -> list[Candidate]:
        return each_policy(self.ops.list_all_policies, self._evaluate_any, what="policy", log=log)

    def _evaluate_any(self, policy: AnyPolicy) -> list[Candidate]:
        """ScaleToZero: its candidates; GpuTypeFit: its recommendations written (no candidates); others: none."""
        if isinstance(policy, ScaleToZeroPolicy):
            return self.evaluate_policy(policy)
        if isinstance(policy, GpuTypeFitPolicy):
            self.evaluate_fit(policy)
        return []

    def _node_pools(self, rule: FitRule) -> dict[str, str]:
        """Node -> its Karpenter NodePool, for the nodes of one; read only when a candidate could be expressed as
        a NodePool requirement (one names its product and is not a MIG slice)."""
        if not any(c.product and not c.mig for c in rule.candidates):
            return {}
        nodes: list[Any] = self.ops.core.list_node(label_selector=NODEPOOL_LABEL).items
        return {str(n.metadata.name): str(n.metadata.labels[NODEPOOL_LABEL]) for n in nodes}

    def evaluate_fit(self, policy: GpuTypeFitPolicy) -> list[FitRecommendation]:
        spec, rule = policy.spec, policy.spec.fit
        pools = self._node_pools(rule)
        # (workload, namespace, its pods, GPUs, the NodePool of each scheduled GPU pod's node, "" for none)
        workloads: list[tuple[str, str, list[str], int, list[str]]] = []
        for ns in spec.namespaces:
            ns_pods = self.ops.core.list_namespaced_pod(ns).items
            for ref, w in self.ops.list_workloads(ns, list(spec.selector.kinds), spec.selector.match_labels):
                if spec.excluded(ns, ref.name):
                    continue
                pods = self.ops.pods_of(w, ns_pods)
                gpus = sum(gpus_requested(p) for p in pods)
                if gpus:
                    workloads.append((ref.key, ns, sorted(str(p.metadata.name) for p in pods), gpus,
                                      [pools.get(str(p.spec.node_name), "") for p in pods
                                       if gpus_requested(p) and p.spec.node_name]))
        memory: dict[tuple[str, str], PodMemory]
        memory, problem = self._measured(bool(workloads), NO_PROMETHEUS_FIT,
                                         lambda m: m.pod_memory(spec.namespaces, rule.window_seconds))
        recs = [] if problem else [
            recommend(key, [memory[(ns, p)] for p in pods if (ns, p) in memory], gpus, rule, node_pools)
            for key, ns, pods, gpus, node_pools in workloads]
        recs.sort(key=lambda r: (-r.saving_usd_per_month, r.workload))
        self.ops.patch_status(policy.name, {
            "enforcedMode": "Recommend",
            "conditions": [metrics_condition(problem)],
            "evaluatedAt": evaluated_at(),
            "savingUsdPerMonth": round(sum(r.saving_usd_per_month for r in recs), 2),
            "recommendations": [r.status() for r in recs[:MAX_DECISIONS]]}, key=FIT_STATUS_KEY)
        return recs

    def evaluate_policy(self, policy: ScaleToZeroPolicy) -> list[Candidate]:
        spec = policy.spec
        mode = spec.effective_mode(self.default_mode())
        mode_reason = ""
        if not self.prometheus_configured and mode != "Recommend":
            mode, mode_reason = "Recommend", NO_PROMETHEUS
        permitted = [ns for ns in spec.namespaces if self.ops.can_scale(ns)]
        refused = [ns for ns in spec.namespaces if ns not in permitted]
        for ns in refused:
            log.warning("ScaleToZero policy %s: %s", policy.name, scale_role_missing(ns))
        decisions: list[dict[str, Any]] = []
        candidates: list[Candidate] = []
        workloads: list[tuple[WorkloadRef, list[str]]] = []
        for ns in permitted:
            ns_pods = self.ops.core.list_namespaced_pod(ns).items
            for ref, w in self.ops.list_workloads(ns, list(spec.selector.kinds), spec.selector.match_labels):
                if spec.excluded(ns, ref.name):
                    decisions.append({"workload": ref.key, "idle": False, "reason": "excluded by the policy"})
                    continue
                if (w.spec.replicas if w.spec.replicas is not None else 1) == 0:
                    decisions.append({"workload": ref.key, "idle": False, "reason": "at 0 replicas"})
                    continue
                workloads.append((ref, sorted(p.metadata.name for p in self.ops.pods_of(w, ns_pods))))
        activity: dict[tuple[str, str], PodActivity]
        activity, metrics_problem = self._measured(bool(workloads), NO_PROMETHEUS,
                                                   lambda m: m.pod_activity(permitted, spec.idle.idle_for_seconds))
        for ref, pods in workloads:
            if metrics_problem:
                decisions.append({"workload": ref.key, "idle": False, "reason": f"not measured: {metrics_problem}"})
                continue
            verdict = judge_idle([(ref.namespace, p) for p in pods], activity, threshold=spec.idle.threshold,
                                 idle_for_s=spec.idle.idle_for_seconds, min_coverage=spec.idle.min_coverage)
            decisions.append({"workload": ref.key, "idle": verdict.idle, "reason": verdict.reason})
            if verdict.idle:
                candidates.append(Candidate(policy=policy.name, workload=ref, reason=verdict.reason))
        decisions.sort(key=lambda d: (not d["idle"], d["workload"]))
        conditions = [
            prometheus_condition(self.prometheus_configured, NO_PROMETHEUS),
            condition("ScaleRolePresent", not refused, "AllNamespaces" if not refused else "ScaleRoleMissing",
                      "; ".join(scale_role_missing(ns) for ns in refused) or f"may scale in {', '.join(permitted)}"),
            metrics_condition(metrics_problem),
        ]
        self.ops.patch_status(policy.name, {
            "enforcedMode": mode, "modeReason": mode_reason, "conditions": conditions,
            "refusedNamespaces": refused, "evaluatedAt": evaluated_at(),
            "idleWorkloads": len(candidates), "decisions": decisions[:MAX_DECISIONS]})
        return candidates

    # -- acting -------------------------------------------------------------------------------------------
    async def resync(self) -> list[str]:
        """Evaluate every policy and make sure each idle workload has its operation; their workflow IDs."""
        candidates = await asyncio.to_thread(self.evaluate)
        started = []
        for c in candidates:
            started.append(await self._start_operation(
                "ScaleWorkflow",
                ScaleInput(cluster=self.cluster, policy=c.policy, workload=c.workload,
                           default_mode=self.default_mode(), prometheus_configured=self.prometheus_configured,
                           settings=self.settings),
                id=scale_workflow_id(self.cluster, c.policy, c.workload),
                summary=f"ScaleToZero {c.workload.key} (policy {c.policy})"))
        self.started += started
        return started

    async def check_prerequisites(self) -> None:
        """R1.6: at start and then every ``prerequisites_every`` seconds; a line each when one changes."""
        now = asyncio.get_running_loop().time()
        if self.prerequisites is None or now - self._prereq_checked < self.prerequisites_every:
            return
        self._prereq_checked = now
        self._prereq_log.report(await asyncio.to_thread(self.prerequisites))

    async def _round(self) -> None:
        await self.check_prerequisites()
        await self.resync()
