"""BurstNodeWorkflow: one new node of a batch: launch -> join -> verify -> serve -> return home.

Started by the policy's ProvisionWorkflow once the batch is approved (or at once in Automatic mode). Durable and
resumable after any crash: every side effect is an idempotent activity; what was launched is found again by
its operation tag. On failure or cancel it compensates in reverse (drain if serving, terminate everything
tagged with the operation, remove the Node). Whatever the outcome it tells its provisioning workflow, which
holds ``maxNodes`` and plans the pods the node was for again if they still wait."""

from __future__ import annotations

import asyncio
from datetime import datetime
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError
from temporalio.exceptions import CancelledError
from temporalio.exceptions import ChildWorkflowError

from models import search_attributes as sa
from models.audit import AuditRecord
from models.cost import BYTES_PER_GB
from models.cost import ActualCost
from models.cost import CostCount
from models.cost import TransferReading
from models.cost import actual_cost
from models.drain import DrainInput
from models.drain import DrainResult
from models.ids import SERVE_QUEUE_SUFFIX
from models.ids import operation_id
from models.join import burst_node_name
from models.labels import BURN_IN_LABEL
from models.labels import LABEL_GPU_PRODUCT
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from models.labels import burn_in_label
from models.node import BurnInRequest
from models.node import BurnInResult
from models.node import BurstResult
from models.node import CleanupRequest
from models.node import CleanupResult
from models.node import Instance
from models.node import InstanceRef
from models.node import LaunchRequest
from models.node import NodeExpectation
from models.node import NodeFinished
from models.node import NodeIdentityCheck
from models.node import NodeIdentityResult
from models.node import NodeInput
from models.node import NodePhase
from models.node import NodeWaitRequest
from models.node import OperationView
from models.node import ServeCheckRequest
from models.node import ServeCheckResult
from models.node import VerifyResult
from models.policy import location_label_value
from models.provisioning import LoadPolicyRequest
from models.provisioning import MeasuredEgress
from models.provisioning import Offering
from models.provisioning import PolicySnapshot
from models.ui_text import Details
from models.ui_text import code
from models.ui_text import md
from workflows.audit import record_audit
from workflows.drain import DrainWorkflow
from workflows.failures import RETRY
from workflows.failures import error_type
from workflows.failures import message
from workflows.failures import quick_step
from workflows.gate import action_gate
from workflows.gate import wait_until_allowed
from workflows.operation import Operation

# Must match activities.burst (workflows may not import activities).
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
HELD = "Held"

# Short enough that an activity on a killed worker is retried on another within seconds.
HEARTBEAT = timedelta(seconds=15)
# The serve activity heartbeats every second (the SDK sends at most one per 0.8 x this); a worker killed while
# nodes serve is noticed this long after its last heartbeat, so the serve resumes within seconds of a worker
# being back (issue 26: 60 s before). It costs one heartbeat RPC per serving node per 4 s at Temporal.
SERVE_HEARTBEAT = timedelta(seconds=5)


