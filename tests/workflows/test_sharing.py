"""Sharing by time-slicing end to end on the real parts: the control plane (a kwok A100 node, the chart's
ServiceAccount, ClusterRole and its time-slicing Role in the GPU Operator's namespace), the GPU Operator stand-in
(config-manager with a propagation delay), a real Prometheus with backfilled DCGM history, the Temporal dev
server and the worker in-process.

The issue's acceptance: four 1-GPU pods at 5 % on a 4-GPU node and four more pending -> a proposal with
replicas 2, approved -> allocatable 8, the pending pods run on the same node, no new node; undo -> back to 4 and
the extra pods named as unservable (still running: never evicted). A SIGKILL of the worker at each step:
test_sharing_crash."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.sharing import SharingOps
from hub.plans import parse_plan
from models.decisions import Approval
from models.decisions import Rejection
from models.policy import API_GROUP
from models.policy import PLURAL
from models.sharing import CONFIG_LABEL
from models.sharing import KEY_PREFIX
from models.sharing import NO_PROMETHEUS
from models.sharing import CleanupRequest
from models.sharing import MigInput
from models.sharing import SharingOutcome
from models.sharing import SharingPhase
from models.sharing import SharingSettings
from models.sharing import SharingView
from models.sharing import TimeSlicingInput
from models.sharing import UndoRequest
from models.sharing import WriteKeyRequest
from models.sharing import WriteKeyResult
from models.sharing import sharing_workflow_id
from tests.harness import burst
from tests.harness import workloads
from tests.harness.burst import build_stack
from tests.harness.burst import unique
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.gpu_metrics import GpuMetricsStack
from tests.harness.gpu_operator import GpuOperator
from tests.harness.gpu_operator import gpu_operator_namespace
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.kube import wait_for
from tests.harness.prometheus import Prometheus
from worker import ops
from worker.config import Settings
from worker.main import worker_services
from worker.sharing_watcher import SharingWatcher

pytestmark = [pytest.mark.cluster, pytest.mark.temporal, pytest.mark.prometheus]
PRODUCT = "NVIDIA-A100-SXM4-80GB"


@dataclass
class SharingBed(GpuMetricsStack):
    operator_ns: str
    node: str
    pool: str
    gpu_operator: GpuOperator


def gpu_pod(name: str, pool: str) -> client.V1Pod:
    return workloads.gpu_pod(name, labels={"app": "shared"}, node_selector={"pool": pool})


def pods_on(cluster: Cluster, namespace: str, node: str) -> list[str]:
    found: list[Any] = cluster.admin.core.list_namespaced_pod(namespace).items
    return sorted(p.metadata.name for p in found if p.spec.node_name == node and p.status.phase == "Running"
                  and p.metadata.deletion_timestamp is None)


def allocatable(cluster: Cluster, node: str) -> str:
    return str(cluster.admin.core.read_node(node).status.allocatable["nvidia.com/gpu"])


@pytest.fixture(scope="module")
def bed(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharingBed]:
    workdir = tmp_path_factory.mktemp("sharing")
    burst = build_stack(cluster, workdir)
    operator_ns = gpu_operator_namespace(cluster)
    pool = f"ts-{uuid.uuid4().hex[:6]}"
    node = f"a100-{pool}"
    cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels(PRODUCT, 4), "pool": pool}, gpus=4)
    gpu_operator = GpuOperator(cluster.admin.api, namespace=operator_ns, propagation_delay=1.0).start()
    exporter = DcgmExporter().start()
    exporter.add_node(node, gpus=4)
    prometheus = Prometheus(workdir / "prometheus", targets=[exporter.address])
    try:
        yield SharingBed(burst=burst, exporter=exporter, prometheus=prometheus, operator_ns=operator_ns, node=node,
                         pool=pool, gpu_operator=gpu_operator)
    finally:
        gpu_operator.stop()
        prometheus.stop()
        exporter.stop()
        cluster.admin.core.delete_node(node)
        cluster.admin.core.delete_namespace(operator_ns)


def create_policy(bed: SharingBed, name: str, mode: str) -> None:
    bed.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
        "spec": {"kind": "Sharing", "mode": mode, "nodes": {"matchLabels": {"pool": bed.pool}},
                 "timeSlicing": {"maxReplicas": 4}, "idle": {"threshold": 0.4, "window": "1h"},
                 "usdPerGpuHour": 4.1}})


def sharing_status(bed: SharingBed, policy: str) -> dict[str, Any]:
    doc: Any = bed.cluster.admin.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, policy)
    return dict((doc.get("status") or {}).get("sharing") or {})


def settings(bed: SharingBed, env: WorkflowEnvironment, *, prometheus: bool = True) -> Settings:
    queue = unique("sh")
    return bed.burst.settings(
        temporal_address=env.client.service_client.config.target_host, task_queue=queue, locations=[],
        cluster_name=queue, burst_enabled=False, prometheus_url=bed.prometheus.url if prometheus else "",
        scale_resync_seconds=1, gpu_operator_namespace=bed.operator_ns, sharing_propagation_seconds=2,
        sharing_verify_timeout_seconds=30)


async def wait_phase(temporal: Client, wf_id: str, *phases: SharingPhase, timeout: float = 90) -> SharingView:
    return await burst.wait_phase(temporal.get_workflow_handle(wf_id), *phases, timeout=timeout, view=SharingView)


async def test_time_slicing_approved_runs_the_waiting_pods_then_undo_names_the_extra_ones(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment) -> None:
    cluster = bed.cluster
    for i in range(4):
        cluster.admin.core.create_namespaced_pod(namespace, gpu_pod(f"run-{i}", bed.pool))
    await until(lambda: len(pods_on(cluster, namespace, bed.node)) == 4, what="four pods running", timeout=60)
    bed.give_gpus(namespace, [f"run-{i}" for i in range(4)], activity=0.05, minutes=70, fb_used_mib=4096)
    for i in range(4):
        cluster.admin.core.create_namespaced_pod(namespace, gpu_pod(f"wait-{i}", bed.pool))

    def unschedulable() -> bool:
        found: list[Any] = cluster.admin.core.list_namespaced_pod(namespace).items
        waiting = [p for p in found if p.metadata.name.startswith("wait-")]
        return len(waiting) == 4 and all(any(c.type == "PodScheduled" and c.reason == "Unschedulable"
                                             for c in (p.status.conditions or [])) for p in waiting)
    await until(unschedulable, what="four pods pending: the node's 4 GPUs are taken", timeout=60)
    nodes_before = len(cluster.admin.core.list_node().items)

    policy = unique("share")
    create_policy(bed, policy, "Approve")
    s = settings(bed, temporal_dev_server)
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            wf_id = sharing_workflow_id(s.cluster, bed.node)
            view = await wait_phase(temporal, wf_id, SharingPhase.AWAITING_APPROVAL)
            assert view.replicas == 2 and view.mode == "Approve"
            status = await until(lambda: sharing_status(bed, policy).get("proposals") and sharing_status(bed, policy),
                                 what="the proposal in the policy's status")
            assert status["enforcedMode"] == "Approve"
            proposal = status["nodes"][0]["proposals"][0]
            assert (proposal["kind"], proposal["replicas"], proposal["savingUsdPerHour"]) == ("time-slicing", 2, 16.4)
            assert sorted(proposal["waitingServed"]) == [f"{namespace}/wait-{i}" for i in range(4)]
            assert "noisy neighbours" in proposal["risk"]
            assert allocatable(cluster, bed.node) == "4"
            # The hub is sent the proposal's plan (its Approvals page shows it and binds a decision to the plan id).
            records = [json.loads(line) for line in (s.state_dir / "audit.jsonl").read_text().splitlines()]
            sent = parse_plan(next(r["detail"] for r in records
                                   if r["operation"] == view.operation and r["action"] == "proposed"))
            assert sent is not None and sent.plan_id == proposal["planId"]
            assert (sent.node, sent.gpus, sent.change, sent.saving_usd_per_hour) == (
                bed.node, 4, "time-slicing 2 replicas per GPU", 16.4)
            assert "noisy neighbours" in sent.risk and sent.summary

            await ops.approve(temporal, view.operation, Approval(approver="alice", plan_id=proposal["planId"]))
            view = await wait_phase(temporal, wf_id, SharingPhase.SHARED, SharingPhase.FAILED)
            assert view.phase == SharingPhase.SHARED, view.history
            assert any("waiting 2s for it to reach the device plugin's mounted ConfigMap" in h for h in view.history)
            assert allocatable(cluster, bed.node) == "8"
            labels = cluster.admin.core.read_node(bed.node).metadata.labels
            assert labels[CONFIG_LABEL] == view.key and view.key.startswith(KEY_PREFIX + "r2-")
            assert labels["nvidia.com/gpu.product"] == f"{PRODUCT}-SHARED"
            await until(lambda: len(pods_on(cluster, namespace, bed.node)) == 8,
                        what="the waiting pods running on the same node", timeout=60)
            assert len(cluster.admin.core.list_node().items) == nodes_before, "no new node"
            cm = cluster.admin.core.read_namespaced_config_map("time-slicing-config", bed.operator_ns)
            assert view.key in cm.data and "any" in cm.data, "the new key beside the admin's, none edited"

            result = await ops.undo(temporal, view.operation, UndoRequest(by="bob", reason="noisy"))
            assert "restoring node" in result.message
            view = await wait_phase(temporal, wf_id, SharingPhase.UNDONE, SharingPhase.FAILED)
            assert view.phase == SharingPhase.UNDONE, view.history
            assert allocatable(cluster, bed.node) == "4"
            assert CONFIG_LABEL not in (cluster.admin.core.read_node(bed.node).metadata.labels or {})
            assert sorted(view.unservable) == [f"{namespace}/wait-{i}" for i in range(4)]
            assert "cannot be served again here" in view.message
            assert len(pods_on(cluster, namespace, bed.node)) == 8, "the extra pods are not evicted"
            cm = cluster.admin.core.read_namespaced_config_map("time-slicing-config", bed.operator_ns)
            assert not [k for k in cm.data if k.startswith(KEY_PREFIX)], "the unused key removed"
    finally:
        bed.burst.delete_policy(policy)


def test_without_prometheus_the_policy_is_enforced_as_recommend(bed: SharingBed) -> None:
    policy = unique("share")
    create_policy(bed, policy, "Automatic")
    try:
        ops_ = SharingOps(bed.cluster.admin.api, None)
        watcher = SharingWatcher(ops_, None, cluster="c", task_queue="q",  # type: ignore[arg-type]
                                 default_mode="Recommend", settings=SharingSettings(), namespace=bed.operator_ns,
                                 config_map="time-slicing-config")
        assert watcher.evaluate() == []
        status = wait_for(lambda: sharing_status(bed, policy) or None, what="status.sharing", timeout=10)
        assert (status["enforcedMode"], status["modeReason"]) == ("Recommend", NO_PROMETHEUS)
        assert status["conditions"][0] == {"type": "PrometheusConfigured", "status": "False",
                                           "reason": "NoPrometheusUrl", "message": NO_PROMETHEUS}
        assert status["proposals"] == 0
    finally:
        bed.burst.delete_policy(policy)


async def test_a_node_that_never_shows_the_config_gets_its_previous_label_back(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment) -> None:
    """The ClusterPolicy does not point the device plugin at the ConfigMap (the stand-in ignores the label): the
    verification times out, the previous label is restored, the operation fails saying why."""
    cluster = bed.cluster
    node = f"a100-{uuid.uuid4().hex[:6]}"
    cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels(PRODUCT, 2), CONFIG_LABEL: "any"}, gpus=2)
    bed.gpu_operator.disconnect()
    s = settings(bed, temporal_dev_server).model_copy(update={"sharing_verify_timeout_seconds": 3})
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            handle = await temporal.start_workflow(
                "TimeSlicing", TimeSlicingInput(cluster=s.cluster, policy="p", node=node, gpus=2, replicas=3,
                                                mode="Automatic", namespace=bed.operator_ns,
                                                settings=s.sharing_settings()),
                id=sharing_workflow_id(s.cluster, node), task_queue=s.task_queue)
            outcome = SharingOutcome.model_validate(await handle.result())
            assert outcome.phase == SharingPhase.FAILED
            assert f"node {node} did not show the config within 3s: allocatable nvidia.com/gpu is 2, not 2 x 3 = 6" \
                in outcome.message
            assert "previous config any restored" in outcome.message
            assert cluster.admin.core.read_node(node).metadata.labels[CONFIG_LABEL] == "any"
    finally:
        bed.gpu_operator.disconnect(True)
        cluster.admin.core.delete_node(node)


def mig_node(bed: SharingBed) -> tuple[str, str]:
    pool = f"mig-{uuid.uuid4().hex[:6]}"
    node = f"a100-{pool}"
    bed.cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels(PRODUCT, 2), "pool": pool}, gpus=2)
    bed.exporter.add_node(node, gpus=2)
    return node, pool


@contextlib.asynccontextmanager
async def mig_services(bed: SharingBed, temporal_dev_server: WorkflowEnvironment,
                       fault: Callable[[str], None]) -> AsyncIterator[tuple[Client, Settings, str]]:
    """A fresh MIG-capable node (see :func:`mig_node`) the GPU Operator stand-in sees, told ``fault`` first; the
    worker's services running (its client, its settings, the node); the node deleted after."""
    node, _pool = mig_node(bed)
    await until(lambda: bed.gpu_operator.nodes.get(node), what="the stand-in sees the node", timeout=10)
    fault(node)
    s = settings(bed, temporal_dev_server)
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            yield temporal, s, node
    finally:
        bed.cluster.admin.core.delete_node(node)


