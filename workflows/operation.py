"""The skeleton of an operation workflow (Provision, Scale, BurstNode, Drain; the sharing and packing kinds to come).

Two bases, each a plain class the workflow class inherits from (the Python SDK collects the ``@workflow.signal``,
``@workflow.update`` and ``@workflow.query`` handlers of base classes; ``@workflow.run`` stays on the workflow):

- :class:`Operation`: the phase, its message and the history lines, and what the operation shows of them: the
  ``KubeonPhase`` search attribute (upserted only when the phase changes; a run's first upsert, continue-as-new
  included, is written whole as it always was), the Temporal UI's current details
  (set only when what they show changed), a ``Phase:<phase>`` span per change. What the message says may be
  derived from the workflow's state when shown (:meth:`Operation._message`), so it never goes stale.
- :class:`Approvable`: an operation with a proposal a person approves or rejects: signals ``approve`` and
  ``reject`` (for the Temporal UI and ``temporal workflow signal``: ignored unless that proposal awaits), updates
  ``approve_plan`` and ``reject_plan`` whose validators refuse a stale plan, another batch or operation, or the
  wrong phase with :class:`~models.converter.Refused` (an answer without a stack trace). The workflow says what
  awaits (:meth:`Approvable._awaiting`) and waits on ``self.approval`` / ``self.rejection``.

Names a running history may hold stay as they are: workflow types ``Provision``, ``BurstNode``, ``DrainWorkflow``,
``ScaleWorkflow``, ``HubSync``; queries ``state`` (and ``status`` on a drain and the hub sync); the names here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from typing import ClassVar
from typing import Generic
from typing import TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate

from models import search_attributes as sa
from models.converter import Refused
from models.decisions import Approval
from models.decisions import DecisionResult
from models.decisions import Rejection
from models.ids import operation_id
from workflows.observe import phase_span

P = TypeVar("P", bound=StrEnum)
InputT = TypeVar("InputT")

KEEP_HISTORY = 50


class Operation(Generic[P, InputT]):
    """Phase bookkeeping: every write (search attribute, details, history line) only when what it shows changed."""

    KIND: ClassVar[str]  # the KubeonOperationKind value, and the kind of its phase spans

    def __init__(self, phase: P, message: str = "") -> None:
        self.phase: P = phase
        self.message = message
        self.inp: InputT | None = None  # the run's input, once run() has it: a query or signal may come first
        # This run's operation ID (audit records, hub reports and approvals name it), once the run has it; "" in a
        # run that has none.
        self.operation = ""
        self.history: list[str] = []
        self._written: dict[str, Any] = {}  # search attribute name -> the value this run last upserted
        self._shown: str | None = None  # the details last set
        self._spanned: str | None = None  # the phase of the last phase span
        # Only ScaleWorkflow, before this skeleton, upserted KubeonPhase on every phase set: its older runs replay
        # that way (see ScaleWorkflow.run).
        self._upsert_every_set = False

    # -- what subclasses give ---------------------------------------------------------------------------------
    def _details(self) -> str:
        """The Temporal UI's current details (markdown), rendered from the state."""
        raise NotImplementedError

    def _message(self) -> str:
        """The message as shown now (the query, the details, history lines). Override to derive it from state."""
        return self.message

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _set_phase(self, phase: P, message: str = "", also: Sequence[SearchAttributeUpdate[Any]] = ()) -> None:
        """The operation is now in ``phase`` (with ``message``): a history line if either changed, ``KubeonPhase``
        (and ``also``) upserted if changed, the details set if they changed."""
        noted = (phase, message) != (self.phase, self.message) or not self.history
        self.phase, self.message = phase, message
        self._upsert([sa.PHASE.value_set(phase.value), *also], every=self._upsert_every_set)
        if phase.value != self._spanned:
            phase_span(self.KIND, phase.value)
            self._spanned = phase.value
        if noted:
            shown = self._message()
            self._log(phase.value + (f": {shown}" if shown else ""))
        self._show()

    def _note(self, message: str) -> None:
        """A new message in the same phase: a history line and the details if it changed; no upsert."""
        if message != self.message:
            self.message = message
            self._log(self.phase.value + (f": {self._message()}" if self._message() else ""))
        self._show()

    def _upsert(self, updates: Sequence[SearchAttributeUpdate[Any]], *, every: bool = False) -> None:
        """One upsert (a Temporal command and a visibility write) of what changed since this run last wrote it;
        none when nothing did. ``every``: all of ``updates``, as the histories of older runs hold them."""
        changed = [u for u in updates if every or self._written.get(u.key.name) != u.value]
        if changed:
            workflow.upsert_search_attributes(changed)
            self._written.update({u.key.name: u.value for u in changed})

    def _start(self, *attributes: SearchAttributeUpdate[Any]) -> None:
        """The run's first upsert (cluster, policy, kind, ...): in one command, as every run has written it."""
        self._upsert(attributes)

    def _begin(self, cluster: str, policy: str, *also: SearchAttributeUpdate[Any]) -> str:
        """An audited operation's first upsert: cluster, policy, kind, its operation ID (this run's, which its
        audit records and hub reports name), then ``also``. Returns the operation ID."""
        info = workflow.info()
        operation = operation_id(info.workflow_id, info.run_id)
        self._start(sa.CLUSTER.value_set(cluster), sa.POLICY.value_set(policy), sa.OPERATION_KIND.value_set(self.KIND),
                    sa.OPERATION.value_set(operation), *also)
        return operation

    def _log(self, line: str) -> None:
        self.history.append(f"{workflow.now().strftime('%H:%M:%S')} {line}")
        del self.history[:-KEEP_HISTORY]

    def _show(self) -> None:
        """Set the details if what they show changed (call after any change of state they render)."""
        details = self._details()
        if details != self._shown:
            workflow.set_current_details(details)
            self._shown = details


