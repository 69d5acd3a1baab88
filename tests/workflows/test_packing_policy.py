"""Packing policies end to end on the real Karpenter (kwok provider), the real apiserver with the GpuPolicy CRD
and the Temporal dev server, with the optimizer's own credentials: over a fragmented pool (six 1-GPU pods on
three 4-GPU nodes) a Recommend policy only reports (status.packing: the proposal, $/h saved, the pods it moves;
no round, nothing moved); the same policy in Approve gets one round from the watcher, a second resync leaves it
as it is, the approval (the ``approve_plan`` update, bound to the run's plan ID) empties one node (its NodeClaim
deleted by us), audited from proposal to removal, and the next resync proposes and starts nothing. An
Autoscaling policy: Recommend reports the limit it would set, Automatic sets the NodePool's GPU limit to maxGpus,
holds it, and patches it again when maxGpus is lowered; with maxUsdPerHour the limit is the GPUs the budget buys
at the pool's worst $/GPU-hour, patched when the budget is lowered, and a pool without priced instance types is
reported as not holding the budget (its limit left alone, maxGpus still held)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

from activities.capacity.karpenter import KarpenterCapacity
from activities.clients.audit_log import AuditLog
from hub.plans import parse_plan
from models.autoscaling import GpuProductsView
from models.decisions import Approval
from models.packing import PackInput
from models.packing import PackView
from models.packing import packing_workflow_id
from models.policy import API_GROUP
from models.policy import PLURAL
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.crd import install_gpupolicy_crd
from tests.harness.crd import read_gpupolicy
from tests.harness.karpenter import A100
from tests.harness.karpenter import L4
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.packing import FAST
from tests.harness.packing import until_async
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.temporal import listed
from tests.harness.workloads import live_pods
from tests.workflows.test_pack import USER_BUDGETS
from tests.workflows.test_pack import _worker
from tests.workflows.test_pack import fragmented as fragmented  # the fixture
from worker import ops
from worker.packing_watcher import PackingWatcher
from workflows.gpu_products import GpuProductsWorkflow
from workflows.pack import PackWorkflow

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture
def packing_policy(cluster: Cluster) -> Iterator[str]:
    install_gpupolicy_crd(cluster)
    name = f"pack-{uuid.uuid4().hex[:6]}"
    yield name
    with contextlib.suppress(Exception):  # already gone
        cluster.admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, name)


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    doc = read_gpupolicy(cluster, name) or {}
    return dict((doc.get("status") or {}).get("packing") or {})


async def test_recommend_reports_then_approve_runs_one_round_that_removes_a_node(
        cluster: Cluster, karpenter: Karpenter, namespace: str, temporal_dev_server: WorkflowEnvironment,
        fragmented: tuple[str, dict[str, int]], packing_policy: str, tmp_path: Path) -> None:
    pool, spread = fragmented
    temporal: Client = temporal_dev_server.client
    queue, cluster_name = f"packpol-{uuid.uuid4().hex[:6]}", f"c-{uuid.uuid4().hex[:6]}"
    cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": packing_policy},
        "spec": {"kind": "Packing", "mode": "Recommend", "nodePools": [pool], "maxNodesAtOnce": 2,
                 "pods": {"namespaces": [namespace]}, "interval": "10m"}})
    optimizer = grant(cluster, "kubeon-packing-policy-test", OPTIMIZER_RULES)
    watcher = PackingWatcher(optimizer.api, KarpenterCapacity(optimizer.api), temporal, cluster=cluster_name,
                             task_queue=queue, default_mode=lambda: "Automatic", settings=FAST, resync_seconds=1)
    claims_before = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    wid = packing_workflow_id(cluster_name, packing_policy)

    # Recommend: the proposal is recorded, no round starts, nothing is moved.
    assert await watcher.resync() == []
    status = _status(cluster, packing_policy)
    assert status["enforcedMode"] == "Recommend" and status["nodePools"] == [pool]
    proposal = status["proposal"]
    assert proposal["usdPerHourSaved"] == 4.6 and len(proposal["nodes"]) == 1, status
    [node] = proposal["nodes"]
    assert len(proposal["moves"]) == spread[node] and all(m["from"] == node for m in proposal["moves"])
    assert "saves $4.60/h" in proposal["summary"] and "nothing is moved" in status["round"]["note"]
    assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} == claims_before
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))

    # Approve: the watcher starts the policy's round, which awaits one approval; another resync leaves it be.
    cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, packing_policy,
                                                     {"spec": {"mode": "Approve"}})
    audit = AuditLog(tmp_path / "audit.jsonl")
    async with _worker(cluster, temporal, queue, audit):
        assert await watcher.resync() == [wid]
        handle = temporal.get_workflow_handle(wid, result_type=PackView)

        async def awaiting() -> bool:
            return (await handle.query(PackWorkflow.state)).phase == "AwaitingApproval"

        await until_async(awaiting, what="the round awaiting approval")
        assert await watcher.resync() == []
        status = _status(cluster, packing_policy)
        assert status["enforcedMode"] == "Approve" and status["round"]["workflowId"] == wid
        assert "left as it is" in status["round"]["note"], status["round"]
        assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} == claims_before  # nothing done yet
        proposed = await handle.query(PackWorkflow.state)
        assert proposed.operation.startswith("op-")
        # The plan ID is the run's: an approval naming the policy's round in general (its workflow ID, which every
        # round shares) is refused as stale, never applied to this round.
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update("approve_plan", Approval(approver="test", plan_id=wid))
        result = await handle.execute_update("approve_plan", Approval(approver="test", plan_id=proposed.operation))
        assert "approved by test" in str(result)
        view = await handle.result()
    assert view.phase == "Done", view
    [removed] = view.removed
    assert removed in spread and len(view.moved) == spread[removed]
    claims_after = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    assert claims_after < claims_before and len(claims_after) == 2
    assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == USER_BUDGETS
    # The round is audited and reported to the hub (R2.8), its proposal with the plan the hub shows and binds to.
    records = [r for r in audit.read() if r.operation == view.operation]
    assert [(r.action, r.node_name) for r in records] == [
        ("proposed", None), ("approved", None), ("drained", removed), ("removed", removed)]
    assert records[1].approver == "test"
    sent = parse_plan(records[0].detail)
    assert sent is not None and (sent.plan_id, sent.remove) == (view.operation, [removed])
    assert view.plan is not None and sent.saving_usd_per_hour == round(view.plan.usd_per_hour_saved, 6) > 4.5
    assert len(sent.moves) == spread[removed] and all(f": {removed} -> " in m for m in sent.moves)
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    # Packed: the next resync proposes nothing more and starts no round; the proposal and round are gone from the
    # status.
    assert await watcher.resync() == []
    status = _status(cluster, packing_policy)
    assert "proposal" not in status and "round" not in status and status["reason"], status
    assert status["nodePools"] == [pool]


async def test_autoscaling_recommend_reports_automatic_holds_and_lowering_max_gpus_patches_the_limit(
        cluster: Cluster, karpenter: Karpenter, temporal_dev_server: WorkflowEnvironment,
        packing_policy: str, namespace: str) -> None:
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=12, gpu_counts=(4,)))
    try:
        cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": packing_policy},
            "spec": {"kind": "Autoscaling", "mode": "Recommend", "nodePools": [pool], "maxGpus": 8}})
        optimizer = grant(cluster, "kubeon-autoscaling-policy-test", OPTIMIZER_RULES)
        watcher = PackingWatcher(optimizer.api, KarpenterCapacity(optimizer.api), temporal_dev_server.client,
                                 cluster="c", task_queue="unused", default_mode=lambda: "Automatic")

        def limit() -> str | None:
            return (karpenter.nodepool(pool)["spec"].get("limits") or {}).get("nvidia.com/gpu")

        def entry() -> dict[str, Any]:
            doc = read_gpupolicy(cluster, packing_policy) or {}
            [only] = doc["status"]["autoscaling"]["nodePools"]
            return dict(only)

        assert await watcher.resync() == []
        assert limit() == "12" and "would set the limit to 8 GPUs (now 12)" in entry()["reason"]
        patch = cluster.admin.custom.patch_cluster_custom_object
        patch(API_GROUP, "v1", PLURAL, packing_policy, {"spec": {"mode": "Automatic"}})
        await watcher.resync()
        assert limit() == "8" and "limit set to 8 GPUs (was 12)" in entry()["reason"]
        await watcher.resync()
        assert limit() == "8" and entry()["reason"] == "held at 8 GPUs"
        patch(API_GROUP, "v1", PLURAL, packing_policy, {"spec": {"maxGpus": 4}})
        await watcher.resync()
        assert limit() == "4" and "limit set to 4 GPUs (was 8)" in entry()["reason"]
        # The user's other settings of the pool are as they were.
        assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == [{"nodes": "10%"}]

        # Held: two 4-GPU pods get one 4-GPU node; Karpenter says the second exceeds the pool's limits (its own event
        # on the waiting pod) and makes no NodeClaim for it.
        cluster.admin.apps.create_namespaced_deployment(namespace, gpu_workload("over", taint=taint, replicas=2,
                                                                                 gpus=4))

        def one_running() -> list[Any]:
            pods = live_pods(cluster.admin.core, namespace, "over")
            return pods if sorted(str(p.status.phase) for p in pods) == ["Pending", "Running"] else []

        def refused_at_the_limit() -> str | None:
            pods = one_running()
            waiting = [str(p.metadata.name) for p in pods if p.status.phase == "Pending"]
            said = [e.message for e in cluster.admin.core.list_namespaced_event(
                namespace, field_selector=f"involvedObject.name={waiting[0]}").items
                if e.reporting_component == "karpenter" and "exceed limits for nodepool" in (e.message or "")
            ] if waiting else []
            return said[0] if said else None

        said = await until(refused_at_the_limit, timeout=90, what="the second pod refused at the pool's limit")
        assert f"NodePool={pool}" in said
        assert len(karpenter.nodeclaims(pool)) == 1 and len(one_running()) == 2  # one node; the second still waits
    finally:
        with contextlib.suppress(Exception):
            cluster.admin.apps.delete_namespaced_deployment("over", namespace)
        karpenter.delete_nodepool(pool)


def _autoscaling(cluster: Cluster, karpenter: Karpenter, temporal: Client, policy: str,
                 spec: dict[str, Any]) -> tuple[PackingWatcher, Any, Any]:
    """The policy created; a watcher with the optimizer's credentials; the limit of a pool and the policy's
    status.autoscaling read back."""
    cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": policy},
        "spec": {"kind": "Autoscaling", **spec}})
    optimizer = grant(cluster, "kubeon-autoscaling-policy-test", OPTIMIZER_RULES)
    watcher = PackingWatcher(optimizer.api, KarpenterCapacity(optimizer.api), temporal, cluster="c",
                             task_queue="unused", default_mode=lambda: "Automatic")

    def limit(pool: str) -> str | None:
        return (karpenter.nodepool(pool)["spec"].get("limits") or {}).get("nvidia.com/gpu")

    def status() -> dict[str, Any]:
        doc = read_gpupolicy(cluster, policy) or {}
        return dict(doc["status"]["autoscaling"])

    return watcher, limit, status


async def test_autoscaling_max_usd_per_hour_recommend_reports_automatic_sets_and_lowering_it_patches_the_limit(
        cluster: Cluster, karpenter: Karpenter, temporal_dev_server: WorkflowEnvironment,
        packing_policy: str) -> None:
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    try:
        # L4 types of 1 and 4 GPUs: the worst case is g6.12xlarge's 4.602/4 = 1.1505 $/GPU-hour.
        karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=12,
                                               instance_types=("g6.xlarge", "g6.12xlarge")))
        watcher, limit, status = _autoscaling(cluster, karpenter, temporal_dev_server.client, packing_policy,
                                              {"mode": "Recommend", "nodePools": [pool], "maxUsdPerHour": 10})
        await watcher.resync()
        [entry] = status()["nodePools"]
        assert limit(pool) == "12" and "would set the limit to 8 GPUs (now 12)" in entry["reason"], entry
        assert entry["usdPerGpuHour"] == 1.1505 and entry["budgetGpus"] == 8
        assert status()["usdPerHour"] == {"max": 10.0, "held": True, "worstCase": 9.204,
                                          "reason": "held: the limits cost at most $9.20/h of $10/h"}
        patch = cluster.admin.custom.patch_cluster_custom_object
        patch(API_GROUP, "v1", PLURAL, packing_policy, {"spec": {"mode": "Automatic"}})
        await watcher.resync()
        [entry] = status()["nodePools"]
        assert limit(pool) == "8" and "limit set to 8 GPUs (was 12)" in entry["reason"], entry
        # Lowered: $5/h holds 4 GPUs (4.602).
        patch(API_GROUP, "v1", PLURAL, packing_policy, {"spec": {"maxUsdPerHour": 5}})
        await watcher.resync()
        [entry] = status()["nodePools"]
        assert limit(pool) == "4" and "limit set to 4 GPUs (was 8)" in entry["reason"], entry
        assert status()["usdPerHour"]["worstCase"] == 4.602
        # With maxGpus the smaller wins.
        patch(API_GROUP, "v1", PLURAL, packing_policy, {"spec": {"maxGpus": 2}})
        await watcher.resync()
        assert limit(pool) == "2" and karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == [{"nodes": "10%"}]
    finally:
        karpenter.delete_nodepool(pool)


async def test_autoscaling_max_usd_per_hour_cannot_be_held_for_pools_without_priced_instance_types(
        cluster: Cluster, karpenter: Karpenter, temporal_dev_server: WorkflowEnvironment,
        packing_policy: str) -> None:
    taint = uuid.uuid4().hex[:8]
    unnamed, unpriced = f"gpu-{taint}", f"gpu-u-{taint}"
    try:
        # One pool names no instance types (Karpenter may launch any that fits); the other names g6.48xlarge,
        # which the product has no price for.
        karpenter.create_nodepool(gpu_nodepool(unnamed, taint=taint, gpu_limit=12, gpu_counts=(4,)))
        karpenter.create_nodepool(gpu_nodepool(unpriced, taint=taint, gpu_limit=12,
                                               instance_types=("g6.12xlarge", "g6.48xlarge")))
        watcher, limit, status = _autoscaling(
            cluster, karpenter, temporal_dev_server.client, packing_policy,
            {"mode": "Automatic", "nodePools": [unnamed, unpriced], "maxUsdPerHour": 5})
        # The dollar budget alone: nothing is set.
        await watcher.resync()
        budget = status()["usdPerHour"]
        assert budget["held"] is False and "worstCase" not in budget, budget  # null: removed by the merge patch
        assert f"NodePool {unnamed} names no instance types" in budget["reason"]
        assert f"NodePool {unpriced} may launch instance types without a price: g6.48xlarge" in budget["reason"]
        assert budget["reason"].endswith("no limit is set for it")
        assert limit(unnamed) == "12" and limit(unpriced) == "12"
        first, second = status()["nodePools"]
        assert "the limit is left as it is (12)" in first["reason"]
        assert f"maxUsdPerHour is not held: NodePool {unnamed} names no instance types" in first["reason"]
        assert "without a price: g6.48xlarge" in second["reason"] and second.get("usdPerGpuHour") is None
        # With maxGpus: that is held, the dollar part still is not.
        cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, packing_policy,
                                                         {"spec": {"maxGpus": 10}})
        await watcher.resync()
        assert limit(unnamed) == "10" and limit(unpriced) == "10"
        assert status()["usdPerHour"]["reason"].endswith("only maxGpus (10) is held")
        assert all("limit set to 10 GPUs (was 12)" in e["reason"] and "maxUsdPerHour is not held" in e["reason"]
                   for e in status()["nodePools"])
    finally:
        karpenter.delete_nodepool(unnamed)
        karpenter.delete_nodepool(unpriced)


async def test_the_worker_runs_the_loop_and_packing_rounds_with_capacity_provider_karpenter(
        stack: BurstStack, start_worker: StartWorker, locations: list[dict[str, Any]], karpenter: Karpenter,
        packing_policy: str) -> None:
    """The worker's own wiring (worker/main.py): its loop holds an Autoscaling policy's limit, and its task queue
    runs PackWorkflow with its activities (a pool with no node: nothing to do)."""
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=12, gpu_counts=(4,)))
    try:
        stack.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": packing_policy},
            "spec": {"kind": "Autoscaling", "mode": "Automatic", "nodePools": [pool], "maxGpus": 4}})
        async with start_worker(locations, capacity_provider="karpenter", scale_resync_seconds=1) as (
                temporal, settings, _runtime):
            await until(lambda: (karpenter.nodepool(pool)["spec"].get("limits") or {}).get("nvidia.com/gpu") == "4",
                        timeout=30, what="the worker's loop capping the NodePool at 4 GPUs")
            view = await temporal.execute_workflow(
                PackWorkflow.run, PackInput(cluster=settings.cluster, policy=packing_policy, groups=[pool],
                                            mode="Automatic", settings=FAST),
                id=f"pack-{uuid.uuid4().hex[:6]}", task_queue=settings.task_queue,
                execution_timeout=timedelta(seconds=30))
        assert view.phase == "NothingToDo" and not view.removed, view
    finally:
        karpenter.delete_nodepool(pool)


async def test_autoscaling_gpu_products_change_the_nodepool_requirement_only_when_approved(
        cluster: Cluster, karpenter: Karpenter, temporal_dev_server: WorkflowEnvironment,
        fragmented: tuple[str, dict[str, int]], packing_policy: str, tmp_path: Path) -> None:
    """Issue 23: the policy's gpuProducts as the NodePool's requirement. Recommend only reports the change (no
    operation); Automatic proposes it as a GpuProducts operation naming the nodes that would drift, and the pool is
    unchanged until it is approved; approved, the requirement is set (the pool's other requirements as they were),
    audited, and the next resync finds it held and proposes nothing."""
    pool, spread = fragmented
    temporal: Client = temporal_dev_server.client
    queue, cluster_name = f"prod-{uuid.uuid4().hex[:6]}", f"c-{uuid.uuid4().hex[:6]}"
    before = karpenter.nodepool(pool)["spec"]["template"]["spec"]["requirements"]
    cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": packing_policy},
        "spec": {"kind": "Autoscaling", "mode": "Recommend", "nodePools": [pool], "maxGpus": 100,
                 "gpuProducts": [A100]}})
    optimizer = grant(cluster, "kubeon-gpu-products-test", OPTIMIZER_RULES)
    watcher = PackingWatcher(optimizer.api, KarpenterCapacity(optimizer.api), temporal, cluster=cluster_name,
                             task_queue=queue, default_mode=lambda: "Automatic")

    def products() -> dict[str, Any]:
        doc = read_gpupolicy(cluster, packing_policy) or {}
        [only] = doc["status"]["autoscaling"]["nodePools"]
        return dict(only["gpuProducts"])

    def required() -> list[str]:
        reqs = karpenter.nodepool(pool)["spec"]["template"]["spec"]["requirements"]
        return [v for r in reqs if r["key"] == "nvidia.com/gpu.product" for v in r["values"]]

    assert await watcher.resync() == []
    status = products()
    assert (status["required"], status["wanted"]) == ([L4], [A100])
    assert status["reason"].startswith("Recommend: would propose: NodePool "), status
    assert f"Karpenter drifts {len(spread)} node(s) of other products" in status["reason"], status
    assert required() == [L4]

    cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, packing_policy,
                                                     {"spec": {"mode": "Automatic"}})
    audit = AuditLog(tmp_path / "audit.jsonl")
    async with _worker(cluster, temporal, queue, audit):
        [wid] = await watcher.resync()
        assert wid.startswith(f"gpu-products/{cluster_name}/{packing_policy}/{pool}/")
        handle = temporal.get_workflow_handle(wid, result_type=GpuProductsView)

        async def awaiting() -> bool:
            return (await handle.query(GpuProductsWorkflow.state)).phase == "AwaitingApproval"

        await until_async(awaiting, what="the change awaiting approval")
        assert await watcher.resync() == []  # one operation per change
        assert products()["reason"].startswith("awaiting approval: ") and products()["workflowId"] == wid
        assert required() == [L4]  # Automatic too: a requirement change waits for its approval
        proposed = await handle.query(GpuProductsWorkflow.state)
        assert proposed.change is not None and sorted(proposed.change.drifted) == sorted(spread)
        result = await handle.execute_update("approve_plan", Approval(approver="test", plan_id=proposed.operation))
        assert "approved by test" in str(result)
        view = await handle.result()
        shown = await ops.show(temporal, wid)  # `kubeon-gpu ops show` (a query: the worker replays it)
        assert await listed(temporal, wid, "Done") == [("GpuProducts", "Done")]  # and `ops list` has it
    assert isinstance(shown, GpuProductsView) and shown.phase == "Done"
    assert view.phase == "Done" and f"requires {A100} (was In [{L4}])" in view.message, view
    after = karpenter.nodepool(pool)["spec"]["template"]["spec"]["requirements"]
    assert required() == [A100]
    assert [r for r in after if r["key"] != "nvidia.com/gpu.product"] == [
        r for r in before if r["key"] != "nvidia.com/gpu.product"]
    assert [r.action for r in audit.read() if r.operation == view.operation] == ["proposed", "approved", "applied"]
    assert await watcher.resync() == []
    assert products()["reason"] == f"held: {A100}"
