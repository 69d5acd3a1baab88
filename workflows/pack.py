"""One packing round (``kind: Packing``) as a durable operation: plan, propose (Recommend records it; Approve waits
for one approval; Automatic goes on within maxNodesAtOnce), then freeze the pools' disruption and cordon every node
the round empties (no replacement lands on one of them), then one node at a time: evict its pods one at a time (a
PDB refusal is a visible wait), each replacement Ready on a kept node before the next eviction, remove the emptied
node through the capacity provider, confirm its NodeClaim and Node gone. Whatever happens (a failure, a cancel, a
pod that cannot be re-placed) the nodes not removed are uncordoned and the pool unfrozen; a crash resumes from the
history, so no node is left cordoned and no budget left frozen."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from enum import StrEnum

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.exceptions import CancelledError

from models import search_attributes as sa
from models.audit import AuditRecord
from models.hub import pack_proposal_detail
from models.packing import EvictOutcome
from models.packing import GroupRef
from models.packing import NodeRef2
from models.packing import PackInput
from models.packing import PackPlan
from models.packing import PackPlanRequest
from models.packing import PackView
from models.packing import PodRef
from models.packing import ReplacementCheck
from models.packing import ReplacementState
from workflows.audit import record_audit
from workflows.failures import QUICK
from workflows.failures import RETRY
from workflows.operation import Approvable
from workflows.operation import Proposal

# A round cancelled while it waits between steps compensates too (it did only while an activity ran).
CANCEL_IN_WAIT = "pack-cancel-in-wait"


class PackPhase(StrEnum):
    PLANNING = "Planning"
    PROPOSED = "Proposed"
    AWAITING_APPROVAL = "AwaitingApproval"
    PACKING = "Packing"
    DONE = "Done"
    NOTHING_TO_DO = "NothingToDo"
    REJECTED = "Rejected"
    STOPPED = "Stopped"
    CANCELLED = "Cancelled"


class PodNotReplaced(Exception):
    pass


@workflow.defn(name="PackWorkflow")
class PackWorkflow(Approvable[PackPhase, PackInput]):
    KIND = "Pack"

    def __init__(self) -> None:
        super().__init__(PackPhase.PLANNING)
        self.plan: PackPlan | None = None
        self.removed: list[str] = []
        self.moved: list[str] = []
        self.cordoned: list[str] = []
        self.frozen: list[str] = []
        # Every planned node cordoned before the first eviction (False: a run begun before, one node at a time).
        self.cordon_first = False

    def _details(self) -> str:
        lines = [f"**Packing** {self.phase.value}: {self.message}"]
        if self.plan is not None:
            lines.append(self.plan.summary())
        return "\n\n".join(lines)

    def _awaiting(self) -> Proposal | None:
        if self.phase != PackPhase.AWAITING_APPROVAL or self.plan is None:
            return None
        # The plan ID is this run's: a decision for an earlier round of the policy (the same workflow ID) is stale.
        plan_id = self.operation or workflow.info().workflow_id
        return Proposal(operation=self.operation or workflow.info().workflow_id, plan_id=plan_id,
                        summary=self.plan.summary())

    @workflow.query(name="state")
    def state(self) -> PackView:
        inp = self.inp
        return PackView(workflow_id=workflow.info().workflow_id, cluster=inp.cluster if inp else "",
                        policy=inp.policy if inp else "", phase=self.phase.value, message=self.message,
                        plan=self.plan, removed=list(self.removed), moved=list(self.moved),
                        history=list(self.history), operation=self.operation,
                        approver=self.approval.approver if self.approval else None)

    async def _audit(self, action: str, detail: str, *, node: str | None = None) -> None:
        """An audit record, reported to the hub (R2.8): proposed, approved/rejected/expired, each node drained and
        removed, failed or cancelled."""
        if not self.operation or self.inp is None:
            return
        await record_audit(AuditRecord(
            key=f"{self.operation}/{action}" + (f"/{node}" if node else ""), at=workflow.now(),
            cluster=self.inp.cluster, policy=self.inp.policy, operation=self.operation, action=action,
            node_name=node, approver=self.approval.approver if self.approval else None, detail=detail))

    async def _act(self, name: str, arg: object, result_type: type | None = None,
                   timeout: timedelta = QUICK) -> object:
        return await workflow.execute_activity(name, arg, result_type=result_type, start_to_close_timeout=timeout,
                                               retry_policy=RETRY)

    @workflow.run
    async def run(self, inp: PackInput) -> PackView:
        self.inp = inp
        if workflow.patched("pack-audit"):
            self.operation = self._begin(inp.cluster, inp.policy, sa.PHASE.value_set(self.phase.value))
        else:  # a run begun before rounds were audited goes on unaudited: no operation ID, no audit commands
            self._start(sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
                        sa.OPERATION_KIND.value_set(self.KIND), sa.PHASE.value_set(self.phase.value))
        plan = await self._act("pack_plan", PackPlanRequest(groups=inp.groups, max_nodes=inp.max_nodes,
                                                            min_savings_usd_per_hour=inp.min_savings_usd_per_hour,
                                                            scope=inp.scope),
                               PackPlan, timeout=timedelta(minutes=3))
        assert isinstance(plan, PackPlan)
        self.plan = plan
        if not plan.empty:
            self._set_phase(PackPhase.NOTHING_TO_DO, plan.summary())
            return self.state()
        # The proposal as the hub's Approvals page shows it and binds a decision to (this run's plan ID).
        await self._audit("proposed", pack_proposal_detail(
            plan_id=self.operation, summary=plan.summary(), remove=plan.empty,
            saving_usd_per_hour=plan.usd_per_hour_saved,
            moves=[f"{m.pod}: {m.source} -> {m.target}" for m in plan.moves]))
        if inp.mode == "Recommend":
            self._set_phase(PackPhase.PROPOSED, plan.summary())
            return self.state()
        if inp.mode == "Approve":
            self._set_phase(PackPhase.AWAITING_APPROVAL, plan.summary())
            try:
                await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None,
                                              timeout=timedelta(seconds=inp.settings.approval_timeout_seconds))
            except TimeoutError:
                self._set_phase(PackPhase.REJECTED, "the approval timed out; nothing was moved")
                await self._audit("expired", self.message)
                return self.state()
            if self.rejection is not None:
                self._set_phase(PackPhase.REJECTED, f"rejected by {self.rejection.approver}; nothing was moved")
                await self._audit("rejected", self.rejection.reason or self.message)
                return self.state()
            await self._audit("approved", f"plan {self.operation}")
        try:
            # Every node the round empties is cordoned before the first eviction (its pool frozen until its last
            # planned node is gone): a replacement never lands on a node emptied later, to be evicted again. The plan
            # holds every moved pod on the kept nodes, so the cordons take no room the pods need.
            self.cordon_first = workflow.patched("pack-cordon-all")
            if self.cordon_first:
                self._set_phase(PackPhase.PACKING, f"cordoning the {len(plan.empty)} node(s) to empty")
                for node in plan.empty:
                    await self._hold_node(node, self._group_of(node))
            for node in plan.empty:
                await self._pack_node(node, self._group_of(node))
            self._set_phase(PackPhase.DONE, f"{len(self.removed)} node(s) removed, {len(self.moved)} pod(s) moved: "
                                            f"saves ${plan.usd_per_hour_saved:.2f}/h")
        except PodNotReplaced as exc:
            await self._compensate()
            self._set_phase(PackPhase.STOPPED, f"{exc}; stopped, nothing else evicted, node(s) uncordoned")
            await self._audit("failed", self.message)
        except (ActivityError, CancelledError, TimeoutError) as exc:
            cancelled = isinstance(exc, CancelledError) or isinstance(getattr(exc, "cause", None), CancelledError)
            await self._compensate()
            if cancelled:
                await self._cancelled()
                raise
            self._set_phase(PackPhase.STOPPED, f"failed: {getattr(exc, 'cause', None) or exc}; compensated")
            await self._audit("failed", self.message)
        except asyncio.CancelledError:
            # Cancelled while the round waited between steps (a PDB, a replacement, the node's removal): before this
            # patch the round ended there with its node cordoned and its pool frozen. Runs cancelled so before it
            # replay without compensating, as they ran.
            if workflow.patched(CANCEL_IN_WAIT):
                await self._compensate()
                await self._cancelled()
            raise
        return self.state()

    async def _cancelled(self) -> None:
        self._set_phase(PackPhase.CANCELLED, "cancelled; node(s) uncordoned, pool unfrozen")
        await self._audit("cancelled", self.message)

    def _group_of(self, node: str) -> str:
        assert self.plan is not None and self.inp is not None
        return self.plan.group_of.get(node) or self.inp.groups[0]

    async def _pack_node(self, node: str, group: str) -> None:
        assert self.inp is not None
        s = self.inp.settings
        op = workflow.info().workflow_id
        self._set_phase(PackPhase.PACKING, f"emptying {node}")
        if not self.cordon_first:
            await self._hold_node(node, group)
        pods = await self._act("pack_pods_on_node", NodeRef2(node=node, group=group), list[PodRef])
        assert isinstance(pods, list)
        for pod in pods:
            waited = 0.0
            while True:
                out = await self._act("pack_evict_pod", pod, EvictOutcome)
                assert isinstance(out, EvictOutcome)
                if out.outcome != "blocked":
                    break
                if waited >= s.pdb_wait_seconds:
                    raise PodNotReplaced(f"pod {pod.key} stayed blocked by PDB {out.pdb} for {waited:.0f}s")
                self._note(f"emptying {node}: eviction of {pod.key} waits for PDB {out.pdb} (no disruption allowed)")
                await workflow.sleep(timedelta(seconds=s.pdb_retry_seconds))
                waited += s.pdb_retry_seconds
            self._note(f"emptying {node}: evicted {pod.key}; waiting for its replacement Ready on a kept node")
            waited = 0.0
            while True:
                state = await self._act("pack_replacement_ready",
                                        ReplacementCheck(pod=pod, owner_uid=out.owner_uid, node=node,
                                                         ready_before=out.ready_before),
                                        ReplacementState)
                assert isinstance(state, ReplacementState)
                if state.ready:
                    break
                if waited >= s.replacement_timeout_seconds:
                    raise PodNotReplaced(f"pod {pod.key} cannot be re-placed: {state.detail} after {waited:.0f}s")
                await workflow.sleep(timedelta(seconds=s.poll_seconds))
                waited += s.poll_seconds
            self.moved.append(pod.key)
        self._note(f"{node} empty; removing it through the capacity provider")
        await self._audit("drained", f"node {node}: {len(pods)} pod(s) evicted, each Ready on a kept node",
                          node=node)
        await self._act("pack_remove_node", NodeRef2(node=node, group=group))
        waited = 0.0
        while not await self._act("pack_node_gone", NodeRef2(node=node, group=group), bool):
            if waited >= s.removal_timeout_seconds:
                raise TimeoutError(f"{node}'s NodeClaim or Node still there after {waited:.0f}s")
            await workflow.sleep(timedelta(seconds=s.poll_seconds))
            waited += s.poll_seconds
        self.cordoned.remove(node)
        self.removed.append(node)
        await self._audit("removed", f"node {node}: its NodeClaim and Node gone (group {group})", node=node)
        if self.cordon_first and any(self._group_of(n) == group for n in self.cordoned):
            return  # the group's other cordoned nodes keep it frozen
        await self._act("pack_unfreeze", GroupRef(group=group, operation=op))
        self.frozen.remove(group)

    async def _hold_node(self, node: str, group: str) -> None:
        """The node's pool frozen (once) and the node cordoned."""
        if group not in self.frozen:
            await self._act("pack_freeze", GroupRef(group=group, operation=workflow.info().workflow_id))
            self.frozen.append(group)
        self.cordoned.append(node)
        await self._act("pack_cordon", NodeRef2(node=node, group=group))

    async def _compensate(self) -> None:
        """Uncordon what we cordoned and did not remove, unfreeze what we froze (also when cancelled)."""
        op = workflow.info().workflow_id
        for node in list(self.cordoned):
            await workflow.execute_activity("pack_uncordon", NodeRef2(node=node), start_to_close_timeout=QUICK,
                                            retry_policy=RETRY, cancellation_type=workflow.ActivityCancellationType.
                                            TRY_CANCEL)
            self.cordoned.remove(node)
        for group in list(self.frozen):
            await workflow.execute_activity("pack_unfreeze", GroupRef(group=group, operation=op),
                                            start_to_close_timeout=QUICK, retry_policy=RETRY)
            self.frozen.remove(group)
