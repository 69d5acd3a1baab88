"""A packing round end to end on the real Karpenter (kwok provider) and the Temporal dev server, with the
optimizer's own credentials: a pool fragmented in waves (six 1-GPU pods over three 4-GPU nodes) -> one node
emptied, its pods evicted one at a time (each replacement Ready on a kept node before the next), its NodeClaim
deleted by us, no node launched by Karpenter during the round, the pool's budgets back as they were; and a pod
that cannot be re-placed stops the round with its node uncordoned and nothing else evicted."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterator

import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.client import WorkflowFailureError
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.capacity.karpenter import KarpenterCapacity
from activities.clients.audit_log import AuditLog
from models.decisions import Approval
from models.packing import PackInput
from models.packing import PackSettings
from models.packing import PackView
from tests.harness import packing
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.packing import FAST
from tests.harness.packing import USER_BUDGETS
from tests.harness.packing import proposed_round
from tests.harness.packing import until_async
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.temporal import listed
from worker import ops
from worker.cli import _render_view as render_view
from workflows.pack import PackWorkflow

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@contextlib.asynccontextmanager
async def _worker(cluster: Cluster, temporal: Client, queue: str,
                  audit_log: AuditLog | None = None) -> AsyncIterator[None]:
    optimizer = grant(cluster, "kubeon-pack-test", OPTIMIZER_RULES)
    async with packing.pack_worker(temporal, queue, optimizer.api, KarpenterCapacity(optimizer.api), audit_log):
        yield


@pytest.fixture
async def pack_worker(cluster: Cluster, temporal_dev_server: WorkflowEnvironment) -> AsyncIterator[tuple[Client, str]]:
    queue = f"pack-{uuid.uuid4().hex[:6]}"
    async with _worker(cluster, temporal_dev_server.client, queue):
        yield temporal_dev_server.client, queue


@pytest.fixture
def fragmented(cluster: Cluster, karpenter: Karpenter, namespace: str) -> Iterator[tuple[str, dict[str, int]]]:
    """A pool of three 4-GPU nodes with six 1-GPU pods spread over them by the default scheduler."""
    with packing.fragmented_pool(cluster, karpenter, namespace) as fragmented:
        yield fragmented


def _wait_running(cluster: Cluster, namespace: str, app: str, count: int) -> list[client.V1Pod]:
    return packing.wait_running(cluster, namespace, app, count)


async def _round_waiting_on_the_pdb(temporal: Client, queue: str, cluster: Cluster, namespace: str, pool: str,
                                    settings: PackSettings) -> WorkflowHandle[PackWorkflow, PackView]:
    """An Automatic round of one node over ``pool``, started once the PDB ``serve`` allows no disruption, and
    waiting, visibly, on it (its node cordoned, its pool frozen)."""
    pdbs = cluster.admin.policy
    pdbs.patch_namespaced_pod_disruption_budget("serve", namespace, {"spec": {"maxUnavailable": 0}})
    await until(lambda: pdbs.read_namespaced_pod_disruption_budget("serve", namespace).status.disruptions_allowed == 0,
                timeout=30, what="the PDB allowing no disruption")
    handle = await temporal.start_workflow(
        PackWorkflow.run, PackInput(cluster="t", policy="pack", groups=[pool], mode="Automatic", max_nodes=1,
                                    settings=settings),
        id=f"pack-{uuid.uuid4().hex[:6]}", task_queue=queue)

    async def waiting_for_pdb() -> bool:
        return "waits for PDB serve" in (await handle.query(PackWorkflow.state)).message

    await until_async(waiting_for_pdb, what="the round waiting, visibly, on the PDB")
    return handle


async def test_approved_round_empties_one_node_of_three(pack_worker: tuple[Client, str], cluster: Cluster,
                                               karpenter: Karpenter, namespace: str,
                                               fragmented: tuple[str, dict[str, int]]) -> None:
    temporal, queue = pack_worker
    pool, spread = fragmented
    claims_before = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    handle, proposal = await proposed_round(temporal, queue, [pool])
    assert proposal.plan is not None and len(proposal.plan.empty) == 1 and not proposal.moved
    assert "saves $4.60/h" in proposal.message and len(proposal.plan.moves) == spread[proposal.plan.empty[0]]
    assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} == claims_before  # nothing done yet
    await handle.signal("approve", Approval(approver="test"))
    view: PackView = await handle.result()
    assert view.phase == "Done", view
    [removed] = view.removed
    # `ops list` and `ops show` have the round: its kind, its phase, the node it emptied and the pods it moved.
    assert await listed(temporal, handle.id, "Done") == [("Pack", "Done")]
    shown = await ops.show(temporal, handle.id)
    assert isinstance(shown, PackView) and shown.removed == [removed]
    rendered = render_view(shown)
    assert f"removed    {removed}" in rendered and f"from {removed} to " in rendered, rendered
    assert removed in spread and len(view.moved) == spread[removed]
    assert "saves $4.60/h" in view.message
    # Each pod's replacement was Ready elsewhere before the next eviction.
    evicted = [i for i, line in enumerate(view.history) if ": evicted " in line]
    assert len(evicted) == spread[removed]
    # Karpenter launched nothing during the round; our one NodeClaim is gone; the budgets are the user's again.
    claims_after = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    assert claims_after < claims_before and len(claims_after) == 2
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == USER_BUDGETS
    pods = _wait_running(cluster, namespace, "serve", 6)
    assert removed not in {p.spec.node_name for p in pods}
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))


async def test_pdb_wait_then_a_pod_that_cannot_be_replaced_stops_the_round(
        pack_worker: tuple[Client, str], cluster: Cluster, karpenter: Karpenter, namespace: str,
        fragmented: tuple[str, dict[str, int]]) -> None:
    temporal, queue = pack_worker
    pool, _ = fragmented
    pdbs = cluster.admin.policy
    handle = await _round_waiting_on_the_pdb(temporal, queue, cluster, namespace, pool,
                                             FAST.model_copy(update={"replacement_timeout_seconds": 6}))
    # While it waits, the kept nodes fill up (the pool is at its 12-GPU limit: Karpenter cannot add one).
    cluster.admin.apps.create_namespaced_deployment(
        namespace, gpu_workload("filler", taint=pool.removeprefix("gpu-"), replicas=2, gpus=2))
    _wait_running(cluster, namespace, "filler", 2)
    pdbs.patch_namespaced_pod_disruption_budget("serve", namespace, {"spec": {"maxUnavailable": 1}})
    await handle.result()
    state = await handle.query(PackWorkflow.state)
    assert state.phase == "Stopped", state
    assert "cannot be re-placed" in state.message and "Pending" in state.message, state.message
    assert not state.moved and not state.removed
    # One eviction only, the node uncordoned, the budgets as they were, no NodeClaim removed or added.
    assert len([line for line in state.history if ": evicted " in line]) == 1
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == USER_BUDGETS
    assert len(karpenter.nodeclaims(pool)) == 3


async def test_worker_gone_mid_round_the_round_resumes(cluster: Cluster, karpenter: Karpenter, namespace: str,
                                                       temporal_dev_server: WorkflowEnvironment,
                                                       fragmented: tuple[str, dict[str, int]]) -> None:
    pool, spread = fragmented
    temporal, queue = temporal_dev_server.client, f"pack-{uuid.uuid4().hex[:6]}"
    claims_before = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    async with _worker(cluster, temporal, queue):
        handle = await temporal.start_workflow(
            PackWorkflow.run, PackInput(cluster="t", policy="pack", groups=[pool], mode="Automatic", max_nodes=1,
                                        settings=FAST), id=f"pack-{uuid.uuid4().hex[:6]}", task_queue=queue)

        async def first_eviction() -> bool:
            return any(": evicted " in line for line in (await handle.query(PackWorkflow.state)).history)

        await until_async(first_eviction, what="the round's first eviction")
    # The worker is gone with the round cordoned and frozen; a new one picks the round up where it was.
    assert any(n.spec.unschedulable for n in karpenter.nodes(pool))
    async with _worker(cluster, temporal, queue):
        state = await handle.result()
    assert state.phase == "Done", state
    [removed] = state.removed
    assert len(state.moved) == spread[removed]
    assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} < claims_before
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == USER_BUDGETS


async def test_a_cancelled_round_uncordons_and_unfreezes(
        pack_worker: tuple[Client, str], cluster: Cluster, karpenter: Karpenter, namespace: str,
        fragmented: tuple[str, dict[str, int]]) -> None:
    """Cancelled from the UI or CLI while it waits on a PDB (its node cordoned, its pool frozen): the round ends
    Cancelled with the node uncordoned, the budgets the user's again, nothing evicted and no NodeClaim removed."""
    temporal, queue = pack_worker
    pool, _ = fragmented
    handle = await _round_waiting_on_the_pdb(temporal, queue, cluster, namespace, pool, FAST)
    assert [n.metadata.name for n in karpenter.nodes(pool) if n.spec.unschedulable]  # its node cordoned
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] != USER_BUDGETS  # its pool frozen
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    state = await handle.query(PackWorkflow.state)
    assert state.phase == "Cancelled", state
    assert not [line for line in state.history if ": evicted " in line] and not state.removed
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == USER_BUDGETS
    assert len(karpenter.nodeclaims(pool)) == 3
    assert len(_wait_running(cluster, namespace, "serve", 6)) == 6