async def start_mig(temporal: Client, s: Settings, node: str, geometry: str,
                    slices: dict[str, int]) -> WorkflowHandle[Any, Any]:
    """An Automatic MigWorkflow on ``node`` under its sharing workflow ID; its handle."""
    return await temporal.start_workflow(
        "Mig", MigInput(cluster=s.cluster, policy="p", node=node, gpus=2, geometry=geometry, slices=slices,
                        mode="Automatic"), id=sharing_workflow_id(s.cluster, node), task_queue=s.task_queue)


def create_mig_policy(bed: SharingBed, name: str, pool: str, mode: str, allowed: list[str]) -> None:
    """A Sharing policy of the MIG-capable nodes of ``pool`` (see :func:`mig_node`), these geometries allowed."""
    bed.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
        "spec": {"kind": "Sharing", "mode": mode, "nodes": {"matchLabels": {"pool": pool}},
                 "mig": {"allowed": allowed}, "idle": {"threshold": 0.4, "window": "1h"}, "usdPerGpuHour": 4.1}})


def unschedulable_node(cluster: Cluster, node: str) -> bool:
    return bool(cluster.admin.core.read_node(node).spec.unschedulable)


async def test_mig_approved_waits_for_the_pdb_then_reconfigures_and_uncordons(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment) -> None:
    cluster = bed.cluster
    node, pool = mig_node(bed)
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="infer"),
        spec=client.V1DeploymentSpec(
            replicas=2, selector=client.V1LabelSelector(match_labels={"app": "infer"}),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels={"app": "infer"}),
                spec=gpu_pod("x", pool).spec)))
    cluster.admin.apps.create_namespaced_deployment(namespace, deployment)
    cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="infer"),
        spec=client.V1PodDisruptionBudgetSpec(max_unavailable=0,
                                              selector=client.V1LabelSelector(match_labels={"app": "infer"}))))
    await until(lambda: len(pods_on(cluster, namespace, node)) == 2, what="two inference pods running", timeout=60)
    running = pods_on(cluster, namespace, node)
    bed.give_gpus(namespace, running, activity=0.05, minutes=70, fb_used_mib=9 * 1024)
    policy = unique("mig")
    create_mig_policy(bed, policy, pool, "Approve", ["all-1g.10gb", "all-3g.40gb"])
    s = settings(bed, temporal_dev_server)
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            wf_id = sharing_workflow_id(s.cluster, node)
            view = await wait_phase(temporal, wf_id, SharingPhase.AWAITING_APPROVAL)
            assert view.key == "all-1g.10gb"
            await ops.approve(temporal, view.operation, Approval(approver="alice"))
            view = await wait_phase(temporal, wf_id, SharingPhase.EVICTING)

            async def blocked() -> SharingView | None:
                v = await temporal.get_workflow_handle(wf_id).query("state", result_type=SharingView)
                return v if "blocked by PDB infer" in v.message else None
            deadline = time.monotonic() + 60
            while (seen := await blocked()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
            assert seen is not None, "the PDB's wait is shown"
            assert unschedulable_node(cluster, node)
            assert len(pods_on(cluster, namespace, node)) == 2, "nothing evicted past the PDB"
            cluster.admin.policy.patch_namespaced_pod_disruption_budget("infer", namespace,
                                                                        {"spec": {"maxUnavailable": 2}})
            view = await wait_phase(temporal, wf_id, SharingPhase.SHARED, SharingPhase.FAILED)
            assert view.phase == SharingPhase.SHARED, view.history
            n: Any = cluster.admin.core.read_node(node)
            assert n.status.allocatable["nvidia.com/mig-1g.10gb"] == "14"
            assert n.status.allocatable["nvidia.com/gpu"] == "0"
            assert n.metadata.labels["nvidia.com/mig.config.state"] == "success"
            assert not n.spec.unschedulable, "uncordoned"
            # The owner asks for a slice: its pods run on the node again.
            cluster.admin.apps.patch_namespaced_deployment("infer", namespace, {"spec": {"template": {"spec": {
                "containers": [{"name": "main", "resources": {
                    "limits": {"nvidia.com/gpu": None, "nvidia.com/mig-1g.10gb": "1"},
                    "requests": {"nvidia.com/gpu": None, "nvidia.com/mig-1g.10gb": "1"}}}]}}}})
            await until(lambda: len(pods_on(cluster, namespace, node)) == 2, what="pods on MIG slices", timeout=60)

            await ops.undo(temporal, view.operation, UndoRequest(by="bob"))
            view = await wait_phase(temporal, wf_id, SharingPhase.UNDONE, SharingPhase.FAILED)
            assert view.phase == SharingPhase.UNDONE, view.history
            n = cluster.admin.core.read_node(node)
            assert n.status.allocatable["nvidia.com/gpu"] == "2" and not n.spec.unschedulable
    finally:
        bed.burst.delete_policy(policy)
        cluster.admin.core.delete_node(node)


async def test_a_recommendation_goes_on_to_await_approval_once_its_policy_is_set_to_approve(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment) -> None:
    """A newcomer reads a Recommend policy's proposal and sets the policy to Approve: the operation standing as the
    recommendation (it would stand until its approval timeout, a day, holding the node's operation ID) is told by
    the watcher and awaits approval with the same plan; a rejection ends it with nothing changed."""
    cluster = bed.cluster
    node, pool = mig_node(bed)
    for name in ("a", "b"):
        pod = gpu_pod(name, pool)
        cluster.admin.core.create_namespaced_pod(namespace, pod)
    await until(lambda: len(pods_on(cluster, namespace, node)) == 2, what="two pods running", timeout=60)
    bed.give_gpus(namespace, ["a", "b"], activity=0.05, minutes=70, fb_used_mib=9 * 1024)
    policy = unique("rec")
    create_mig_policy(bed, policy, pool, "Recommend", ["all-1g.10gb"])
    s = settings(bed, temporal_dev_server)
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            wf_id = sharing_workflow_id(s.cluster, node)
            proposed = await wait_phase(temporal, wf_id, SharingPhase.PROPOSED)
            assert proposed.mode == "Recommend" and proposed.key == "all-1g.10gb"
            cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, policy,
                                                             {"spec": {"mode": "Approve"}})
            view = await wait_phase(temporal, wf_id, SharingPhase.AWAITING_APPROVAL)
            assert view.operation == proposed.operation and view.mode == "Approve"
            assert any(f"policy {policy} now in Approve" in line for line in view.history), view.history
            await ops.reject(temporal, view.operation, Rejection(approver="alice", reason="not now"))
            view = await wait_phase(temporal, wf_id, SharingPhase.REJECTED)
            n: Any = cluster.admin.core.read_node(node)
            assert n.metadata.labels.get("nvidia.com/mig.config") is None and not n.spec.unschedulable
            assert pods_on(cluster, namespace, node) == ["a", "b"]
    finally:
        bed.burst.delete_policy(policy)
        cluster.admin.core.delete_node(node)


