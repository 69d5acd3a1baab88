"""The documented test (R4.10) and provisioning by batch, end to end with the sim provider: real control plane,
real dev server, the optimizer and the gateway each with their own ServiceAccount."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client
from temporalio.client import Client

from models.decisions import Approval
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.node import NodePhase
from models.provisioning import BatchPhase
from models.provisioning import ProvisionPhase
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import node_workflows
from tests.harness.burst import provision_state
from tests.harness.burst import provisioning
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.burst import wait_phase
from tests.harness.kube import until
from worker import ops
from worker.audit_verify import verify_file
from worker.cli import _render_view as render_view

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


def _l4(itype: str, gpus: int, price: float) -> dict[str, Any]:
    return {"instanceType": itype, "gpus": gpus, "gpuProduct": "NVIDIA-L4", "usdPerHour": price}


LOCATIONS: list[dict[str, Any]] = [*SIM_LOCATIONS,
    # Four 1-GPU nodes cost $3.80/h here, one 4-GPU node $3.60/h; in pack-dear the 4-GPU node costs $4.20/h.
    {"name": "sim/pack-cheap", "sim": {"bootSeconds": 0.3},
     "offerings": [_l4("sim.l4.1", 1, 0.95), _l4("sim.l4.4", 4, 3.60)]},
    {"name": "sim/pack-dear", "sim": {"bootSeconds": 0.3},
     "offerings": [_l4("sim.l4.1", 1, 0.95), _l4("sim.l4.4", 4, 4.20)]},
]


@pytest.fixture
async def worker(start_worker: StartWorker) -> AsyncIterator[tuple[Client, str]]:
    """The worker over these locations; every test leaves an audit log, whose hash chain verifies."""
    async with start_worker(LOCATIONS) as (temporal, settings, runtime):
        yield temporal, settings.cluster
        assert runtime.audit.read() is not None
        chain = verify_file(runtime.audit.path)
        assert chain.ok, chain.render()


def _burst_nodes(stack: BurstStack, policy: str) -> list[client.V1Node]:
    return list(stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items)


def _running(stack: BurstStack, namespace: str) -> list[client.V1Pod]:
    return [p for p in stack.cluster.admin.core.list_namespaced_pod(namespace).items
            if p.spec.node_name and p.metadata.deletion_timestamp is None]


async def _all_gone(stack: BurstStack, policy: str) -> None:
    await until(lambda: not _burst_nodes(stack, policy), timeout=120, what="every burst node home")


async def test_approve_launch_join_verify_return_home(stack: BurstStack, worker: tuple[Client, str],
                                                       namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west", "sim/us-west"], max_nodes=2)
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))

    view = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
    assert view.proposal is not None and view.phase == BatchPhase.AWAITING_APPROVAL
    plan = view.proposal.plan
    (node,) = plan.new_nodes
    # Cheapest location inside the policy, never the cheaper one outside it; the transfer estimate is shown.
    assert (node.offering.location, node.offering.instance_type) == ("sim/eu-west", "sim.l4.1")
    assert node.pods[0].startswith(f"{namespace}/{deploy}-") and node.offering.transfer_usd_per_gpu_hour > 0
    assert all(o.location != "sim/ap-cheap" for o in node.alternatives)
    shown = await ops.show(temporal, view.proposal.batch)  # by the batch's operation ID
    assert shown.model_dump()["proposal"]["plan"]["plan_id"] == plan.plan_id
    rows = await ops.list_operations(temporal, cluster=cluster_name)
    assert any(r.kind == "Provision" and r.operation == view.proposal.batch for r in rows)

    # A stale plan is refused with a clear message, and nothing launches.
    with pytest.raises(ops.DecisionRefused, match="stale"):
        await ops.approve(temporal, view.proposal.batch, Approval(approver="alice", plan_id="plan-old"))
    decided = await ops.approve(temporal, view.proposal.batch, Approval(approver="alice", plan_id=plan.plan_id))
    assert "alice" in decided.message

    handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
    serving = await wait_phase(handle, NodePhase.SERVING)
    labels = stack.cluster.admin.core.read_node(str(serving.node_name)).metadata.labels
    assert labels[LABEL_LOCATION] == "sim.eu-west" and labels[LABEL_POLICY] == policy
    assert labels[LABEL_OPERATION] == serving.operation and labels[LABEL_INSTANCE_TYPE] == "sim.l4.1"
    node_taints = stack.cluster.admin.core.read_node(str(serving.node_name)).spec.taints
    assert any(t.key == "gpu.kubeon.io/burst" and t.effect == "NoSchedule" for t in node_taints)
    assert [p.spec.node_name for p in _running(stack, namespace)] == [serving.node_name]
    rows = await ops.list_operations(temporal, cluster=cluster_name)
    assert any(r.kind == "Burst" and r.batch == view.proposal.batch and r.phase == "Serving" for r in rows)

    # Remove the workload: the burst node drains and is removed.
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    done = await result(handle)
    assert done.phase == NodePhase.COMPLETED, done.message
    wait_for(lambda: not stack.cluster.admin.core.list_node(
        field_selector=f"metadata.name={serving.node_name}").items, what="burst node gone")
    after = await provision_state(temporal, cluster_name, policy, lambda v: not v.nodes and not v.waiting)
    assert after.batches[-1].approver == "alice"
    # What `ops show` says once the burst is over: the batch ended with its node, the phase's message says the
    # nodes and pods there are now (both once stayed as they were when the node started).
    assert (after.batches[-1].phase, after.batches[-1].message) == (BatchPhase.COMPLETED,
                                                                    "its 1 node(s) ended: 1 Completed")
    shown_text = render_view(await ops.show(temporal, after.workflow_id))
    assert "phase      Idle: 0 node(s), 0 pod(s) waiting" in shown_text, shown_text
    assert "nodes      0 of maxNodes 2" in shown_text and "Completed" in shown_text, shown_text


async def test_a_nodes_quick_steps_run_in_its_workflow_tasks_and_its_waits_as_activities(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    """issue 26: the policy read before launching, the attested identity and a burn-in with no checks are local
    activities (a marker each, named by its summary); only what launches or waits goes through the task queue (a
    burn-in with checks waits for the node: test_burn_in). The provisioning's policy read each round too."""
    from temporalio.api.enums.v1 import EventType

    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], max_nodes=1, burn_in={"checks": []})
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
    await wait_phase(handle, NodePhase.SERVING)
    scheduled, local = [], []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled.append(event.activity_task_scheduled_event_attributes.activity_type.name)
        elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            local.append(event.user_metadata.summary.data.decode())  # the summary's payload: a JSON string
    assert scheduled == ["launch_instance", "wait_for_node", "verify_node", "serve_until_done"], scheduled
    for summary in ("the policy, just before launching", "the node's attested identity",
                    "no burn-in checks: lift the joining taint"):
        assert any(summary in s for s in local), (summary, local)
    planned = [e.activity_task_scheduled_event_attributes.activity_type.name
               async for e in provisioning(temporal, cluster_name, policy).fetch_history_events()
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    assert planned == ["plan_batch"], planned
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    assert (await result(handle)).phase == NodePhase.COMPLETED


async def test_recommend_mode_launches_nothing(stack: BurstStack, worker: tuple[Client, str],
                                               namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode=None, locations=["sim/eu-west"])  # no mode: the default, Recommend
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    view = await provision_state(temporal, cluster_name, policy, lambda v: bool(v.batches))
    assert view.batches[0].phase == BatchPhase.PROPOSED and view.batches[0].plan.new_nodes
    assert view.batches[0].nodes == [] and view.nodes == []
    # Its round over (back to Idle), the provisioning has launched nothing.
    settled = await provision_state(temporal, cluster_name, policy, lambda v: v.phase == ProvisionPhase.IDLE)
    assert settled.nodes == [] and all(b.nodes == [] for b in settled.batches)
    assert not _burst_nodes(stack, policy)
    # Its pod would wait for the next test's policy otherwise (namespaces go asynchronously).
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace, propagation_policy="Foreground")


