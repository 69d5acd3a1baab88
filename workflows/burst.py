"""BurstWorkflow: plan -> [approve] -> reserve -> launch -> join -> verify -> serve -> return home.

Durable and resumable after any crash: every side effect is an idempotent activity; what was launched is
found again by its operation tag. On failure or cancel it compensates in reverse (drain if serving, terminate
everything tagged with the operation, remove the Node, release the reservation)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, ChildWorkflowError

from models import search_attributes as sa
from models.operation import (
    LABEL_GPU_PRODUCT,
    LABEL_INSTANCE_TYPE,
    LABEL_LOCATION,
    LABEL_OPERATION,
    LABEL_POLICY,
    SERVE_QUEUE_SUFFIX,
    Approval,
    AuditRecord,
    BurstInput,
    BurstResult,
    CleanupRequest,
    CleanupResult,
    DecisionResult,
    DrainInput,
    GroupPlacement,
    Instance,
    InstanceRef,
    LaunchRequest,
    LedgerReserve,
    LoadPolicyRequest,
    NodeExpectation,
    NodeWaitRequest,
    Offering,
    OperationView,
    Phase,
    PlacementRequest,
    Plan,
    PlanRequest,
    PolicySnapshot,
    Rejection,
    ReservationRequest,
    ReservationResult,
    ServeCheckRequest,
    ServeCheckResult,
    Taint,
    VerifyResult,
    ledger_workflow_id,
    operation_id,
)
from models.policy import location_label_value
from workflows.drain import DrainWorkflow
from workflows.gate import action_gate, wait_until_allowed
from workflows.ledger import GRANTED_SIGNAL
from workflows.observe import phase_span

# Must match activities.burst (workflows may not import activities).
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
HELD = "Held"

QUICK = timedelta(seconds=60)
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
# Short enough that an activity on a killed worker is retried on another within seconds.
HEARTBEAT = timedelta(seconds=15)


def _error_type(exc: BaseException) -> str | None:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) else exc
    return cause.type if isinstance(cause, ApplicationError) else None


def _message(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause else exc
    return str(cause) or type(cause).__name__


@workflow.defn(name="BurstWorkflow")
class BurstWorkflow:
    def __init__(self) -> None:
        self.inp: BurstInput | None = None
        self.operation = ""
        self.node_name = ""
        self.phase = Phase.PLANNING
        self.message = ""
        self.policy: PolicySnapshot | None = None
        self.plan: Plan | None = None
        self.approval: Approval | None = None
        self.rejection: Rejection | None = None
        self.instance: Instance | None = None
        self.launch_attempted = False
        self.reserved = False
        self.requested = False
        self.grant: ReservationResult | None = None
        self.serving = False
        self.history: list[str] = []

    # -- visibility -----------------------------------------------------------------------------------------
    def _set_phase(self, phase: Phase, message: str = "") -> None:
        self.phase = phase
        self.message = message
        stamp = workflow.now().strftime("%H:%M:%S")
        self.history.append(f"{stamp} {phase.value}" + (f": {message}" if message else ""))
        workflow.upsert_search_attributes([sa.PHASE.value_set(phase.value)])
        workflow.set_current_details(self._details())
        phase_span("Burst", phase.value)

    def _details(self) -> str:
        assert self.inp is not None
        g = self.inp.group
        lines = [
            f"**Burst** `{self.operation}` for `{g.key}` ({g.gpus} GPU(s), {len(g.pods)} pod(s)), "
            f"policy `{self.inp.policy}`, mode {self.policy.mode if self.policy else '?'}",
            f"**Phase:** {self.phase.value}" + (f" — {self.message}" if self.message else ""),
        ]
        if self.plan:
            lines.append(f"**Plan** `{self.plan.plan_id}`: {self.plan.summary()}")
            for o in self.plan.candidates[1:4]:
                lines.append(f"- alternative: {o.instance_type} in {o.location} ${o.usd_per_gpu_hour:.2f}/GPU-h")
            for r in self.plan.refused[:6]:
                lines.append(f"- refused: {r}")
        if self.phase == Phase.AWAITING_APPROVAL:
            lines.append(f"Approve: `kubeon-gpu ops approve {self.operation}` or signal `approve`")
        if self.instance:
            lines.append(f"**Instance** {self.instance.instance_id} in {self.instance.location}")
        if self.approval:
            lines.append(f"Approved by {self.approval.approver}")
        return "\n".join(lines)

    def _view(self) -> OperationView:
        inp = self.inp
        return OperationView(
            operation=self.operation, workflow_id=workflow.info().workflow_id,
            cluster=inp.cluster if inp else "", policy=inp.policy if inp else "",
            group=inp.group.key if inp else "", mode=self.policy.mode if self.policy else None, phase=self.phase,
            plan=self.plan, location=self.instance.location if self.instance else None, instance=self.instance,
            node_name=self.node_name or None, approver=self.approval.approver if self.approval else None,
            message=self.message, history=list(self.history),
        )

    async def _audit(self, action: str, detail: str = "") -> None:
        assert self.inp is not None
        await workflow.execute_activity(
            "record_audit",
            AuditRecord(
                key=f"{self.operation}/{action}", at=workflow.now(), cluster=self.inp.cluster,
                policy=self.inp.policy, operation=self.operation, action=action,
                location=self.instance.location if self.instance else (
                    self.plan.best.location if self.plan and self.plan.best else None),
                instance_id=self.instance.instance_id if self.instance else None,
                node_name=self.node_name if self.instance else None,
                approver=self.approval.approver if self.approval else None, detail=detail,
            ),
            start_to_close_timeout=QUICK, retry_policy=RETRY,
        )

    # -- operator interface ---------------------------------------------------------------------------------
    @workflow.query(name="state")
    def state(self) -> OperationView:
        return self._view()

    @workflow.signal(name="approve")
    def approve_signal(self, approval: Approval | None = None) -> None:
        """For the Temporal UI and `temporal workflow signal`: ignored unless awaiting approval of this plan."""
        approval = approval or Approval()
        if self._decision_problem(approval.plan_id) is None:
            self.approval = approval

    @workflow.signal(name="reject")
    def reject_signal(self, rejection: Rejection | None = None) -> None:
        if self._decision_problem(None) is None:
            self.rejection = rejection or Rejection()

    @workflow.update(name="approve_plan")
    def approve_update(self, approval: Approval) -> DecisionResult:
        self.approval = approval
        return DecisionResult(operation=self.operation, phase=self.phase,
                              message=f"approved by {approval.approver}")

    @approve_update.validator
    def _validate_approve(self, approval: Approval) -> None:
        problem = self._decision_problem(approval.plan_id)
        if problem:
            raise ValueError(problem)
        if not approval.approver.strip():
            raise ValueError("approver must name who approves")

    @workflow.update(name="reject_plan")
    def reject_update(self, rejection: Rejection) -> DecisionResult:
        self.rejection = rejection
        return DecisionResult(operation=self.operation, phase=self.phase,
                              message=f"rejected by {rejection.approver}")

    @reject_update.validator
    def _validate_reject(self, rejection: Rejection) -> None:
        problem = self._decision_problem(None)
        if problem:
            raise ValueError(problem)

    def _decision_problem(self, plan_id: str | None) -> str | None:
        if self.phase != Phase.AWAITING_APPROVAL or self.approval or self.rejection:
            return f"operation {self.operation} is {self.phase.value}, not awaiting approval"
        if plan_id and self.plan and plan_id != self.plan.plan_id:
            return (f"plan {plan_id} is stale: operation {self.operation} now proposes {self.plan.plan_id} "
                    f"({self.plan.summary()})")
        return None

    # -- the operation --------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: BurstInput) -> BurstResult:
        self.inp = inp
        info = workflow.info()
        self.operation = operation_id(info.workflow_id, info.run_id)
        self.node_name = f"burst-{self.operation}"
        workflow.upsert_search_attributes([
            sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
            sa.OPERATION_KIND.value_set("Burst"), sa.OPERATION.value_set(self.operation),
        ])
        try:
            try:
                return await self._run(inp)
            except (ActivityError, ChildWorkflowError) as exc:
                # A cancelled operation may surface as the cancelled activity or child it was waiting on.
                if isinstance(exc.cause, CancelledError):
                    raise asyncio.CancelledError(str(exc.cause)) from exc
                raise
        except asyncio.CancelledError:
            # Cancelled from the UI or CLI: drain and remove what this operation made, then end cancelled.
            self.history.append("cancel requested: returning what was made")
            await self._compensate("cancelled")
            self._set_phase(Phase.CANCELLED, "cancelled; what it made was drained and removed")
            await self._audit("cancelled")
            raise
        except (ActivityError, ChildWorkflowError, ApplicationError) as exc:
            reason = _message(exc)
            self.history.append(f"failed: {reason}; compensating")
            await self._compensate(reason)
            self._set_phase(Phase.FAILED, reason)
            await self._audit("failed", reason)
            return self._result()

    def _result(self) -> BurstResult:
        return BurstResult(operation=self.operation, phase=self.phase, message=self.message, plan=self.plan,
                           instance=self.instance, node_name=self.node_name if self.instance else None)

    async def _load_policy(self, inp: BurstInput) -> PolicySnapshot:
        return await workflow.execute_activity(
            "load_policy", LoadPolicyRequest(policy=inp.policy, default_mode=inp.default_mode),
            result_type=PolicySnapshot, start_to_close_timeout=QUICK, retry_policy=RETRY)

    async def _run(self, inp: BurstInput) -> BurstResult:
        s = inp.settings
        self._set_phase(Phase.PLANNING, "pricing the policy's locations")
        self.policy = await self._load_policy(inp)
        self.plan = await workflow.execute_activity(
            "plan_burst",
            PlanRequest(policy=inp.policy, locations=self.policy.locations,
                        max_gpu_hour=self.policy.max_gpu_hour, group=inp.group),
            result_type=Plan, start_to_close_timeout=timedelta(minutes=3), retry_policy=RETRY)
        if self.plan.best is None:
            self._set_phase(Phase.FAILED, self.plan.summary() + (
                ": " + "; ".join(self.plan.refused[:5]) if self.plan.refused else ""))
            await self._audit("failed", self.message)
            return self._result()
        workflow.upsert_search_attributes([sa.LOCATION.value_set(self.plan.best.location)])

        if self.policy.mode == "Recommend":
            self._set_phase(Phase.PROPOSED, self.plan.summary())
            await self._audit("proposed", self.plan.summary())
            return self._result()

        if self.policy.mode == "Approve":
            self._set_phase(Phase.AWAITING_APPROVAL, self.plan.summary())
            await self._audit("proposed", self.plan.summary())
            try:
                await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None,
                                              timeout=timedelta(seconds=s.approval_timeout_seconds))
            except TimeoutError:
                self._set_phase(Phase.EXPIRED, f"no approval within {s.approval_timeout_seconds}s")
                await self._audit("expired")
                return self._result()
            if self.rejection is not None:
                self._set_phase(Phase.REJECTED, f"rejected by {self.rejection.approver}: {self.rejection.reason}")
                await self._audit("rejected", self.rejection.reason)
                return self._result()
            await self._audit("approved", f"plan {self.plan.plan_id}")

        await self._reserve(inp)
        # Waiting for approval or capacity can outlast the need: launch nothing for a group that has gone. A group
        # whose pods took another operation's node has not gone: that operation's own pods now wait for this node.
        if workflow.patched("launch-for-displaced"):
            placement = await workflow.execute_activity(
                "group_placement", PlacementRequest(group=inp.group, operation=self.operation),
                result_type=GroupPlacement, start_to_close_timeout=QUICK, retry_policy=RETRY)
            pending = placement.pending + placement.displaced
        else:
            pending = await workflow.execute_activity("pending_pods", inp.group, result_type=int,
                                                      start_to_close_timeout=QUICK, retry_policy=RETRY)
        if pending == 0:
            await self._release()
            self._set_phase(Phase.COMPLETED, "no pod of the group is pending any more; nothing launched")
            await self._audit("withdrawn", self.message)
            return self._result()
        if not await self._go_ahead(inp):
            await self._release()
            self._set_phase(Phase.PROPOSED, "policy switched to Recommend before launch; nothing launched")
            return self._result()
        await self._launch(inp)
        assert self.instance is not None

        self._set_phase(Phase.JOINING, f"waiting for node {self.node_name}")
        await workflow.execute_activity(
            "wait_for_node", NodeWaitRequest(operation=self.operation, node_name=self.node_name,
                                             timeout_seconds=s.join_timeout_seconds),
            result_type=str, start_to_close_timeout=timedelta(seconds=s.join_timeout_seconds + 120),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        await self._audit("joined")

        self._set_phase(Phase.VERIFYING, "taint, labels, pods placed")
        verified = await workflow.execute_activity(
            "verify_node",
            NodeExpectation(node_name=self.node_name, taint_key=self.policy.tolerate, labels=self._labels(),
                            pods=inp.group.pods, timeout_seconds=s.verify_timeout_seconds, group=inp.group),
            result_type=VerifyResult, start_to_close_timeout=timedelta(seconds=s.verify_timeout_seconds + 120),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        await self._audit("verified", ", ".join(verified.pods_on_node))

        self.serving = True
        self._set_phase(Phase.SERVING, f"{len(verified.pods_on_node)} pod(s) on {self.node_name}")
        served = await workflow.execute_activity(
            "serve_until_done",
            ServeCheckRequest(group=inp.group, node_name=self.node_name, return_home=self.policy.return_home,
                              check_seconds=s.serve_check_seconds, taint_key=self.policy.tolerate),
            task_queue=workflow.info().task_queue + SERVE_QUEUE_SUFFIX,
            result_type=ServeCheckResult, start_to_close_timeout=timedelta(days=365),
            heartbeat_timeout=timedelta(seconds=max(60, s.serve_check_seconds * 3)), retry_policy=RETRY)

        await self._return_home(served.reason)
        await self._release()
        self._set_phase(Phase.COMPLETED, f"returned home: {served.reason}")
        return self._result()

    def _labels(self) -> dict[str, str]:
        assert self.inp is not None and self.plan is not None and self.plan.best is not None
        offering = self.instance_offering()
        return {
            LABEL_LOCATION: location_label_value(offering.location),
            LABEL_POLICY: self.inp.policy,
            LABEL_OPERATION: self.operation,
            LABEL_GPU_PRODUCT: offering.gpu_product,
            LABEL_INSTANCE_TYPE: offering.instance_type,
        }

    def instance_offering(self) -> Offering:
        assert self.plan is not None and self.plan.best is not None
        if self.instance is not None:
            for o in self.plan.candidates:
                if o.location == self.instance.location and o.instance_type == self.instance.instance_type:
                    return o
        return self.plan.best

    async def _go_ahead(self, inp: BurstInput) -> bool:
        """Just before launching: False when the policy was switched to Recommend (R2.7 stops its actions at once,
        even after approval); holds while the hub rejects this cluster's token (R2.3)."""
        while True:
            self.policy = await self._load_policy(inp)
            if self.policy.mode == "Recommend":
                return False
            gate = await action_gate(inp.policy)
            if not gate.held:
                return True
            await self._hold(inp, gate.reason)

    async def _hold(self, inp: BurstInput, reason: str) -> None:
        before = (self.phase, self.message)
        self._set_phase(Phase.HELD, reason)
        await self._audit("held", reason)
        await wait_until_allowed(inp.policy)
        await self._audit("resumed")
        self._set_phase(*before)

    async def _reserve(self, inp: BurstInput) -> None:
        """Queue for a node in the policy's ledger and wait for the grant (first come, first served)."""
        assert self.policy is not None
        s = inp.settings
        self.requested = True
        await workflow.execute_activity(
            "request_capacity",
            LedgerReserve(cluster=inp.cluster, policy=inp.policy, request=ReservationRequest(
                operation=self.operation, nodes=1, max_nodes=self.policy.max_nodes,
                reply_to=workflow.info().workflow_id)),
            start_to_close_timeout=QUICK, retry_policy=RETRY)
        if self.grant is None:
            self._set_phase(Phase.WAITING_FOR_CAPACITY,
                            f"maxNodes {self.policy.max_nodes}: queued in the policy's ledger for a node")
        try:
            await workflow.wait_condition(lambda: self.grant is not None,
                                          timeout=timedelta(seconds=s.capacity_wait_seconds))
        except TimeoutError:
            raise ApplicationError(f"maxNodes {self.policy.max_nodes} stayed in use for {s.capacity_wait_seconds}s",
                                   non_retryable=True) from None
        self.reserved = True

    async def _release(self) -> None:
        """Give the node (or the place in the queue) back to the ledger."""
        if self.requested and self.inp is not None:
            try:
                await workflow.get_external_workflow_handle(
                    ledger_workflow_id(self.inp.cluster, self.inp.policy)).signal("release", self.operation)
            except Exception as exc:  # no ledger running: nothing holds a node for this operation
                workflow.logger.warning("release of %s not delivered: %s", self.operation, exc)
            self.requested = self.reserved = False

    @workflow.signal(name=GRANTED_SIGNAL)
    def capacity_granted(self, grant: ReservationResult) -> None:
        if grant.operation == self.operation and grant.granted:  # not a grant meant for an earlier run
            self.grant = grant

    async def _launch(self, inp: BurstInput) -> None:
        assert self.plan is not None and self.policy is not None
        tried: list[str] = []
        candidates = list(self.plan.candidates)
        while candidates:
            offering = candidates[0]
            self._set_phase(Phase.LAUNCHING, f"{offering.instance_type} in {offering.location}")
            workflow.upsert_search_attributes([sa.LOCATION.value_set(offering.location)])
            labels = {
                LABEL_LOCATION: location_label_value(offering.location), LABEL_POLICY: inp.policy,
                LABEL_OPERATION: self.operation, LABEL_GPU_PRODUCT: offering.gpu_product,
                LABEL_INSTANCE_TYPE: offering.instance_type,
            }
            self.launch_attempted = True
            try:
                self.instance = await workflow.execute_activity(
                    "launch_instance",
                    LaunchRequest(operation=self.operation, cluster=inp.cluster, policy=inp.policy,
                                  allowed_locations=self.policy.locations, offering=offering,
                                  node_name=self.node_name, labels=labels,
                                  taints=[Taint(key=self.policy.tolerate)]),
                    result_type=Instance, start_to_close_timeout=timedelta(minutes=5),
                    heartbeat_timeout=HEARTBEAT, retry_policy=RetryPolicy(
                        initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30),
                        maximum_attempts=8))
            except ActivityError as exc:
                if _error_type(exc) == INSUFFICIENT_CAPACITY:
                    tried.append(_message(exc))
                    candidates.pop(0)
                    continue
                if _error_type(exc) == HELD:  # revoked between the check and the launch: hold, then try again
                    await self._hold(inp, _message(exc))
                    continue
                raise
            await self._audit("launched", f"{offering.instance_type} at ${offering.usd_per_gpu_hour:.2f}/GPU-h")
            return
        raise ApplicationError("no capacity in any eligible location: " + "; ".join(tried), non_retryable=True)

    async def _return_home(self, reason: str) -> None:
        assert self.inp is not None and self.instance is not None
        self._set_phase(Phase.DRAINING, reason)
        await workflow.execute_child_workflow(
            DrainWorkflow.run,
            DrainInput(cluster=self.inp.cluster, policy=self.inp.policy, operation=self.operation,
                       node_name=self.node_name, reason=reason, settings=self.inp.settings,
                       instance=InstanceRef(location=self.instance.location, instance_id=self.instance.instance_id,
                                            policy=self.inp.policy)),
            id=f"drain/{workflow.info().workflow_id}/{self.operation}",
            static_summary=f"Drain {self.node_name} ({reason})",
        )
        await self._audit("drained", reason)
        await self._audit("removed")

    async def _compensate(self, reason: str) -> None:
        """Undo in reverse: drain a serving node (pods leave through the Eviction API), then terminate anything
        tagged with this operation and remove its Node, then release the reservation."""
        assert self.inp is not None and self.policy is not None
        if self.serving and self.instance is not None:
            try:
                await self._return_home(reason)
            except (ActivityError, ChildWorkflowError) as exc:
                self.history.append(f"drain during compensation failed: {_message(exc)}")
        if self.launch_attempted:
            cleaned = await workflow.execute_activity(
                "cleanup_operation",
                CleanupRequest(operation=self.operation, policy=self.inp.policy, locations=self.policy.locations,
                               node_name=self.node_name),
                result_type=CleanupResult, start_to_close_timeout=timedelta(minutes=5),
                heartbeat_timeout=timedelta(seconds=60), retry_policy=RETRY)
            if cleaned.terminated or cleaned.node_removed:
                await self._audit("removed", f"compensation: terminated {cleaned.terminated}, "
                                             f"node removed {cleaned.node_removed}")
        await self._release()
