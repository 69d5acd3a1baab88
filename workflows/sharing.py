"""The Sharing operations, one per node (``sharing/<cluster>/<node>``), over one base (:class:`SharingOperation`:
the proposal, approval and policy gate, the undo signal/update, audit records, the run's compensation on a failure
or a cancellation):

- :class:`TimeSlicingWorkflow`: propose -> [approve] -> write the config key -> wait for it to propagate -> label
  the node -> verify allocatable and labels -> shared, until undone (restore the previous label, verify, name the
  pods the node can no longer serve, remove keys no node names). The key is content-addressed and never edited
  once written; its propagation is counted from when it was written (a key found there may be a moment old); the
  previous label lives in this workflow's state. On a verification timeout or mismatch the
  previous label is set back and the operation fails saying why; a crash at any step resumes (every activity is
  idempotent: the same key, the same label).
- :class:`MigWorkflow`: see its docstring."""

from __future__ import annotations

import asyncio
import contextlib
import math
from datetime import timedelta
from typing import Any
from typing import ClassVar
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError

from models import search_attributes as sa
from models.audit import AuditRecord
from models.drain import EvictionResult
from models.drain import NodeRef
from models.hub import sharing_proposal_detail
from models.policy import Mode
from models.sharing import CleanupRequest
from models.sharing import CleanupResult
from models.sharing import LabelRequest
from models.sharing import MigInput
from models.sharing import MigLabelRequest
from models.sharing import MigStateRequest
from models.sharing import MigStateResult
from models.sharing import MigVerifyRequest
from models.sharing import NodeConfig
from models.sharing import PolicyModeChange
from models.sharing import SharingInputBase
from models.sharing import SharingOutcome
from models.sharing import SharingPhase
from models.sharing import SharingView
from models.sharing import TimeSlicingInput
from models.sharing import UndoRequest
from models.sharing import UndoResult
from models.sharing import UnservableRequest
from models.sharing import UnservableResult
from models.sharing import VerifyRequest
from models.sharing import VerifyResult
from models.sharing import WriteKeyRequest
from models.sharing import WriteKeyResult
from workflows.audit import record_audit
from workflows.failures import QUICK
from workflows.failures import RETRY
from workflows.failures import message
from workflows.gate import action_gate
from workflows.gate import wait_until_allowed
from workflows.operation import Approvable
from workflows.operation import Proposal
from workflows.operation import refuse

# Short: a cancelled wait learns it at its next heartbeat, which the SDK throttles to 80 % of this.
HEARTBEAT = timedelta(seconds=5)

InputT = TypeVar("InputT", bound=SharingInputBase)