@workflow.defn(name="BurstNode")
class BurstNodeWorkflow(Operation[NodePhase, NodeInput]):
    KIND = "Burst"

    def __init__(self) -> None:
        super().__init__(NodePhase.LAUNCHING)
        self.node_name = ""
        self.policy: PolicySnapshot | None = None
        self.instance: Instance | None = None
        self.offering: Offering | None = None
        self.launch_attempted = False
        self.serving = False
        self.burn_in_passed = ""
        # The node was launched with the burn-in label: the gateway holds its joining taint until burn_in_node runs.
        self.taint_held = False
        # Cost on actuals (issue 27): the workflow's own clock from the launch to the termination, and the
        # node's tunnel transfer as last read from the gateway.
        self.launched_at: datetime | None = None
        self.ended_at: datetime | None = None
        self.transfer: TransferReading | None = None
        self.over_budget = ""

    # -- visibility (the phase bookkeeping is Operation's) -----------------------------------------------------
    def _details(self) -> str:
        assert self.inp is not None
        n = self.inp.node
        d = Details()
        d.para(f"**Burst node** {code(self.operation)} of batch {code(self.inp.batch)}, policy "
               f"{code(self.inp.policy)}")
        d.para(f"**Phase:** {md(self.phase.value)}" + (f" — {md(self.message)}" if self.message else ""))
        d.para(f"**Planned:** {md(n.offering.describe())}")
        d.para(f"**For** {len(n.pods)} pod(s), {n.gpus_used} GPU(s):")
        d.bullets((code(p) for p in n.pods), limit=8, more="more pods")
        if n.alternatives:
            d.para("**Fallbacks** (a location without capacity):")
            d.bullets((md(o.describe()) for o in n.alternatives), limit=3, more="more")
        if self.instance:
            d.para(f"**Instance** {code(self.instance.instance_id)} ({md(self.instance.instance_type)}) in "
                   f"{md(self.instance.location)}")
        cost = self._cost()
        if cost is not None:
            d.para(f"**Cost{'' if cost.final else ' so far'}:** {md(cost.describe())}"
                   + ("" if cost.transfer_measured else " (transfer estimated: not measured at the gateway)"))
        if self.over_budget:
            d.para(f"**Over budget:** {md(self.over_budget)}")
        return d.render()

    def _cost(self) -> ActualCost | None:
        """Compute hours (launch to termination, or to now while it runs) and the measured transfer, priced."""
        if self.launched_at is None or self.instance is None:
            return None
        return actual_cost(self._offering(), self.launched_at, self.ended_at or workflow.now(), self.transfer,
                           final=self.ended_at is not None)

    def _egress(self, cost: ActualCost | None) -> MeasuredEgress | None:
        """What the node moved out of its location over its GPU-hours, when the gateway measured it."""
        if cost is None or not cost.transfer_measured or cost.compute_hours <= 0:
            return None
        offering = self._offering()
        return MeasuredEgress(location=offering.location, egress_gb=cost.egress_bytes / BYTES_PER_GB,
                              gpu_hours=cost.compute_hours * offering.gpus)

    def _took_transfer(self, reading: TransferReading | None) -> None:
        """Keep a new reading if it measured something (a failed read keeps the last good one's numbers)."""
        if reading is not None and (reading.measured or self.transfer is None):
            self.transfer = reading

    def _view(self) -> OperationView:
        inp = self.inp
        return OperationView(
            operation=self.operation, workflow_id=workflow.info().workflow_id,
            cluster=inp.cluster if inp else "", policy=inp.policy if inp else "", batch=inp.batch if inp else "",
            phase=self.phase, node=inp.node if inp else None,
            location=self.instance.location if self.instance else None, instance=self.instance,
            node_name=self.node_name or None, message=self.message, history=list(self.history),
            cost=self._cost(), over_budget=self.over_budget, launched_at=self.launched_at,
        )

    async def _audit(self, action: str, detail: str = "") -> None:
        assert self.inp is not None
        await record_audit(AuditRecord(
            key=f"{self.operation}/{action}", at=workflow.now(), cluster=self.inp.cluster,
            policy=self.inp.policy, operation=self.operation, action=action,
            location=self.instance.location if self.instance else self.inp.node.offering.location,
            instance_id=self.instance.instance_id if self.instance else None,
            node_name=self.node_name if self.instance else None, detail=detail,
        ))

    @workflow.query(name="state", description=(
        "The node: phase, planned offering and pods, the instance, node name and history."))
    def state(self) -> OperationView:
        return self._view()

    # -- the node -------------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: NodeInput) -> BurstResult:
        self.inp = inp
        info = workflow.info()
        self.operation = operation_id(info.workflow_id, info.run_id)
        self.node_name = burst_node_name(self.operation)
        self._start(
            sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
            sa.OPERATION_KIND.value_set(self.KIND), sa.OPERATION.value_set(self.operation),
            sa.BATCH.value_set(inp.batch), sa.LOCATION.value_set(inp.node.offering.location),
            sa.USD_PER_HOUR.value_set(round(inp.node.offering.usd_per_hour, 4)),
            sa.PHASE.value_set(NodePhase.LAUNCHING.value),
        )
        try:
            try:
                result = await self._run(inp)
            except (ActivityError, ChildWorkflowError) as exc:
                # A cancelled operation may surface as the cancelled activity or child it was waiting on.
                if isinstance(exc.cause, CancelledError):
                    raise asyncio.CancelledError(str(exc.cause)) from exc
                raise
        except asyncio.CancelledError:
            # Cancelled from the UI or CLI: drain and remove what this operation made, then end cancelled.
            self._log("cancel requested: returning what was made")
            await self._compensate("cancelled")
            self._set_phase(NodePhase.CANCELLED, "cancelled; what it made was drained and removed")
            await self._audit("cancelled")
            await self._finished()
            raise
        except (ActivityError, ChildWorkflowError, ApplicationError) as exc:
            reason = message(exc)
            self._log(f"failed: {reason}; compensating")
            await self._compensate(reason)
            self._set_phase(NodePhase.FAILED, reason)
            await self._audit("failed", reason)
            result = self._result()
        await self._finished()
        return result

    async def _finished(self) -> None:
        """Tell the provisioning workflow (by ID: its current run, across continue-as-new) the node is done."""
        assert self.inp is not None
        if self.launched_at is not None and self.ended_at is None:
            self.ended_at = workflow.now()
        cost = self._cost()
        if cost is not None and workflow.patched("burst-actual-cost"):
            await workflow.execute_local_activity(
                "count_burst_cost", CostCount(operation=self.operation, location=self._offering().location,
                                              compute_usd=cost.compute_usd, transfer_usd=cost.transfer_usd),
                start_to_close_timeout=timedelta(seconds=10), retry_policy=RETRY, summary="count the node's cost")
        try:
            await workflow.get_external_workflow_handle(self.inp.provision_workflow_id).signal(
                "node_finished", NodeFinished(workflow_id=workflow.info().workflow_id, phase=self.phase,
                                              message=self.message, launched=self.instance is not None,
                                              pods=list(self.inp.node.pods), egress=self._egress(cost)))
        except Exception as exc:  # no provisioning running: nothing holds a node for this one
            workflow.logger.warning("node_finished of %s not delivered: %s", self.operation, exc)

    def _result(self) -> BurstResult:
        return BurstResult(operation=self.operation, phase=self.phase, message=self.message,
                           node=self.inp.node if self.inp else None, instance=self.instance,
                           node_name=self.node_name if self.instance else None)

    async def _load_policy(self, inp: NodeInput) -> PolicySnapshot:
        return await quick_step(
            "load_policy", LoadPolicyRequest(policy=inp.policy, default_mode=inp.default_mode),
            result_type=PolicySnapshot, summary="the policy, just before launching")

    async def _run(self, inp: NodeInput) -> BurstResult:
        s = inp.settings
        self._set_phase(NodePhase.LAUNCHING, inp.node.offering.describe())
        if not await self._go_ahead(inp):
            self._set_phase(NodePhase.PROPOSED, "policy switched to Recommend before launch; nothing launched")
            return self._result()
        await self._launch(inp)
        assert self.instance is not None and self.policy is not None

        self._set_phase(NodePhase.JOINING, f"waiting for node {self.node_name}")
        await workflow.execute_activity(
            "wait_for_node", NodeWaitRequest(operation=self.operation, node_name=self.node_name,
                                             timeout_seconds=s.join_timeout_seconds),
            result_type=str, start_to_close_timeout=timedelta(seconds=s.join_timeout_seconds + 120),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        await self._audit("joined", await self._attested_identity())
        await self._burn_in(inp)

        self._set_phase(NodePhase.VERIFYING, "taint, labels, pods placed")
        verified = await workflow.execute_activity(
            "verify_node",
            NodeExpectation(node_name=self.node_name, taint_key=self.policy.tolerate, labels=self._labels(),
                            pods=[], timeout_seconds=s.verify_timeout_seconds),
            result_type=VerifyResult, start_to_close_timeout=timedelta(seconds=s.verify_timeout_seconds + 120),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        await self._audit("verified", "; ".join(p for p in (
            f"burn-in passed: {self.burn_in_passed}" if self.burn_in_passed else "",
            ", ".join(verified.pods_on_node)) if p))

        self.serving = True
        self._set_phase(NodePhase.SERVING, f"{len(verified.pods_on_node)} pod(s) on {self.node_name}")
        while True:
            served = await workflow.execute_activity(
                "serve_until_done",
                ServeCheckRequest(node_name=self.node_name, return_home=self.policy.return_home,
                                  check_seconds=s.serve_check_seconds, taint_key=self.policy.tolerate,
                                  node_selector={LABEL_GPU_PRODUCT: self._offering().gpu_product},
                                  operation=self.operation, location=self.instance.location,
                                  transfer_check_seconds=s.transfer_check_seconds, offering=self._offering(),
                                  launched_at=self.launched_at, max_gpu_hour=self.policy.max_gpu_hour,
                                  on_over_budget=self.policy.on_over_budget,
                                  over_budget_reported=bool(self.over_budget)),
                task_queue=workflow.info().task_queue + SERVE_QUEUE_SUFFIX,
                result_type=ServeCheckResult, start_to_close_timeout=timedelta(days=365),
                heartbeat_timeout=SERVE_HEARTBEAT, retry_policy=RETRY)
            self._took_transfer(served.transfer)
            if served.over_budget:  # issue 27: recorded in the operation; Drain ends the serve with it
                first = not self.over_budget
                self.over_budget = served.over_budget + (": draining" if served.done else ": reported")
                if first or served.done:
                    self._log(self.over_budget)
                self._show()
            if served.done:
                break
        await self._return_home(served.reason)
        self._set_phase(NodePhase.COMPLETED, f"returned home: {served.reason}")
        return self._result()

    async def _attested_identity(self) -> str:
        """issue 27: the node that joined must be the launched instance (its identity, as the gateway verified it,
        names that instance); what it attested goes into its "joined" record. A mismatch fails the node like a
        failed burn-in: terminated, removed, its pods planned again."""
        if not workflow.patched("attested-identity"):
            return ""
        assert self.instance is not None
        checked = await quick_step(
            "check_node_identity",
            NodeIdentityCheck(operation=self.operation, node_name=self.node_name, instance=self.instance),
            result_type=NodeIdentityResult, summary="the node's attested identity")
        return checked.detail

    async def _burn_in(self, inp: NodeInput) -> None:
        """issue 27: the burn-in gate, while the node still carries its taint (no workload has landed). A failure
        is non-retryable: run() compensates (terminates the node, removes it) and ends Failed with the reason in
        the operation and the audit; the provisioning workflow plans the pods again."""
        assert self.policy is not None
        checks = self.policy.burn_in_checks
        if not self.taint_held or not workflow.patched("burn-in"):
            return
        self._set_phase(NodePhase.VERIFYING, "burn-in: " + (", ".join(checks) or "none; lifting the joining taint"))
        request = BurnInRequest(node_name=self.node_name, gpus=self._offering().gpus, checks=checks,
                                timeout_seconds=self.policy.burn_in_timeout_seconds, operation=self.operation)
        burned: BurnInResult
        if not checks:  # one patch of the node's annotation
            burned = await quick_step("burn_in_node", request, result_type=BurnInResult,
                                      summary="no burn-in checks: lift the joining taint")
        else:  # checks wait for the node (up to the timeout each): an activity of its own, heartbeating
            burned = await workflow.execute_activity(
                "burn_in_node", request, result_type=BurnInResult,
                start_to_close_timeout=timedelta(seconds=self.policy.burn_in_timeout_seconds * len(checks) + 120),
                heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        # In the "verified" record that follows (one record per step the hub knows: every record is reported, in
        # the audit chain's order).
        self.burn_in_passed = "; ".join(burned.passed)

    def _offering(self) -> Offering:
        assert self.inp is not None
        return self.offering or self.inp.node.offering

    def _labels(self, offering: Offering | None = None) -> dict[str, str]:
        assert self.inp is not None
        o = offering or self._offering()
        return {
            LABEL_LOCATION: location_label_value(o.location), LABEL_POLICY: self.inp.policy,
            LABEL_OPERATION: self.operation, LABEL_GPU_PRODUCT: o.gpu_product, LABEL_INSTANCE_TYPE: o.instance_type,
        }

    def _launch_labels(self, offering: Offering) -> dict[str, str]:
        """The node's labels, and the burn-in label: the gateway then keeps the node's joining taint until the
        checks have passed (issue 27). With no checks the label names none and the taint is still held until the
        attested identity has been checked, so no workload lands on a machine that is not the launched instance."""
        assert self.policy is not None
        labels = self._labels(offering)
        if self.policy.burn_in_checks or workflow.patched("identity-before-workload"):
            labels[BURN_IN_LABEL] = burn_in_label(self.policy.burn_in_checks)
            self.taint_held = True
        return labels

    async def _go_ahead(self, inp: NodeInput) -> bool:
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

    async def _hold(self, inp: NodeInput, reason: str) -> None:
        before = (self.phase, self.message)
        self._set_phase(NodePhase.HELD, reason)
        await self._audit("held", reason)
        await wait_until_allowed(inp.policy)
        await self._audit("resumed")
        self._set_phase(*before)

    async def _launch(self, inp: NodeInput) -> None:
        """The planned offering, then the alternatives its pods fit (cheapest first) where one has no capacity."""
        assert self.policy is not None
        tried: list[str] = []
        candidates = [inp.node.offering, *inp.node.alternatives]
        while candidates:
            offering = candidates[0]
            self._set_phase(NodePhase.LAUNCHING, offering.describe(), also=[
                sa.LOCATION.value_set(offering.location), sa.USD_PER_HOUR.value_set(round(offering.usd_per_hour, 4))])
            self.launch_attempted = True
            try:
                self.instance = await workflow.execute_activity(
                    "launch_instance",
                    LaunchRequest(operation=self.operation, cluster=inp.cluster, policy=inp.policy,
                                  allowed_locations=self.policy.locations, offering=offering,
                                  node_name=self.node_name, labels=self._launch_labels(offering),
                                  taints=[Taint(key=self.policy.tolerate)]),
                    result_type=Instance, start_to_close_timeout=timedelta(minutes=5),
                    heartbeat_timeout=HEARTBEAT, retry_policy=RetryPolicy(
                        initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30),
                        maximum_attempts=8))
            except ActivityError as exc:
                if error_type(exc) == INSUFFICIENT_CAPACITY:
                    tried.append(message(exc))
                    candidates.pop(0)
                    continue
                if error_type(exc) == HELD:  # revoked between the check and the launch: hold, then try again
                    await self._hold(inp, message(exc))
                    continue
                raise
            self.offering = offering
            self.launched_at = workflow.now()
            await self._audit("launched", offering.describe())
            return
        raise ApplicationError("no capacity in any eligible location: " + "; ".join(tried), non_retryable=True)

    async def _return_home(self, reason: str) -> None:
        assert self.inp is not None and self.instance is not None
        self._set_phase(NodePhase.DRAINING, reason)
        drained: DrainResult = await workflow.execute_child_workflow(
            DrainWorkflow.run,
            DrainInput(cluster=self.inp.cluster, policy=self.inp.policy, operation=self.operation,
                       node_name=self.node_name, reason=reason, settings=self.inp.settings,
                       instance=InstanceRef(location=self.instance.location, instance_id=self.instance.instance_id,
                                            policy=self.inp.policy)),
            id=f"drain/{workflow.info().workflow_id}/{self.operation}",
            static_summary=f"Drain {self.node_name} ({reason})",
        )
        self._took_transfer(drained.transfer)
        self.ended_at = drained.terminated_at or workflow.now()
        cost = self._cost()
        await self._audit("drained", reason)
        await self._audit("removed", "; ".join(p for p in (cost.describe() if cost else "", self.over_budget) if p))

    async def _compensate(self, reason: str) -> None:
        """Undo in reverse: drain a serving node (pods leave through the Eviction API), then terminate anything
        tagged with this operation and remove its Node."""
        assert self.inp is not None
        if self.serving and self.instance is not None:
            try:
                await self._return_home(reason)
            except (ActivityError, ChildWorkflowError) as exc:
                self._log(f"drain during compensation failed: {message(exc)}")
        if self.launch_attempted:
            locations = self.policy.locations if self.policy else [self._offering().location]
            cleaned = await workflow.execute_activity(
                "cleanup_operation",
                CleanupRequest(operation=self.operation, policy=self.inp.policy, locations=locations,
                               node_name=self.node_name),
                result_type=CleanupResult, start_to_close_timeout=timedelta(minutes=5),
                heartbeat_timeout=timedelta(seconds=60), retry_policy=RETRY)
            if cleaned.terminated or cleaned.node_removed:
                await self._audit("removed", f"compensation: terminated {cleaned.terminated}, "
                                             f"node removed {cleaned.node_removed}")
