"""ScaleWorkflow: observe -> propose -> [approve] -> scale to 0 -> wait for wake -> scale back -> verify Ready.

One per (policy, workload). The replicas before the scale-down live in this workflow's state (carried over
continue-as-new) and in the policy's status, never on the workload (the Role allows only ``/scale``). Wake:
``wake`` update or signal (`kubeon-gpu ops wake`), the policy's schedule, or its demand query. A workload that
something else scaled meanwhile (HPA, KEDA, GitOps, a person) is left alone, with the reason. Failure or cancel
after the scale-down scales the workload back first."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError
from temporalio.exceptions import CancelledError

from models import search_attributes as sa
from models.audit import AuditRecord
from models.decisions import Approval
from models.hub import scale_proposal_detail
from models.ids import operation_id
from models.scale import DemandRequest
from models.scale import DemandValue
from models.scale import Observation
from models.scale import ObserveRequest
from models.scale import ReadyRequest
from models.scale import ReadyResult
from models.scale import ScaledState
from models.scale import ScaleInput
from models.scale import ScaleOutcome
from models.scale import ScalePhase
from models.scale import ScalePolicyRequest
from models.scale import ScalePolicySnapshot
from models.scale import ScaleRequest
from models.scale import ScaleResult
from models.scale import ScaleStatusUpdate
from models.scale import ScaleView
from models.scale import WakeRequest
from models.scale import WakeResult
from models.scale import WakeTime
from models.scale import WakeTimeRequest
from workflows.audit import record_audit
from workflows.failures import QUICK
from workflows.failures import RETRY
from workflows.failures import message
from workflows.gate import action_gate
from workflows.gate import wait_until_allowed
from workflows.operation import Approvable
from workflows.operation import Proposal
from workflows.operation import refuse

HEARTBEAT = timedelta(seconds=15)
WAKEABLE = (ScalePhase.SCALING_DOWN, ScalePhase.SCALED_TO_ZERO)
# Runs started before the phase bookkeeping upserted KubeonPhase only on change replay without this marker.
PHASE_ON_CHANGE = "kubeon-phase-on-change"


@workflow.defn(name="ScaleWorkflow")
class ScaleWorkflow(Approvable[ScalePhase, ScaleInput]):
    KIND = "Scale"

    def __init__(self) -> None:
        super().__init__(ScalePhase.OBSERVING)
        self.policy: ScalePolicySnapshot | None = None
        self.observation: Observation | None = None
        self.replicas_before: int | None = None
        self.scaled_at: datetime | None = None
        self.wake_request: WakeRequest | None = None
        self.woken_by: str | None = None

    # -- visibility -----------------------------------------------------------------------------------------
    def _details(self) -> str:
        assert self.inp is not None
        lines = [f"**ScaleToZero** `{self.operation}` for `{self.inp.workload.key}`, policy `{self.inp.policy}`, "
                 f"mode {self.policy.mode if self.policy else '?'}",
                 f"**Phase:** {self.phase.value}" + (f" — {self.message}" if self.message else "")]
        if self.replicas_before is not None:
            lines.append(f"Replicas before: {self.replicas_before}")
        if self.phase == ScalePhase.AWAITING_APPROVAL:
            lines.append(f"Approve: `kubeon-gpu ops approve {self.operation}` or signal `approve`")
        if self.phase == ScalePhase.SCALED_TO_ZERO:
            lines.append(f"Wake: `kubeon-gpu ops wake {self.operation}` or signal `wake`")
        return "\n".join(lines)

    def _view(self) -> ScaleView:
        inp = self.inp
        return ScaleView(
            operation=self.operation, workflow_id=workflow.info().workflow_id, cluster=inp.cluster if inp else "",
            policy=inp.policy if inp else "", workload=inp.workload.key if inp else "",
            mode=self.policy.mode if self.policy else None, phase=self.phase, replicas_before=self.replicas_before,
            approver=self.approval.approver if self.approval else None, woken_by=self.woken_by,
            message=self.message, history=list(self.history))

    async def _audit(self, action: str, detail: str = "", *, whole: bool = False) -> None:
        """An audit record, reported to the hub (R2.8). ``whole``: the detail goes as it is (the proposal's plan)."""
        assert self.inp is not None
        key = self.inp.workload.key
        await record_audit(AuditRecord(
            key=f"{self.operation}/{action}", at=workflow.now(), cluster=self.inp.cluster, policy=self.inp.policy,
            operation=self.operation, action=action, approver=self.approval.approver if self.approval else None,
            detail=detail if whole else f"{key}: {detail}" if detail else key))

    async def _status(self, entry: dict[str, str | int | None] | None) -> None:
        assert self.inp is not None
        await workflow.execute_activity(
            "update_scale_status", ScaleStatusUpdate(policy=self.inp.policy, workload=self.inp.workload, entry=entry),
            start_to_close_timeout=QUICK, retry_policy=RETRY)

    # -- operator interface (approve, reject: Approvable's handlers) ---------------------------------------
    @workflow.query(name="state")
    def state(self) -> ScaleView:
        return self._view()

    def _awaiting(self) -> Proposal | None:
        if self.phase != ScalePhase.AWAITING_APPROVAL:
            return None
        return Proposal(operation=self.operation, plan_id=self.plan_id(),
                        summary=f"scaling {self._workload()} to 0")

    @workflow.signal(name="wake")
    def wake_signal(self, request: WakeRequest | None = None) -> None:
        if self._wake_problem() is None:
            self.wake_request = request or WakeRequest()

    @workflow.update(name="wake")
    def wake_update(self, request: WakeRequest) -> WakeResult:
        self.wake_request = request
        return WakeResult(operation=self.operation, phase=self.phase,
                          message=f"waking {self._workload()} to {self.replicas_before} replica(s)")

    @wake_update.validator
    def _validate_wake(self, request: WakeRequest) -> None:
        refuse(self._wake_problem())

    def _workload(self) -> str:
        return self.inp.workload.key if self.inp else "?"

    def plan_id(self) -> str:
        return f"{self.operation}-r{self.replicas_before}"

    def _wake_problem(self) -> str | None:
        if self.phase not in WAKEABLE:
            return f"operation {self.operation} is {self.phase.value}: only a workload scaled to zero can be woken"
        if self.wake_request is not None:
            return f"operation {self.operation} is already being woken"
        return None

    # -- the operation --------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: ScaleInput) -> ScaleOutcome:
        self.inp = inp
        info = workflow.info()
        self.operation = inp.resume.operation if inp.resume else operation_id(info.workflow_id, info.run_id)
        self._start(sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
                    sa.OPERATION_KIND.value_set(self.KIND), sa.OPERATION.value_set(self.operation),
                    sa.LOCATION.value_set(inp.workload.namespace))
        # A run begun before this bookkeeping wrote KubeonPhase at every phase set (a proposal open in Recommend
        # mode, once a minute): its history replays that way.
        self._upsert_every_set = not workflow.patched(PHASE_ON_CHANGE)
        try:
            try:
                return await self._run(inp)
            except ActivityError as exc:
                if isinstance(exc.cause, CancelledError):
                    raise asyncio.CancelledError(str(exc.cause)) from exc
                raise
        except asyncio.CancelledError:
            self._log("cancel requested")
            note = await self._restore("cancelled")
            self._set_phase(ScalePhase.CANCELLED, "cancelled" + note)
            await self._audit("cancelled", self.message)
            raise
        except (ActivityError, ApplicationError) as exc:
            reason = message(exc)
            note = await self._restore(reason)
            self._set_phase(ScalePhase.FAILED, reason + note)
            await self._audit("failed", self.message)
            return self._outcome()

    def _outcome(self) -> ScaleOutcome:
        return ScaleOutcome(operation=self.operation, phase=self.phase, message=self.message,
                            replicas_before=self.replicas_before)

    async def _restore(self, why: str) -> str:
        """Compensation: a workload this operation scaled to zero goes back to its replicas."""
        if self.scaled_at is None or self.replicas_before is None or self.inp is None:
            return ""
        try:
            result = await workflow.execute_activity(
                "scale_workload", self._scale_request(self.replicas_before, expect=0), result_type=ScaleResult,
                start_to_close_timeout=QUICK, retry_policy=RetryPolicy(maximum_attempts=5))
            await self._status(None)
        except ActivityError as exc:
            return f"; could not scale {self._workload()} back to {self.replicas_before}: {message(exc)}"
        return f"; {result.message}"

    def _scale_request(self, replicas: int, *, expect: int) -> ScaleRequest:
        assert self.inp is not None
        return ScaleRequest(operation=self.operation, workload=self.inp.workload, replicas=replicas, expect=expect)

    async def _load_policy(self) -> ScalePolicySnapshot:
        assert self.inp is not None
        self.policy = await workflow.execute_activity(
            "load_scale_policy",
            ScalePolicyRequest(policy=self.inp.policy, default_mode=self.inp.default_mode,
                               prometheus_configured=self.inp.prometheus_configured, workload=self.inp.workload),
            result_type=ScalePolicySnapshot, start_to_close_timeout=QUICK, retry_policy=RETRY)
        return self.policy

    async def _observe(self) -> Observation:
        assert self.policy is not None and self.inp is not None
        self.observation = await workflow.execute_activity(
            "observe_workload",
            ObserveRequest(workload=self.inp.workload, threshold=self.policy.threshold,
                           idle_for_seconds=self.policy.idle_for_seconds, min_coverage=self.policy.min_coverage),
            result_type=Observation, start_to_close_timeout=timedelta(minutes=2), retry_policy=RETRY)
        return self.observation

    def _gone(self, policy: ScalePolicySnapshot) -> str | None:
        if not policy.exists:
            return f"policy {policy.name} is gone"
        if not policy.applies:
            return policy.not_applying_reason
        return None

    async def _run(self, inp: ScaleInput) -> ScaleOutcome:
        if inp.resume is not None:
            self.replicas_before = inp.resume.replicas_before
            self.scaled_at = inp.resume.scaled_at
            self.history = list(inp.resume.history)
            if inp.resume.approver:
                self.approval = Approval(approver=inp.resume.approver)
            await self._load_policy()
            return await self._at_zero(inp)

        self._set_phase(ScalePhase.OBSERVING, "measuring GPU activity")
        policy = await self._load_policy()
        gone = self._gone(policy)
        if gone:
            self._set_phase(ScalePhase.WITHDRAWN, gone)
            return self._outcome()
        obs = await self._observe()
        if obs.replicas == 0:
            self._set_phase(ScalePhase.WITHDRAWN, f"{self._workload()} is already at 0 replicas")
            return self._outcome()
        if not obs.idle:
            self._set_phase(ScalePhase.WITHDRAWN, f"not scaled: {obs.reason}")
            return self._outcome()
        self.replicas_before = obs.replicas
        proposal = f"scale {self._workload()} from {obs.replicas} to 0 replicas ({obs.reason})"
        # The proposal as the hub's Approvals page shows it and binds a decision to (its plan id).
        await self._audit("proposed", scale_proposal_detail(
            plan_id=self.plan_id(), summary=proposal, workload=self._workload(), replicas=obs.replicas,
            idle_evidence=obs.reason), whole=True)

        waited = 0
        while policy.mode != "Automatic":
            if policy.mode == "Recommend":
                self._set_phase(ScalePhase.PROPOSED, proposal + (f"; {policy.mode_reason}" if policy.mode_reason
                                                                 else ""))
            elif self.phase != ScalePhase.AWAITING_APPROVAL:
                self._set_phase(ScalePhase.AWAITING_APPROVAL, proposal)
            step = inp.settings.observe_seconds
            try:
                await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None,
                                              timeout=timedelta(seconds=step))
            except TimeoutError:
                waited += step
            if self.rejection is not None:
                snooze = inp.settings.snooze_seconds or policy.idle_for_seconds
                self._set_phase(ScalePhase.REJECTED, f"rejected by {self.rejection.approver}"
                                + (f": {self.rejection.reason}" if self.rejection.reason else "")
                                + f"; not proposed again for {snooze // 60}m")
                await self._audit("rejected", self.rejection.reason)
                await workflow.sleep(timedelta(seconds=snooze))
                return self._outcome()
            if self.approval is not None:
                await self._audit("approved", f"plan {self.plan_id()}")
                break
            if waited >= inp.settings.approval_timeout_seconds:
                if policy.mode == "Recommend":
                    # The proposal ends (its history stays short); the next resync proposes again while idle.
                    self._note(f"{proposal}; still idle after {waited}s (re-proposed while idle)")
                    return self._outcome()
                self._set_phase(ScalePhase.EXPIRED, f"no approval within {inp.settings.approval_timeout_seconds}s")
                await self._audit("expired")
                return self._outcome()
            policy = await self._load_policy()
            gone = self._gone(policy)
            obs = await self._observe()
            if gone or not obs.idle or obs.replicas != self.replicas_before:
                # A rescale by something else (HPA, KEDA, GitOps) says more than the idleness it causes.
                why = gone or (f"replicas changed from {self.replicas_before} to {obs.replicas} meanwhile"
                               if obs.replicas != self.replicas_before else f"no longer idle: {obs.reason}")
                self._set_phase(ScalePhase.WITHDRAWN, f"proposal withdrawn: {why}")
                await self._audit("withdrawn", why)
                return self._outcome()

        gate = await action_gate(inp.policy)
        if gate.held:
            self._set_phase(ScalePhase.HELD, gate.reason)
            await self._audit("held", gate.reason)
            await wait_until_allowed(inp.policy)
            await self._audit("resumed")
        # Approval can take a while: look once more just before acting.
        obs = await self._observe()
        if not obs.idle:
            self._set_phase(ScalePhase.WITHDRAWN, f"not scaled: no longer idle: {obs.reason}")
            await self._audit("withdrawn", self.message)
            return self._outcome()

        self._set_phase(ScalePhase.SCALING_DOWN, f"{self.replicas_before} -> 0")
        result = await workflow.execute_activity(
            "scale_workload", self._scale_request(0, expect=self.replicas_before), result_type=ScaleResult,
            start_to_close_timeout=QUICK, retry_policy=RETRY)
        if not result.done:
            self._set_phase(ScalePhase.LEFT_ALONE, result.message)
            await self._audit("withdrawn", result.message)
            return self._outcome()
        self.scaled_at = workflow.now()
        await self._status({"phase": ScalePhase.SCALED_TO_ZERO.value, "replicas": self.replicas_before,
                            "operation": self.operation, "since": self.scaled_at.isoformat(),
                            "workflowId": workflow.info().workflow_id})
        await self._audit("scaled", f"{self.replicas_before} -> 0 replicas")
        return await self._at_zero(inp)

    async def _at_zero(self, inp: ScaleInput) -> ScaleOutcome:
        assert self.replicas_before is not None and self.scaled_at is not None
        policy = self.policy
        assert policy is not None
        self._set_phase(ScalePhase.SCALED_TO_ZERO, f"was {self.replicas_before} replica(s); waiting for wake")
        wake_at: datetime | None = None
        if policy.schedule is not None:
            wake_at = (await workflow.execute_activity(
                "next_wake_time", WakeTimeRequest(schedule=policy.schedule, after=self.scaled_at),
                result_type=WakeTime, start_to_close_timeout=QUICK, retry_policy=RETRY)).at
            self._log(f"scheduled wake at {wake_at.isoformat()}")
        checks = 0
        why = ""
        while not why:
            now = workflow.now()
            step = float(inp.settings.rescale_check_seconds)
            if policy.demand_query:
                step = min(step, policy.demand_poll_seconds)
            if wake_at is not None:
                step = max(0.0, min(step, (wake_at - now).total_seconds()))
            if step > 0:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(lambda: self.wake_request is not None,
                                                  timeout=timedelta(seconds=step))
            if self.wake_request is not None:
                self.woken_by = self.wake_request.by
                why = f"woken by {self.wake_request.by}" + (f": {self.wake_request.reason}"
                                                              if self.wake_request.reason else "")
                break
            if wake_at is not None and workflow.now() >= wake_at:
                self.woken_by = "schedule"
                why = f"scheduled wake at {policy.schedule.at if policy.schedule else '?'}"
                break
            if policy.demand_query:
                demand = await workflow.execute_activity(
                    "demand_value", DemandRequest(query=policy.demand_query), result_type=DemandValue,
                    start_to_close_timeout=QUICK, retry_policy=RETRY)
                if demand.value is not None and demand.value > policy.activation_threshold:
                    self.woken_by = "demand"
                    why = f"demand {demand.value:g} > {policy.activation_threshold:g} ({policy.demand_query})"
                    break
                if demand.error and not self.message.endswith(demand.error):
                    self._note(f"demand query not answered: {demand.error}")
            # A policy deleted, or no longer naming the workload, gives it back its replicas.
            policy = await self._load_policy()
            gone = self._gone(policy)
            if gone:
                why = f"{gone}: restoring its replicas"
                break
            found = await workflow.execute_activity("read_replicas", inp.workload, result_type=int,
                                                    start_to_close_timeout=QUICK, retry_policy=RETRY)
            if found != 0:
                msg = (f"{self._workload()} was scaled to {found} replica(s) by something else while at zero: "
                       "left alone")
                self.scaled_at = None  # not ours to restore any more
                await self._status(None)
                self._set_phase(ScalePhase.LEFT_ALONE, msg)
                await self._audit("withdrawn", msg)
                return self._outcome()
            checks += 1
            if checks >= inp.settings.checks_before_continue:
                workflow.continue_as_new(ScaleInput(
                    cluster=inp.cluster, policy=inp.policy, workload=inp.workload, default_mode=inp.default_mode,
                    prometheus_configured=inp.prometheus_configured, settings=inp.settings,
                    resume=ScaledState(operation=self.operation, replicas_before=self.replicas_before,
                                       scaled_at=self.scaled_at,
                                       approver=self.approval.approver if self.approval else None,
                                       history=self.history[-50:])))

        self._set_phase(ScalePhase.WAKING, f"{why}: 0 -> {self.replicas_before}")
        result = await workflow.execute_activity(
            "scale_workload", self._scale_request(self.replicas_before, expect=0), result_type=ScaleResult,
            start_to_close_timeout=QUICK, retry_policy=RETRY)
        if not result.done:
            self.scaled_at = None
            await self._status(None)
            self._set_phase(ScalePhase.LEFT_ALONE, result.message)
            await self._audit("withdrawn", result.message)
            return self._outcome()
        await self._audit("woken", why)
        self._set_phase(ScalePhase.VERIFYING, f"waiting for {self.replicas_before} Ready pod(s)")
        ready = await workflow.execute_activity(
            "wait_workload_ready",
            ReadyRequest(workload=inp.workload, replicas=self.replicas_before,
                         timeout_seconds=inp.settings.ready_timeout_seconds),
            result_type=ReadyResult, start_to_close_timeout=timedelta(seconds=inp.settings.ready_timeout_seconds + 60),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        self.scaled_at = None
        await self._status(None)
        self._set_phase(ScalePhase.COMPLETED, f"{why}; back to {ready.ready}/{ready.replicas} replica(s) Ready")
        await self._audit("verified", self.message)
        return self._outcome()