class SharingOperation(Approvable[SharingPhase, InputT]):
    """What the two sharing workflows do alike. A workflow gives what it changes (:meth:`_what`,
    :meth:`_view_fields`, :meth:`_undo_message`, the lines of its details), its steps (:meth:`_apply`) and its
    compensation (:meth:`_compensate`); its ``@workflow.run`` calls :meth:`_operate`."""

    KIND = "Sharing"
    CHANGED: ClassVar[str] = "shared"  # "only a node it <CHANGED> can be restored"

    def __init__(self) -> None:
        super().__init__(SharingPhase.PROPOSED)
        self.unservable: list[str] = []
        self.undo_request: UndoRequest | None = None
        self.undone_by: str | None = None
        self.mode_change: PolicyModeChange | None = None  # the policy switched from Recommend while proposed

    # -- what subclasses give -------------------------------------------------------------------------------
    def _what(self) -> str:
        """What the operation does to its node, for the details' first line."""
        raise NotImplementedError

    def _progress_lines(self) -> list[str]:
        """Details lines after the saving and risk (what the operation learnt on the way)."""
        return []

    def _closing_lines(self) -> list[str]:
        """Details lines after the approve/undo hints."""
        return []

    def _view_fields(self) -> dict[str, Any]:
        """The :class:`SharingView` fields this workflow fills (replicas, previous_label, key)."""
        raise NotImplementedError

    def _undo_message(self) -> str:
        raise NotImplementedError

    async def _apply(self, inp: InputT) -> SharingOutcome:
        """After the proposal was approved (or needs none) and the gate let it go: the change, and its undo."""
        raise NotImplementedError

    async def _compensate(self, why: str, *, cancelled: bool) -> str:
        """On a failure or a cancellation: put back what was changed; a note on how that went (or "")."""
        raise NotImplementedError

    # -- visibility -----------------------------------------------------------------------------------------
    def _details(self) -> str:
        assert self.inp is not None
        inp = self.inp
        lines = [f"**Sharing** `{self.operation}`: {self._what()} on node `{inp.node}`, policy `{inp.policy}`, "
                 f"mode {self._mode()}",
                 f"**Phase:** {self.phase.value}" + (f" — {self.message}" if self.message else ""),
                 f"Saves ${inp.saving_usd_per_hour:,.2f}/h. Why: {inp.reason}", f"Risk: {inp.risk}",
                 *self._progress_lines()]
        if self.phase == SharingPhase.AWAITING_APPROVAL:
            lines.append(f"Approve: `kubeon-gpu ops approve {self.operation}` or signal `approve`")
        if self.phase == SharingPhase.SHARED:
            lines.append(f"Undo: `kubeon-gpu ops undo {self.operation}` or signal `undo`")
        return "\n".join(lines + self._closing_lines())

    def _view(self) -> SharingView:
        inp = self.inp
        return SharingView(
            operation=self.operation, workflow_id=workflow.info().workflow_id, cluster=inp.cluster if inp else "",
            policy=inp.policy if inp else "", node=inp.node if inp else "", mode=self._mode() if inp else None,
            phase=self.phase, unservable=list(self.unservable), undone_by=self.undone_by,
            approver=self.approval.approver if self.approval else None, message=self.message,
            history=list(self.history), **self._view_fields())

    @workflow.query(name="state")
    def state(self) -> SharingView:
        return self._view()

    def _mode(self) -> Mode:
        assert self.inp is not None
        return self.mode_change.mode if self.mode_change else self.inp.mode

    @workflow.signal(name="policy_mode")
    def policy_mode(self, change: PolicyModeChange) -> None:
        """Sent by the watcher when this Recommend operation's policy now acts: taken only for the proposal it
        made, while it is proposed, and only to a mode that acts (a switch back to Recommend changes nothing)."""
        if (self.inp is not None and self.inp.mode == "Recommend" and self.mode_change is None
                and self.phase == SharingPhase.PROPOSED and change.plan_id == self.inp.plan_id
                and change.mode != "Recommend"):
            self.mode_change = change

    def _awaiting(self) -> Proposal | None:
        if self.phase != SharingPhase.AWAITING_APPROVAL or self.inp is None:
            return None
        return Proposal(operation=self.operation, plan_id=self.inp.plan_id, summary=self.inp.summary)

    @workflow.signal(name="undo")
    def undo_signal(self, request: UndoRequest | None = None) -> None:
        if self._undo_problem() is None:
            self.undo_request = request or UndoRequest()

    @workflow.update(name="undo")
    def undo_update(self, request: UndoRequest) -> UndoResult:
        self.undo_request = request
        return UndoResult(operation=self.operation, phase=self.phase, message=self._undo_message())

    @undo_update.validator
    def _validate_undo(self, request: UndoRequest) -> None:
        refuse(self._undo_problem())

    def _undo_problem(self) -> str | None:
        if self.phase != SharingPhase.SHARED:
            return f"operation {self.operation} is {self.phase.value}: only a node it {self.CHANGED} can be restored"
        if self.undo_request is not None:
            return f"operation {self.operation} is already being undone"
        return None

    def _node(self) -> str:
        return self.inp.node if self.inp else "?"

    async def _audit(self, action: str, detail: str = "", *, key: str = "", whole: bool = False) -> None:
        """An audit record, reported to the hub (R2.8) with its actions' names: a change in force is
        ``verified``, as is its undo (keyed apart). ``whole``: the detail goes as it is (the proposal's plan)."""
        assert self.inp is not None
        await record_audit(AuditRecord(
            key=f"{self.operation}/{key or action}", at=workflow.now(), cluster=self.inp.cluster,
            policy=self.inp.policy, operation=self.operation, action=action,
            approver=self.approval.approver if self.approval else None,
            detail=detail if whole else f"node {self.inp.node}: {detail}" if detail else f"node {self.inp.node}"))

    def _outcome(self) -> SharingOutcome:
        return SharingOutcome(operation=self.operation, phase=self.phase, message=self.message,
                              unservable=list(self.unservable))

    async def _wait_undo(self) -> UndoRequest:
        """Shared until an undo is asked for (signal or update): who asked."""
        await workflow.wait_condition(lambda: self.undo_request is not None)
        assert self.undo_request is not None
        self.undone_by = self.undo_request.by
        return self.undo_request

    # -- the operation --------------------------------------------------------------------------------------
    async def _operate(self, inp: InputT) -> SharingOutcome:
        """The whole run: search attributes, then :meth:`_run`; a failure or a cancellation compensates."""
        self.inp = inp
        self.operation = self._begin(inp.cluster, inp.policy, sa.LOCATION.value_set(inp.node),
                                     sa.USD_PER_HOUR.value_set(inp.saving_usd_per_hour))
        try:
            return await self._run(inp)
        except asyncio.CancelledError:
            # Cancelled (`temporal workflow cancel`): what was changed is put back first.
            note = await self._compensate("cancelled", cancelled=True)
            self._set_phase(SharingPhase.FAILED, "cancelled" + note)
            await self._audit("cancelled", self.message)
            raise
        except (ActivityError, ApplicationError) as exc:
            reason = message(exc)
            note = await self._compensate(reason, cancelled=False)
            self._set_phase(SharingPhase.FAILED, reason + note)
            await self._audit("failed", self.message)
            return self._outcome()

    async def _run(self, inp: InputT) -> SharingOutcome:
        """Propose; in Approve mode wait for the decision; wait while the policy's gate holds; then apply."""
        # The proposal as the hub's Approvals page shows it and binds a decision to (its plan id).
        await self._audit("proposed", sharing_proposal_detail(
            plan_id=inp.plan_id, node=inp.node, gpus=inp.gpus, change=self._what(), summary=inp.summary,
            reason=inp.reason, risk=inp.risk, saving_usd_per_hour=inp.saving_usd_per_hour), whole=True)
        timeout = inp.settings.approval_timeout_seconds
        if inp.mode == "Recommend":
            self._set_phase(SharingPhase.PROPOSED, inp.summary + (f"; {inp.mode_reason}" if inp.mode_reason else ""))
            # A recommendation stands until it expires, or until its policy acts (the watcher signals the switch:
            # a newcomer who reads the proposal and sets the policy to Approve gets it to approve, not a day's
            # wait for this one to end before the next is started).
            try:
                await workflow.wait_condition(lambda: self.mode_change is not None, timeout=timedelta(seconds=timeout))
            except TimeoutError:
                return self._outcome()
            self._log(f"policy {inp.policy} now in {self._mode()}: the proposal goes on in that mode")
        if self._mode() == "Approve":
            self._set_phase(SharingPhase.AWAITING_APPROVAL, inp.summary)
            try:
                await workflow.wait_condition(lambda: self.approval is not None or self.rejection is not None,
                                              timeout=timedelta(seconds=timeout))
            except TimeoutError:
                self._set_phase(SharingPhase.EXPIRED, f"no approval within {timeout}s")
                await self._audit("expired")
                return self._outcome()
            if self.rejection is not None:
                self._set_phase(SharingPhase.REJECTED, f"rejected by {self.rejection.approver}"
                                + (f": {self.rejection.reason}" if self.rejection.reason else ""))
                await self._audit("rejected", self.rejection.reason)
                return self._outcome()
            assert self.approval is not None
            await self._audit("approved", f"plan {inp.plan_id} by {self.approval.approver}")
        gate = await action_gate(inp.policy)
        if gate.held:
            self._set_phase(SharingPhase.HELD, gate.reason)
            await self._audit("held", gate.reason)
            await wait_until_allowed(inp.policy)
        return await self._apply(inp)


