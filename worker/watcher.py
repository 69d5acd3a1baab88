"""The pending-pod watcher: a watch (not a poll) on Pending pods that hands them to their policy's provisioning.

A pod is a candidate when the scheduler has marked it Unschedulable (it fits no node), it requests GPUs, and it
tolerates the taint a Burst policy names in ``workloads.tolerate`` (the first such policy by name). Candidates
are sent, with the facts planning needs (GPUs, nodeSelector, required node affinity, tolerations), to the
policy's one ProvisionWorkflow by signal-with-start (``pods_waiting``): every replica's watcher names the same
workflow ID, so each pod is planned once. Pods that stop waiting (bound, deleted) are signalled as gone.

The watcher keeps an informer-like cache of the Pending GPU pods it has seen (from the list and the watch) and
every ``resync_seconds`` sends the policy's still Unschedulable pods again: the provisioning plans again those
whose node failed or that no plan could serve yet; pods it already knows cost nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from typing import Any
from typing import TypeVar

from kubernetes import client
from kubernetes import watch
from temporalio.client import Client
from temporalio.common import SearchAttributePair
from temporalio.common import TypedSearchAttributes
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.service import RPCStatusCode

from activities.clients.kube import KubeOps
from activities.clients.kube import gpus_requested
from activities.clients.kube import pending_pod
from activities.clients.kube import tolerates
from models import search_attributes as sa
from models.ids import provision_workflow_id
from models.policy import GpuPolicy
from models.policy import Mode
from models.provisioning import OperationSettings
from models.provisioning import PodsGone
from models.provisioning import PodsWaiting
from models.provisioning import ProvisionInput
from workflows.provision import ProvisionWorkflow

log = logging.getLogger("kubeon.watcher")
T = TypeVar("T")


def unschedulable_since(pod: client.V1Pod) -> datetime | None:
    if pod.spec.node_name or (pod.status and pod.status.phase != "Pending"):
        return None
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return cond.last_transition_time or datetime.now(UTC)
    return None


def waits_for_node(pod: client.V1Pod) -> bool:
    """Pending, not bound to a node, and asking for GPUs: what the cache holds."""
    return (not pod.spec.node_name and (pod.status is None or pod.status.phase in (None, "Pending"))
            and pod.metadata.deletion_timestamp is None and gpus_requested(pod) > 0)


@dataclass
class PendingPodWatcher:
    kube: KubeOps
    temporal: Client
    cluster: str
    task_queue: str
    default_mode: Callable[[], Mode]
    settings: OperationSettings = field(default_factory=OperationSettings)
    # Every this long the cached pods still Unschedulable are sent again.
    resync_seconds: float = 30.0
    # A rollout's pods turn Unschedulable over a few hundred milliseconds (the ReplicaSet creates them in
    # doubling batches): events are gathered until none came for debounce_seconds, at most debounce_max_seconds,
    # so they reach the provisioning (which plans at once) as one batch. Timed here, in process: a durable timer
    # in the workflow would fire with the server's coarser timer resolution.
    debounce_seconds: float = 0.2
    debounce_max_seconds: float = 1.0
    # Signals in flight (one per policy per batch of events).
    start_concurrency: int = 32
    resyncs: int = field(default=0, init=False)
    # Informer-like cache: uid -> the latest version of every Pending GPU pod not bound to a node.
    _pending: dict[str, client.V1Pod] = field(default_factory=dict, init=False)
    # uid -> the policy whose provisioning it was sent to.
    _sent: dict[str, str] = field(default_factory=dict, init=False)
    # policy -> uids sent there that no longer wait, still to be signalled.
    _gone: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set), init=False)
    _executor: ThreadPoolExecutor | None = field(default=None, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def candidate_policies(self, pod: client.V1Pod, policies: list[GpuPolicy]) -> list[GpuPolicy]:
        return [p for p in policies if p.spec.kind == "Burst" and tolerates(pod, p.spec.workloads.tolerate)]

    # -- the loop ----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._watch_forever, args=(loop, queue), daemon=True,
                                  name="pending-pod-watch")
        thread.start()
        next_resync = loop.time() + self.resync_seconds
        try:
            # The stop flag ends the loop even if a cancellation were lost (asyncio.wait_for in 3.11 can swallow
            # one that races with the queue's result: the worker's shutdown then waited for ever).
            while not self._stop.is_set():
                first = None
                try:
                    async with asyncio.timeout(max(0.0, next_resync - loop.time())):
                        first = await queue.get()
                except TimeoutError:
                    pass
                if first is not None:
                    events = [first]
                    until = loop.time() + self.debounce_max_seconds
                    while (left := min(self.debounce_seconds, until - loop.time())) > 0:
                        try:
                            async with asyncio.timeout(left):
                                events.append(await queue.get())
                        except TimeoutError:
                            break
                        while not queue.empty():
                            events.append(queue.get_nowait())
                    await self._guarded(self.handle(self.observe(events)))
                if loop.time() >= next_resync:
                    await self._guarded(self.resync())
                    next_resync = loop.time() + self.resync_seconds
        finally:
            self.stop()

    async def _guarded(self, work: Awaitable[list[str]]) -> None:
        try:
            await work
        except Exception:
            # Pods un-marked by handle() are retried on their next event or the next resync.
            log.exception("handling pending pods failed; they are looked at again on the next resync")

    def observe(self, events: Iterable[tuple[str, Any]]) -> list[client.V1Pod]:
        """Apply watch events to the cache; returns the pods to handle (the latest version of each)."""
        changed: dict[str, client.V1Pod] = {}
        for kind, obj in events:
            if kind == "LIST":  # a (re-)list replaces the cache: pods missing from it are gone or bound
                listed = {str(p.metadata.uid): p for p in obj}
                for uid in set(self._pending) - set(listed):
                    self._forget_pod(uid)
                    changed.pop(uid, None)
                pods = list(listed.values())
            elif kind == "DELETED":
                self._forget_pod(str(obj.metadata.uid))
                changed.pop(str(obj.metadata.uid), None)
                continue
            else:
                pods = [obj]
            for pod in pods:
                uid = str(pod.metadata.uid)
                if waits_for_node(pod):
                    self._pending[uid] = changed[uid] = pod
                else:  # bound to a node, running or being deleted: nothing to burst for
                    self._forget_pod(uid)
                    changed.pop(uid, None)
        return list(changed.values())

    def _forget_pod(self, uid: str) -> None:
        self._pending.pop(uid, None)
        policy = self._sent.pop(uid, None)
        if policy is not None:
            self._gone[policy].add(uid)

    @property
    def pending(self) -> dict[str, client.V1Pod]:
        """The cache: uid -> Pending GPU pod not bound to a node."""
        return dict(self._pending)

    def _watch_forever(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        core = self.kube.core

        def put(kind: str, obj: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, obj))

        while not self._stop.is_set():
            try:
                listed = core.list_pod_for_all_namespaces(field_selector="status.phase=Pending")
                put("LIST", listed.items)
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
                        # DELETED also when a pod leaves status.phase=Pending (it started or ended).
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            put(event["type"], obj)
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

    # -- handing pods to their policy's provisioning ---------------------------------------------------------
    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Kubernetes calls on the watcher's own thread: the loop's default executor is small (cores + 4) and
        shared with the serving activities."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pending-pod-lookup")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def handle(self, pods: list[client.V1Pod], *, again: bool = False) -> list[str]:
        """Send the Unschedulable GPU pods among ``pods`` to their policies' provisioning (those not sent yet, or
        all with ``again``), and the pods that stopped waiting as gone. Returns the workflow IDs signalled. Pods
        whose signal failed are sent again on the next event or resync."""
        fresh = [p for p in pods if unschedulable_since(p) is not None and gpus_requested(p) > 0
                 and (again or str(p.metadata.uid) not in self._sent)]
        by_policy: dict[str, list[client.V1Pod]] = defaultdict(list)
        if fresh:
            policies = await self._blocking(self.kube.list_policies)
            for pod in fresh:
                matching = self.candidate_policies(pod, policies)
                if matching:  # the first matching policy by name: deterministic across replicas
                    by_policy[sorted(matching, key=lambda p: p.name)[0].name].append(pod)
        gone = {policy: sorted(uids) for policy, uids in self._gone.items() if uids}
        self._gone.clear()
        sends = asyncio.Semaphore(self.start_concurrency)

        async def send(policy: str, members: list[client.V1Pod]) -> str | None:
            try:
                async with sends:
                    wf_id = await self.send(policy, members)
            except Exception as exc:
                log.warning("handing %d pod(s) to the provisioning of policy %s failed: %s; sent again later",
                            len(members), policy, exc or type(exc).__name__)
                return None
            for p in members:
                if str(p.metadata.uid) in self._pending:  # not forgotten meanwhile (deleted, bound)
                    self._sent[str(p.metadata.uid)] = policy
            return wf_id

        async def send_gone(policy: str, uids: list[str]) -> None:
            handle = self.temporal.get_workflow_handle(provision_workflow_id(self.cluster, policy))
            try:
                async with sends:
                    await handle.signal("pods_gone", PodsGone(uids=uids))
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:  # none running: nothing waits there
                    log.warning("telling policy %s that %d pod(s) are gone failed: %s", policy, len(uids), exc)

        await asyncio.gather(*(send_gone(p, u) for p, u in gone.items()))
        sent = await asyncio.gather(*(send(p, m) for p, m in by_policy.items()))
        return [wf_id for wf_id in sent if wf_id]

    async def send(self, policy: str, pods: list[client.V1Pod]) -> str:
        """Signal-with-start the policy's provisioning with these waiting pods."""
        wf_id = provision_workflow_id(self.cluster, policy)
        facts = [pending_pod(p) for p in pods]
        handle = await self.temporal.start_workflow(
            ProvisionWorkflow.run,
            ProvisionInput(cluster=self.cluster, policy=policy, default_mode=self.default_mode(),
                           settings=self.settings),
            id=wf_id, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal="pods_waiting", start_signal_args=[PodsWaiting(pods=facts)],
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.CLUSTER, self.cluster), SearchAttributePair(sa.POLICY, policy),
                SearchAttributePair(sa.OPERATION_KIND, "Provision"),
            ]),
            static_summary=f"Provisioning for policy {policy}",
        )
        log.info("%d pod(s), %d GPU(s) waiting sent to %s", len(facts), sum(p.gpus for p in facts), handle.id)
        return handle.id

    # -- resync ------------------------------------------------------------------------------------------------
    async def resync(self) -> list[str]:
        """Send every cached pod still Unschedulable again (the provisioning keeps what it knows)."""
        self.resyncs += 1
        return await self.handle(list(self._pending.values()), again=True)

    def stop(self) -> None:
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
