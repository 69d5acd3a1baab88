"""KubeOps against the real control plane: the home capacity a serving node's return-home check reads, and how a
burst node's verification waits for its pods."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from activities.clients.kube import HOME_VIEW_SECONDS
from activities.clients.kube import VERIFY_WATCH_SECONDS
from activities.clients.kube import WAITING_VIEW_SECONDS
from activities.clients.kube import KubeOps
from activities.clients.kube import Wakeups
from common.watch import WatchedList
from models.node import NodeExpectation
from models.node import VerifyResult
from tests.harness.burst import unique
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def kube(cluster: Cluster) -> Iterator[KubeOps]:
    ops = KubeOps(cluster.admin.api)
    yield ops
    ops.close()  # its watches of the cluster's Nodes and Pods


def _gpu_pod(name: str, node: str, gpus: int) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(node_name=node, termination_grace_period_seconds=0, containers=[client.V1Container(
            name="infer", image="registry.invalid/infer:1",
            resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)}))]))


def test_home_free_gpus_counts_matching_ready_home_nodes_less_their_pods(kube: KubeOps, cluster: Cluster,
                                                                         namespace: str) -> None:
    product = unique("gpu-home")
    selector = {"nvidia.com/gpu.product": product}
    home, burst = unique("home"), unique("burst")
    cluster.create_kwok_node(home, gpus=4, labels=selector)
    # A burst node (location label) of the same product is never home capacity.
    cluster.create_kwok_node(burst, gpus=4, labels={**selector, "gpu.kubeon.io/location": "sim.eu-west"})
    try:
        wait_for(lambda: cluster.node_ready(home) and cluster.node_ready(burst), what="both nodes Ready")
        # The watched view follows the node to Ready (a list at most HOME_VIEW_SECONDS old before it follows).
        wait_for(lambda: kube.home_free_gpus(selector) == 4, timeout=HOME_VIEW_SECONDS + 10,
                 what="the home node's 4 GPUs free")
        assert kube.home_free_gpus({"nvidia.com/gpu.product": "another"}) == 0

        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("one", home, 1))
        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("two", home, 2))
        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("on-burst", burst, 4))
        # The pods show once the watch sees them bound (and kwok has them running).
        wait_for(lambda: kube.home_free_gpus(selector) == 1, timeout=HOME_VIEW_SECONDS + 10,
                 what="3 of the home node's 4 GPUs taken")

        cluster.admin.core.patch_node(home, {"spec": {"unschedulable": True}})  # cordoned: no room at home
        wait_for(lambda: kube.home_free_gpus(selector) == 0, timeout=HOME_VIEW_SECONDS + 10,
                 what="a cordoned home node offers nothing")
    finally:
        for name in (home, burst):
            cluster.admin.core.delete_node(name)


def _never_following(monkeypatch: pytest.MonkeyPatch, *watches: WatchedList[Any]) -> None:
    """These watches never start, as if their API server were away: whoever reads them must list."""
    for watched in watches:
        monkeypatch.setattr(watched, "start", lambda: None)


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "listed"])
def test_waiting_for_counts_only_the_waiting_pods_the_node_could_take(kube: KubeOps, namespace: str,
                                                                       cluster: Cluster, watched: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """From the watch of the pending pods, or (the watch not following) from a list: a pod counts if it tolerates
    the burst taint, matches the node and fits its GPUs; it stops counting once deleted."""
    if not watched:
        _never_following(monkeypatch, kube._waiting_watch)
    taint, pin = "gpu.kubeon.io/burst-test", unique("pin")
    node = client.V1Node(metadata=client.V1ObjectMeta(name=unique("burst"), labels={"pin": pin}),
                         status=client.V1NodeStatus(allocatable={"nvidia.com/gpu": "1"}))

    def waiting(name: str, *, gpus: int = 1, tolerates: bool = True, where: str = pin) -> client.V1Pod:
        return client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=client.V1PodSpec(
            node_selector={"pin": where}, termination_grace_period_seconds=0,
            tolerations=[client.V1Toleration(key=taint, operator="Exists", effect="NoSchedule")] if tolerates else None,
            containers=[client.V1Container(name="infer", image="registry.invalid/infer:1",
                                           resources=client.V1ResourceRequirements(
                                               limits={"nvidia.com/gpu": str(gpus)}))]))

    for pod in (waiting("fits"), waiting("too-big", gpus=2), waiting("intolerant", tolerates=False),
                waiting("elsewhere", where="other")):
        cluster.admin.core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: kube.waiting_for(node, taint) == 1, timeout=WAITING_VIEW_SECONDS + 10,
             what="the one pod the node could take counted")
    cluster.admin.core.delete_namespaced_pod("fits", namespace, grace_period_seconds=0)
    wait_for(lambda: kube.waiting_for(node, taint) == 0, timeout=WAITING_VIEW_SECONDS + 10,
             what="the deleted pod no longer counted")
    assert (kube._waiting_watch.snapshot() is not None) is watched


def test_while_the_watches_have_no_view_home_capacity_is_read_from_a_list(
        kube: KubeOps, cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch that is not following (starting, or its API server away) never serves a stale view: the check lists
    instead, at most HOME_VIEW_SECONDS old."""
    _never_following(monkeypatch, kube._node_watch, kube._pod_watch)
    selector = {"nvidia.com/gpu.product": unique("gpu-listed")}
    home = unique("home")
    cluster.create_kwok_node(home, gpus=2, labels=selector)
    try:
        wait_for(lambda: cluster.node_ready(home), what="the node Ready")
        cluster.admin.core.create_namespaced_pod(namespace, _gpu_pod("one", home, 1))
        wait_for(lambda: kube.home_free_gpus(selector) == 1, timeout=HOME_VIEW_SECONDS + 10,
                 what="1 of the home node's 2 GPUs free, from lists")
        assert kube._node_watch.snapshot() is None and kube._pod_watch.snapshot() is None
    finally:
        cluster.admin.core.delete_node(home)


