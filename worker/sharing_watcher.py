"""The metrics loop for Sharing policies. Every resync, each Sharing policy's nodes are measured (one round of
Prometheus queries for all of them) and decided (planning/sharing.py); a time-slicing proposal gets its
TimeSlicingWorkflow (one per node: a running one is left as it is). What was decided, and why not for the others,
goes into the policy's ``status.sharing``: the mode enforced (R1.3: without ``prometheus.url`` nothing is measured
and the policy stays in Recommend), conditions, and one entry per node. A node gets one operation at a time:
time-slicing when it applies, else a MIG geometry (MigWorkflow, Approve unless the policy names a mode: MIG
evicts every GPU pod of the node).

The disruption budget, ``spec.maxNodesAtOnce`` (default 1): at most that many of a policy's nodes are changing at
once. A node counts while its operation runs in any phase but a recommendation (``Proposed`` in Recommend: it
changes nothing unless told that its policy acts, which the watcher tells it only within the budget) and
``Shared`` (the change is in force; the workflow waits for an undo). So ``AwaitingApproval`` and ``Held`` count:
an approval (or the gate's release) lets the operation cordon, evict or relabel at once without the watcher in
between, and 20 approvals in a row would otherwise evict 20 nodes' GPU pods together. A node beyond the budget
gets no operation (nor the signal) this resync, and its status entry says that it waits; the limit lives here,
not in the workflows, which keep their histories. Nodes are taken in name order. An operation whose state cannot
be read counts as changing (the safe side)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from temporalio.client import Client
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from activities.clients.prometheus import MetricsError
from activities.sharing import SharingOps
from models.policy import Mode
from models.policy import SharingPolicy
from models.sharing import NO_PROMETHEUS
from models.sharing import MigInput
from models.sharing import MigSettings
from models.sharing import PolicyModeChange
from models.sharing import SharingPhase
from models.sharing import SharingSettings
from models.sharing import SharingView
from models.sharing import TimeSlicingInput
from models.sharing import sharing_workflow_id
from planning.idle import PodMemory
from planning.sharing import Proposal
from planning.sharing import Rule
from planning.sharing import decide
from planning.sharing import mig_geometries
from worker.metrics_loop import ResyncLoop
from worker.metrics_loop import condition
from worker.metrics_loop import each_policy
from worker.metrics_loop import evaluated_at
from worker.metrics_loop import metrics_condition
from worker.metrics_loop import prometheus_condition

log = logging.getLogger("kubeon.sharing")


# A running operation in one of these phases does not hold a slot of its policy's budget (see the module docstring).
NOT_CHANGING = frozenset({SharingPhase.SHARED, SharingPhase.UNDONE, SharingPhase.REJECTED, SharingPhase.EXPIRED,
                          SharingPhase.FAILED})


def changing(view: SharingView | None) -> bool:
    """Whether a running operation (its state; None: it could not say) holds a slot of the budget."""
    if view is None:
        return True
    if view.phase in NOT_CHANGING:
        return False
    return not (view.phase == SharingPhase.PROPOSED and view.mode == "Recommend")


def budget_message(changing_now: int, limit: int) -> str:
    return f"waiting: {changing_now} of {limit} node(s) changing at once (spec.maxNodesAtOnce)"


@dataclass
class PolicyRound:
    """One policy's evaluation: its candidates, its nodes, its budget and the status to write."""

    policy: str
    nodes: list[str]
    max_nodes_at_once: int
    candidates: list[Candidate]
    status: dict[str, Any]


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
        """Every policy evaluated and its status written (without the budget, which needs Temporal); the
        candidates."""
        out: list[Candidate] = []
        for r in self.evaluate_rounds():
            self.ops.patch_status(r.policy, r.status)
            out += r.candidates
        return out

    def evaluate_rounds(self) -> list[PolicyRound]:
        return each_policy(self.ops.list_policies, lambda p: [self.evaluate_policy(p)], what="Sharing policy",
                           log=log)

    def evaluate_policy(self, policy: SharingPolicy) -> PolicyRound:
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
        status = {
            "enforcedMode": mode, "modeReason": reason,
            "conditions": [prometheus_condition(measured, NO_PROMETHEUS), metrics_condition(problem)],
            "evaluatedAt": evaluated_at(),
            "proposals": sum(len(e["proposals"]) for e in entries),
            "savingUsdPerHour": round(sum(p["savingUsdPerHour"] for e in entries for p in e["proposals"]), 2),
            "maxNodesAtOnce": spec.max_nodes_at_once,
            "nodes": entries[:100]}
        candidates.sort(key=lambda c: c.proposal.node)
        return PolicyRound(policy.name, sorted(n.name for n in nodes), spec.max_nodes_at_once, candidates, status)

    async def resync(self) -> list[str]:
        rounds = await asyncio.to_thread(self.evaluate_rounds)
        started: list[str] = []
        for r in rounds:
            try:
                started += await self._act(r)
            except Exception:
                log.exception("Sharing policy %s: starting its operations failed", r.policy)
            await asyncio.to_thread(self.ops.patch_status, r.policy, r.status)
        self.started += started
        return started

    async def _operation_state(self, node: str) -> tuple[bool, SharingView | None]:
        """Whether the node's operation runs, and its state (None: none runs, or it could not answer)."""
        handle = self.temporal.get_workflow_handle(sharing_workflow_id(self.cluster, node))
        try:
            described = await handle.describe()
        except RPCError:  # none was ever started under this ID
            return False, None
        if described.status != WorkflowExecutionStatus.RUNNING:
            return False, None
        try:
            return True, await handle.query("state", result_type=SharingView)
        except RPCError:
            return True, None

    async def _act(self, r: PolicyRound) -> list[str]:
        """The policy's candidates within its budget: each started (or, standing as a recommendation, told that
        the policy acts) while fewer than ``maxNodesAtOnce`` of its nodes change; the others wait, said in its
        status."""
        states = dict(zip(r.nodes, await asyncio.gather(*(self._operation_state(n) for n in r.nodes)), strict=True))
        busy = {n for n, (running, view) in states.items() if running and changing(view)}
        limit = r.max_nodes_at_once
        entries = {e["node"]: e for e in r.status["nodes"]}
        waiting: list[str] = []
        started = []
        for c in r.candidates:
            p = c.proposal
            running, view = states.get(p.node, (False, None))
            acts = c.mode != "Recommend"
            # What this candidate would do now: start an operation that acts (or awaits approval), or tell a
            # standing recommendation that its policy acts. Either takes a slot.
            recommendation = running and view is not None and view.phase == SharingPhase.PROPOSED \
                and view.mode == "Recommend"
            needs_slot = acts and p.node not in busy and (not running or recommendation)
            if needs_slot and len(busy) >= limit:
                waiting.append(p.node)
                if p.node in entries:
                    entries[p.node]["waiting"] = budget_message(len(busy), limit)
                continue
            if needs_slot:
                busy.add(p.node)
            if acts and recommendation:
                await self._tell_recommendation(sharing_workflow_id(self.cluster, p.node), c.mode, p.plan_id)
            if running:
                started.append(sharing_workflow_id(self.cluster, p.node))
                continue
            started.append(await self._start(c))
        r.status["changing"] = sorted(busy)[:100]
        r.status["conditions"] = [*r.status["conditions"], condition(
            "DisruptionBudget", not waiting, "NodesWaiting" if waiting else "WithinBudget",
            f"{len(busy)} of {limit} node(s) changing at once"
            + (f"; {len(waiting)} wait: {', '.join(waiting[:20])}" if waiting else ""))]
        return started

    async def _start(self, c: Candidate) -> str:
        """The candidate's operation started (one already running under its ID is left as it is); its ID."""
        p = c.proposal
        if p.kind == "mig":
            return await self._start_operation(
                "Mig",
                MigInput(cluster=self.cluster, policy=c.policy, node=p.node, gpus=c.gpus, geometry=p.geometry,
                         slices=c.slices or {}, mode=c.mode, mode_reason=c.mode_reason, plan_id=p.plan_id,
                         summary=p.summary(), reason=p.reason, risk=p.risk,
                         saving_usd_per_hour=p.saving_usd_per_hour, settings=self.mig_settings),
                id=sharing_workflow_id(self.cluster, p.node),
                summary=f"Sharing: MIG {p.geometry} on {p.node} (policy {c.policy})")
        return await self._start_operation(
            "TimeSlicing",
            TimeSlicingInput(cluster=self.cluster, policy=c.policy, node=p.node, gpus=c.gpus, replicas=p.replicas,
                             fail_requests_greater_than_one=c.fail_requests_greater_than_one, mode=c.mode,
                             mode_reason=c.mode_reason, plan_id=p.plan_id, summary=p.summary(), reason=p.reason,
                             risk=p.risk, saving_usd_per_hour=p.saving_usd_per_hour, namespace=self.namespace,
                             config_map=self.config_map, settings=self.settings),
            id=sharing_workflow_id(self.cluster, p.node),
            summary=f"Sharing: time-slicing {p.replicas} on {p.node} (policy {c.policy})")

    async def _tell_recommendation(self, workflow_id: str, mode: Mode, plan_id: str) -> None:
        """A node's operation standing as a recommendation of this proposal (its state was just read), while its
        policy now acts: signal it the mode (it goes on to await approval, or applies). Operations that already
        act get no signal each resync."""
        await self.temporal.get_workflow_handle(workflow_id).signal(
            "policy_mode", PolicyModeChange(mode=mode, plan_id=plan_id))