async def test_mig_failure_restores_the_previous_config_and_uncordons(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment) -> None:
    cluster = bed.cluster
    async with mig_services(bed, temporal_dev_server, bed.gpu_operator.fail_next_mig) as (temporal, s, node):
        handle = await start_mig(temporal, s, node, "all-1g.10gb", {"1g.10gb": 7})
        outcome = SharingOutcome.model_validate(await handle.result())
        assert outcome.phase == SharingPhase.FAILED
        assert outcome.message.startswith(f"the MIG manager reported failed for all-1g.10gb on {node}")
        assert "node uncordoned" in outcome.message
        n: Any = cluster.admin.core.read_node(node)
        assert not n.spec.unschedulable
        assert n.status.allocatable["nvidia.com/gpu"] == "2"
        assert n.metadata.labels.get("nvidia.com/mig.config") is None


def test_cleanup_keeps_a_key_another_operation_is_bringing_to_its_node(bed: SharingBed) -> None:
    """As the chart's ServiceAccount: a key written for node A and not yet named by A's label survives node B's
    cleanup; once A's operation releases it (and no node names it), it goes; the admin's keys are never touched."""
    from common.kube import kube_api

    ops_ = SharingOps(kube_api(bed.burst.optimizer_kubeconfig), None)
    written = ops_.write_key(WriteKeyRequest(namespace=bed.operator_ns, config_map="time-slicing-config",
                                             replicas=3, fail_requests_greater_than_one=True, node="node-a"))
    assert written.written and written.key.startswith(KEY_PREFIX + "r3-")
    assert ops_.cleanup(CleanupRequest(namespace=bed.operator_ns, config_map="time-slicing-config",
                                       release="node-b")).removed == []
    again = ops_.write_key(WriteKeyRequest(namespace=bed.operator_ns, config_map="time-slicing-config",
                                           replicas=3, fail_requests_greater_than_one=True, node="node-a"))
    assert again == WriteKeyResult(key=written.key, written=False, written_at=written.written_at), \
        "an existing key is never rewritten; when it was written is read back"
    assert ops_.cleanup(CleanupRequest(namespace=bed.operator_ns, config_map="time-slicing-config",
                                       release="node-a")).removed == [written.key]
    cm = bed.cluster.admin.core.read_namespaced_config_map("time-slicing-config", bed.operator_ns)
    assert "any" in cm.data and written.key not in cm.data
    assert not [k for k in (cm.metadata.annotations or {}) if k.startswith("sharing.gpu.kubeon.io/")]


