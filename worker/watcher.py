"""The pending-pod watcher: a watch (not a poll) on Pending pods that starts burst operations.

A pod is a candidate when the scheduler has marked it Unschedulable (it fits no node), it requests GPUs, and it
tolerates the taint a Burst policy names in ``workloads.tolerate``. Candidates are grouped by owner and each
group starts, or joins, the one BurstWorkflow whose ID is derived from cluster, policy and group: a second
replica's watcher or a restart finds the running workflow instead of starting another (USE_EXISTING).

The watcher keeps an informer-like cache of the Pending GPU pods it has seen (from the list and the watch) and
every ``resync_seconds`` looks again at those still Unschedulable: a pod stays Pending without producing events,
so without the resync a pod whose operation ended without giving it a node would wait for ``recheck_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes import client, watch
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)

from activities.kube import KubeOps, gpus_requested, pending_pod, tolerates
from models import search_attributes as sa
from models.operation import (
    BurstInput,
    BurstResult,
    OperationSettings,
    Phase,
    WorkloadGroup,
    burst_workflow_id,
)
from models.policy import GpuPolicy, Mode
from workflows.burst import BurstWorkflow

log = logging.getLogger("kubeon.watcher")
T = TypeVar("T")
# policy, namespace, owner kind, owner name, and "" or the serving operation a further node is for
GroupKey = tuple[str, str, str, str, str]
# Temporal refuses a start whose summary is over `limit.userMetadataSummarySize` (400 bytes by default).
SUMMARY_MAX = 200
# A closed operation that ended this way was decided by a person (or the policy): its pods keep the
# recheck_seconds back-off. (COMPLETED and FAILED results, and failed, terminated or timed-out runs, did not give
# a still-Unschedulable pod a node: the pod gets a new operation.)
DECIDED_PHASES = frozenset({Phase.PROPOSED, Phase.REJECTED, Phase.EXPIRED, Phase.CANCELLED})
FAILED_STATUSES = frozenset({WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.TERMINATED,
                             WorkflowExecutionStatus.TIMED_OUT})


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


def _owner_ref(pod: client.V1Pod) -> tuple[str, str, str]:
    """The pod's controller reference (pods of one ReplicaSet share one owner lookup), or the pod itself."""
    refs = [r for r in pod.metadata.owner_references or [] if r.controller]
    if refs:
        return str(pod.metadata.namespace), str(refs[0].kind), str(refs[0].name)
    return str(pod.metadata.namespace), "Pod", str(pod.metadata.name)


@dataclass
class _Ended:
    """Runs of one workflow ID that ended without serving their pods, in a row: each further restart waits
    longer (a policy that can never be served is not restarted every resync)."""

    run_id: str
    count: int
    seen_at: float


