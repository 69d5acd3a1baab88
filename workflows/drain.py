"""Return home: cordon, evict through the Eviction API honouring PodDisruptionBudgets, wait until the node is
empty, terminate the instance, remove the Node (through the gateway), confirm both gone.

Started as a child of BurstNodeWorkflow, or alone (``kubeon-gpu ops drain``)."""

from __future__ import annotations

from datetime import datetime
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError

from models import search_attributes as sa
from models.cost import TransferReading
from models.drain import DrainInput
from models.drain import DrainPhase
from models.drain import DrainResult
from models.drain import DrainStatus
from models.drain import EvictionResult
from models.drain import GoneCheck
from models.drain import NodeRef
from models.drain import NodeRemoval
from models.node import TransferRequest
from models.ui_text import Details
from models.ui_text import code
from models.ui_text import md
from workflows.failures import QUICK
from workflows.failures import RETRY
from workflows.failures import message
from workflows.gate import action_gate
from workflows.gate import wait_until_allowed
from workflows.operation import Operation


@workflow.defn(name="DrainWorkflow")
class DrainWorkflow(Operation[DrainPhase, DrainInput]):
    KIND = "Drain"

    def __init__(self) -> None:
        super().__init__(DrainPhase.DRAINING, "starting")
        self.blocked: dict[str, str] = {}
        self.cordoned = False
        self.evicted: list[str] = []
        self.pdb_waits: dict[str, int] = {}
        self.terminated: str | None = None
        self.node_removed = False
        self.transfer: TransferReading | None = None
        self.terminated_at: datetime | None = None

    @workflow.query(name="status", description=(
        "What the drain did so far: cordoned, pods evicted (in order), pods a PodDisruptionBudget holds and how "
        "often, the instance terminated, the Node removed."))
    def current_status(self) -> DrainStatus:
        return DrainStatus(status=self.message, blocked=dict(self.blocked), cordoned=self.cordoned,
                           evicted=list(self.evicted), pdb_waits=dict(self.pdb_waits), terminated=self.terminated,
                           node_removed=self.node_removed, phase=self.phase.value, history=list(self.history))

    def _details(self) -> str:
        inp = self.inp
        assert inp is not None
        where = f", location {md(inp.instance.location)}" if inp.instance else ""
        d = Details()
        d.para(f"**Drain** of node {code(inp.node_name)} (operation {code(inp.operation)}, policy "
               f"{code(inp.policy)}{where}): {md(inp.reason or 'requested')}")
        d.para(f"**Status:** {md(self.message)}")
        d.para("**Cordoned:** " + ("yes" if self.cordoned else "not yet"))
        if self.evicted:
            d.para(f"**Evicted** ({len(self.evicted)}):")
            d.bullets((code(p) for p in self.evicted), limit=30, more="more pods")
        if self.blocked:
            d.para("**Waiting for PodDisruptionBudgets** (never forced):")
            d.bullets(f"{code(p)}: {md(why)} ({self.pdb_waits.get(p, 1)} round(s))"
                      for p, why in sorted(self.blocked.items()))
        if self.terminated:
            d.para(f"**Terminated** instance {code(self.terminated)}")
        if self.node_removed:
            d.para("**Node removed**")
        return d.render()

    def _set(self, inp: DrainInput, status: str) -> None:
        self._note(status)

    async def _hold_while_disconnected(self, inp: DrainInput) -> None:
        gate = await action_gate(inp.policy)
        if gate.held:
            status = self.message
            self._set(inp, f"held: {gate.reason}")
            await wait_until_allowed(inp.policy)
            self._set(inp, status)

    @workflow.run
    async def run(self, inp: DrainInput) -> DrainResult:
        self.inp = inp
        self._start(
            sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
            sa.OPERATION_KIND.value_set(self.KIND), sa.PHASE.value_set(DrainPhase.DRAINING.value),
            sa.OPERATION.value_set(inp.operation),
            *([sa.LOCATION.value_set(inp.instance.location)] if inp.instance else []),
        )
        await self._hold_while_disconnected(inp)  # R2.3: no drain starts while the hub rejects our token
        self._set(inp, "cordoning")
        node = NodeRef(node_name=inp.node_name)
        present = await workflow.execute_activity(
            "cordon_node", node, result_type=bool, start_to_close_timeout=QUICK, retry_policy=RETRY,
            summary=f"cordon {inp.node_name}")
        self.cordoned = present
        if present:
            await self._evict_until_empty(inp, node)
        if inp.instance is not None:
            self._set(inp, f"terminating {inp.instance.instance_id}")
            await workflow.execute_activity(
                "terminate_instance", inp.instance, start_to_close_timeout=QUICK, retry_policy=RETRY,
                summary=f"terminate {inp.instance.instance_id} in {inp.instance.location}")
            self.terminated = inp.instance.instance_id
            self.terminated_at = workflow.now()
        await self._read_transfer(inp)
        self._set(inp, "removing node")
        removed = await workflow.execute_activity(
            "remove_node", NodeRemoval(node_name=inp.node_name, operation=inp.operation), result_type=bool,
            start_to_close_timeout=QUICK, retry_policy=RETRY, summary=f"remove Node {inp.node_name}")
        self.node_removed = True
        self._set(inp, "confirming node and instance gone")
        deadline = workflow.now() + timedelta(minutes=10)
        while not await workflow.execute_activity(
            "confirm_gone", GoneCheck(node_name=inp.node_name, instance=inp.instance), result_type=bool,
            start_to_close_timeout=QUICK, retry_policy=RETRY,
        ):
            if workflow.now() > deadline:
                raise ApplicationError(
                    f"node {inp.node_name} or its instance still present 10 minutes after removal")
            await workflow.sleep(timedelta(seconds=2), summary="until the Node and the instance are gone")
        self._set_phase(DrainPhase.COMPLETED, "done: node drained, instance terminated, Node removed"
                        if inp.instance else "done: node drained and removed")
        return DrainResult(node_name=inp.node_name, evicted=len(self.evicted),
                           instance_terminated=inp.instance is not None, node_removed=removed,
                           transfer=self.transfer, terminated_at=self.terminated_at)

    async def _read_transfer(self, inp: DrainInput) -> None:
        """The node's transfer a last time before its slot at the gateway goes (issue 27). A gateway that cannot
        answer after a few tries does not hold the drain up: the reading made while serving stands, said so."""
        if inp.instance is None or not workflow.patched("drain-reads-transfer"):
            return
        try:
            self.transfer = await workflow.execute_activity(
                "read_transfer", TransferRequest(node_name=inp.node_name, operation=inp.operation,
                                                 location=inp.instance.location),
                result_type=TransferReading, start_to_close_timeout=QUICK,
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
                summary=f"transfer of {inp.node_name}")
        except ActivityError as exc:
            self._log(f"transfer not read before removal: {message(exc)}")

    async def _evict_until_empty(self, inp: DrainInput, node: NodeRef) -> None:
        backoff = 1.0
        deadline = workflow.now() + timedelta(seconds=inp.settings.drain_timeout_seconds)
        while True:
            await self._hold_while_disconnected(inp)
            res: EvictionResult = await workflow.execute_activity(
                "evict_pods", node, result_type=EvictionResult, start_to_close_timeout=QUICK, retry_policy=RETRY,
                summary=f"evict the pods of {inp.node_name} (Eviction API, PDBs honoured)")
            # Pods still listed and not blocked had their eviction accepted (they may still be terminating).
            self.evicted += [p for p in res.remaining if p not in res.blocked and p not in self.evicted]
            for pod in res.blocked:
                self.pdb_waits[pod] = self.pdb_waits.get(pod, 0) + 1
            self.blocked = dict(res.blocked)
            if not res.remaining:
                return
            if res.blocked:
                names = sorted({why for why in res.blocked.values()})
                self._set(inp, f"evicting: {len(res.remaining)} pod(s) left; " + ", ".join(names))
            else:
                self._set(inp, f"waiting for {len(res.remaining)} pod(s) to terminate")
                backoff = 1.0
            if workflow.now() > deadline:
                # Never force past a PDB: leave the node cordoned and say why; an operator decides.
                raise ApplicationError(
                    f"drain of {inp.node_name} not finished after {inp.settings.drain_timeout_seconds}s: "
                    + "; ".join(f"{p} {w}" for p, w in sorted(res.blocked.items())))
            await workflow.sleep(timedelta(seconds=backoff), summary="before the next eviction round")
            backoff = min(backoff * 2, 30.0) if res.blocked else 1.0