async def test_mig_cancelled_while_stuck_pending_is_uncordoned(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment) -> None:
    """The MIG manager never leaves ``pending``; the operation is cancelled: the node is uncordoned and its MIG
    label restored before the operation ends."""
    cluster = bed.cluster
    async with mig_services(bed, temporal_dev_server, bed.gpu_operator.stick_pending) as (temporal, s, node):
        wf_id = sharing_workflow_id(s.cluster, node)
        handle = await start_mig(temporal, s, node, "all-3g.40gb", {"3g.40gb": 2})
        await wait_phase(temporal, wf_id, SharingPhase.RECONFIGURING)
        await until(lambda: cluster.admin.core.read_node(node).metadata.labels.get(
            "nvidia.com/mig.config.state") == "pending", what="stuck pending", timeout=10)
        assert unschedulable_node(cluster, node)
        await handle.cancel()
        view = await wait_phase(temporal, wf_id, SharingPhase.FAILED)
        assert view.message == "Cancelled; nvidia.com/mig.config removed (it had none); node uncordoned"
        assert "node uncordoned" in view.message
        assert not unschedulable_node(cluster, node)
        assert cluster.admin.core.read_node(node).metadata.labels.get("nvidia.com/mig.config") is None


@contextlib.asynccontextmanager
async def quiet_mig_nodes(bed: SharingBed, namespace: str, count: int) -> AsyncIterator[tuple[str, list[str]]]:
    """``count`` MIG-capable A100 nodes of a fresh pool, each running two 1-GPU pods at 5 % and 9 GiB peak (with
    history), each node's reconfiguration to all-1g.10gb held pending by the stand-in: (the pool, the nodes), in
    name order; released and deleted after."""
    cluster = bed.cluster
    pool = f"bud-{uuid.uuid4().hex[:6]}"
    nodes = [f"a100-{pool}-{i}" for i in range(count)]
    pods: list[str] = []
    for node in nodes:
        cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels(PRODUCT, 2), "pool": pool, "pin": node},
                                 gpus=2)
        bed.exporter.add_node(node, gpus=2)
    try:
        for node in nodes:
            await until(functools.partial(bed.gpu_operator.nodes.get, node), what="the stand-in sees the node",
                        timeout=10)
            bed.gpu_operator.hold_mig(node, "all-1g.10gb")
            for k in range(2):
                pod = gpu_pod(f"{node}-{k}", pool)
                pod.spec.node_selector = {"pin": node}
                cluster.admin.core.create_namespaced_pod(namespace, pod)
                pods.append(f"{node}-{k}")
        await until(lambda: all(len(pods_on(cluster, namespace, n)) == 2 for n in nodes),
                    what="two pods running on each node", timeout=60)
        bed.give_gpus(namespace, pods, activity=0.05, minutes=70, fb_used_mib=9 * 1024)
        yield pool, nodes
    finally:
        for node in nodes:
            if node in bed.gpu_operator.nodes:
                bed.gpu_operator.release(node)
            cluster.admin.core.delete_node(node)


