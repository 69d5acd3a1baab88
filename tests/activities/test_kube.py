"""KubeOps against the real control plane: the home capacity a serving node's return-home check reads."""

from __future__ import annotations

import pytest
from kubernetes import client

from activities.clients.kube import HOME_VIEW_SECONDS, KubeOps
from tests.harness.burst import unique
from tests.harness.kube import Cluster, wait_for

pytestmark = pytest.mark.cluster


def _gpu_pod(name: str, node: str, gpus: int) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(node_name=node, termination_grace_period_seconds=0, containers=[client.V1Container(
            name="infer", image="registry.invalid/infer:1",
            resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)}))]))


def test_home_free_gpus_counts_matching_ready_home_nodes_less_their_pods(cluster: Cluster, namespace: str) -> None:
    kube = KubeOps(cluster.admin.api)
    product = unique("gpu-home")
    selector = {"nvidia.com/gpu.product": product}
    home, burst = unique("home"), unique("burst")
    cluster.create_kwok_node(home, gpus=4, labels=selector)
    # A burst node (location label) of the same product is never home capacity.
    cluster.create_kwok_node(burst, gpus=4, labels={**selector, "gpu.kubeon.io/location": "sim.eu-west"})
    try:
        wait_for(lambda: cluster.node_ready(home) and cluster.node_ready(burst), what="both nodes Ready")
        # Within HOME_VIEW_SECONDS of Ready the view may still be one taken before; then it shows the home node.
        wait_for(lambda: kube.home_free_gpus(selector) == 4, timeout=HOME_VIEW_SECONDS + 10,
                 what="the home node's 4 GPUs free")
        assert kube.home_free_gpus({"nvidia.com/gpu.product": "another"}) == 0

        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("one", home, 1))
        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("two", home, 2))
        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("on-burst", burst, 4))
        # The view is at most HOME_VIEW_SECONDS old: the pods show within that (and then some for kwok).
        wait_for(lambda: kube.home_free_gpus(selector) == 1, timeout=HOME_VIEW_SECONDS + 10,
                 what="3 of the home node's 4 GPUs taken")

        cluster.admin.core.patch_node(home, {"spec": {"unschedulable": True}})  # cordoned: no room at home
        wait_for(lambda: kube.home_free_gpus(selector) == 0, timeout=HOME_VIEW_SECONDS + 10,
                 what="a cordoned home node offers nothing")
    finally:
        for name in (home, burst):
            cluster.admin.core.delete_node(name)


def test_a_node_registering_or_being_removed_is_not_home_capacity(cluster: Cluster) -> None:
    """A Karpenter node still unregistered (or disrupted, or being deleted by an autoscaler) is no home a burst node
    could go back to, whatever GPUs it shows."""
    kube = KubeOps(cluster.admin.api)
    selector = {"nvidia.com/gpu.product": unique("gpu-coming")}
    node = unique("home")
    cluster.create_kwok_node(node, gpus=2, labels=selector, taints=[
        client.V1Taint(key="karpenter.sh/unregistered", effect="NoExecute")])
    try:
        wait_for(lambda: cluster.node_ready(node), what="the node Ready")
        for _ in range(3):
            assert kube.home_free_gpus(selector) == 0
        cluster.admin.core.patch_node(node, {"spec": {"taints": None}})  # registered: now it is capacity
        wait_for(lambda: kube.home_free_gpus(selector) == 2, timeout=HOME_VIEW_SECONDS + 10,
                 what="the registered node's 2 GPUs free")
    finally:
        cluster.admin.core.delete_node(node)