@workflow.defn(name="TimeSlicing")
class TimeSlicingWorkflow(SharingOperation[TimeSlicingInput]):
    """Time-slicing on one node (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: NodeConfig | None = None
        self.key = ""

    # -- visibility -----------------------------------------------------------------------------------------
    def _what(self) -> str:
        assert self.inp is not None
        return f"time-slicing {self.inp.replicas} replicas per GPU"

    def _progress_lines(self) -> list[str]:
        if self.previous is None:
            return []
        return [f"Previous config label: {self.previous.label or '(none)'} ({self.previous.replicas} replica(s))"]

    def _closing_lines(self) -> list[str]:
        return [f"Unservable after undo: {', '.join(self.unservable)}"] if self.unservable else []

    def _view_fields(self) -> dict[str, Any]:
        return {"replicas": self.inp.replicas if self.inp else 0,
                "previous_label": self.previous.label if self.previous else None, "key": self.key}

    def _undo_message(self) -> str:
        label = self.previous.label if self.previous else None
        return f"restoring node {self._node()} to config {label or '(none)'}"

    # -- steps ----------------------------------------------------------------------------------------------
    async def _label(self, key: str | None) -> None:
        await workflow.execute_activity("set_device_plugin_config", LabelRequest(node=self._node(), key=key),
                                        start_to_close_timeout=QUICK, retry_policy=RETRY)

    async def _verify(self, replicas: int) -> VerifyResult:
        assert self.inp is not None
        timeout = self.inp.settings.verify_timeout_seconds
        return await workflow.execute_activity(
            "verify_time_slicing", VerifyRequest(node=self._node(), replicas=replicas, gpus=self.inp.gpus,
                                                 timeout_seconds=timeout),
            result_type=VerifyResult, start_to_close_timeout=timedelta(seconds=timeout + 60),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)

    async def _cleanup(self) -> None:
        """Release this node's pending mark, then remove the keys no node names and no operation brings."""
        assert self.inp is not None
        done = await workflow.execute_activity(
            "remove_unused_time_slicing_keys", CleanupRequest(namespace=self.inp.namespace,
                                                              config_map=self.inp.config_map,
                                                              release=self.inp.node),
            result_type=CleanupResult, start_to_close_timeout=QUICK, retry_policy=RETRY)
        if done.removed:
            self._log(f"removed unused key(s) {', '.join(done.removed)}")

    async def _restore(self) -> str:
        """Compensation: the previous label back on the node; what the node then shows."""
        if self.previous is None:
            return ""
        try:
            await self._label(self.previous.label)
            back = await self._verify(self.previous.replicas)
        except ActivityError as exc:
            return f"; could not restore config {self.previous.label or '(none)'}: {message(exc)}"
        shown = "" if back.ok else f" (node does not show it yet: {back.reason})"
        return f"; previous config {self.previous.label or '(none)'} restored{shown}"

    async def _compensate(self, why: str, *, cancelled: bool) -> str:
        """Once a key was written: the node gets its previous label back (and, on a failure, unused keys go)."""
        if not self.key:
            return ""
        note = await self._restore()
        if not cancelled:
            with contextlib.suppress(ActivityError):
                await self._cleanup()
        return note

    def _propagation_left(self, written: WriteKeyResult) -> int:
        """Whole seconds the key still needs to reach the device plugin, counted from when it was written: a key
        found in the ConfigMap may have been written a moment ago (by this operation's attempt that a crash cut
        off before it reported, or by another node's operation), and naming it at once would have the
        config-manager refuse a key its mounted copy lacks. A key without a written time (an admin's, or written
        before the time was kept; and every result in a history recorded before) is waited for in full only
        when this call wrote it, as before."""
        assert self.inp is not None
        full = self.inp.settings.propagation_seconds
        if written.written_at is None:
            return full if written.written else 0
        left = (written.written_at + timedelta(seconds=full) - workflow.now()).total_seconds()
        return min(full, max(0, math.ceil(left)))

    # -- the operation --------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: TimeSlicingInput) -> SharingOutcome:
        return await self._operate(inp)

    async def _apply(self, inp: TimeSlicingInput) -> SharingOutcome:
        self.previous = await workflow.execute_activity("read_node_config", inp.node, result_type=NodeConfig,
                                                        start_to_close_timeout=QUICK, retry_policy=RETRY)
        self._set_phase(SharingPhase.WRITING_CONFIG, f"a time-slicing key with {inp.replicas} replicas into "
                                                     f"ConfigMap {inp.namespace}/{inp.config_map}")
        written = await workflow.execute_activity(
            "write_time_slicing_key", WriteKeyRequest(namespace=inp.namespace, config_map=inp.config_map,
                                                      replicas=inp.replicas, node=inp.node,
                                                      fail_requests_greater_than_one=inp.fail_requests_greater_than_one),
            result_type=WriteKeyResult, start_to_close_timeout=QUICK, retry_policy=RETRY)
        self.key = written.key
        wait = self._propagation_left(written)
        if wait > 0:
            self._set_phase(SharingPhase.PROPAGATING, (
                f"key {self.key} written; waiting {wait}s for it to reach the device plugin's mounted ConfigMap "
                "(kubelet sync period + ConfigMap cache TTL; the optimizer cannot see inside the pod)"))
            await workflow.sleep(timedelta(seconds=wait))
        self._set_phase(SharingPhase.LABELLING, f"{inp.node}: nvidia.com/device-plugin.config={self.key} (was "
                                                f"{self.previous.label or '(none)'})")
        await self._label(self.key)
        self._set_phase(SharingPhase.VERIFYING, f"allocatable nvidia.com/gpu = {inp.gpus} x {inp.replicas}, "
                                                "replicas, -SHARED product and sharing-strategy labels")
        result = await self._verify(inp.replicas)
        if not result.ok:
            why = (f"node {inp.node} did not show the config within {inp.settings.verify_timeout_seconds}s: "
                   f"{result.reason}")
            note = await self._restore()
            await self._cleanup()
            self._set_phase(SharingPhase.FAILED, why + note)
            await self._audit("failed", self.message)
            return self._outcome()
        self._set_phase(SharingPhase.SHARED, f"{inp.node}: {result.allocatable} time-sliced GPUs "
                                             f"({inp.gpus} x {inp.replicas})")
        await self._audit("verified", self.message, key="shared")
        await self._cleanup()

        undo = await self._wait_undo()
        label = self.previous.label
        self._set_phase(SharingPhase.RESTORING, f"undo by {self.undone_by}"
                        + (f" ({undo.reason})" if undo.reason else "") + f": config {label or '(none)'}")
        await self._label(label)
        back = await self._verify(self.previous.replicas)
        if not back.ok:
            raise ApplicationError(f"undo: node {inp.node} did not show config {label or '(none)'} within "
                                   f"{inp.settings.verify_timeout_seconds}s: {back.reason}", non_retryable=True)
        over = await workflow.execute_activity("unservable_pods", UnservableRequest(node=inp.node),
                                               result_type=UnservableResult, start_to_close_timeout=QUICK,
                                               retry_policy=RETRY)
        self.unservable = over.pods
        await self._cleanup()
        note = (f"; {len(over.pods)} pod(s) above its {over.allocatable} GPUs keep running but cannot be served "
                f"again here: {', '.join(over.pods)}" if over.pods else "")
        self._set_phase(SharingPhase.UNDONE, f"{inp.node} back to {back.allocatable} GPU(s)" + note)
        await self._audit("verified", f"undo: {self.message}", key="undone")
        return self._outcome()


