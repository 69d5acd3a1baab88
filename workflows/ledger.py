"""One long-lived ledger per policy: operations reserve burst nodes by update before launching, so
``maxNodes`` holds across all open operations of a policy, not per workflow."""

from __future__ import annotations

from temporalio import workflow

from models.operation import LedgerInput, ReservationRequest, ReservationResult


@workflow.defn(name="PolicyLedger")
class PolicyLedgerWorkflow:
    @workflow.init
    def __init__(self, inp: LedgerInput) -> None:
        # The input is read here, not in run(): updates can be handled before run() starts, and a reservation
        # granted against an empty ledger after continue-as-new would break maxNodes.
        self.reservations: dict[str, int] = dict(inp.reservations)
        self.max_nodes = 0
        self.updates = 0

    @workflow.run
    async def run(self, inp: LedgerInput) -> None:
        await workflow.wait_condition(
            lambda: self.updates >= inp.continue_after_updates and workflow.all_handlers_finished())
        workflow.continue_as_new(inp.model_copy(update={"reservations": self.reservations}))

    def _result(self, granted: bool) -> ReservationResult:
        return ReservationResult(granted=granted, in_use=sum(self.reservations.values()), max_nodes=self.max_nodes,
                                 holders=sorted(self.reservations))

    @workflow.update(name="reserve")
    def reserve(self, req: ReservationRequest) -> ReservationResult:
        self.updates += 1
        self.max_nodes = req.max_nodes  # the policy's current limit, as the operation just read it
        if req.operation in self.reservations:  # a retried reservation is granted again, not twice
            return self._result(True)
        if sum(self.reservations.values()) + req.nodes > req.max_nodes:
            return self._result(False)
        self.reservations[req.operation] = req.nodes
        return self._result(True)

    @reserve.validator
    def _validate_reserve(self, req: ReservationRequest) -> None:
        if req.nodes < 1 or req.max_nodes < 1:
            raise ValueError("nodes and max_nodes must be at least 1")

    @workflow.update(name="release")
    def release(self, operation: str) -> ReservationResult:
        self.updates += 1
        self.reservations.pop(operation, None)
        return self._result(True)

    @workflow.query(name="reservations")
    def current(self) -> ReservationResult:
        return self._result(True)