def create_budget_policy(bed: SharingBed, name: str, pool: str, mode: str, max_nodes_at_once: int) -> None:
    bed.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
        "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
        "spec": {"kind": "Sharing", "mode": mode, "nodes": {"matchLabels": {"pool": pool}},
                 "mig": {"allowed": ["all-1g.10gb"]}, "idle": {"threshold": 0.4, "window": "1h"},
                 "usdPerGpuHour": 4.1, "maxNodesAtOnce": max_nodes_at_once}})


def budget_says(bed: SharingBed, policy: str, changing: list[str], waiting: list[str]) -> dict[str, Any] | None:
    """The policy's status once it says exactly ``changing`` change and each of ``waiting`` waits (budget 1)."""
    status = sharing_status(bed, policy)
    entries = {e["node"]: e for e in status.get("nodes", [])}
    ok = status.get("changing") == changing and all(
        entries.get(n, {}).get("waiting") == "waiting: 1 of 1 node(s) changing at once (spec.maxNodesAtOnce)"
        for n in waiting)
    return status if ok else None


async def no_operation(temporal: Client, wf_id: str) -> bool:
    from temporalio.service import RPCError

    try:
        await temporal.get_workflow_handle(wf_id).describe()
    except RPCError:
        return True
    return False


async def test_max_nodes_at_once_changes_one_node_at_a_time_the_others_wait_and_say_so(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment) -> None:
    """Three quiet MIG-capable nodes of one Automatic policy with maxNodesAtOnce 1: while the first node's
    reconfiguration is held pending (cordoned, its pods evicted), the other two get no operation, stay schedulable
    and their status entries say they wait for the budget; released, the next one starts; all three end shared."""
    cluster = bed.cluster
    policy = unique("bud")
    async with quiet_mig_nodes(bed, namespace, 3) as (pool, nodes):
        try:
            create_budget_policy(bed, policy, pool, "Automatic", 1)
            s = settings(bed, temporal_dev_server)
            async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
                for i, node in enumerate(nodes):
                    wf_id = sharing_workflow_id(s.cluster, node)
                    view = await wait_phase(temporal, wf_id, SharingPhase.RECONFIGURING)
                    assert view.key == "all-1g.10gb" and unschedulable_node(cluster, node)
                    rest = nodes[i + 1:]
                    status = await until(functools.partial(budget_says, bed, policy, [node], rest),
                                         what=f"{node} changing, {rest} waiting, in the policy's status", timeout=30)
                    assert status["maxNodesAtOnce"] == 1
                    budget = next(c for c in status["conditions"] if c["type"] == "DisruptionBudget")
                    if rest:
                        assert budget["status"] == "False" and budget["reason"] == "NodesWaiting", budget
                    for other in rest:
                        assert await no_operation(temporal, sharing_workflow_id(s.cluster, other)), \
                            f"{other} got an operation while {node} is changing"
                        assert not unschedulable_node(cluster, other)
                        assert len(pods_on(cluster, namespace, other)) == 2, f"{other}'s pods evicted"
                    bed.gpu_operator.release(node)
                    view = await wait_phase(temporal, wf_id, SharingPhase.SHARED, SharingPhase.FAILED)
                    assert view.phase == SharingPhase.SHARED, view.history
                for node in nodes:
                    n: Any = cluster.admin.core.read_node(node)
                    assert n.status.allocatable["nvidia.com/mig-1g.10gb"] == "14" and not n.spec.unschedulable
        finally:
            bed.burst.delete_policy(policy)