@workflow.defn(name="Mig")
class MigWorkflow(SharingOperation[MigInput]):
    """propose -> [approve] -> cordon -> evict the node's GPU pods (Eviction API, PDBs honoured: a blocked pod is
    waited for, shown) -> nvidia.com/mig.config -> wait for nvidia.com/mig.config.state success -> wait for the
    nvidia.com/mig-* allocatable (the device plugin registers it after the MIG manager's success) -> uncordon;
    until undone (the previous geometry through the same steps). ``failed`` or a timeout restores the previous
    geometry and uncordons: the node is never left cordoned."""

    CHANGED = "reconfigured"

    def __init__(self) -> None:
        super().__init__()
        self.previous: str | None = None
        self.cordoned = False
        self.blocked: dict[str, str] = {}
        self.evicted: list[str] = []

    # -- visibility -----------------------------------------------------------------------------------------
    def _what(self) -> str:
        assert self.inp is not None
        return f"MIG geometry {self.inp.geometry}"

    def _progress_lines(self) -> list[str]:
        if not self.blocked:
            return []
        return ["Waiting on: " + ", ".join(f"{p} ({w})" for p, w in sorted(self.blocked.items()))]

    def _view_fields(self) -> dict[str, Any]:
        return {"replicas": 1, "previous_label": self.previous, "key": self.inp.geometry if self.inp else ""}

    def _undo_message(self) -> str:
        return f"restoring node {self._node()} to MIG config {self.previous or 'all-disabled'}"

    # -- steps ----------------------------------------------------------------------------------------------
    async def _uncordon(self) -> None:
        assert self.inp is not None
        if self.cordoned:
            self._set_phase(SharingPhase.UNCORDONING, self.inp.node)
            await workflow.execute_activity("uncordon_node", self.inp.node, start_to_close_timeout=QUICK,
                                            retry_policy=RETRY)
            self.cordoned = False

    async def _evict(self) -> None:
        assert self.inp is not None
        inp = self.inp
        deadline = workflow.now() + timedelta(seconds=inp.settings.drain_timeout_seconds)
        backoff = 1.0
        while True:
            res = await workflow.execute_activity(
                "evict_pods", NodeRef(node_name=inp.node, gpu_only=True), result_type=EvictionResult,
                start_to_close_timeout=QUICK, retry_policy=RETRY,
                summary=f"evict the GPU pods of {inp.node} (Eviction API, PDBs honoured)")
            self.evicted += [p for p in res.remaining if p not in res.blocked and p not in self.evicted]
            self.blocked = dict(res.blocked)
            if not res.remaining:
                self.blocked = {}
                return
            if res.blocked:
                self._note(f"{len(res.remaining)} GPU pod(s) left; waiting: "
                           + ", ".join(f"{p} {w}" for p, w in sorted(res.blocked.items())))
            else:
                self._note(f"waiting for {len(res.remaining)} GPU pod(s) to terminate")
                backoff = 1.0
            if workflow.now() > deadline:
                raise ApplicationError(f"eviction of the GPU pods of {inp.node} not finished after "
                                       f"{inp.settings.drain_timeout_seconds}s: "
                                       + "; ".join(f"{p} {w}" for p, w in sorted(res.blocked.items())))
            await workflow.sleep(timedelta(seconds=backoff), summary="before the next eviction round")
            backoff = min(backoff * 2, 30.0)

    async def _set_geometry(self, geometry: str | None) -> MigStateResult | None:
        """nvidia.com/mig.config set to ``geometry`` (None removes it); unless removed, what the MIG manager then
        reports in nvidia.com/mig.config.state (success, failed, timeout)."""
        assert self.inp is not None
        inp = self.inp
        await workflow.execute_activity("set_mig_config", MigLabelRequest(node=inp.node, geometry=geometry),
                                        start_to_close_timeout=QUICK, retry_policy=RETRY)
        if geometry is None:
            return None
        return await workflow.execute_activity(
            "wait_mig_state", MigStateRequest(node=inp.node, geometry=geometry,
                                              timeout_seconds=inp.settings.mig_timeout_seconds),
            result_type=MigStateResult, start_to_close_timeout=timedelta(seconds=inp.settings.mig_timeout_seconds + 60),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)

    async def _reconfigure(self, geometry: str | None, expected: dict[str, int]) -> None:
        """Cordon, evict, label, wait for success, verify; raises with the reason (the caller compensates)."""
        assert self.inp is not None
        inp = self.inp
        self._set_phase(SharingPhase.CORDONING, inp.node)
        await workflow.execute_activity("cordon_node", NodeRef(node_name=inp.node), result_type=bool,
                                        start_to_close_timeout=QUICK, retry_policy=RETRY)
        self.cordoned = True
        self._set_phase(SharingPhase.EVICTING, f"the GPU pods of {inp.node}")
        await self._evict()
        target = geometry or "all-disabled"
        self._set_phase(SharingPhase.RECONFIGURING, f"nvidia.com/mig.config={target}; waiting for "
                                                    "nvidia.com/mig.config.state (pending, rebooting, success)")
        state = await self._set_geometry(target)
        assert state is not None
        if state.state != "success":
            raise ApplicationError(f"the MIG manager reported {state.state} for {target} on {inp.node}",
                                   non_retryable=True)
        self._set_phase(SharingPhase.VERIFYING, ", ".join(f"{k}={v}" for k, v in sorted(expected.items())))
        wait = inp.settings.verify_timeout_seconds
        verified = await workflow.execute_activity(
            "verify_mig_resources", MigVerifyRequest(node=inp.node, expected=expected, timeout_seconds=wait),
            result_type=VerifyResult, start_to_close_timeout=timedelta(seconds=wait + 60),
            heartbeat_timeout=HEARTBEAT, retry_policy=RETRY)
        if not verified.ok:
            raise ApplicationError(f"{inp.node} reports {target} but not its resources within {wait}s: "
                                   f"{verified.reason}",
                                   non_retryable=True)
        await self._uncordon()

    def _expected(self) -> dict[str, int]:
        assert self.inp is not None
        return {f"nvidia.com/mig-{p}": n * self.inp.gpus for p, n in self.inp.slices.items()}

    async def _restore(self) -> str:
        """Compensation: the previous geometry back, the node uncordoned (whatever the restore does)."""
        try:
            state = await self._set_geometry(self.previous)
            if state is not None:
                note = f"; previous MIG config {self.previous} restored ({state.state})"
            else:
                note = "; nvidia.com/mig.config removed (it had none)"
        except ActivityError as exc:
            note = f"; could not restore MIG config {self.previous}: {message(exc)}"
        await self._uncordon()
        return note + "; node uncordoned"

    async def _compensate(self, why: str, *, cancelled: bool) -> str:
        """Once the node was cordoned: the previous geometry back and the node uncordoned."""
        return await self._restore() if self.cordoned else ""

    # -- the operation --------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: MigInput) -> SharingOutcome:
        return await self._operate(inp)

    async def _apply(self, inp: MigInput) -> SharingOutcome:
        self.previous = (await workflow.execute_activity(
            "read_mig_config", inp.node, result_type=MigStateResult, start_to_close_timeout=QUICK,
            retry_policy=RETRY)).previous
        await self._reconfigure(inp.geometry, self._expected())
        self._set_phase(SharingPhase.SHARED, f"{inp.node}: " + ", ".join(
            f"{v} {k}" for k, v in sorted(self._expected().items())) + f"; evicted {len(self.evicted)} GPU pod(s)")
        await self._audit("verified", self.message, key="shared")

        await self._wait_undo()
        back = self.previous or "all-disabled"
        self._set_phase(SharingPhase.RESTORING, f"undo by {self.undone_by}: MIG config {back}")
        await self._reconfigure(self.previous, {"nvidia.com/gpu": inp.gpus} if back == "all-disabled" else {})
        self._set_phase(SharingPhase.UNDONE, f"{inp.node} back to MIG config {self.previous or 'all-disabled'}")
        await self._audit("verified", f"undo: {self.message}", key="undone")
        return self._outcome()
