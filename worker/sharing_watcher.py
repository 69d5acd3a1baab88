"""The metrics loop for Sharing policies. Every resync, each Sharing policy's nodes are measured (one round of
Prometheus queries for all of them) and decided (planning/sharing.py); a time-slicing proposal gets its
TimeSlicingWorkflow (one per node: a running one is left as it is). What was decided, and why not for the others,
goes into the policy's ``status.sharing``: the mode enforced (R1.3: without ``prometheus.url`` nothing is measured
and the policy stays in Recommend), conditions, and one entry per node. A node gets one operation at a time:
time-slicing when it applies, else a MIG geometry (MigWorkflow, Approve unless the policy names a mode: MIG
evicts every GPU pod of the node)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from activities.clients.prometheus import MetricsError
from activities.sharing import SharingOps
from models.policy import Mode, SharingPolicy
from models.sharing import (
    NO_PROMETHEUS,
    MigInput,
    MigSettings,
    PolicyModeChange,
    SharingPhase,
    SharingSettings,
    SharingView,
    TimeSlicingInput,
    sharing_workflow_id,
)
from planning.idle import PodMemory
from planning.sharing import Proposal, Rule, decide, mig_geometries
from worker.metrics_loop import (
    ResyncLoop,
    each_policy,
    evaluated_at,
    metrics_condition,
    prometheus_condition,
)

log = logging.getLogger("kubeon.sharing")


@dataclass
class Candidate:
    policy: str
    mode: Mode
    mode_reason: str
    proposal: Proposal
    gpus: int
    fail_requests_greater_than_one: bool
    slices: dict[str, int] | None = None  # MIG: per GPU


def rule_of(policy: SharingPolicy) -> Rule:
    spec = policy.spec
    return Rule(threshold=spec.idle.threshold, min_coverage=spec.idle.min_coverage, window=spec.idle.window,
                max_replicas=spec.time_slicing.max_replicas if spec.time_slicing else None,
                fail_requests_greater_than_one=spec.time_slicing.fail_requests_greater_than_one
                if spec.time_slicing else True,
                mig_allowed=tuple(spec.mig.allowed) if spec.mig else (),
                mig_headroom=spec.mig.headroom if spec.mig else 0.1, usd_per_gpu_hour=spec.usd_per_gpu_hour)


class SharingWatcher(ResyncLoop):
    NAME = "Sharing"
    log = log

    def __init__(self, ops: SharingOps, temporal: Client, *, cluster: str, task_queue: str,
                 default_mode: Mode, settings: SharingSettings, namespace: str, config_map: str,
                 resync_seconds: float = 60.0, mig_settings: MigSettings | None = None) -> None:
        super().__init__(temporal, cluster=cluster, task_queue=task_queue, resync_seconds=resync_seconds)
        self.mig_settings = mig_settings or MigSettings(approval_timeout_seconds=settings.approval_timeout_seconds)
        self.ops = ops
        self.default_mode = default_mode
        self.settings = settings
        self.namespace = namespace
        self.config_map = config_map

    def evaluate(self) -> list[Candidate]:
        return each_policy(self.ops.list_policies, self.evaluate_policy, what="Sharing policy", log=log)

    def evaluate_policy(self, policy: SharingPolicy) -> list[Candidate]:
        spec = policy.spec
        mode, reason = spec.effective_mode(self.default_mode), ""
        measured = self.ops.metrics is not None
        if not measured and mode != "Recommend":
            mode, reason = "Recommend", NO_PROMETHEUS
        nodes = self.ops.node_facts(spec.nodes.match_labels)
        problem = "" if measured else NO_PROMETHEUS
        usage: dict[tuple[str, str], PodMemory] = {}
        if self.ops.metrics is not None and nodes:
            try:
                usage = self.ops.metrics.pod_memory([], spec.idle.window_seconds)
            except MetricsError as exc:
                problem = str(exc)
        rule = rule_of(policy)
        entries: list[dict[str, Any]] = []
        candidates: list[Candidate] = []
        for node in nodes:
            if problem:
                entries.append({"node": node.name, "proposals": [], "reason": f"not measured: {problem}"})
                continue
            verdict = decide(node, usage, rule)
            entries.append({"node": node.name, "proposals": [p.status() for p in verdict.proposals],
                            "reason": verdict.reason})
            for p in verdict.proposals[:1]:  # one operation per node: time-slicing first when both apply
                if p.kind == "time-slicing":
                    candidates.append(Candidate(policy.name, mode, reason, p, node.gpus,
                                                rule.fail_requests_greater_than_one))
                else:
                    mig_mode = spec.mig_mode(self.default_mode) if measured else "Recommend"
                    candidates.append(Candidate(policy.name, mig_mode, reason, p, node.gpus, True,
                                                mig_geometries(node.product).get(p.geometry, {})))
        self.ops.patch_status(policy.name, {
            "enforcedMode": mode, "modeReason": reason,
            "conditions": [prometheus_condition(measured, NO_PROMETHEUS), metrics_condition(problem)],
            "evaluatedAt": evaluated_at(),
            "proposals": sum(len(e["proposals"]) for e in entries),
            "savingUsdPerHour": round(sum(p["savingUsdPerHour"] for e in entries for p in e["proposals"]), 2),
            "nodes": entries[:100]})
        return candidates

    async def resync(self) -> list[str]:
        candidates = await asyncio.to_thread(self.evaluate)
        started = []
        for c in candidates:
            p = c.proposal
            if c.mode != "Recommend":
                await self._tell_recommendation(sharing_workflow_id(self.cluster, p.node), c.mode, p.plan_id)
            if p.kind == "mig":
                started.append(await self._start_operation(
                    "Mig",
                    MigInput(cluster=self.cluster, policy=c.policy, node=p.node, gpus=c.gpus, geometry=p.geometry,
                             slices=c.slices or {}, mode=c.mode, mode_reason=c.mode_reason, plan_id=p.plan_id,
                             summary=p.summary(), reason=p.reason, risk=p.risk,
                             saving_usd_per_hour=p.saving_usd_per_hour, settings=self.mig_settings),
                    id=sharing_workflow_id(self.cluster, p.node),
                    summary=f"Sharing: MIG {p.geometry} on {p.node} (policy {c.policy})"))
                continue
            started.append(await self._start_operation(
                "TimeSlicing",
                TimeSlicingInput(cluster=self.cluster, policy=c.policy, node=p.node, gpus=c.gpus, replicas=p.replicas,
                                 fail_requests_greater_than_one=c.fail_requests_greater_than_one, mode=c.mode,
                                 mode_reason=c.mode_reason, plan_id=p.plan_id, summary=p.summary(), reason=p.reason,
                                 risk=p.risk, saving_usd_per_hour=p.saving_usd_per_hour, namespace=self.namespace,
                                 config_map=self.config_map, settings=self.settings),
                id=sharing_workflow_id(self.cluster, p.node),
                summary=f"Sharing: time-slicing {p.replicas} on {p.node} (policy {c.policy})"))
        self.started += started
        return started

    async def _tell_recommendation(self, workflow_id: str, mode: Mode, plan_id: str) -> None:
        """A node's operation still standing as a recommendation of this proposal, while its policy now acts:
        signal it the mode (it goes on to await approval, or applies). Asked first (a query adds nothing to its
        history), so operations that already act get no signal each resync."""
        handle = self.temporal.get_workflow_handle(workflow_id)
        try:
            view = await handle.query("state", result_type=SharingView)
        except RPCError:  # none running (the start that follows makes one), or it cannot answer now: next resync
            return
        if view.phase == SharingPhase.PROPOSED and view.mode == "Recommend":
            await handle.signal("policy_mode", PolicyModeChange(mode=mode, plan_id=plan_id))
