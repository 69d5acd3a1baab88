"""Return home: cordon, evict through the Eviction API honouring PodDisruptionBudgets, wait until the node is
empty, terminate the instance, remove the Node (through the gateway), confirm both gone.

Started as a child of BurstNodeWorkflow, or alone (``kubeon-gpu ops drain``)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

from models import search_attributes as sa
from models.operation import (
    DrainInput,
    DrainResult,
    DrainStatus,
    EvictionResult,
    GoneCheck,
    NodeRef,
    NodeRemoval,
    Phase,
)
from workflows.gate import action_gate, wait_until_allowed

SHORT = timedelta(seconds=60)
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))


class NotGoneYet(Exception):
    pass


@workflow.defn(name="DrainWorkflow")
class DrainWorkflow:
    def __init__(self) -> None:
        self.status = "starting"
        self.blocked: dict[str, str] = {}

    @workflow.query(name="status")
    def current_status(self) -> DrainStatus:
        return DrainStatus(status=self.status, blocked=dict(self.blocked))

    def _details(self, inp: DrainInput) -> None:
        lines = [f"**Drain** node `{inp.node_name}` of operation `{inp.operation}` ({inp.reason or 'requested'})",
                 f"status: {self.status}"]
        lines += [f"- {pod}: {why}" for pod, why in sorted(self.blocked.items())]
        workflow.set_current_details("\n".join(lines))

    def _set(self, inp: DrainInput, status: str) -> None:
        self.status = status
        self._details(inp)

    async def _hold_while_disconnected(self, inp: DrainInput) -> None:
        gate = await action_gate(inp.policy)
        if gate.held:
            status = self.status
            self._set(inp, f"held: {gate.reason}")
            await wait_until_allowed(inp.policy)
            self._set(inp, status)

    @workflow.run
    async def run(self, inp: DrainInput) -> DrainResult:
        workflow.upsert_search_attributes([
            sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
            sa.OPERATION_KIND.value_set("Drain"), sa.PHASE.value_set(Phase.DRAINING.value),
        ])
        await self._hold_while_disconnected(inp)  # R2.3: no drain starts while the hub rejects our token
        self._set(inp, "cordoning")
        node = NodeRef(node_name=inp.node_name)
        present = await workflow.execute_activity(
            "cordon_node", node, result_type=bool, start_to_close_timeout=SHORT, retry_policy=RETRY)
        evicted: set[str] = set()
        if present:
            await self._evict_until_empty(inp, node, evicted)
        if inp.instance is not None:
            self._set(inp, f"terminating {inp.instance.instance_id}")
            await workflow.execute_activity(
                "terminate_instance", inp.instance, start_to_close_timeout=SHORT, retry_policy=RETRY)
        self._set(inp, "removing node")
        removed = await workflow.execute_activity(
            "remove_node", NodeRemoval(node_name=inp.node_name, operation=inp.operation), result_type=bool,
            start_to_close_timeout=SHORT, retry_policy=RETRY)
        self._set(inp, "confirming node and instance gone")
        deadline = workflow.now() + timedelta(minutes=10)
        while not await workflow.execute_activity(
            "confirm_gone", GoneCheck(node_name=inp.node_name, instance=inp.instance), result_type=bool,
            start_to_close_timeout=SHORT, retry_policy=RETRY,
        ):
            if workflow.now() > deadline:
                raise ApplicationError(
                    f"node {inp.node_name} or its instance still present 10 minutes after removal")
            await workflow.sleep(timedelta(seconds=2))
        workflow.upsert_search_attributes([sa.PHASE.value_set(Phase.COMPLETED.value)])
        self._set(inp, "done")
        return DrainResult(node_name=inp.node_name, evicted=len(evicted),
                           instance_terminated=inp.instance is not None, node_removed=removed)

    async def _evict_until_empty(self, inp: DrainInput, node: NodeRef, evicted: set[str]) -> None:
        backoff = 1.0
        deadline = workflow.now() + timedelta(seconds=inp.settings.drain_timeout_seconds)
        while True:
            await self._hold_while_disconnected(inp)
            res: EvictionResult = await workflow.execute_activity(
                "evict_pods", node, result_type=EvictionResult, start_to_close_timeout=SHORT, retry_policy=RETRY)
            evicted.update(p for p in res.remaining if p not in res.blocked)
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
            await workflow.sleep(timedelta(seconds=backoff))
            backoff = min(backoff * 2, 30.0) if res.blocked else 1.0
