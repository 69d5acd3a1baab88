"""The loop for Packing and Autoscaling policies (only with ``capacity.provider: karpenter``). Autoscaling: each
resync every NodePool of the policy is held at the limit its budgets leave it (``limits["nvidia.com/gpu"]``:
``maxGpus`` and its part of ``maxUsdPerHour``, planning/autoscaling.py; Automatic) or the limit it would set is
reported (Recommend), in ``status.autoscaling``; a dollar budget that cannot be held is said so there. Packing:
every resync, each Packing policy's GPU NodePools (``nodePools``, else every GPU NodePool the capacity provider
lists) are read and planned (planning/packing.py, the same plan the round makes). In Recommend the proposal is
only recorded; in Approve and Automatic a proposal gets its PackWorkflow, one per policy (a running round is left
as it is; a new one starts at most every ``interval`` after the last one started). The policy's ``status.packing``
says the mode enforced, the proposal (nodes, $/h saved, the pods it moves) or why there is none, the nodes kept and
why, and the round."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from temporalio.client import Client
from temporalio.client import WorkflowExecutionDescription
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.common import WorkflowIDReusePolicy
from temporalio.service import RPCError
from temporalio.service import RPCStatusCode

from activities.capacity import CapacityError
from activities.capacity import CapacityProvider
from activities.clients.policies import enforceable_policies
from activities.clients.policies import patch_policy_status
from activities.packing import plan_round
from models.autoscaling import GpuProductsChange
from models.autoscaling import GpuProductsInput
from models.autoscaling import GpuProductsView
from models.autoscaling import gpu_products_workflow_id
from models.capacity import HomeNodeGroup
from models.packing import PackInput
from models.packing import PackPlan
from models.packing import PackPlanRequest
from models.packing import PackScope
from models.packing import PackSettings
from models.packing import packing_workflow_id
from models.policy import AutoscalingPolicy
from models.policy import Mode
from models.policy import PackingPolicy
from planning.autoscaling import plan_limits

log = logging.getLogger("kubeon.packing")
STATUS_KEY = "packing"
AUTOSCALING_STATUS_KEY = "autoscaling"
MAX_KEPT = 100


@dataclass
class Holding:
    """An Autoscaling policy's evaluation: its status.autoscaling, and the GPU products changes it proposes (each
    with its pool's status entry, which says what became of it)."""

    policy: AutoscalingPolicy
    mode: Mode
    status: dict[str, Any]
    changes: list[tuple[GpuProductsChange, dict[str, Any]]]


@dataclass
class Round:
    policy: PackingPolicy
    mode: Mode
    request: PackPlanRequest
    plan: PackPlan | None
    status: dict[str, Any]


def scope_of(policy: PackingPolicy) -> PackScope:
    spec = policy.spec
    return PackScope(node_labels=dict(spec.node_selector.match_labels) if spec.node_selector else {},
                     namespaces=list(spec.pods.namespaces), pod_labels=dict(spec.pods.match_labels),
                     min_pod_age_seconds=spec.protect.min_pod_age_minutes * 60.0,
                     protect_annotations=list(spec.protect.annotations))


def proposal_status(plan: PackPlan) -> dict[str, Any]:
    return {"nodes": plan.empty, "usdPerHourSaved": round(plan.usd_per_hour_saved, 2), "summary": plan.summary(),
            "moves": [{"pod": m.pod, "from": m.source, "to": m.target, "gpus": m.gpus,
                       **({"waitsForPdb": m.waits_for_pdb} if m.waits_for_pdb else {})} for m in plan.moves[:100]]}


def products_change(group: HomeNodeGroup, wanted: list[str]) -> GpuProductsChange | None:
    """The pool's GPU products requirement to change, or None when it already requires exactly ``wanted``; the
    pool's nodes of other products would drift."""
    if sorted(group.gpu_products) == sorted(wanted):
        return None
    drifted = [n.name for n in group.nodes if n.gpu_product not in wanted]
    return GpuProductsChange(node_pool=group.name, current=list(group.gpu_products), wanted=sorted(wanted),
                             drifted=drifted)


