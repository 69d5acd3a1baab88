"""The pending-pod watcher on the real parts: concurrent starts, a failed start retried, and pods whose operation
ended without giving them a node started again on resync (no pod event needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import pytest
from kubernetes import client
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from models import search_attributes as sa
from models.operation import Phase, WorkloadGroup, burst_workflow_id
from tests.harness.burst import BurstStack, build_stack, gpu_deployment, result, unique, wait_for, wait_phase
from tests.harness.kube import Cluster
from worker.main import worker_services
from worker.runtime import Runtime
from worker.watcher import PendingPodWatcher, running, unschedulable_since

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
T = TypeVar("T")


def locations(product: str) -> list[dict[str, Any]]:
    """sim/full never has room; sim/open has."""
    offering = [{"instanceType": "sim.gpu.1", "gpus": 1, "gpuProduct": product, "usdPerHour": 0.9}]
    return [{"name": "sim/full", "sim": {"bootSeconds": 0.3, "capacity": 0}, "offerings": offering},
            {"name": "sim/open", "sim": {"bootSeconds": 0.3, "capacity": 50}, "offerings": offering}]


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> BurstStack:
    return build_stack(cluster, tmp_path_factory.mktemp("watcher"))


@pytest.fixture
def product() -> str:
    """A GPU type of this test alone: its pods fit no other test's nodes."""
    return unique("NVIDIA-W")


@pytest.fixture
def policy(stack: BurstStack) -> Iterator[str]:
    name = unique("watch")
    yield name
    stack.delete_policy(name)


@pytest.fixture
async def worker(stack: BurstStack, temporal_dev_server: WorkflowEnvironment, product: str
                 ) -> AsyncIterator[tuple[Client, Runtime]]:
    """Workflows and activities without the worker's own watcher: each test runs the watcher it configures."""
    queue = unique("q")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=locations(product), cluster_name=queue)
    async with worker_services(settings, watch=False) as (temporal, runtime, _):
        yield temporal, runtime


class FlakyWatcher(PendingPodWatcher):
    """The real watcher, whose first start of one group fails (as a Temporal start can); counts starts in
    flight."""

    def __init__(self, *args: Any, fail_owner: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_owner = fail_owner
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.peak_in_flight = 0

    async def start(self, policy: str, group: WorkloadGroup, since: datetime | None, *,
                    further_for: str = "") -> str:
        self.attempts[group.owner_name] += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # every start of the batch gets in before the first one finishes
            if group.owner_name == self.fail_owner and self.attempts[group.owner_name] == 1:
                raise RuntimeError("start refused (injected by the test)")
            return await super().start(policy, group, since, further_for=further_for)
        finally:
            self.in_flight -= 1


def watcher_for(runtime: Runtime, temporal: Client, cls: type[PendingPodWatcher] = PendingPodWatcher,
                **kwargs: Any) -> Any:
    s = runtime.settings
    return cls(kube=runtime.kube, temporal=temporal, cluster=s.cluster, task_queue=s.task_queue,
               default_mode=lambda: "Recommend", settings=s.operation_settings(), resync_seconds=1, **kwargs)


async def all_unschedulable(core: client.CoreV1Api, namespace: str, count: int) -> None:
    def check() -> bool:
        pods = core.list_namespaced_pod(namespace).items
        return len(pods) == count and all(unschedulable_since(p) for p in pods)

    await asyncio.to_thread(wait_for, check, what=f"{count} pods Unschedulable in {namespace}")


async def resyncs(watcher: PendingPodWatcher, more: int) -> None:
    target = watcher.resyncs + more
    await asyncio.to_thread(wait_for, lambda: watcher.resyncs >= target, what=f"{more} resyncs")


async def eventually(check: Callable[[], Coroutine[Any, Any, T | None]], *, what: str) -> T:
    """The harness's wait_for (on a thread) over an async check run on this loop, each check bounded."""
    loop = asyncio.get_running_loop()
    return await asyncio.to_thread(
        wait_for, lambda: asyncio.run_coroutine_threadsafe(asyncio.wait_for(check(), 30), loop).result(),
        what=what, retry_on=(RPCError, client.ApiException, TimeoutError))


async def run_in_phase(handle: Any, phase: Phase, *, not_run: str = "") -> str:
    """The ID of the workflow's running run once it is in ``phase`` (search attribute; no query, so nothing waits
    on a workflow task), other than ``not_run``."""
    async def check() -> str | None:
        desc = await handle.describe(rpc_timeout=timedelta(seconds=10))
        ok = (desc.status == WorkflowExecutionStatus.RUNNING and desc.run_id != not_run
              and desc.typed_search_attributes.get(sa.PHASE) == phase.value)
        return str(desc.run_id) if ok else None

    return await eventually(check, what=f"a run of {handle.id} in {phase.value}")


async def runs_of(temporal: Client, wf_id: str) -> list[str]:
    return [wf.run_id async for wf in temporal.list_workflows(f"WorkflowId = '{wf_id}'")]


async def test_groups_start_concurrently_and_a_failed_start_is_retried(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    stack.create_policy(policy, mode="Recommend", locations=["sim/open"])
    names = [f"group-{i:02d}" for i in range(12)]
    for name in names:
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(name, gpu_product=product))
    # All pods wait before the watcher starts: its first list hands them over in one batch.
    await all_unschedulable(stack.cluster.admin.core, namespace, len(names))

    watcher = watcher_for(runtime, temporal, FlakyWatcher, fail_owner=names[3])
    handles = {n: temporal.get_workflow_handle(burst_workflow_id(runtime.settings.cluster, policy,
                                                                 f"{namespace}/Deployment/{n}")) for n in names}
    async with running(watcher):
        outcomes = await asyncio.gather(*(result(h) for h in handles.values()))
        assert [o.phase for o in outcomes] == [Phase.PROPOSED] * len(names)
        # The groups were started side by side, not one after another.
        assert watcher.peak_in_flight > 1
        # The failed group was tried again (no pod event: the resync), the others started once.
        assert watcher.attempts[names[3]] == 2
        assert all(watcher.attempts[n] == 1 for n in names if n != names[3])

        # A proposed operation keeps its back-off: the resync does not start it again.
        await resyncs(watcher, 3)
        for h in handles.values():
            assert len(await runs_of(temporal, h.id)) == 1
    for name in names:
        stack.cluster.admin.apps.delete_namespaced_deployment(name, namespace)
    await asyncio.to_thread(pods_gone, stack, namespace)


@contextlib.asynccontextmanager
async def one_deployment(stack: BurstStack, namespace: str, product: str) -> AsyncIterator[str]:
    deploy = unique("stranded")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product=product))
    try:
        yield deploy
    finally:
        with contextlib.suppress(client.ApiException):
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        await asyncio.to_thread(pods_gone, stack, namespace)


