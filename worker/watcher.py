"""The pending-pod watcher: a watch (not a poll) on Pending pods that starts burst operations.

A pod is a candidate when the scheduler has marked it Unschedulable (it fits no node), it requests GPUs, and it
tolerates the taint a Burst policy names in ``workloads.tolerate``. Candidates are grouped by owner and each
group starts, or joins, the one BurstWorkflow whose ID is derived from cluster, policy and group: a second
replica's watcher or a restart finds the running workflow instead of starting another (USE_EXISTING).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kubernetes import client, watch
from temporalio.client import Client
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)

from activities.kube import KubeOps, gpus_requested, pending_pod
from models.operation import BurstInput, OperationSettings, WorkloadGroup, burst_workflow_id
from models.policy import GpuPolicy, Mode
from workflows import search_attributes as sa
from workflows.burst import BurstWorkflow

log = logging.getLogger("kubeon.watcher")


def unschedulable_since(pod: client.V1Pod) -> datetime | None:
    if pod.spec.node_name or (pod.status and pod.status.phase != "Pending"):
        return None
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return cond.last_transition_time or datetime.now(UTC)
    return None


def tolerates(pod: client.V1Pod, taint_key: str) -> bool:
    for t in pod.spec.tolerations or []:
        key_ok = t.key == taint_key or (t.key in (None, "") and t.operator == "Exists")
        if key_ok and t.effect in (None, "", "NoSchedule"):
            return True
    return False


@dataclass
class PendingPodWatcher:
    kube: KubeOps
    temporal: Client
    cluster: str
    task_queue: str
    default_mode: Callable[[], Mode]
    settings: OperationSettings = field(default_factory=OperationSettings)
    # A pod handled once is looked at again only after this long (if still unschedulable): a failed or
    # merely proposed operation is not restarted on every status update.
    recheck_seconds: float = 600.0
    debounce_seconds: float = 0.2
    _handled: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def candidate_policies(self, pod: client.V1Pod, policies: list[GpuPolicy]) -> list[GpuPolicy]:
        return [p for p in policies if p.spec.kind == "Burst" and tolerates(pod, p.spec.workloads.tolerate)]

    async def run(self) -> None:
        queue: asyncio.Queue[client.V1Pod] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._watch_forever, args=(loop, queue), daemon=True,
                                  name="pending-pod-watch")
        thread.start()
        try:
            while True:
                batch = [await queue.get()]
                await asyncio.sleep(self.debounce_seconds)  # gather the rest of a rollout's pods into one batch
                while not queue.empty():
                    batch.append(queue.get_nowait())
                try:
                    await self.handle(batch)
                except Exception:
                    log.exception("handling %d pending pod(s) failed; they are retried on the next event",
                                  len(batch))
                    for pod in batch:
                        self._handled.pop(str(pod.metadata.uid), None)
        finally:
            self._stop.set()

    def _watch_forever(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[client.V1Pod]) -> None:
        core = self.kube.core
        while not self._stop.is_set():
            try:
                listed = core.list_pod_for_all_namespaces(field_selector="status.phase=Pending")
                for pod in listed.items:
                    loop.call_soon_threadsafe(queue.put_nowait, pod)
                rv = listed.metadata.resource_version
                while not self._stop.is_set():
                    w = watch.Watch()
                    expired = False
                    for event in w.stream(core.list_pod_for_all_namespaces, field_selector="status.phase=Pending",
                                          resource_version=rv, timeout_seconds=30, allow_watch_bookmarks=True):
                        obj = event["object"]
                        if event["type"] == "ERROR":  # typically 410 Gone: our resourceVersion is too old
                            expired = True
                            w.stop()
                            break
                        if event["type"] == "BOOKMARK":  # left as a dict by the client: only its resourceVersion
                            rv = event["raw_object"]["metadata"]["resourceVersion"]
                            continue
                        rv = obj.metadata.resource_version
                        if event["type"] in ("ADDED", "MODIFIED"):
                            loop.call_soon_threadsafe(queue.put_nowait, obj)
                        if self._stop.is_set():
                            w.stop()
                    if expired:
                        break  # re-list
            except client.ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch failed (%s); re-listing", exc.reason)
                    self._stop.wait(2)
            except Exception as exc:  # connection reset and the like: re-list and go on
                log.warning("pod watch interrupted (%s); re-listing", exc)
                self._stop.wait(2)

    async def handle(self, pods: list[client.V1Pod]) -> list[str]:
        """Start or join the operations for a batch of pod events. Returns the workflow IDs touched."""
        now = time.monotonic()
        fresh: dict[str, client.V1Pod] = {}
        for pod in pods:
            uid = str(pod.metadata.uid)
            if unschedulable_since(pod) is None or gpus_requested(pod) == 0:
                continue
            if uid in self._handled and now - self._handled[uid] < self.recheck_seconds:
                continue
            fresh[uid] = pod
        if not fresh:
            return []
        policies = await asyncio.to_thread(self.kube.list_policies)
        groups: dict[tuple[str, str, str, str], list[client.V1Pod]] = defaultdict(list)
        for pod in fresh.values():
            matching = self.candidate_policies(pod, policies)
            self._handled[str(pod.metadata.uid)] = now
            if not matching:
                continue
            # The first matching policy by name: deterministic across replicas.
            policy = sorted(matching, key=lambda p: p.name)[0]
            kind, name = await asyncio.to_thread(self.kube.owner_of, pod)
            groups[(policy.name, str(pod.metadata.namespace), kind, name)].append(pod)
        touched = []
        for (policy_name, namespace, kind, name), members in groups.items():
            group = WorkloadGroup(namespace=namespace, owner_kind=kind, owner_name=name,
                                  pods=[pending_pod(p) for p in members])
            touched.append(await self.start(policy_name, group, min(
                (t for t in (unschedulable_since(p) for p in members) if t), default=None)))
        return touched

    async def start(self, policy: str, group: WorkloadGroup, since: datetime | None) -> str:
        wf_id = burst_workflow_id(self.cluster, policy, group.key)
        handle = await self.temporal.start_workflow(
            BurstWorkflow.run,
            BurstInput(cluster=self.cluster, policy=policy, group=group, default_mode=self.default_mode(),
                       settings=self.settings),
            id=wf_id, task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.CLUSTER, self.cluster), SearchAttributePair(sa.POLICY, policy),
                SearchAttributePair(sa.OPERATION_KIND, "Burst"),
            ]),
            static_summary=f"Burst {group.key}: {group.gpus} GPU(s) pending (policy {policy})",
        )
        log.info("burst operation %s for %s (%d pod(s), %d GPU(s), unschedulable since %s)", handle.id, group.key,
                 len(group.pods), group.gpus, since.isoformat() if since else "?")
        return handle.id

    def stop(self) -> None:
        self._stop.set()


@contextlib.asynccontextmanager
async def running(watcher: PendingPodWatcher) -> AsyncIterator[PendingPodWatcher]:
    task = asyncio.create_task(watcher.run(), name="pending-pod-watcher")
    try:
        yield watcher
    finally:
        watcher.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
