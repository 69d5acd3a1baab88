"""Burst defers to home managed node groups (capacity.provider eks-nodegroups, gke-nodepools, aks-nodepools): GPU
pods a home group can serve grow that group, through the official client against the local server, and are not
burst; the group's size afterwards is the plan's. One 4-GPU node and six 1-GPU pods that tolerate the burst taint
too and ask for the group's GPU product, which a sim location offers as well (so it could serve them, and would at
once: the launch grace is 0): four run, two wait, the plan grows the group from 1 to 2 nodes, and all six run on
the group's nodes with no burst node. (The group's nodes carry a GPU product label of this test alone, the
``product`` fixture, so its pods fit no other test's nodes.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from models.aks import AGENTPOOL_LABEL
from models.eks import NODEGROUP_LABEL
from models.gke import NODEPOOL_LABEL
from models.labels import LABEL_POLICY
from models.provisioning import BatchPhase
from tests.activities.capacity.test_aks import GPU_SIZE
from tests.activities.capacity.test_aks import RG
from tests.activities.capacity.test_aks import TAINT
from tests.activities.capacity.test_aks import identity
from tests.activities.capacity.test_aks import pool_state
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import provision_state
from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_SUBSCRIPTION
from tests.harness.clouds.local import GKE_LOCATION
from tests.harness.clouds.local import GKE_PROJECT
from tests.harness.clouds.local import seed_gke_gpu_pool
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import until
from tests.harness.kube import wait_for
from tests.harness.workloads import GPU_TAINT_TOLERATION
from tests.harness.workloads import SMALL_REQUESTS
from tests.harness.workloads import gpu_pods
from tests.harness.workloads import live_pods

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

PRODUCT_LABEL = "nvidia.com/gpu.product"  # as the GPU Operator's feature discovery labels a node


def sim(product: str) -> dict[str, Any]:
    """A burst location offering 1-GPU nodes of ``product``: it could serve the test's pods."""
    return {"name": "sim/eu-west", "sim": {"bootSeconds": 0.3}, "offerings": [
        {"instanceType": "sim.gpu.1", "gpus": 1, "gpuProduct": product, "usdPerHour": 0.9}]}


@dataclass
class HomeGroup:
    """A home managed group of one 4-GPU node: the worker's settings for its provider, its label and name on the
    Nodes, and its size as the cloud reports it."""

    settings: dict[str, Any]
    product: str  # its nodes' nvidia.com/gpu.product label: a product of this test alone
    label: str
    name: str
    nodes: NodeReconciler
    size: Callable[[], int]


@pytest.fixture
def eks_group(eks_nodegroups: EksNodeGroups, eks_nodes: NodeReconciler, eks_api: MotoRecorder, product: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[HomeGroup]:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    eks_cluster, ng = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
    eks_nodegroups.create(eks_cluster, ng, instance_type="g5.12xlarge", min_size=1, max_size=3, desired=1,
                          labels={PRODUCT_LABEL: product},
                          taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}])
    eks = eks_nodegroups.client("eks")
    try:
        yield HomeGroup(
            settings={"capacity_provider": "eks-nodegroups", "capacity_cluster_name": eks_cluster,
                      "capacity_region": "eu-central-1", "aws_endpoint_url": eks_api.url},
            product=product, label=NODEGROUP_LABEL, name=ng, nodes=eks_nodes,
            size=lambda: int(eks.describe_nodegroup(clusterName=eks_cluster, nodegroupName=ng)["nodegroup"][
                "scalingConfig"]["desiredSize"]))
    finally:
        eks_nodegroups.delete(eks_cluster, ng)


@pytest.fixture
def gke_group(gcp_server: FakeServer, gke_nodes: NodeReconciler, product: str) -> Iterator[HomeGroup]:
    gke_cluster, pool = seed_gke_gpu_pool(gcp_server, machine_type="a2-highgpu-4g", nodes=1,
                                          labels={PRODUCT_LABEL: product})

    def size() -> int:  # the VMs of the pool's instance groups
        return len([i for i in gcp_server.state()["instances"]
                    if i.get("labels", {}).get("goog-k8s-node-pool-name") == pool])

    try:
        yield HomeGroup(
            settings={"capacity_provider": "gke-nodepools", "capacity_cluster_name": gke_cluster,
                      "capacity_project": GKE_PROJECT, "capacity_location": GKE_LOCATION,
                      "gcp_endpoint_url": gcp_server.url},
            product=product, label=NODEPOOL_LABEL, name=pool, nodes=gke_nodes, size=size)
    finally:
        gcp_server.reset()
        wait_for(lambda: not gke_nodes.group(NODEPOOL_LABEL, pool), timeout=30, what="the pool's nodes gone")