def pods_gone(stack: BurstStack, namespace: str) -> None:
    """Pending pods left behind would tolerate the next test's policy too (same taint): wait until they are gone."""
    wait_for(lambda: not stack.cluster.admin.core.list_namespaced_pod(namespace).items,
             what=f"pods of {namespace} deleted")


async def test_pod_whose_operation_failed_gets_a_new_one_on_resync(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/full"])
    async with one_deployment(stack, namespace, product) as deploy, \
            running(watcher_for(runtime, temporal)) as watcher:
        handle = temporal.get_workflow_handle(burst_workflow_id(runtime.settings.cluster, policy,
                                                                f"{namespace}/Deployment/{deploy}"))
        failed = await result(handle)
        assert failed.phase == Phase.FAILED, failed.message
        assert "no capacity in any eligible location" in failed.message
        [pod] = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        assert unschedulable_since(pod) is not None  # the operation ended; the pod still waits

        # Room appears (the policy now allows a location with capacity). No pod changes, so no pod event: the
        # resync finds the pod's operation ended without a node and starts it again.
        stack.cluster.admin.custom.patch_cluster_custom_object(
            "gpu.kubeon.io", "v1", "gpupolicies", policy, {"spec": {"locations": ["sim/open"]}})
        view = await wait_phase(handle, Phase.SERVING)
        assert view.location == "sim/open"
        assert len(await runs_of(temporal, handle.id)) >= 2
        [pod] = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        assert pod.spec.node_name == view.node_name
        await asyncio.to_thread(wait_for, lambda: str(pod.metadata.uid) not in watcher.pending,
                                what="the bound pod gone from the watcher's cache")
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        assert (await result(handle)).phase == Phase.COMPLETED


async def test_pod_whose_operation_was_terminated_gets_a_new_one_on_resync(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    temporal, runtime = worker
    stack.create_policy(policy, mode="Approve", locations=["sim/open"])
    async with one_deployment(stack, namespace, product) as deploy, \
            running(watcher_for(runtime, temporal)) as watcher:
        handle = temporal.get_workflow_handle(burst_workflow_id(runtime.settings.cluster, policy,
                                                                f"{namespace}/Deployment/{deploy}"))
        first = await run_in_phase(handle, Phase.AWAITING_APPROVAL)
        await handle.terminate("the operator ended it by hand", rpc_timeout=timedelta(seconds=10))
        # A new run for the pod that still waits, without any pod event.
        await run_in_phase(handle, Phase.AWAITING_APPROVAL, not_run=first)

        [pod] = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        await asyncio.to_thread(wait_for, lambda: str(pod.metadata.uid) not in watcher.pending,
                                what="the deleted pod gone from the watcher's cache")
        await handle.terminate("test over", rpc_timeout=timedelta(seconds=10))


async def test_pods_still_waiting_while_their_operation_serves_get_one_more_node(
        stack: BurstStack, worker: tuple[Client, Runtime], namespace: str, policy: str, product: str) -> None:
    """A group larger than one node (or whose node went to other tolerating pods): the operation serves, its
    other pods wait; the resync starts one more node for them, under an ID derived from the serving operation."""
    temporal, runtime = worker
    stack.create_policy(policy, mode="Automatic", locations=["sim/open"], max_nodes=4)
    name = unique("pair")
    core = stack.cluster.admin.core
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(name, replicas=2,
                                                                                   gpu_product=product))
    await all_unschedulable(core, namespace, 2)
    async with running(watcher_for(runtime, temporal)) as watcher:
        first = temporal.get_workflow_handle(burst_workflow_id(runtime.settings.cluster, policy,
                                                               f"{namespace}/Deployment/{name}"))
        await run_in_phase(first, Phase.SERVING)
        serving = (await first.describe()).typed_search_attributes.get(sa.OPERATION)
        further = temporal.get_workflow_handle(burst_workflow_id(
            runtime.settings.cluster, policy, f"{namespace}/Deployment/{name}+{serving}"))
        await run_in_phase(further, Phase.SERVING)

        def placed() -> set[str] | None:
            nodes = {str(p.spec.node_name) for p in core.list_namespaced_pod(namespace).items if p.spec.node_name}
            return nodes if len(nodes) == 2 else None

        nodes = await asyncio.to_thread(wait_for, placed, what="both pods on burst nodes of their own")
        second = (await further.describe()).typed_search_attributes.get(sa.OPERATION)
        assert nodes == {f"burst-{serving}", f"burst-{second}"}
        assert watcher.resyncs >= 1
        stack.cluster.admin.apps.delete_namespaced_deployment(name, namespace)
        for handle in (first, further):
            assert (await result(handle)).phase == Phase.COMPLETED
