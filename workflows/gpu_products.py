"""An Autoscaling policy's GPU products made a NodePool requirement (issue 23) as a durable operation. Changing a
NodePool's requirements drifts its nodes (Karpenter replaces each node the new requirement excludes, within the
pool's disruption budgets), so the change waits for one approval in every mode that acts (Recommend only reports
it, in the policy's status, and starts no operation): proposed (audited, with the nodes that would drift) ->
approved -> the requirement set (one activity, absolute) -> done; rejected or not decided within the approval
timeout: nothing changes. One run per change (pool, from, to): a decided change is not proposed again."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum

from temporalio import workflow

from models import search_attributes as sa
from models.audit import AuditRecord
from models.autoscaling import GpuProductsInput
from models.autoscaling import GpuProductsRequest
from models.autoscaling import GpuProductsView
from workflows.audit import record_audit
from workflows.failures import QUICK
from workflows.failures import RETRY
from workflows.operation import Approvable
from workflows.operation import Proposal


class GpuProductsPhase(StrEnum):
    AWAITING_APPROVAL = "AwaitingApproval"
    APPLYING = "Applying"
    DONE = "Done"
    REJECTED = "Rejected"


@workflow.defn(name="GpuProducts")
class GpuProductsWorkflow(Approvable[GpuProductsPhase, GpuProductsInput]):
    KIND = "GpuProducts"

    def __init__(self) -> None:
        super().__init__(GpuProductsPhase.AWAITING_APPROVAL)

    def _details(self) -> str:
        lines = [f"**GPU products** {self.phase.value}: {self.message}"]
        if self.inp is not None:
            lines.append(self.inp.change.summary())
        return "\n\n".join(lines)

    def _awaiting(self) -> Proposal | None:
        if self.phase != GpuProductsPhase.AWAITING_APPROVAL or self.inp is None:
            return None
        return Proposal(operation=self.operation, plan_id=self.operation, summary=self.inp.change.summary())

    @workflow.query(name="state")
    def state(self) -> GpuProductsView:
        inp = self.inp
        return GpuProductsView(workflow_id=workflow.info().workflow_id, cluster=inp.cluster if inp else "",
                               policy=inp.policy if inp else "", phase=self.phase.value, message=self.message,
                               change=inp.change if inp else None, history=list(self.history),
                               operation=self.operation, approver=self.approval.approver if self.approval else None)

    async def _audit(self, action: str, detail: str) -> None:
        assert self.inp is not None
        await record_audit(AuditRecord(
            key=f"{self.operation}/{action}", at=workflow.now(), cluster=self.inp.cluster, policy=self.inp.policy,
            operation=self.operation, action=action, approver=self.approval.approver if self.approval else None,
            detail=detail))

    @workflow.run
    async def run(self, inp: GpuProductsInput) -> GpuProductsView:
        self.inp = inp
        self.operation = self._begin(inp.cluster, inp.policy, sa.PHASE.value_set(self.phase.value))
        summary = inp.change.summary()
        await self._audit("proposed", summary)
        self._set_phase(GpuProductsPhase.AWAITING_APPROVAL, f"approve to change it: {summary}")
        try:
            await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None,
                                          timeout=timedelta(seconds=inp.approval_timeout_seconds))
        except TimeoutError:
            self._set_phase(GpuProductsPhase.REJECTED, "the approval timed out; the NodePool is as it was")
            await self._audit("expired", self.message)
            return self.state()
        if self.rejection is not None:
            self._set_phase(GpuProductsPhase.REJECTED,
                            f"rejected by {self.rejection.approver}; the NodePool is as it was")
            await self._audit("rejected", self.rejection.reason or self.message)
            return self.state()
        assert self.approval is not None
        await self._audit("approved", f"plan {self.operation}")
        self._set_phase(GpuProductsPhase.APPLYING, f"approved by {self.approval.approver}")
        previous = await workflow.execute_activity(
            "set_gpu_products", GpuProductsRequest(node_pool=inp.change.node_pool, products=inp.change.wanted),
            result_type=list[str], start_to_close_timeout=QUICK, retry_policy=RETRY)
        was = f"In [{', '.join(previous)}]" if previous else "any product"
        drift = (f"; Karpenter drifts {len(inp.change.drifted)} node(s) of other products"
                 if inp.change.drifted else "")
        self._set_phase(GpuProductsPhase.DONE, f"NodePool {inp.change.node_pool} requires "
                                               f"{', '.join(inp.change.wanted)} (was {was}){drift}")
        await self._audit("applied", self.message)
        return self.state()