@dataclass(frozen=True)
class Proposal:
    """What awaits approval: the operation (or batch) a decision names, its plan, and what approving does."""

    operation: str
    plan_id: str
    summary: str


class Approvable(Operation[P, InputT]):
    """An operation whose proposal waits for one approval or rejection (CLI, Temporal UI, hub)."""

    NOUN: ClassVar[str] = "operation"  # what a decision names: "batch" for a provisioning

    def __init__(self, phase: P) -> None:
        super().__init__(phase)
        self.approval: Approval | None = None
        self.rejection: Rejection | None = None

    def _awaiting(self) -> Proposal | None:
        """The proposal awaiting a decision now, or None."""
        raise NotImplementedError

    def _subject(self) -> str:
        """How a refusal names the operation when the decision named none: its operation ID (what ``ops list``
        shows), or its workflow ID where it has none (a provisioning, whose decisions name batches)."""
        return f"operation {self.operation}" if self.operation else workflow.info().workflow_id

    @workflow.signal(name="approve", description=(
        "Approve the batch or operation awaiting approval (input may be empty): what it proposes goes ahead (its "
        "details show it). Ignored when nothing awaits. Optional input {\"approver\": \"you\", \"plan_id\": "
        "\"...\"} approves only that plan."))
    def approve_signal(self, approval: Approval | None = None) -> None:
        approval = approval or Approval()
        if self._decision_problem(approval.plan_id, approval.operation) is None:
            self.approval = approval
            self._show()

    @workflow.signal(name="reject", description=(
        "Reject the batch or operation awaiting approval (input may be empty): nothing is done; what it was for "
        "is proposed again later if still wanted."))
    def reject_signal(self, rejection: Rejection | None = None) -> None:
        rejection = rejection or Rejection()
        if self._decision_problem(None, rejection.operation) is None:
            self.rejection = rejection
            self._show()

    @workflow.update(name="approve_plan", description=(
        "Approve the batch or operation awaiting approval, refused with the reason if the plan is stale, another "
        "one awaits, or nothing does. Input {\"approver\": \"you\", \"plan_id\": \"...\"}. In the Temporal "
        "UI fill in an Update ID."))
    def approve_update(self, approval: Approval) -> DecisionResult:
        self.approval = approval
        return self._answer(f"approved by {approval.approver}", with_summary=True)

    @approve_update.validator
    def _validate_approve(self, approval: Approval) -> None:
        refuse(self._decision_problem(approval.plan_id, approval.operation)
                or (None if approval.approver.strip() else "approver must name who approves"))

    @workflow.update(name="reject_plan", description=(
        "Reject the batch or operation awaiting approval; refused with the reason if nothing awaits. Input "
        "{\"approver\": \"you\", \"reason\": \"...\"}."))
    def reject_update(self, rejection: Rejection) -> DecisionResult:
        self.rejection = rejection
        return self._answer(f"rejected by {rejection.approver}")

    @reject_update.validator
    def _validate_reject(self, rejection: Rejection) -> None:
        refuse(self._decision_problem(None, rejection.operation))

    def _answer(self, message: str, *, with_summary: bool = False) -> DecisionResult:
        proposal = self._awaiting()
        assert proposal is not None  # the validator refused otherwise
        self._show()
        return DecisionResult(operation=proposal.operation, phase=self.phase,
                              message=f"{message}: {proposal.summary}" if with_summary else message)

    def _decision_problem(self, plan_id: str | None, operation: str | None) -> str | None:
        """Why a decision is refused (or a signal ignored): None when it is for what awaits now."""
        proposal = self._awaiting()
        if proposal is None or self.approval is not None or self.rejection is not None:
            return f"{operation or self._subject()} is {self.phase.value}, not awaiting approval"
        if operation and operation != proposal.operation:
            return f"{self.NOUN} {operation} is not awaiting approval ({self.NOUN} {proposal.operation} is)"
        if plan_id and plan_id != proposal.plan_id:
            return (f"plan {plan_id} is stale: {self.NOUN} {proposal.operation} now proposes {proposal.plan_id} "
                    f"({proposal.summary})")
        return None


def refuse(problem: str | None) -> None:
    """An update validator's answer: a refusal with the reason (no stack trace), or nothing."""
    if problem:
        raise Refused(problem)