@dataclass
class PendingPodWatcher:
    kube: KubeOps
    temporal: Client
    cluster: str
    task_queue: str
    default_mode: Callable[[], Mode]
    settings: OperationSettings = field(default_factory=OperationSettings)
    # A pod handled once is looked at again only after this long (if still unschedulable) while its operation
    # runs or ended proposed, rejected or expired: such an operation is not restarted on every status update.
    recheck_seconds: float = 600.0
    # Every this long the cached pods still Unschedulable are looked at again: those whose operation ended
    # without giving them a node get a new one, at once if it had served and returned home, after a back-off
    # (resync_seconds, doubling) if it failed, was terminated or withdrew.
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.2
    # Owner lookups in flight (the watcher's own threads; the Kubernetes client's pool is shared with the
    # activities) and workflow starts in flight.
    lookup_concurrency: int = 16
    start_concurrency: int = 32
    resyncs: int = field(default=0, init=False)
    # Informer-like cache: uid -> the latest version of every Pending GPU pod not bound to a node.
    _pending: dict[str, client.V1Pod] = field(default_factory=dict, init=False)
    # uid -> when it was handled (monotonic), and the workflow ID it was given (none: no policy matched).
    _handled: dict[str, float] = field(default_factory=dict, init=False)
    _workflow_of: dict[str, str] = field(default_factory=dict, init=False)
    # Workflow IDs whose latest run closed in a decided phase: not described again until restarted.
    _decided: dict[str, str] = field(default_factory=dict, init=False)
    _ended: dict[str, _Ended] = field(default_factory=dict, init=False)
    # Running workflow ID -> when it was first seen Serving while pods given to it still waited.
    _serving_since: dict[str, float] = field(default_factory=dict, init=False)
    # uid -> the serving operation a further node is started for (its node went to other pods).
    _further_for: dict[str, str] = field(default_factory=dict, init=False)
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
                    await asyncio.sleep(self.debounce_seconds)  # gather the rest of a rollout's pods into one batch
                    events = [first]
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
        self._handled.pop(uid, None)
        self._workflow_of.pop(uid, None)

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

    # -- starting operations -----------------------------------------------------------------------------------
    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Kubernetes calls on the watcher's own threads: the loop's default executor is small (cores + 4) and
        shared with the serving activities."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.lookup_concurrency,
                                                thread_name_prefix="pending-pod-lookup")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def handle(self, pods: list[client.V1Pod]) -> list[str]:
        """Start or join the operations for a batch of pods: owners are resolved and workflows started
        concurrently (bounded). Returns the workflow IDs touched. The pods of a group that could not be started
        are un-marked, so the next event or resync retries them; the other groups are not held up."""
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
        policies = await self._blocking(self.kube.list_policies)
        chosen: dict[str, GpuPolicy] = {}
        for uid, pod in fresh.items():
            self._handled[uid] = now
            self._workflow_of.pop(uid, None)
            matching = self.candidate_policies(pod, policies)
            if matching:  # the first matching policy by name: deterministic across replicas
                chosen[uid] = sorted(matching, key=lambda p: p.name)[0]

        # One owner lookup per controller (a ReplicaSet's pods share it), a bounded number at a time.
        refs: dict[tuple[str, str, str], client.V1Pod] = {}
        for uid in chosen:
            refs.setdefault(_owner_ref(fresh[uid]), fresh[uid])
        lookups = asyncio.Semaphore(self.lookup_concurrency)

        async def owner(pod: client.V1Pod) -> tuple[str, str]:
            async with lookups:
                return await self._blocking(self.kube.owner_of, pod)

        resolved = await asyncio.gather(*(owner(p) for p in refs.values()), return_exceptions=True)
        owners = dict(zip(refs, resolved, strict=True))
        groups: dict[GroupKey, list[client.V1Pod]] = defaultdict(list)
        for uid, policy in chosen.items():
            pod = fresh[uid]
            found = owners[_owner_ref(pod)]
            if isinstance(found, BaseException):
                log.warning("owner of pod %s/%s not found (%s); retried on the next resync",
                            pod.metadata.namespace, pod.metadata.name, found)
                self._handled.pop(uid, None)
                continue
            kind, name = found
            further = self._further_for.pop(uid, "")
            groups[(policy.name, str(pod.metadata.namespace), kind, name, further)].append(pod)

        starts = asyncio.Semaphore(self.start_concurrency)

        async def start_group(key: GroupKey, members: list[client.V1Pod]) -> str | None:
            policy_name, namespace, kind, name, further = key
            group = WorkloadGroup(namespace=namespace, owner_kind=kind, owner_name=name,
                                  pods=[pending_pod(p) for p in members])
            since = min((t for t in (unschedulable_since(p) for p in members) if t), default=None)
            try:
                async with starts:
                    wf_id = await self.start(policy_name, group, since, further_for=further)
            except Exception as exc:
                log.warning("starting the operation for %s (policy %s) failed: %s; its %d pod(s) are retried",
                            group.key, policy_name, exc or type(exc).__name__, len(members))
                for p in members:
                    self._handled.pop(str(p.metadata.uid), None)
                return None
            for p in members:
                if str(p.metadata.uid) in self._handled:  # not forgotten meanwhile (deleted, bound)
                    self._workflow_of[str(p.metadata.uid)] = wf_id
            self._decided.pop(wf_id, None)
            return wf_id

        started = await asyncio.gather(*(start_group(k, m) for k, m in groups.items()))
        return [wf_id for wf_id in started if wf_id]

    async def start(self, policy: str, group: WorkloadGroup, since: datetime | None, *,
                    further_for: str = "") -> str:
        """Start (or join) the group's operation. ``further_for``: the group's operation ``further_for`` serves
        but its pods still wait (their node went to other pods, or the group grew): one more node, under an ID
        derived from that operation, so every watcher names the same one."""
        wf_id = burst_workflow_id(self.cluster, policy, group.key + (f"+{further_for}" if further_for else ""))
        summary = f"Burst {group.key}: {group.gpus} GPU(s) pending (policy {policy})"
        if further_for:
            summary = f"Burst {group.key}: {group.gpus} GPU(s) still pending while {further_for} serves"
        if len(summary.encode()) > SUMMARY_MAX:
            summary = f"Burst {group.owner_kind} {group.owner_name}"[:SUMMARY_MAX - 3] + "..."
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
            static_summary=summary,
        )
        log.info("burst operation %s for %s (%d pod(s), %d GPU(s), unschedulable since %s)", handle.id, group.key,
                 len(group.pods), group.gpus, since.isoformat() if since else "?")
        return handle.id

    # -- resync ------------------------------------------------------------------------------------------------
    async def resync(self) -> list[str]:
        """Look again at the cached pods still Unschedulable. Pods whose operation ended without giving them a
        node are forgotten and get a new run (see _restart_now for when); pods without an operation (no policy
        matched, or the start failed) are looked at again. Returns the workflow IDs touched."""
        self.resyncs += 1
        now = time.monotonic()
        waiting = [p for p in self._pending.values() if unschedulable_since(p) is not None]
        by_workflow: dict[str, list[str]] = defaultdict(list)
        for pod in waiting:
            uid = str(pod.metadata.uid)
            if uid not in self._handled or now - self._handled[uid] >= self.recheck_seconds:
                continue  # handle() takes it as fresh
            wf_id = self._workflow_of.get(uid)
            if wf_id is None:
                self._handled.pop(uid, None)  # policies may have changed since
            elif wf_id not in self._decided:
                by_workflow[wf_id].append(uid)
        describes = asyncio.Semaphore(self.start_concurrency)

        async def judged(wf_id: str) -> bool | str:
            async with describes:
                try:
                    return await self._restart_now(wf_id, now)
                except Exception as exc:
                    log.warning("describing %s failed (%s); looked at again on the next resync", wf_id, exc)
                    return False

        verdicts = await asyncio.gather(*(judged(wf_id) for wf_id in by_workflow))
        for (wf_id, uids), restart in zip(by_workflow.items(), verdicts, strict=True):
            if restart is True:
                log.info("operation %s ended without a node for %d still unschedulable pod(s): starting it again",
                         wf_id, len(uids))
                for uid in uids:
                    self._handled.pop(uid, None)
            elif restart:  # the operation's ID: it serves, but these pods of its group still wait
                log.info("operation %s serves but %d pod(s) of its group still wait: starting one more node",
                         restart, len(uids))
                for uid in uids:
                    self._handled.pop(uid, None)
                    self._further_for[uid] = restart
        referenced = set(self._workflow_of.values())
        for table in (self._decided, self._ended, self._serving_since):
            for wf_id in set(table) - referenced:
                del table[wf_id]
        return await self.handle(waiting)

    async def _restart_now(self, wf_id: str, now: float) -> bool | str:
        """Whether the pods given ``wf_id`` get a new run now: its latest run closed without serving them. Or,
        while it runs, the operation ID when it has been Serving for a resync and the pods still wait: burst nodes
        take any tolerating pod, so its node may serve others (or the group grew); they get one more node."""
        desc = await self.temporal.get_workflow_handle(wf_id).describe()
        if desc.status == WorkflowExecutionStatus.RUNNING:
            attrs = desc.typed_search_attributes
            if attrs.get(sa.PHASE) != Phase.SERVING.value:
                self._serving_since.pop(wf_id, None)
                return False
            seen = self._serving_since.setdefault(wf_id, now)
            return (attrs.get(sa.OPERATION) or False) if now - seen >= self.resync_seconds else False
        if desc.status is None:
            return False
        if desc.status == WorkflowExecutionStatus.COMPLETED:
            result = await self.temporal.get_workflow_handle(wf_id, run_id=desc.run_id,
                                                             result_type=BurstResult).result()
            if result.phase in DECIDED_PHASES:
                self._decided[wf_id] = desc.run_id
                return False
            if result.phase == Phase.COMPLETED and result.instance is not None:  # served, then returned home
                self._ended.pop(wf_id, None)
                return True
        elif desc.status not in FAILED_STATUSES:  # cancelled by an operator; continued as new
            self._decided[wf_id] = desc.run_id
            return False
        # Failed, or withdrawn although the pod still waits: started again resync_seconds after it was seen
        # closed, doubling for each further run that ends this way, up to recheck_seconds (a policy that cannot be
        # served is not restarted every resync; what failed stays readable for a while).
        ended = self._ended.get(wf_id)
        if ended is None or ended.run_id != desc.run_id:
            ended = self._ended[wf_id] = _Ended(run_id=desc.run_id, count=(ended.count + 1) if ended else 1,
                                                seen_at=now)
        wait = min(self.recheck_seconds, self.resync_seconds * 2 ** (ended.count - 1))
        return now - ended.seen_at >= wait

    def stop(self) -> None:
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


@contextlib.asynccontextmanager
async def running(watcher: PendingPodWatcher) -> AsyncIterator[PendingPodWatcher]:
    task = asyncio.create_task(watcher.run(), name="pending-pod-watcher")
    try:
        yield watcher
    finally:
        watcher.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            # Bounded: the loop also ends on the stop flag, at the latest one resync period from now.
            await asyncio.wait([task], timeout=watcher.resync_seconds + 5)
