"""One long-lived ledger per policy: ``maxNodes`` holds across all open operations of a policy, not per
workflow.

Operations ask by signal (``request``, sent with signal-with-start by an activity, so the ledger starts on first
use) and are answered by signal (``capacity_granted`` to the requesting workflow), first come first served; they
give nodes back with ``release``. Signals, unlike updates, have no per-workflow in-flight limit, so hundreds of
operations can queue at once, and a waiting operation polls nothing: it is told when a node frees up."""

from __future__ import annotations

from temporalio import workflow

from models.operation import LedgerInput, ReservationRequest, ReservationResult

GRANTED_SIGNAL = "capacity_granted"


@workflow.defn(name="PolicyLedger")
class PolicyLedgerWorkflow:
    @workflow.init
    def __init__(self, inp: LedgerInput) -> None:
        # The input is read here, not in run(): signals can be handled before run() starts, and a request
        # granted against an empty ledger after continue-as-new would break maxNodes.
        self.reservations: dict[str, int] = dict(inp.reservations)
        self.waiting: list[ReservationRequest] = list(inp.waiting)
        self.max_nodes = inp.max_nodes
        self.signals = 0
        self.outbox: list[tuple[str, ReservationResult]] = []  # (workflow ID, grant) still to be sent

    @workflow.run
    async def run(self, inp: LedgerInput) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self.outbox) or self.signals >= inp.continue_after_signals)
            while self.outbox:
                target, grant = self.outbox.pop(0)
                try:
                    await workflow.get_external_workflow_handle(target).signal(GRANTED_SIGNAL, grant)
                except Exception:
                    # The requester is gone (finished or terminated): its node goes to the next in line.
                    self._release(grant.operation)
            if self.signals >= inp.continue_after_signals and not self.outbox:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(inp.model_copy(update={
                    "reservations": self.reservations, "waiting": self.waiting, "max_nodes": self.max_nodes}))

    def _result(self, operation: str, granted: bool) -> ReservationResult:
        return ReservationResult(granted=granted, in_use=sum(self.reservations.values()), max_nodes=self.max_nodes,
                                 holders=sorted(self.reservations), operation=operation,
                                 waiting=[w.operation for w in self.waiting])

    def _promote(self) -> None:
        while self.waiting and sum(self.reservations.values()) + self.waiting[0].nodes <= self.max_nodes:
            req = self.waiting.pop(0)
            self.reservations[req.operation] = req.nodes
            self.outbox.append((req.reply_to, self._result(req.operation, True)))

    def _release(self, operation: str) -> None:
        self.reservations.pop(operation, None)
        self.waiting = [w for w in self.waiting if w.operation != operation]
        self._promote()

    @workflow.signal(name="request")
    def request(self, req: ReservationRequest) -> None:
        self.signals += 1
        if req.nodes < 1 or req.max_nodes < 1 or not req.reply_to:
            workflow.logger.warning("ignoring malformed reservation request %s", req)
            return
        self.max_nodes = req.max_nodes  # the policy's current limit, as the operation just read it
        if req.operation in self.reservations:  # a retried request is granted again, not twice
            self.outbox.append((req.reply_to, self._result(req.operation, True)))
        elif all(w.operation != req.operation for w in self.waiting):
            self.waiting.append(req)
            self._promote()

    @workflow.signal(name="release")
    def release(self, operation: str) -> None:
        self.signals += 1
        self._release(operation)

    @workflow.query(name="reservations")
    def current(self) -> ReservationResult:
        return self._result("", True)