async def _served(stack: BurstStack, temporal: Client, cluster: str, policy: str, namespace: str,
                  pods: int) -> list[str]:
    """Waits until ``pods`` pods run; returns the instance types of the policy's burst nodes."""
    await until(lambda: len(_running(stack, namespace)) == pods, timeout=120, what=f"{pods} pod(s) running")
    return sorted(n.metadata.labels[LABEL_INSTANCE_TYPE] for n in _burst_nodes(stack, policy))


async def test_one_pod_gets_a_one_gpu_node_and_four_at_once_the_cheapest_cover(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    apps = stack.cluster.admin.apps
    stack.create_policy(policy, mode="Automatic", locations=["sim/pack-cheap"], max_nodes=4)
    apps.create_namespaced_deployment(namespace, gpu_deployment("one"))
    assert await _served(stack, temporal, cluster_name, policy, namespace, 1) == ["sim.l4.1"]
    apps.delete_namespaced_deployment("one", namespace)
    await _all_gone(stack, policy)

    apps.create_namespaced_deployment(namespace, gpu_deployment("four", replicas=4))
    assert await _served(stack, temporal, cluster_name, policy, namespace, 4) == ["sim.l4.4"]
    apps.delete_namespaced_deployment("four", namespace)
    await _all_gone(stack, policy)

    stack.cluster.admin.custom.patch_cluster_custom_object("gpu.kubeon.io", "v1", "gpupolicies", policy,
                                                           {"spec": {"locations": ["sim/pack-dear"]}})
    apps.create_namespaced_deployment(namespace, gpu_deployment("dear", replicas=4))
    assert await _served(stack, temporal, cluster_name, policy, namespace, 4) == ["sim.l4.1"] * 4
    view = await provision_state(temporal, cluster_name, policy)
    assert all(n.gpus_used <= n.offering.gpus for b in view.batches for n in b.plan.new_nodes)
    apps.delete_namespaced_deployment("dear", namespace)
    await _all_gone(stack, policy)


async def test_a_two_gpu_pod_never_lands_a_plan_that_cannot_fit_it(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/us-west"])  # 1-GPU nodes only
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment("two", gpus=2))
    view = await provision_state(temporal, cluster_name, policy,
                                 lambda v: any("asks for 2 GPU(s)" in w for w in v.waiting))
    assert view.batches == [] and view.nodes == []
    assert "the largest eligible offering has 1" in view.waiting[0]
    settled = await provision_state(temporal, cluster_name, policy, lambda v: v.phase == ProvisionPhase.IDLE)
    assert settled.batches == [] and settled.nodes == []
    assert not _burst_nodes(stack, policy)
    stack.cluster.admin.apps.delete_namespaced_deployment("two", namespace, propagation_policy="Foreground")


async def test_fifty_deployments_in_approve_mode_take_at_most_three_proposals(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/pack-cheap"], max_nodes=20)
    apps = stack.cluster.admin.apps
    names = [f"app-{i}" for i in range(50)]
    await asyncio.gather(*(asyncio.to_thread(apps.create_namespaced_deployment, namespace, gpu_deployment(n))
                           for n in names))
    approved: list[str] = []

    async def approve_until_served() -> None:
        while len(_running(stack, namespace)) < 50:
            view = await provision_state(temporal, cluster_name, policy)
            if view.proposal is not None and view.proposal.batch not in approved:
                approved.append(view.proposal.batch)
                await ops.approve(temporal, view.proposal.batch,
                                  Approval(approver="alice", plan_id=view.proposal.plan.plan_id))
            await asyncio.sleep(0.5)

    await asyncio.wait_for(approve_until_served(), 240)
    view = await provision_state(temporal, cluster_name, policy)
    assert 1 <= len(approved) <= 3, [b.plan.summary() for b in view.batches]
    assert [b.batch for b in view.batches] == approved
    # 50 one-GPU pods: twelve 4-GPU nodes and two 1-GPU nodes, the cheapest cover.
    planned = sorted(n.offering.instance_type for b in view.batches for n in b.plan.new_nodes)
    nodes = sorted(n.metadata.labels[LABEL_INSTANCE_TYPE] for n in _burst_nodes(stack, policy))
    assert nodes == planned
    if len(approved) == 1:
        assert planned == ["sim.l4.1"] * 2 + ["sim.l4.4"] * 12
    for n in names:
        apps.delete_namespaced_deployment(n, namespace)
    await _all_gone(stack, policy)


async def test_a_pod_taking_another_batchs_node_leaves_no_spare_node_and_no_pod_without_one(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str) -> None:
    """Burst nodes serve every tolerating pod. B's batch launches a node; A's pod (scheduled first) takes it:
    the next plan gives B the node A's batch launches, and no third node is made."""
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west"], max_nodes=4)
    first_class = unique("burst-first")  # the scheduler places A's pod first when B's node appears
    scheduling = client.SchedulingV1Api(stack.cluster.admin.api)
    scheduling.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=first_class),
                                                            value=1000))
    apps = stack.cluster.admin.apps
    try:
        apps.create_namespaced_deployment(namespace, gpu_deployment("infer-b"))
        view = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
        assert view.proposal is not None
        first = view.proposal
        deployment_a = gpu_deployment("infer-a")
        deployment_a.spec.template.spec.priority_class_name = first_class
        apps.create_namespaced_deployment(namespace, deployment_a)
        await provision_state(temporal, cluster_name, policy, lambda v: len(v.waiting) == 2)
        await ops.approve(temporal, first.batch, Approval(approver="alice"))
        # A's pod waits too: the next proposal covers whichever pod is still waiting once it is planned.
        view = await provision_state(temporal, cluster_name, policy,
                                     lambda v: v.proposal is not None and v.proposal.batch != first.batch)
        assert view.proposal is not None and len(view.proposal.plan.new_nodes) == 1
        await ops.approve(temporal, view.proposal.batch, Approval(approver="alice"))
        await until(lambda: len(_running(stack, namespace)) == 2, timeout=90, what="both pods running")
        # Settled: nothing waits, nothing proposed, back to Idle: a spare node would have been planned by now.
        final = await provision_state(temporal, cluster_name, policy, lambda v: (
            v.phase == ProvisionPhase.IDLE and not v.waiting and v.proposal is None))
        assert final.proposal is None and len(node_workflows(final)) == 2
        assert len(_burst_nodes(stack, policy)) == 2
        for d in ("infer-a", "infer-b"):
            apps.delete_namespaced_deployment(d, namespace)
        await _all_gone(stack, policy)
    finally:
        scheduling.delete_priority_class(first_class)
