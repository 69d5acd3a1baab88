"""Packing rounds in tests: a worker serving PackWorkflow over any capacity provider with the optimizer's own
credentials, a round started in Approve mode up to its proposal, and a Karpenter pool fragmented in waves (six
1-GPU pods over three 4-GPU nodes, a PDB over them)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client
from temporalio import activity
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.worker import Worker

from activities.capacity import CapacityProvider
from activities.clients.audit_log import AuditLog
from activities.clients.kube import KubeOps
from activities.packing import PackActivities
from models.audit import AuditRecord
from models.packing import PackInput
from models.packing import PackSettings
from models.packing import PackView
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from worker.main import workflow_runner
from workflows.gpu_products import GpuProductsWorkflow
from workflows.pack import PackWorkflow

# A round's waits shortened for tests: PDB retries each second, replacements and removals bounded.
FAST = PackSettings(pdb_retry_seconds=1, poll_seconds=0.5, replacement_timeout_seconds=30,
                    removal_timeout_seconds=60)
# The user's own budgets on the fragmented pool: a round leaves them exactly so.
USER_BUDGETS: list[dict[str, Any]] = [{"nodes": "1"}, {"nodes": "0", "reasons": ["Drifted"]}]


async def until_async(check: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 30) -> None:
    """Await ``check`` until it is true (a workflow query, say); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def pack_worker(temporal: Client, queue: str, optimizer: client.ApiClient,
                      capacity: CapacityProvider, audit_log: AuditLog | None = None) -> AsyncIterator[None]:
    """PackWorkflow, GpuProductsWorkflow and their activities on ``queue``, with the optimizer's credentials and
    ``capacity``; their audit records go to ``audit_log`` (the real log; a temporary one when not given), as the
    worker's record_audit writes them."""
    acts = PackActivities(KubeOps(optimizer), capacity)
    with contextlib.ExitStack() as stack:
        if audit_log is None:
            audit_log = AuditLog(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "audit.jsonl")
        log = audit_log

        @activity.defn(name="record_audit")
        async def record_audit(record: AuditRecord) -> bool:
            return (await asyncio.to_thread(log.write, record))[1]

        executor = stack.enter_context(ThreadPoolExecutor(8))
        async with Worker(temporal, task_queue=queue, workflows=[PackWorkflow, GpuProductsWorkflow],
                          activities=[*acts.all(), record_audit],
                          activity_executor=executor, workflow_runner=workflow_runner()):
            yield


async def proposed_round(temporal: Client, queue: str, groups: list[str], max_nodes: int = 2,
                         settings: PackSettings = FAST) -> tuple[WorkflowHandle[PackWorkflow, PackView], PackView]:
    """A round over ``groups`` in Approve mode, once it awaits approval: its handle and its proposal."""
    handle = await temporal.start_workflow(
        PackWorkflow.run, PackInput(cluster="t", policy="pack", groups=groups, mode="Approve", max_nodes=max_nodes,
                                    settings=settings),
        id=f"pack-{uuid.uuid4().hex[:6]}", task_queue=queue)

    async def proposed() -> bool:
        return (await handle.query(PackWorkflow.state)).phase == "AwaitingApproval"

    await until_async(proposed, what="the round's proposal")
    return handle, await handle.query(PackWorkflow.state)


def wait_running(cluster: Cluster, namespace: str, app: str, count: int, timeout: float = 90) -> list[client.V1Pod]:
    """The ``count`` pods of ``app`` once they are all Running (none terminating)."""
    def running() -> list[client.V1Pod]:
        pods = [p for p in cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
                if p.metadata.deletion_timestamp is None]
        return pods if len(pods) == count and all(p.status.phase == "Running" for p in pods) else []

    return list(wait_for(running, timeout=timeout, what=f"{count} {app} pods running"))


@contextlib.contextmanager
def fragmented_pool(cluster: Cluster, karpenter: Karpenter, namespace: str) -> Iterator[tuple[str, dict[str, int]]]:
    """A pool of three 4-GPU nodes (limit 12 GPUs: Karpenter can add none) with six 1-GPU pods of Deployment
    ``serve`` spread over them by the default scheduler, a PDB ``serve`` (maxUnavailable 1) over them, the user's
    budgets ``USER_BUDGETS``: (the pool, node -> its serve pods). Pool and pods are deleted afterwards."""
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=12, gpu_counts=(4,), budgets=USER_BUDGETS))
    apps, core = cluster.admin.apps, cluster.admin.core
    try:
        apps.create_namespaced_deployment(namespace, gpu_workload("wave", taint=taint, replicas=3, gpus=4))
        wait_running(cluster, namespace, "wave", 3)
        apps.delete_namespaced_deployment("wave", namespace)
        wait_for(lambda: not core.list_namespaced_pod(namespace, label_selector="app=wave").items, timeout=90,
                 what="wave 1 gone")
        # The default scheduler scores CPU and memory only and breaks ties at random: now and then it puts the six
        # pods on two nodes (4 + 2). Such a spread is dealt again, a bounded number of times.
        for _ in range(4):
            apps.create_namespaced_deployment(namespace, gpu_workload("serve", taint=taint, replicas=6))
            pods = wait_running(cluster, namespace, "serve", 6)
            spread = Counter(str(p.spec.node_name) for p in pods)
            if len(spread) == 3:
                break
            apps.delete_namespaced_deployment("serve", namespace)
            wait_for(lambda: not core.list_namespaced_pod(namespace, label_selector="app=serve").items, timeout=90,
                     what="the unspread serve pods gone")
        assert len(spread) == 3, spread
        cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"),
            spec=client.V1PodDisruptionBudgetSpec(max_unavailable=1,
                                                  selector=client.V1LabelSelector(match_labels={"app": "serve"}))))
        yield pool, dict(spread)
    finally:
        with contextlib.suppress(client.ApiException):
            apps.delete_namespaced_deployment("serve", namespace)
        karpenter.delete_nodepool(pool)
