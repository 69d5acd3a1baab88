"""The pending-pod watcher on the real parts: waiting pods go to their policy's one provisioning workflow (with
the facts planning needs), a failed send is retried on resync, two replicas make one provisioning and one plan,
and pods that stop waiting are signalled gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from models.provisioning import BatchPhase
from tests.harness.burst import BurstStack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import in_process_worker
from tests.harness.burst import provision_state
from tests.harness.burst import sim_location
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.kube import until
from worker.background import running
from worker.runtime import Runtime
from worker.watcher import PendingPodWatcher
from worker.watcher import unschedulable_since

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture
def policy(stack: BurstStack) -> Iterator[str]:
    name = unique("watch")
    stack.create_policy(name, mode="Recommend", locations=["sim/open"])  # plans, launches nothing
    yield name
    stack.delete_policy(name)


@pytest.fixture
async def worker(stack: BurstStack, temporal_dev_server: WorkflowEnvironment, product: str
                 ) -> AsyncIterator[tuple[Client, Runtime]]:
    """Workflows and activities without the worker's own watcher: each test runs the watchers it configures."""
    locations = [sim_location("sim/open", product, capacity=50)]
    async with in_process_worker(stack, temporal_dev_server, locations, watch=False) as (temporal, _settings, runtime):
        yield temporal, runtime


class FlakyWatcher(PendingPodWatcher):
    """The real watcher, whose first send fails (as a Temporal start can)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sends: Counter[str] = Counter()
        self.sent_pods: list[str] = []

    async def send(self, policy: str, pods: list[client.V1Pod]) -> str:
        self.sends[policy] += 1
        if self.sends[policy] == 1:
            raise RuntimeError("start refused (injected by the test)")
        self.sent_pods += [str(p.metadata.name) for p in pods]
        return await super().send(policy, pods)


def watcher_for(runtime: Runtime, temporal: Client, cls: type[PendingPodWatcher] = PendingPodWatcher,
                **kwargs: Any) -> Any:
    s = runtime.settings
    kwargs.setdefault("resync_seconds", 1)
    return cls(kube=runtime.kube, temporal=temporal, cluster=s.cluster, task_queue=s.task_queue,
               default_mode=lambda: "Recommend", settings=s.operation_settings(), **kwargs)


async def all_unschedulable(core: client.CoreV1Api, namespace: str, count: int) -> None:
    def check() -> bool:
        pods = core.list_namespaced_pod(namespace).items
        return len(pods) == count and all(unschedulable_since(p) for p in pods)

    await asyncio.to_thread(wait_for, check, what=f"{count} pods Unschedulable in {namespace}")


async def test_pods_go_to_their_policys_provisioning_and_a_failed_send_is_retried(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    core = stack.cluster.admin.core
    for i in range(3):
        stack.cluster.admin.apps.create_namespaced_deployment(
            namespace, gpu_deployment(f"group-{i}", replicas=2, gpu_product=product))
    await all_unschedulable(core, namespace, 6)
    watcher = watcher_for(runtime, temporal, FlakyWatcher)
    async with running(watcher):
        view = await provision_state(temporal, runtime.settings.cluster, policy,
                                     lambda v: len(v.waiting) == 6 and bool(v.batches))
    assert watcher.sends[policy] >= 2  # the first send failed; the resync sent them again
    assert sorted({n.rsplit("-", 2)[0] for n in watcher.sent_pods}) == ["group-0", "group-1", "group-2"]
    # The facts planning needs came along: the product selector decided the (recommended) node.
    batch = view.batches[0]
    assert batch.phase == BatchPhase.PROPOSED
    assert {n.offering.gpu_product for n in batch.plan.new_nodes} == {product}
    # maxNodes 4 (one-GPU nodes): four pods planned, two named as waiting for capacity.
    assert sum(len(n.pods) for b in view.batches for n in b.plan.new_nodes) == 4
    assert len([u for u in batch.plan.unplaced if "maxNodes 4 reached" in u.why]) == 2


async def test_two_replicas_make_one_provisioning_and_one_plan(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    stack.cluster.admin.apps.create_namespaced_deployment(
        namespace, gpu_deployment("rollout", replicas=4, gpu_product=product))
    await all_unschedulable(stack.cluster.admin.core, namespace, 4)
    first, second = watcher_for(runtime, temporal), watcher_for(runtime, temporal)
    async with running(first), running(second):
        view = await provision_state(temporal, runtime.settings.cluster, policy,
                                     lambda v: len(v.waiting) == 4 and bool(v.batches))
        # Several resyncs of both replicas (each sends the same pods again).
        seen = (first.resyncs, second.resyncs)
        await until(lambda: first.resyncs >= seen[0] + 2 and second.resyncs >= seen[1] + 2, timeout=30,
                    what="two more resyncs of each watcher")
        view = await provision_state(temporal, runtime.settings.cluster, policy)
    assert len(view.waiting) == 4
    assert len(view.batches) == 1  # the pods were planned once, not once per replica or resync
    assert sorted(p for n in view.batches[0].plan.new_nodes for p in n.pods) == sorted(
        f"{namespace}/{p.metadata.name}" for p in stack.cluster.admin.core.list_namespaced_pod(namespace).items)


async def test_pods_that_stop_waiting_are_signalled_gone(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    apps = stack.cluster.admin.apps
    apps.create_namespaced_deployment(namespace, gpu_deployment("leaving", replicas=2, gpu_product=product))
    await all_unschedulable(stack.cluster.admin.core, namespace, 2)
    watcher = watcher_for(runtime, temporal, resync_seconds=60)
    async with running(watcher):
        await provision_state(temporal, runtime.settings.cluster, policy, lambda v: len(v.waiting) == 2)
        apps.delete_namespaced_deployment("leaving", namespace)
        view = await provision_state(temporal, runtime.settings.cluster, policy, lambda v: not v.waiting)
    assert view.waiting == [] and watcher.pending == {}
    with contextlib.suppress(client.ApiException):
        apps.delete_namespaced_deployment("leaving", namespace)