async def test_max_nodes_at_once_counts_an_approval_request_and_gates_a_recommendation_told_to_act(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment) -> None:
    """Two quiet MIG nodes, a Recommend policy with maxNodesAtOnce 1: both stand as recommendations (they change
    nothing: no slot). The policy set to Approve: only the first is told, and awaits approval (an approval would
    let it evict at once: it holds the slot); the second stays a recommendation and waits in the status. The
    first approved and shared, the second is told and awaits approval with the same operation."""
    cluster = bed.cluster
    policy = unique("bud")
    async with quiet_mig_nodes(bed, namespace, 2) as (pool, nodes):
        for node in nodes:
            bed.gpu_operator.release(node)
        try:
            create_budget_policy(bed, policy, pool, "Recommend", 1)
            s = settings(bed, temporal_dev_server)
            async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
                first, second = (sharing_workflow_id(s.cluster, n) for n in nodes)
                proposed = [await wait_phase(temporal, wf, SharingPhase.PROPOSED) for wf in (first, second)]
                assert all(v.mode == "Recommend" for v in proposed)
                await until(functools.partial(budget_says, bed, policy, [], []), what="nothing changing", timeout=30)
                cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, policy,
                                                                 {"spec": {"mode": "Approve"}})
                view = await wait_phase(temporal, first, SharingPhase.AWAITING_APPROVAL)
                await until(functools.partial(budget_says, bed, policy, [nodes[0]], [nodes[1]]),
                            what=f"{nodes[1]} waiting while {nodes[0]} awaits approval", timeout=30)
                again = await temporal.get_workflow_handle(second).query("state", result_type=SharingView)
                assert (again.phase, again.mode) == (SharingPhase.PROPOSED, "Recommend"), again.history
                await ops.approve(temporal, view.operation, Approval(approver="alice"))
                view = await wait_phase(temporal, first, SharingPhase.SHARED, SharingPhase.FAILED)
                assert view.phase == SharingPhase.SHARED, view.history
                view = await wait_phase(temporal, second, SharingPhase.AWAITING_APPROVAL)
                assert view.operation == proposed[1].operation
                await ops.reject(temporal, view.operation, Rejection(approver="alice", reason="not now"))
                await wait_phase(temporal, second, SharingPhase.REJECTED)
        finally:
            bed.burst.delete_policy(policy)