def test_a_pod_bound_while_the_plan_reads_counts_waiting_or_on_its_node_never_both(
        kube: KubeOps, cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_batch reads which pods wait and what each burst node's bound pods use: a pod the scheduler binds
    between the two reads must not count as both (its GPU taken on the node and a node still wanted for it: a
    second node bought). The pod is bound right after the first list returns."""
    node, pod_name = unique("burst"), unique("infer")
    cluster.create_kwok_node(node, gpus=1)
    pod = _gpu_pod(pod_name, node, 1)
    pod.spec.node_name = None
    pod.spec.node_selector = {"gpu.kubeon.io/nowhere": "true"}  # the scheduler leaves it Pending
    created = cluster.admin.core.create_namespaced_pod(namespace, pod)
    uid = str(created.metadata.uid)
    lists: list[str] = []

    core = client.CoreV1Api(cluster.admin.api)
    list_pods = core.list_pod_for_all_namespaces

    def list_then_bind(**kwargs: Any) -> Any:
        answer = list_pods(**kwargs)
        lists.append(str(kwargs.get("field_selector", "")))
        if len(lists) == 1:
            core.create_namespaced_binding(namespace, client.V1Binding(
                metadata=client.V1ObjectMeta(name=pod_name),
                target=client.V1ObjectReference(kind="Node", name=node)), _preload_content=False)
        return answer

    monkeypatch.setattr(core, "list_pod_for_all_namespaces", list_then_bind)
    try:
        kube.core = core
        waiting, used = kube.waiting_and_used({uid}, {node})
        assert len(lists) == 2, lists
        assert (waiting, used) == ({uid}, {node: 0}), "read as of the first list: waiting, its node still free"
        waiting, used = kube.waiting_and_used({uid}, {node})
        assert (waiting, used) == (set(), {node: 1})
    finally:
        cluster.admin.core.delete_namespaced_pod(pod_name, namespace, grace_period_seconds=0)
        cluster.admin.core.delete_node(node)


def test_a_node_registering_or_being_removed_is_not_home_capacity(kube: KubeOps, cluster: Cluster) -> None:
    """A Karpenter node still unregistered (or disrupted, or being deleted by an autoscaler) is no home a burst node
    could go back to, whatever GPUs it shows."""
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


def test_verify_sees_a_pod_bound_while_it_waits_and_ends_idle_once_nothing_waits(kube: KubeOps, cluster: Cluster,
                                                                                namespace: str) -> None:
    """verify_node waits on a watch, not a poll: a pod the scheduler binds while it waits is what it returns; a node
    nothing waits for any more (its pod deleted) is verified idle within a watch window and the waiting view's age."""
    taint, pin = "gpu.kubeon.io/burst-test", unique("pin")
    node = unique("burst")
    cluster.create_kwok_node(node, gpus=1, labels={"pin": pin}, taints=[
        client.V1Taint(key=taint, value="true", effect="NoSchedule")])
    cluster.admin.core.patch_node(node, {"spec": {"unschedulable": True}})  # the pod waits until uncordoned
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="waits"),
        spec=client.V1PodSpec(node_selector={"pin": pin}, termination_grace_period_seconds=0, tolerations=[
            client.V1Toleration(key=taint, operator="Exists", effect="NoSchedule")], containers=[client.V1Container(
                name="infer", image="registry.invalid/infer:1",
                resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}))]))
    expect = NodeExpectation(node_name=node, taint_key=taint, labels={"pin": pin}, pods=[], timeout_seconds=60)
    results: list[VerifyResult] = []

    def verify() -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(kube.verify_node(expect, lambda _: None)))
        thread.start()
        return thread

    try:
        wait_for(lambda: cluster.node_ready(node), what="the burst node Ready")
        cluster.admin.core.create_namespaced_pod(namespace, pod)
        thread = verify()
        time.sleep(WAITING_VIEW_SECONDS + 1)
        assert thread.is_alive() and not results, "verify must wait while a pod it could take waits"
        cluster.admin.core.patch_node(node, {"spec": {"unschedulable": False}})
        thread.join(timeout=30)
        assert results == [VerifyResult(node_name=node, pods_on_node=[f"{namespace}/waits"])]

        cluster.admin.core.delete_namespaced_pod("waits", namespace, grace_period_seconds=0)
        wait_for(lambda: not cluster.admin.core.list_namespaced_pod(
            namespace, field_selector="metadata.name=waits").items, what="the pod gone")
        cluster.admin.core.patch_node(node, {"spec": {"unschedulable": True}})
        cluster.admin.core.create_namespaced_pod(namespace, pod)
        results.clear()
        thread = verify()
        time.sleep(WAITING_VIEW_SECONDS + 1)
        assert thread.is_alive() and not results
        cluster.admin.core.delete_namespaced_pod("waits", namespace, grace_period_seconds=0)
        thread.join(timeout=VERIFY_WATCH_SECONDS + WAITING_VIEW_SECONDS + 10)
        assert results == [VerifyResult(node_name=node, pods_on_node=[])]
    finally:
        cluster.admin.core.delete_node(node)


def test_a_wakeup_reaches_each_waiter_on_a_node_until_the_last_is_done() -> None:
    """A retried join or verification may wait beside its earlier attempt: both share the node's event, and the
    first to finish does not take it from the other."""
    wakeups = Wakeups()
    with wakeups.waiting("burst-1") as first:
        with wakeups.waiting("burst-1") as second:
            assert second is first
        wakeups.wake("burst-1")
        assert first.is_set(), "the earlier waiter is woken after the later one is done"
    first.clear()
    wakeups.wake("burst-1")
    assert not first.is_set(), "nobody waits: nothing is kept for the node"
