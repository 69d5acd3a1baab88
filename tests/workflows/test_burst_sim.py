"""The documented test (R4.10) end to end with the sim provider: real control plane, real dev server, the
optimizer and the gateway each with their own ServiceAccount."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from models.operation import LABEL_LOCATION, LABEL_OPERATION, LABEL_POLICY, Approval, Phase, burst_workflow_id
from tests.harness.burst import (
    SIM_LOCATIONS,
    BurstStack,
    build_stack,
    gpu_deployment,
    result,
    unique,
    wait_for,
    wait_phase,
)
from tests.harness.kube import Cluster, until
from worker import ops
from worker.main import worker_services

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> BurstStack:
    return build_stack(cluster, tmp_path_factory.mktemp("burst"))


@pytest.fixture
def policy(stack: BurstStack) -> Iterator[str]:
    """A fresh policy name, deleted after the test (policies are cluster-scoped and would match later pods)."""
    name = unique("burst")
    yield name
    stack.delete_policy(name)


@pytest.fixture
async def worker(stack: BurstStack, temporal_dev_server: WorkflowEnvironment) -> AsyncIterator[tuple[Client, str]]:
    queue = unique("q")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=SIM_LOCATIONS, cluster_name=queue)
    async with worker_services(settings) as (temporal, runtime, _watcher):
        yield temporal, settings.cluster
        assert runtime.audit.read() is not None


async def test_approve_launch_join_verify_return_home(stack: BurstStack, worker: tuple[Client, str],
                                                       namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west", "sim/us-west"], max_nodes=2)
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))

    wf_id = burst_workflow_id(cluster_name, policy, f"{namespace}/Deployment/{deploy}")
    handle = temporal.get_workflow_handle(wf_id)
    view = await wait_phase(handle, Phase.AWAITING_APPROVAL)
    assert view.plan is not None and view.plan.best is not None
    # Cheapest location inside the policy, never the cheaper one outside it.
    assert view.plan.best.location == "sim/eu-west"
    assert all(o.location != "sim/ap-cheap" for o in view.plan.candidates)
    assert view.plan.best.transfer_usd_per_gpu_hour > 0  # the transfer estimate is shown with the proposal

    # A stale plan is refused with a clear message, and nothing launches.
    with pytest.raises(ops.DecisionRefused, match="stale"):
        await ops.approve(temporal, view.operation, Approval(approver="alice", plan_id="plan-old"))
    decided = await ops.approve(temporal, view.operation, Approval(approver="alice", plan_id=view.plan.plan_id))
    assert "alice" in decided.message

    view = await wait_phase(handle, Phase.SERVING)
    node = stack.cluster.admin.core.read_node(str(view.node_name))
    labels = node.metadata.labels
    assert labels[LABEL_LOCATION] == "sim.eu-west"
    assert labels[LABEL_POLICY] == policy
    assert labels[LABEL_OPERATION] == view.operation
    assert any(t.key == "gpu.kubeon.io/burst" and t.effect == "NoSchedule" for t in node.spec.taints)
    pods = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
    assert [p.spec.node_name for p in pods] == [view.node_name]

    # Remove the workload: the burst node drains and is removed.
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    done = await result(handle)
    assert done.phase == Phase.COMPLETED, done.message
    wait_for(lambda: not stack.cluster.admin.core.list_node(
        field_selector=f"metadata.name={view.node_name}").items, what="burst node gone")
    assert done.instance is not None
    view = await handle.query("state", result_type=type(view))
    assert view.approver == "alice"


async def test_recommend_mode_launches_nothing(stack: BurstStack, worker: tuple[Client, str],
                                               namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode=None, locations=["sim/eu-west"])  # no mode: the default, Recommend
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    handle = temporal.get_workflow_handle(burst_workflow_id(cluster_name, policy,
                                                            f"{namespace}/Deployment/{deploy}"))
    done = await result(handle)
    assert done.phase == Phase.PROPOSED
    assert done.plan is not None and done.plan.best is not None
    assert done.instance is None
    assert not stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items




async def test_operation_whose_pod_took_another_node_launches_for_the_pod_it_displaced(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    """Burst nodes serve every tolerating pod. When group A's pod takes the node B launched, B's own pod waits:
    A must not withdraw (its pod is placed) but launch, and B's pod lands on A's node."""
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west"], max_nodes=2)
    first_class = unique("burst-first")  # the scheduler places A's pod first when B's node appears
    scheduling = client.SchedulingV1Api(stack.cluster.admin.api)
    scheduling.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=first_class),
                                                            value=1000))
    try:
        a, b = unique("infer-a"), unique("infer-b")
        deployment_a = gpu_deployment(a)
        deployment_a.spec.template.spec.priority_class_name = first_class
        apps = stack.cluster.admin.apps
        apps.create_namespaced_deployment(namespace, deployment_a)
        apps.create_namespaced_deployment(namespace, gpu_deployment(b))
        handle_a, handle_b = (temporal.get_workflow_handle(burst_workflow_id(
            cluster_name, policy, f"{namespace}/Deployment/{d}")) for d in (a, b))
        view_a = await wait_phase(handle_a, Phase.AWAITING_APPROVAL)
        view_b = await wait_phase(handle_b, Phase.AWAITING_APPROVAL)

        await ops.approve(temporal, view_b.operation, Approval(approver="alice"))
        serving_b = await wait_phase(handle_b, Phase.SERVING)

        def pod_node(app: str) -> str | None:
            pods = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
            return pods[0].spec.node_name if pods else None

        assert pod_node(a) == serving_b.node_name and pod_node(b) is None  # A's pod took B's node

        await ops.approve(temporal, view_a.operation, Approval(approver="alice"))
        serving_a = await wait_phase(handle_a, Phase.SERVING)  # not withdrawn: it launches for B's pod
        await until(lambda: pod_node(b) == serving_a.node_name, timeout=60, what="B's pod on A's node")

        for d in (a, b):
            apps.delete_namespaced_deployment(d, namespace)
        for h in (handle_a, handle_b):
            assert (await result(h)).phase == Phase.COMPLETED
        assert not stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items
    finally:
        scheduling.delete_priority_class(first_class)
