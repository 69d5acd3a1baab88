"""Limits and safety on the real parts: maxNodes across concurrent operations, PDBs during return home, cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes import watch
from temporalio.client import Client
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import CancelledError
from temporalio.testing import WorkflowEnvironment

from activities.providers.sim import SimProvider
from gateway.slots import AddressPlan
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_POLICY
from models.node import NodePhase
from models.provisioning import ProvisionPhase
from tests.harness.background import Background
from tests.harness.burst import BurstStack
from tests.harness.burst import drain_blocked
from tests.harness.burst import gpu_deployment
from tests.harness.burst import in_process_worker
from tests.harness.burst import node_for
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import sim_location
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.burst import wait_phase
from worker import ops
from worker.runtime import Runtime

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture
def locations(product: str) -> list[dict[str, Any]]:
    return [sim_location("sim/eu-west", product), sim_location("sim/us-west", product, price=1.5),
            sim_location("sim/big", product, four=3.2)]


class NodeCounter(Background):
    """Watches burst nodes of a policy and records the most that ever existed at once (re-listing whenever the
    watch breaks, so no node is missed)."""

    join_seconds = 15

    def __init__(self, core: client.CoreV1Api, policy: str) -> None:
        super().__init__()
        self.core, self.policy = core, policy
        self.current: set[str] = set()
        self.peak = 0

    def _seen(self, names: set[str]) -> None:
        self.current = names
        self.peak = max(self.peak, len(names))

    def _run(self) -> None:
        selector = f"{LABEL_POLICY}={self.policy}"
        while not self._stop.is_set():
            try:
                listed = self.core.list_node(label_selector=selector)
                self._seen({str(n.metadata.name) for n in listed.items})
                for event in watch.Watch().stream(self.core.list_node, label_selector=selector, timeout_seconds=5,
                                                  resource_version=listed.metadata.resource_version):
                    name = event["object"].metadata.name
                    if event["type"] == "DELETED":
                        self._seen(self.current - {name})
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._seen(self.current | {name})
            except Exception:  # a broken or expired watch: list again
                self._stop.wait(0.2)


async def test_max_nodes_holds_across_ten_concurrent_groups(stack: BurstStack, worker: tuple[Client, str],
                                                            namespace: str, policy: str, product: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west", "sim/us-west"], max_nodes=4)
    apps, core = stack.cluster.admin.apps, stack.cluster.admin.core
    names = [f"group-{i}" for i in range(10)]

    deleted: set[str] = set()

    def running() -> list[str]:
        return sorted(p.metadata.labels["app"] for p in core.list_namespaced_pod(namespace).items
                      if p.status.phase == "Running" and p.metadata.labels["app"] not in deleted)

    def delete(group: list[str]) -> None:
        for name in group:
            apps.delete_namespaced_deployment(name, namespace)
            deleted.add(name)

    async def steady(count: int) -> list[str]:
        while not (len(counter.current) == count and len(running()) == count):
            await asyncio.sleep(0.5)
        return running()

    with NodeCounter(core, policy) as counter:
        try:
            for name in names:
                apps.create_namespaced_deployment(namespace, gpu_deployment(name, gpu_product=product))
            try:
                served = await asyncio.wait_for(steady(4), 150)
            except TimeoutError:
                view = await provision_state(temporal, cluster_name, policy)
                raise AssertionError(f"nodes {sorted(counter.current)}, running {running()}, {view.history}") from None
            # The rest wait visibly: the provisioning says how many and why. Its phase is read in the same view:
            # each recheck round (replan_seconds) shows Planning for a moment before it settles again.
            view = await provision_state(temporal, cluster_name, policy, lambda v: len(
                [w for w in v.waiting if "maxNodes 4 reached" in w]) == 6 and len(v.waiting) == 6
                and v.phase == ProvisionPhase.WAITING_FOR_CAPACITY)
            assert len(view.nodes) == 4
            assert counter.peak == 4

            # As served groups leave, their nodes go home and the waiting ones get theirs; the limit still holds.
            delete(served)
            second = await asyncio.wait_for(steady(4), 150)
            delete(second)
            last = await asyncio.wait_for(steady(2), 150)
            delete(last)
            await asyncio.wait_for(steady(0), 150)
        finally:
            # A failure must not leave ten groups and their burst nodes to the next tests: the groups go and
            # the nodes are sent home while this test's worker still runs (bounded).
            for name in sorted(set(names) - deleted):
                with contextlib.suppress(client.ApiException):  # never created
                    delete([name])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(steady(0), 150)
    assert counter.peak == 4
    assert sorted(served + second + last) == sorted(names)


async def test_sixteen_one_gpu_pods_under_max_nodes_four_are_all_served_by_larger_nodes(
        stack: BurstStack, worker: tuple[Client, str], namespace: str, policy: str, product: str) -> None:
    temporal, cluster_name = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west", "sim/big"], max_nodes=4)
    apps, core = stack.cluster.admin.apps, stack.cluster.admin.core
    with NodeCounter(core, policy) as counter:
        apps.create_namespaced_deployment(namespace, gpu_deployment("sixteen", replicas=16, gpu_product=product))

        def all_running() -> bool:
            pods = core.list_namespaced_pod(namespace).items
            return len(pods) == 16 and all(p.status.phase == "Running" for p in pods)

        try:
            await asyncio.to_thread(wait_for, all_running, what="16 pods running", timeout=150)
        except AssertionError:
            view = await provision_state(temporal, cluster_name, policy)
            raise AssertionError([b.plan.summary() for b in view.batches] + view.history) from None
        types = sorted(n.metadata.labels[LABEL_INSTANCE_TYPE]
                       for n in core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items)
        assert types == ["sim.gpu.4"] * 4
        apps.delete_namespaced_deployment("sixteen", namespace)
        await asyncio.to_thread(wait_for, lambda: not counter.current, what="nodes home", timeout=150)
    assert counter.peak <= 4
    view = await provision_state(temporal, cluster_name, policy, lambda v: not v.nodes)
    assert all(n.gpus_used <= 4 for b in view.batches for n in b.plan.new_nodes)


async def test_the_gateways_address_slots_cap_the_nodes_and_the_rest_wait_visibly(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, policy: str, product: str
        ) -> None:
    """A gateway with 2 address slots (pod CIDR /29 in /30s) under maxNodes 4: 2 nodes serve 2 pods; 2 more pods
    (of another GPU type, so they fit no node already there) wait, named for the address slots, and no instance
    that could never join is launched; as the first nodes go home, the waiting pods get theirs."""
    core, apps = stack.cluster.admin.core, stack.cluster.admin.apps
    for cm in core.list_namespaced_config_map("kubeon-gpu", label_selector="gpu.kubeon.io/gateway-record=slot").items:
        core.delete_namespaced_config_map(str(cm.metadata.name), "kubeon-gpu")  # other modules' slots: this one has 2
    other = f"{product}-b"
    locations = [sim_location("sim/eu-west", product), sim_location("sim/us-west", other)]
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west", "sim/us-west"], max_nodes=4)
    first, then = ["slot-a0", "slot-a1"], ["slot-b0", "slot-b1"]

    def running(names: list[str]) -> list[str]:
        return sorted(p.metadata.labels["app"] for p in core.list_namespaced_pod(namespace).items
                      if p.status.phase == "Running" and p.metadata.labels["app"] in names)

    def launched() -> set[str]:  # operations the sim provider was asked to launch (retries counted once)
        sim = runtime.providers["sim"]
        assert isinstance(sim, SimProvider)
        return {op for method, op in sim.calls if method == "launch"}

    async def steady(names: list[str]) -> None:
        while not (len(counter.current) == len(names) and running(names) == sorted(names)):
            await asyncio.sleep(0.5)

    plan = AddressPlan(pod_cidr="10.245.0.0/29", node_mask=30)
    async with in_process_worker(stack, temporal_dev_server, locations, plan=plan) as (temporal, settings, runtime):
        with NodeCounter(core, policy) as counter:
            for name in first:
                apps.create_namespaced_deployment(namespace, gpu_deployment(name, gpu_product=product))
            await asyncio.wait_for(steady(first), 150)
            for name in then:
                apps.create_namespaced_deployment(namespace, gpu_deployment(name, gpu_product=other))
            try:
                view = await provision_state(temporal, settings.cluster, policy, lambda v: len(
                    [w for w in v.waiting if "address slots" in w]) == 2 and len(v.waiting) == 2)
            except AssertionError:
                raise AssertionError(f"nodes {sorted(counter.current)}, launched {launched()}") from None
            assert view.phase == ProvisionPhase.WAITING_FOR_CAPACITY and "address slots" in view.message
            assert "2 of 2 held" in view.waiting[0]
            assert len(view.nodes) == 2 and counter.peak == 2
            assert len(launched()) == 2  # nothing else launched: no instance that could never join
            # The first pods leave: their nodes go home and free their slots; the waiting pods get theirs.
            for name in first:
                apps.delete_namespaced_deployment(name, namespace)
            await asyncio.wait_for(steady(then), 150)
            for name in then:
                apps.delete_namespaced_deployment(name, namespace)
            await asyncio.wait_for(steady([]), 150)
        assert counter.peak == 2
        assert len(launched()) == 4


async def test_pdb_blocks_return_home_until_relaxed(stack: BurstStack, worker: tuple[Client, str],
                                                    namespace: str, policy: str, product: str) -> None:
    temporal, cluster_name = worker
    admin = stack.cluster.admin
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], return_home=True)
    deploy = unique("guarded")
    admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product=product))
    admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="keep-one"),
        spec=client.V1PodDisruptionBudgetSpec(min_available=1,
                                              selector=client.V1LabelSelector(match_labels={"app": deploy}))))
    handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
    view = await wait_phase(handle, NodePhase.SERVING)

    # Home capacity comes back: a home node with this GPU type. The operation starts returning home.
    home = unique("home")
    stack.cluster.create_kwok_node(home, labels={"nvidia.com/gpu.product": product})
    try:
        await wait_phase(handle, NodePhase.DRAINING, timeout=60)
        drain, status = await drain_blocked(temporal, handle.id, view.operation)
        assert set(status.blocked.values()) == {"blocked by PDB keep-one"}
        desc = await drain.describe()
        assert desc.status is not None and desc.status.name == "RUNNING"
        assert stack.cluster.admin.core.read_node(str(view.node_name)).spec.unschedulable is True

        admin.policy.patch_namespaced_pod_disruption_budget("keep-one", namespace,
                                                            {"spec": {"minAvailable": 0}})
        done = await result(handle)
        assert done.phase == NodePhase.COMPLETED, done.message
        assert "home capacity is back" in done.message
        pods = admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        wait_for(lambda: [p.spec.node_name for p in admin.core.list_namespaced_pod(
            namespace, label_selector=f"app={deploy}").items] == [home], what="pod rescheduled at home")
        assert pods is not None
        assert not admin.core.list_node(field_selector=f"metadata.name={view.node_name}").items
    finally:
        admin.apps.delete_namespaced_deployment(deploy, namespace)
        admin.core.delete_node(home)


async def test_cancel_drains_and_removes_what_it_made(stack: BurstStack, worker: tuple[Client, str],
                                                      namespace: str, policy: str, product: str) -> None:
    temporal, cluster_name = worker
    admin = stack.cluster.admin
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"])
    deploy = unique("cancelled")
    admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product=product))
    handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
    view = await wait_phase(handle, NodePhase.SERVING)
    await ops.cancel(temporal, view.operation)
    with pytest.raises(WorkflowFailureError) as err:
        await result(handle)
    assert isinstance(err.value.cause, CancelledError), repr(err.value.cause)
    assert not admin.core.list_node(field_selector=f"metadata.name={view.node_name}").items
    final = await handle.query("state", result_type=type(view))
    assert final.phase == NodePhase.CANCELLED
    assert any("Draining" in h for h in final.history)
    # The workload is back to Pending (evicted, not deleted): nothing of the operation is left.
    pods = admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
    assert pods and all(p.spec.node_name is None for p in pods)
    admin.apps.delete_namespaced_deployment(deploy, namespace)


@contextlib.asynccontextmanager
async def one_operation(stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, policy: str,
                        product: str, locations: list[dict[str, Any]], **settings_overrides: Any
                        ) -> AsyncIterator[tuple[Any, Runtime]]:
    """A worker over ``locations``, an Automatic policy over them, and one pending Deployment: yields the
    handle of the node workflow planned for it and the worker's runtime; the Deployment is deleted at the end."""
    stack.create_policy(policy, mode="Automatic", locations=[loc["name"] for loc in locations])
    deploy = unique("infer")
    try:
        async with in_process_worker(stack, temporal_dev_server, locations, **settings_overrides) as (
                temporal, settings, runtime):
            stack.cluster.admin.apps.create_namespaced_deployment(namespace,
                                                                  gpu_deployment(deploy, gpu_product=product))
            yield await node_for(temporal, settings.cluster, policy, f"{namespace}/{deploy}-"), runtime
    finally:
        with contextlib.suppress(client.ApiException):  # a test may have deleted it to end the operation
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)


