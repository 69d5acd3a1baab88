"""Burst defers to home capacity (capacity.provider karpenter), against the real Karpenter: pods a home NodePool
can serve get home nodes and are never burst; with the NodePool at its GPU limit the same pod is burst, and the
plan says why."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime

import pytest
from kubernetes import client

from activities.capacity.karpenter import KarpenterCapacity
from activities.clients.kube import pending_pod
from models.labels import LABEL_POLICY
from planning.home import home_verdict
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import provision_state
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import until
from tests.harness.kube import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

BURST_TOLERATION = client.V1Toleration(key=BURST_TAINT_KEY, operator="Exists", effect="NoSchedule")


@pytest.fixture
def pool(karpenter: Karpenter, stack: BurstStack, namespace: str) -> Iterator[tuple[str, str]]:
    taint = uuid.uuid4().hex[:8]
    name = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(name, taint=taint, gpu_limit=2, instance_types=("g6.xlarge",)))
    yield name, taint
    # The test's workloads go first: drained off the pool's nodes they would come back pending, tolerating the
    # burst taint, and every burst policy of the tests that follow would plan them.
    apps, core = stack.cluster.admin.apps, stack.cluster.admin.core
    for deployment in apps.list_namespaced_deployment(namespace).items:
        apps.delete_namespaced_deployment(str(deployment.metadata.name), namespace, propagation_policy="Foreground")
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, timeout=60, what="the test's pods gone")
    karpenter.delete_nodepool(name)


async def test_home_nodepool_first_then_burst_at_its_limit(
        stack: BurstStack, start_worker: StartWorker, karpenter: Karpenter, namespace: str, policy: str,
        pool: tuple[str, str]) -> None:
    name, taint = pool
    apps = stack.cluster.admin.apps
    core = stack.cluster.admin.core
    # Automatic: a pod the watcher hands over is planned (and burst) at once, long before Karpenter's node is up.
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], max_nodes=1)
    async with start_worker([{"name": "sim/eu-west", "sim": {"bootSeconds": 0.3}, "offerings": [
            {"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.9}]}],
            capacity_provider="karpenter", capacity_launch_grace_seconds=60) as (temporal, settings, _):
        # Two 1-GPU pods the home NodePool serves (the sim location could too): home nodes, no burst.
        apps.create_namespaced_deployment(namespace, gpu_workload("home", taint=taint, replicas=2,
                                                                  extra_tolerations=[BURST_TOLERATION]))
        capacity = KarpenterCapacity(stack.cluster.admin.api)

        def launching() -> list[str]:
            group = capacity.get_group(name)
            pods = core.list_namespaced_pod(namespace, label_selector="app=home").items
            waiting = [pending_pod(p) for p in pods if not p.spec.node_name]
            return [home_verdict(p, [group], datetime.now(UTC), grace_seconds=60, register_seconds=300).why
                    for p in waiting] if group.launching else []

        whys = await until(launching, timeout=30, interval=0.05, what="the pods pending while Karpenter launches")
        assert all(w.startswith(f"home NodePool {name} is launching NodeClaim {name}-") for w in whys), whys

        def on_home_nodes() -> bool:
            pods = core.list_namespaced_pod(namespace, label_selector="app=home").items
            nodes = {n.metadata.name for n in karpenter.nodes(name)}
            return len(pods) == 2 and all(p.spec.node_name in nodes and p.status.phase == "Running" for p in pods)

        await until(on_home_nodes, timeout=90, what="both pods running on home Karpenter nodes")
        view = await provision_state(temporal, settings.cluster, policy)
        assert not [b for b in view.batches if b.plan.new_nodes], [b.plan.home for b in view.batches] + view.history
        assert not stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items
        await until(lambda: (g := capacity.get_group(name)).gpus == 2 and not g.launching, timeout=30,
                    what="the pool counting 2 of 2 GPUs, its NodeClaims initialized")

        # The same pod with the NodePool at its limit: burst, and the plan says why.
        apps.create_namespaced_deployment(namespace, gpu_workload("more", taint=taint,
                                                                  extra_tolerations=[BURST_TOLERATION]))
        view = await provision_state(temporal, settings.cluster, policy,
                                     lambda v: any(b.plan.new_nodes for b in v.batches), timeout=60)
        plan = next(b.plan for b in view.batches if b.plan.new_nodes)
        [pod] = [p for n in plan.new_nodes for p in n.pods]
        assert pod.startswith(f"{namespace}/more-")
        assert plan.home == {pod: f"home NodePool {name} at its limit (2 of 2 GPUs)"}
        assert f"burst because home NodePool {name} at its limit (2 of 2 GPUs)" in plan.summary()
        assert len(karpenter.nodeclaims(name)) == 2  # Karpenter launched nothing beyond its limit
        await until(lambda: stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items,
                    timeout=60, what="the burst node of the pod home capacity cannot serve")
        # Its workload gone, the burst node goes home (and is no node for the next test's burst pods).
        apps.delete_namespaced_deployment("more", namespace)
        await until(lambda: not stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items,
                    timeout=90, what="the burst node gone home")