@pytest.fixture
def aks_group(azure_server: FakeServer, aks_nodes: NodeReconciler, product: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[HomeGroup]:
    azure_server.reset()
    azure_server.fault(operation_seconds=0.2, retry_after=0)
    aks_cluster = f"train-{uuid.uuid4().hex[:6]}"
    azure_server.seed(aks={"subscription": AZURE_SUBSCRIPTION, "resourceGroup": RG, "cluster": aks_cluster,
                           "location": "westeurope", "agentPools": [
                               {"name": "gpu", "vmSize": GPU_SIZE, "count": 1, "mode": "User", "nodeTaints": [TAINT],
                                "nodeLabels": {PRODUCT_LABEL: product}},
                               {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})
    identity(azure_server, monkeypatch)
    try:
        yield HomeGroup(
            settings={"capacity_provider": "aks-nodepools", "capacity_cluster_name": aks_cluster,
                      "capacity_subscription": AZURE_SUBSCRIPTION, "capacity_resource_group": RG,
                      "azure_endpoint_url": azure_server.url, "azure_ca_file": azure_server.ca_file},
            product=product, label=AGENTPOOL_LABEL, name="gpu", nodes=aks_nodes,
            size=lambda: int(pool_state(azure_server, aks_cluster, "gpu")["properties"]["count"]))
    finally:
        azure_server.reset()
        wait_for(lambda: not [n for n in aks_nodes.nodes().values() if aks_cluster.lower() in
                              str(n.spec.provider_id).lower()], timeout=30, what="the test's AKS nodes gone")


@pytest.fixture(params=["eks", "gke", "aks"])
def home_group(request: pytest.FixtureRequest) -> HomeGroup:
    group: HomeGroup = request.getfixturevalue(f"{request.param}_group")
    return group


async def test_pods_a_home_group_can_serve_grow_it_and_are_not_burst(
        stack: BurstStack, start_worker: StartWorker, namespace: str, policy: str, home_group: HomeGroup) -> None:
    g = home_group
    core, apps = stack.cluster.admin.core, stack.cluster.admin.apps
    wait_for(lambda: len(g.nodes.ready(g.label, g.name)) == 1, timeout=30, what="the group's node Ready")
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], max_nodes=2)
    # The two pods the group's node cannot take are marked Unschedulable in two scheduling cycles: a second's
    # gathering plans them as one batch (with none, the first may be planned alone), so the one scale is whole.
    async with start_worker([sim(g.product)], capacity_launch_grace_seconds=0, batch_idle_seconds=1.0,
                            **g.settings) as (temporal, settings, _):
        burst_toleration = client.V1Toleration(key=BURST_TAINT_KEY, operator="Exists", effect="NoSchedule")
        apps.create_namespaced_deployment(namespace, gpu_pods(
            "infer", replicas=6, requests=SMALL_REQUESTS, node_selector={PRODUCT_LABEL: g.product},
            tolerations=[GPU_TAINT_TOLERATION, burst_toleration]))
        try:
            try:
                view = await provision_state(temporal, settings.cluster, policy,
                                             lambda v: any(b.plan.home_scale for b in v.batches), timeout=60)
            except AssertionError as exc:  # four pods fit the group's node and two wait: unless they went elsewhere
                where = {str(p.metadata.name): p.spec.node_name for p in live_pods(core, namespace, "infer")}
                raise AssertionError(f"{exc}; the pods are on {where}") from None
            [batch] = [b for b in view.batches if b.plan.home_scale]
            [scale] = batch.plan.home_scale
            assert (scale.group, scale.from_size, scale.to_size, len(scale.pods)) == (g.name, 1, 2, 2), scale
            assert not batch.plan.new_nodes and not batch.plan.home, batch.plan
            assert f"home node group {g.name} from 1 to 2 node(s) for 2 pod(s)" in batch.plan.summary()

            def on_group_nodes() -> bool:
                pods = live_pods(core, namespace, "infer")
                group = set(g.nodes.group(g.label, g.name))
                return len(pods) == 6 and all(p.spec.node_name in group and p.status.phase == "Running"
                                              for p in pods)

            await until(on_group_nodes, timeout=90, what="all six pods running on the home group's nodes")
            assert g.size() == scale.to_size == len(g.nodes.group(g.label, g.name))
            view = await provision_state(temporal, settings.cluster, policy,
                                         lambda v: not v.waiting and any(b.phase == BatchPhase.COMPLETED
                                                                         for b in v.batches), timeout=30)
            assert not [b for b in view.batches if b.plan.new_nodes], [b.plan.summary() for b in view.batches]
            [done] = [b for b in view.batches if b.plan.home_scale]
            assert done.message == f"home node group {g.name} at 2 node(s) (from 1) for 2 pod(s)", done
            assert not core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items
        finally:
            apps.delete_namespaced_deployment("infer", namespace)
            wait_for(lambda: not live_pods(core, namespace, "infer"), timeout=60, what="the test's pods gone")