async def test_insufficient_capacity_falls_back_to_the_next_location(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, policy: str, product: str) -> None:
    locations = [sim_location("sim/eu-west", product, capacity=0), sim_location("sim/us-west", product, price=1.5)]
    async with one_operation(stack, temporal_dev_server, namespace, policy, product, locations) as (handle, _):
        view = await wait_phase(handle, NodePhase.SERVING)
        assert view.node is not None
        assert view.node.offering.location == "sim/eu-west"  # cheapest, but full
        assert [o.location for o in view.node.alternatives] == ["sim/us-west"]
        assert view.instance is not None and view.instance.location == "sim/us-west"
        pod = view.node.pods[0].split("/")[1]
        stack.cluster.admin.apps.delete_namespaced_deployment(pod.rsplit("-", 2)[0], namespace)
        assert (await result(handle)).phase == NodePhase.COMPLETED


async def test_no_capacity_anywhere_fails_leaving_nothing(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, policy: str, product: str) -> None:
    locations = [sim_location("sim/eu-west", product, capacity=0), sim_location("sim/us-west", product, capacity=0)]
    async with one_operation(stack, temporal_dev_server, namespace, policy, product, locations) as (handle, runtime):
        done = await result(handle)
        assert done.phase == NodePhase.FAILED
        assert "no capacity in any eligible location" in done.message
        assert "sim/eu-west" in done.message and "sim/us-west" in done.message
        for loc in ("sim/eu-west", "sim/us-west"):
            assert runtime.providers["sim"].list(loc, policy=policy) == []
        failed = [r for r in runtime.audit.read() if r.action == "failed" and r.operation == done.operation]
        assert len(failed) == 1


async def test_node_that_never_joins_is_terminated(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, policy: str, product: str) -> None:
    slow = sim_location("sim/eu-west", product)
    slow["sim"]["bootSeconds"] = 3600  # never boots within the join deadline
    async with one_operation(stack, temporal_dev_server, namespace, policy, product, [slow],
                             join_timeout_seconds=3) as (handle, runtime):
        done = await result(handle)
        assert done.phase == NodePhase.FAILED
        assert "did not become Ready" in done.message
        launched = runtime.providers["sim"].list("sim/eu-west", policy=policy)
        assert [i.state for i in launched] == ["terminated"]