def _limit(gpus: int | None) -> str:
    return "none" if gpus is None else str(gpus)


def _round_status(*, workflow_id: str = "", run_id: str = "", status: str = "", note: str) -> dict[str, str]:
    return {"workflowId": workflow_id, "runId": run_id, "status": status, "note": note}


class PackingWatcher:
    def __init__(self, api: client.ApiClient, capacity: CapacityProvider, temporal: Client, *, cluster: str,
                 task_queue: str, default_mode: Callable[[], Mode], settings: PackSettings | None = None,
                 resync_seconds: float = 60.0, clock: Callable[[], dt.datetime] | None = None) -> None:
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.capacity = capacity
        self.temporal = temporal
        self.cluster = cluster
        self.task_queue = task_queue
        self.default_mode = default_mode
        self.settings = settings or PackSettings()
        self.resync_seconds = resync_seconds
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.started: list[str] = []
        self._stop = asyncio.Event()

    def list_policies(self) -> list[PackingPolicy]:
        return [p for p in self.list_all() if isinstance(p, PackingPolicy)]

    def list_all(self) -> list[PackingPolicy | AutoscalingPolicy]:
        return [p for p in enforceable_policies(self.custom) if isinstance(p, PackingPolicy | AutoscalingPolicy)]

    def patch_status(self, policy: str, status: dict[str, Any], key: str = STATUS_KEY) -> None:
        patch_policy_status(self.custom, policy, key, status)

    def evaluate_policy(self, policy: PackingPolicy) -> Round:
        spec = policy.spec
        mode = spec.effective_mode(self.default_mode())
        now = self.clock()
        # Written as a JSON merge patch: every key each time, None removes one (a proposal or round gone); the
        # lists are replaced whole.
        status: dict[str, Any] = {"enforcedMode": mode, "evaluatedAt": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                  "proposal": None, "kept": [], "round": None}
        groups = list(spec.node_pools) if spec.node_pools else [g.name for g in self.capacity.list_groups()]
        request = PackPlanRequest(groups=groups, max_nodes=spec.max_nodes_at_once,
                                  min_savings_usd_per_hour=spec.min_savings_usd_per_hour, scope=scope_of(policy))
        status["nodePools"] = groups
        if not groups:
            status["reason"] = "no GPU NodePool found"
            return Round(policy, mode, request, None, status)
        try:
            plan = plan_round(self.api, self.capacity, request, now)
        except CapacityError as exc:
            status["reason"] = f"cannot read the NodePools: {exc}"
            return Round(policy, mode, request, None, status)
        except Exception as exc:  # an ApplicationError from a refused capacity call, an API error
            status["reason"] = f"cannot plan: {exc}"
            return Round(policy, mode, request, None, status)
        status["kept"] = [{"node": n, "reason": why} for n, why in sorted(plan.kept.items())][:MAX_KEPT]
        if plan.empty:
            status["proposal"] = proposal_status(plan)
            status["reason"] = ""
        else:
            status["reason"] = plan.summary()
        return Round(policy, mode, request, plan, status)

    def hold_limits(self, policy: AutoscalingPolicy) -> Holding:
        """Each of the policy's NodePools capped at the limit its budgets leave it (planning/autoscaling.py:
        maxGpus, and its part of maxUsdPerHour valued at the worst case), set in Automatic or reported in
        Recommend; a lower limit stops new GPU nodes and removes none. A dollar budget that cannot be held (a pool
        that names no instance types, or types without a price) is said so and not acted on. A pool whose GPU
        products requirement is not the policy's gpuProducts gets a change to propose (issue 23)."""
        spec = policy.spec
        mode = spec.effective_mode(self.default_mode())
        groups: dict[str, HomeNodeGroup | str] = {}
        for name in spec.node_pools:
            try:
                groups[name] = self.capacity.get_group(name)
            except CapacityError as exc:
                groups[name] = str(exc)
        plan = plan_limits(list(spec.node_pools), groups, max_gpus=spec.max_gpus,
                           max_usd_per_hour=spec.max_usd_per_hour)
        pools: list[dict[str, Any]] = []
        changes: list[tuple[GpuProductsChange, dict[str, Any]]] = []
        for name in spec.node_pools:
            group = groups[name]
            target = plan.pool(name)
            if not isinstance(group, HomeNodeGroup):
                pools.append({"nodePool": name, "gpus": None, "limit": None, "reason": group})
                continue
            entry: dict[str, Any] = {"nodePool": name, "gpus": group.gpus, "limit": group.gpu_limit}
            if spec.max_usd_per_hour is not None:
                entry["usdPerGpuHour"] = (None if target.usd_per_gpu_hour is None
                                          else round(target.usd_per_gpu_hour, 4))
                entry["budgetGpus"] = target.budget_gpus
            try:
                entry["reason"] = self._hold(name, group, target.limit, mode, entry)
            except CapacityError as exc:
                entry["reason"] = str(exc)
            if target.unvalued:
                entry["reason"] += f"; maxUsdPerHour is not held: {target.unvalued}"
            if spec.gpu_products is not None:
                change = products_change(group, spec.gpu_products)
                entry["gpuProducts"] = {"required": group.gpu_products, "wanted": sorted(spec.gpu_products),
                                        "reason": f"held: {', '.join(group.gpu_products)}" if change is None
                                        else change.summary()}
                if change is not None:
                    changes.append((change, entry["gpuProducts"]))
            pools.append(entry)
        status: dict[str, Any] = {"enforcedMode": mode, "evaluatedAt": self.clock().strftime("%Y-%m-%dT%H:%M:%SZ"),
                                  "nodePools": pools, "usdPerHour": None}
        if plan.max_usd_per_hour is not None:
            status["usdPerHour"] = {"max": plan.max_usd_per_hour, "held": plan.held,
                                    "worstCase": plan.worst_usd_per_hour,
                                    "reason": plan.reason or (f"held: the limits cost at most "
                                                              f"${plan.worst_usd_per_hour:.2f}/h of "
                                                              f"${plan.max_usd_per_hour:g}/h")}
        return Holding(policy, mode, status, changes)

    def _hold(self, name: str, group: HomeNodeGroup, limit: int | None, mode: Mode, entry: dict[str, Any]) -> str:
        if limit is None:
            return f"no budget can be held: the limit is left as it is ({_limit(group.gpu_limit)})"
        if group.gpu_limit == limit:
            reason = f"held at {limit} GPUs"
        elif mode == "Automatic":
            previous = self.capacity.set_gpu_limit(name, limit)
            entry["limit"] = limit
            reason = f"limit set to {limit} GPUs (was {_limit(previous)})"
        else:
            reason = f"Recommend: would set the limit to {limit} GPUs (now {_limit(group.gpu_limit)})"
        if group.gpus > limit:
            reason += f"; {group.gpus} GPUs run now: no new GPU node until under it, none removed"
        return reason

    def evaluate(self) -> tuple[list[Round], list[Holding]]:
        rounds, holdings = [], []
        for policy in self.list_all():
            try:
                if isinstance(policy, AutoscalingPolicy):
                    holdings.append(self.hold_limits(policy))
                else:
                    rounds.append(self.evaluate_policy(policy))
            except Exception:  # one policy's failure never stops the others
                log.exception("%s policy %s: evaluation failed", policy.spec.kind, policy.name)
        return rounds, holdings

    async def _described(self, wid: str) -> WorkflowExecutionDescription | None:
        """The workflow's latest run, or None when there is none."""
        try:
            return await self.temporal.get_workflow_handle(wid).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return None

    async def _propose_products(self, h: Holding, change: GpuProductsChange, entry: dict[str, Any]) -> None:
        """The change's operation, started once (its ID names the pool and the change): Recommend only reports; a
        decided change is not proposed again (its outcome is said)."""
        if h.mode == "Recommend":
            entry["reason"] = f"Recommend: would propose: {entry['reason']}"
            return
        wid = gpu_products_workflow_id(self.cluster, h.policy.name, change)
        entry["workflowId"] = wid
        described = await self._described(wid)
        if described is None:
            await self.temporal.start_workflow(
                "GpuProducts", GpuProductsInput(cluster=self.cluster, policy=h.policy.name, change=change),
                id=wid, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                static_summary=f"GPU products: {change.summary()} (policy {h.policy.name})")
            self.started.append(wid)
            entry["reason"] = f"awaiting approval: {entry['reason']}"
        elif described.status == WorkflowExecutionStatus.RUNNING:
            entry["reason"] = f"awaiting approval: {entry['reason']}"
        else:
            # Its result, from the history (a query of a closed workflow would need a worker to replay it).
            view = await self.temporal.get_workflow_handle(wid, result_type=GpuProductsView).result()
            entry["reason"] = f"decided ({view.phase}: {view.message}); change gpuProducts to propose again"

    async def _round(self, r: Round) -> dict[str, Any]:
        """Start the policy's round unless one runs or the last started less than ``interval`` ago."""
        wid = packing_workflow_id(self.cluster, r.policy.name)
        described = await self._described(wid)
        if described is not None:
            state = {"workflow_id": wid, "run_id": described.run_id,
                     "status": described.status.name if described.status else "UNKNOWN"}
            if described.status == WorkflowExecutionStatus.RUNNING:
                return _round_status(**state, note="a round is running; left as it is")
            since = (self.clock() - described.start_time).total_seconds()
            if since < r.policy.spec.interval_seconds:
                return _round_status(**state, note=f"the next round starts in "
                                                   f"{r.policy.spec.interval_seconds - since:.0f}s (interval "
                                                   f"{r.policy.spec.interval})")
        handle = await self.temporal.start_workflow(
            "PackWorkflow",
            PackInput(cluster=self.cluster, policy=r.policy.name, groups=r.request.groups, mode=r.mode,
                      max_nodes=r.request.max_nodes, min_savings_usd_per_hour=r.request.min_savings_usd_per_hour,
                      settings=self.settings, scope=r.request.scope),
            id=wid, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            static_summary=f"Packing: {r.plan.summary() if r.plan else ''} (policy {r.policy.name})")
        self.started.append(wid)
        return _round_status(workflow_id=wid, run_id=handle.result_run_id or "", status="RUNNING", note="started")

    async def resync(self) -> list[str]:
        rounds, holdings = await asyncio.to_thread(self.evaluate)
        started = len(self.started)
        for h in holdings:
            for change, entry in h.changes:
                try:
                    await self._propose_products(h, change, entry)
                except RPCError as exc:
                    entry["reason"] = f"cannot propose it: {exc}"
            await asyncio.to_thread(self.patch_status, h.policy.name, h.status, AUTOSCALING_STATUS_KEY)
        for r in rounds:
            if r.plan is not None and r.plan.empty and r.mode != "Recommend":
                try:
                    r.status["round"] = await self._round(r)
                except RPCError as exc:
                    r.status["round"] = _round_status(note=f"cannot start the round: {exc}")
            elif r.mode == "Recommend" and r.plan is not None and r.plan.empty:
                r.status["round"] = _round_status(note="Recommend: proposed only, nothing is moved")
            await asyncio.to_thread(self.patch_status, r.policy.name, r.status)
        return self.started[started:]

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.resync()
            except Exception:
                log.exception("Packing resync failed; retrying in %gs", self.resync_seconds)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.resync_seconds):
                    await self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
