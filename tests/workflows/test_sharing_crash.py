"""Issue 22's acceptance: "a crash (SIGKILL of the worker) at each step resumes to the same end". Each sharing
operation runs on a real `kubeon-gpu worker` process against the module's bed (``test_sharing.bed``: the control
plane, the chart's identities, the GPU Operator stand-in); at one step the worker is SIGKILLed, what held the
step is let go while no worker runs, and a new worker finishes the operation. Each step is found from real state
(the node's labels, ``spec.unschedulable``, a pod's deletion, the MIG manager's state label) and the workflow's
``state`` query, never by sleeping: the stand-in holds the node at the step (``hold_config``, ``hold_mig``,
``hold_mig_resources``), a PDB holds the eviction, a finalizer holds an evicted pod. ``None`` runs the same
operation without a kill: every case asserts the same end (allocatable, labels, the node uncordoned, the
ConfigMap's keys, one audit record per step, the operation's final phase and message)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.sharing import SharingOps
from models.hub import REPORT_ACTIONS
from models.sharing import CONFIG_LABEL
from models.sharing import KEY_PREFIX
from models.sharing import MIG_CONFIG_LABEL
from models.sharing import MIG_STATE_LABEL
from models.sharing import CleanupRequest
from models.sharing import MigInput
from models.sharing import SharingOutcome
from models.sharing import SharingPhase
from models.sharing import SharingView
from models.sharing import TimeSlicingInput
from models.sharing import WriteKeyRequest
from models.sharing import sharing_workflow_id
from tests.harness.burst import WorkerProcesses
from tests.harness.gpu_operator import GpuOperator
from tests.harness.kube import until
from tests.workflows import test_sharing
from tests.workflows.test_sharing import PRODUCT
from tests.workflows.test_sharing import SharingBed
from tests.workflows.test_sharing import allocatable
from tests.workflows.test_sharing import settings
from tests.workflows.test_sharing import wait_phase
from worker.config import Settings
from worker.main import worker_services

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
bed = test_sharing.bed  # the same module-scoped fixture: this module's own bed, set up once for its tests
HOLD = "gpu.kubeon.io/test-hold"  # a finalizer: an evicted pod stays Terminating until the test removes it


class CrashingWorker(WorkerProcesses):
    """:meth:`crash` SIGKILLs the running worker, runs ``meanwhile`` (what held the step is let go while no worker
    runs) and starts the next."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runs: list[WorkflowHandle[Any, Any]] = []

    def owns(self, handle: WorkflowHandle[Any, Any]) -> WorkflowHandle[Any, Any]:
        """``handle``'s run ends with the test (:func:`crashing_worker` terminates it), also when an assertion
        fails first: it would wait for an undo forever."""
        self.runs.append(handle)
        return handle

    def crash(self, meanwhile: Callable[[], None] = lambda: None) -> None:
        self.kill()
        meanwhile()
        self.start()

    def audit(self, operation: str) -> list[str]:
        """The operation's audit records, as the last part of their keys (``proposed``, ``shared``...)."""
        path = self.settings.state_dir / "audit.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        mine = [r for r in records if r["operation"] == operation]
        assert {r["action"] for r in mine} <= REPORT_ACTIONS, "every action is one the hub takes"
        return sorted(r["key"].rsplit("/", 1)[1] for r in mine)


@contextlib.asynccontextmanager
async def crashing_worker(bed: SharingBed, env: WorkflowEnvironment, log: Path,
                          **overrides: Any) -> AsyncIterator[CrashingWorker]:
    worker = CrashingWorker(settings(bed, env).model_copy(update=overrides), log, bed.burst)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop_all()
        for handle in worker.runs:
            await terminate(handle)


async def when(check: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 60) -> None:
    """Poll ``check`` (the workflow's query and the cluster's state) until it holds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def view_in(handle: WorkflowHandle[Any, Any], *phases: SharingPhase) -> SharingView | None:
    with contextlib.suppress(Exception):  # not started yet
        view = await handle.query("state", result_type=SharingView)
        return view if view.phase in phases else None
    return None


async def phase_is(handle: WorkflowHandle[Any, Any], *phases: SharingPhase) -> bool:
    return await view_in(handle, *phases) is not None


async def on_its_timer(handle: WorkflowHandle[Any, Any]) -> bool:
    """No activity under way (the eviction loop between rounds): a kill inside a short activity, which does not
    heartbeat, would cost its 60 s start-to-close timeout before the retry."""
    return not (await handle.describe()).raw_description.pending_activities


def labels_of(bed: SharingBed, node: str) -> dict[str, str]:
    return dict(bed.cluster.admin.core.read_node(node).metadata.labels or {})


def new_node(bed: SharingBed, gpus: int = 2) -> str:
    node = f"a100-{uuid.uuid4().hex[:6]}"
    bed.cluster.create_kwok_node(node, labels=GpuOperator.gfd_labels(PRODUCT, gpus), gpus=gpus)
    return node


async def seen_by_stand_in(bed: SharingBed, node: str) -> None:
    await until(lambda: bed.gpu_operator.nodes.get(node), what="the stand-in sees the node", timeout=10)


@contextlib.asynccontextmanager
async def stand_in_node(bed: SharingBed) -> AsyncIterator[str]:
    """A new node the stand-in operator sees; at the end, whatever the test held on it let go and the node deleted."""
    node = new_node(bed)
    await seen_by_stand_in(bed, node)
    try:
        yield node
    finally:
        bed.gpu_operator.release(node)
        bed.cluster.admin.core.delete_node(node)


async def terminate(handle: WorkflowHandle[Any, Any]) -> None:
    with contextlib.suppress(Exception):  # ended already
        await handle.terminate("test over")


async def end(handle: WorkflowHandle[Any, Any], timeout: float = 90) -> SharingOutcome:
    return SharingOutcome.model_validate(await asyncio.wait_for(handle.result(), timeout))


# -- time-slicing: apply and undo ---------------------------------------------------------------------------------
TS_STEPS = [None, "propagating", "verifying", "undo-verifying"]


@pytest.mark.parametrize("step", TS_STEPS, ids=[s or "no-kill" for s in TS_STEPS])
async def test_time_slicing_killed_at_a_step_resumes_to_the_same_end(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment, tmp_path: Path, step: str | None) -> None:
    """propagating: the key written, the durable timer running (the node's label not set yet); verifying: the
    node labelled, the config-manager not yet acting on it; undo-verifying: the label removed by the undo, the
    node still shared. Either way: the node shared once (one label change applied), 4 time-sliced GPUs, the key
    beside the admin's; undone once, back to 2, the key removed; one record per step."""
    cluster, operator = bed.cluster, bed.gpu_operator
    temporal = temporal_dev_server.client
    async with (stand_in_node(bed) as node,
                crashing_worker(bed, temporal_dev_server, tmp_path / "worker.log",
                                sharing_propagation_seconds=3) as worker):
        s = worker.settings
        if step == "verifying":
            operator.hold_config(node)
        handle = worker.owns(await temporal.start_workflow(
            "TimeSlicing", TimeSlicingInput(cluster=s.cluster, policy="p", node=node, gpus=2, replicas=2,
                                            mode="Automatic", namespace=bed.operator_ns,
                                            settings=s.sharing_settings()),
            id=sharing_workflow_id(s.cluster, node), task_queue=s.task_queue))
        if step == "propagating":
            await when(lambda: phase_is(handle, SharingPhase.PROPAGATING), what="the key propagating")
            worker.crash()
            assert CONFIG_LABEL not in labels_of(bed, node), "killed before the label"
        elif step == "verifying":
            async def labelled() -> bool:
                return CONFIG_LABEL in labels_of(bed, node) and (
                    await phase_is(handle, SharingPhase.VERIFYING))
            await when(labelled, what="the node labelled, its config not applied yet")
            assert allocatable(cluster, node) == "2"
            worker.crash(lambda: operator.release(node))

        view = await wait_phase(temporal, handle.id, SharingPhase.SHARED, SharingPhase.FAILED, timeout=90)
        assert view.phase == SharingPhase.SHARED, view.history
        assert view.message == f"{node}: 4 time-sliced GPUs (2 x 2)"
        assert allocatable(cluster, node) == "4"
        labels = labels_of(bed, node)
        assert view.key.startswith(KEY_PREFIX + "r2-") and labels[CONFIG_LABEL] == view.key
        assert (labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.product"],
                labels["nvidia.com/gpu.sharing-strategy"]) == ("2", f"{PRODUCT}-SHARED", "time-slicing")
        assert operator.events_for(node).count(f"{node}: config {view.key} applied: replicas 2") == 1
        assert not [e for e in operator.events_for(node) if "does not exist" in e], "never a missing key"
        cm = cluster.admin.core.read_namespaced_config_map("time-slicing-config", bed.operator_ns)
        assert view.key in cm.data and "any" in cm.data

        if step == "undo-verifying":
            operator.hold_config(node)
        await handle.signal("undo")
        if step == "undo-verifying":
            async def unlabelled() -> bool:
                return CONFIG_LABEL not in labels_of(bed, node) and (
                    await phase_is(handle, SharingPhase.RESTORING))
            await when(unlabelled, what="the label removed, the node still shared")
            assert allocatable(cluster, node) == "4"
            worker.crash(lambda: operator.release(node))

        outcome = await end(handle)
        assert (outcome.phase, outcome.message) == (SharingPhase.UNDONE, f"{node} back to 2 GPU(s)")
        assert allocatable(cluster, node) == "2"
        labels = labels_of(bed, node)
        assert CONFIG_LABEL not in labels
        assert (labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.product"]) == ("1", PRODUCT)
        events = operator.events_for(node)  # the first: the stand-in's first look at the node
        after = events[events.index(f"{node}: config {view.key} applied: replicas 2") + 1:]
        assert after == [f"{node}: config (none) applied: replicas 1"], events
        cm = cluster.admin.core.read_namespaced_config_map("time-slicing-config", bed.operator_ns)
        assert view.key not in cm.data and "any" in cm.data, "the key no node names removed"
        assert worker.audit(view.operation) == ["proposed", "shared", "undone"]
        assert len(worker.procs) == (1 if step is None else 2)


async def test_a_key_written_a_moment_before_is_waited_for_from_its_write(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment) -> None:
    """The key is in the ConfigMap already, written a moment ago: by another node's operation, or by this
    operation's own attempt that a worker's death cut off after its write and before it reported (its retry then
    finds the key there). The propagation wait counts from that write: the node is not labelled with a key the
    device plugin's mounted copy lacks (the config-manager would refuse it and exit)."""
    node = new_node(bed)
    await seen_by_stand_in(bed, node)
    operator = bed.gpu_operator
    delay = operator.propagation_delay
    operator.propagation_delay = 2.0
    s = settings(bed, temporal_dev_server).model_copy(update={"sharing_propagation_seconds": 3})
    try:
        async with worker_services(s, bed.burst.runtime(s)) as (temporal, _runtime, _watcher):
            earlier = SharingOps(bed.cluster.admin.api, None).write_key(WriteKeyRequest(
                namespace=bed.operator_ns, config_map="time-slicing-config", replicas=3,
                fail_requests_greater_than_one=True, node="another-node"))
            assert earlier.written and earlier.written_at is not None
            handle = await temporal.start_workflow(
                "TimeSlicing", TimeSlicingInput(cluster=s.cluster, policy="p", node=node, gpus=2, replicas=3,
                                                mode="Automatic", namespace=bed.operator_ns,
                                                settings=s.sharing_settings()),
                id=sharing_workflow_id(s.cluster, node), task_queue=s.task_queue)
            view = await wait_phase(temporal, handle.id, SharingPhase.SHARED, SharingPhase.FAILED, timeout=60)
            assert view.phase == SharingPhase.SHARED, view.history
            assert view.key == earlier.key
            assert any(f"key {earlier.key} written; waiting" in h for h in view.history), view.history
            assert not [e for e in operator.events_for(node) if "does not exist" in e], operator.events_for(node)
            assert allocatable(bed.cluster, node) == "6"
            await handle.signal("undo")
            assert (await end(handle)).phase == SharingPhase.UNDONE
    finally:
        operator.propagation_delay = delay
        SharingOps(bed.cluster.admin.api, None).cleanup(CleanupRequest(
            namespace=bed.operator_ns, config_map="time-slicing-config", release="another-node"))
        bed.cluster.admin.core.delete_node(node)


# -- MIG: apply, and its failure path ------------------------------------------------------------------------------
MIG_STEPS = [None, "cordoned", "evicting", "pending", "verifying"]
GEOMETRY, SLICES, RESOURCE = "all-3g.40gb", {"3g.40gb": 2}, "nvidia.com/mig-3g.40gb"


def hold_pod(bed: SharingBed, namespace: str, node: str, *, finalizer: bool) -> str:
    """A 1-GPU pod bound to ``node`` (a bare pod; ``finalizer``: it stays Terminating once evicted)."""
    bed.cluster.admin.core.create_namespaced_pod(namespace, client.V1Pod(
        metadata=client.V1ObjectMeta(name="infer", labels={"app": "infer"}, finalizers=[HOLD] if finalizer else None),
        spec=client.V1PodSpec(node_name=node, containers=[client.V1Container(
            name="main", image="busybox", resources=client.V1ResourceRequirements(
                limits={"nvidia.com/gpu": "1"}, requests={"nvidia.com/gpu": "1"}))])))
    return f"{namespace}/infer"


def unhold(bed: SharingBed, namespace: str) -> None:
    with contextlib.suppress(client.ApiException):
        bed.cluster.admin.core.patch_namespaced_pod("infer", namespace, {"metadata": {"finalizers": None}})


def pod_state(bed: SharingBed, namespace: str) -> str:
    """``running``, ``terminating`` or ``gone``."""
    try:
        pod: Any = bed.cluster.admin.core.read_namespaced_pod("infer", namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return "gone"
        raise
    return "terminating" if pod.metadata.deletion_timestamp else str(pod.status.phase).lower()


def cordoned(bed: SharingBed, node: str) -> bool:
    return bool(bed.cluster.admin.core.read_node(node).spec.unschedulable)


async def start_mig(temporal: Client, s: Settings, node: str, geometry: str,
                    slices: dict[str, int]) -> WorkflowHandle[Any, Any]:
    return await temporal.start_workflow(
        "Mig", MigInput(cluster=s.cluster, policy="p", node=node, gpus=2, geometry=geometry, slices=slices,
                        mode="Automatic"), id=sharing_workflow_id(s.cluster, node), task_queue=s.task_queue)


@pytest.mark.parametrize("step", MIG_STEPS, ids=[s or "no-kill" for s in MIG_STEPS])
async def test_mig_killed_at_a_step_resumes_to_the_same_end(
        bed: SharingBed, namespace: str, temporal_dev_server: WorkflowEnvironment, tmp_path: Path,
        step: str | None) -> None:
    """cordoned: the node cordoned and its GPU pod evicted, still terminating; evicting: the eviction refused by
    the pod's PDB, waited for; pending: nvidia.com/mig.config set, the MIG manager pending; verifying: the MIG
    manager's success, the node not yet advertising the slices (the device plugin restarts after it), still
    cordoned. Either way: the pod evicted once, the geometry applied once, its slices advertised, uncordoned."""
    cluster, operator = bed.cluster, bed.gpu_operator
    temporal = temporal_dev_server.client
    async with stand_in_node(bed) as node:
        hold_pod(bed, namespace, node, finalizer=step == "cordoned")
        try:
            await until(lambda: pod_state(bed, namespace) == "running", what="the GPU pod running", timeout=30)
            if step == "evicting":
                cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
                    metadata=client.V1ObjectMeta(name="infer"), spec=client.V1PodDisruptionBudgetSpec(
                        min_available=1, selector=client.V1LabelSelector(match_labels={"app": "infer"}))))
            if step == "pending":
                operator.hold_mig(node, GEOMETRY)
            if step == "verifying":
                operator.hold_mig_resources(node, GEOMETRY)
            async with crashing_worker(bed, temporal_dev_server, tmp_path / "worker.log") as worker:
                handle = worker.owns(await start_mig(temporal, worker.settings, node, GEOMETRY, SLICES))
                if step == "cordoned":
                    async def evicted() -> bool:
                        return cordoned(bed, node) and pod_state(bed, namespace) == "terminating" and (
                            await phase_is(handle, SharingPhase.EVICTING)) and await on_its_timer(handle)
                    await when(evicted, what="cordoned, the pod evicted and terminating")
                    worker.crash(lambda: unhold(bed, namespace))
                elif step == "evicting":
                    async def blocked() -> bool:
                        view = await view_in(handle, SharingPhase.EVICTING)
                        return (view is not None and "blocked by PDB infer" in view.message
                                and await on_its_timer(handle))
                    await when(blocked, what="the eviction waiting on the PDB")
                    assert cordoned(bed, node) and pod_state(bed, namespace) == "running"
                    def allow() -> None:
                        cluster.admin.policy.patch_namespaced_pod_disruption_budget(
                            "infer", namespace, {"spec": {"minAvailable": 0}})
                    worker.crash(allow)
                elif step == "pending":
                    async def pending() -> bool:
                        return labels_of(bed, node).get(MIG_STATE_LABEL) == "pending" and (
                            await phase_is(handle, SharingPhase.RECONFIGURING))
                    await when(pending, what="the MIG manager pending")
                    worker.crash(lambda: operator.release(node))
                elif step == "verifying":
                    async def unadvertised() -> bool:
                        return labels_of(bed, node).get(MIG_STATE_LABEL) == "success" and (
                            await phase_is(handle, SharingPhase.VERIFYING))
                    await when(unadvertised, what="success, the slices not advertised yet")
                    assert cordoned(bed, node) and allocatable(cluster, node) == "2"
                    worker.crash(lambda: operator.release(node))

                view = await wait_phase(temporal, handle.id, SharingPhase.SHARED, SharingPhase.FAILED, timeout=90)
                assert view.phase == SharingPhase.SHARED, view.history
                assert view.message == f"{node}: 4 {RESOURCE}; evicted 1 GPU pod(s)"
                n: Any = cluster.admin.core.read_node(node)
                assert (n.status.allocatable[RESOURCE], n.status.allocatable["nvidia.com/gpu"]) == ("4", "0")
                assert not n.spec.unschedulable, "uncordoned"
                labels = n.metadata.labels
                assert (labels[MIG_CONFIG_LABEL], labels[MIG_STATE_LABEL], labels[f"{RESOURCE}.count"]) == (
                    GEOMETRY, "success", "4")
                assert operator.events_for(node).count(f"{node}: mig config {GEOMETRY}: success") == 1
                assert pod_state(bed, namespace) == "gone"
                assert worker.audit(view.operation) == ["proposed", "shared"]
                assert len(worker.procs) == (1 if step is None else 2)
        finally:
            unhold(bed, namespace)


MIG_FAILURE_STEPS = [None, "restoring"]


@pytest.mark.parametrize("step", MIG_FAILURE_STEPS, ids=[s or "no-kill" for s in MIG_FAILURE_STEPS])
async def test_mig_failure_killed_while_restoring_resumes_to_the_same_end(
        bed: SharingBed, temporal_dev_server: WorkflowEnvironment, tmp_path: Path, step: str | None) -> None:
    """The node runs all-3g.40gb; all-1g.10gb is asked for and the MIG manager reports failed; the worker is
    killed while the previous geometry is being restored (the MIG manager pending on it). Either way: all-3g.40gb
    back (once), its slices advertised, the node uncordoned, the operation Failed with the reason, one record."""
    cluster, operator = bed.cluster, bed.gpu_operator
    temporal = temporal_dev_server.client
    async with stand_in_node(bed) as node:
        cluster.admin.core.patch_node(node, {"metadata": {"labels": {MIG_CONFIG_LABEL: GEOMETRY}}})
        await until(lambda: labels_of(bed, node).get(MIG_STATE_LABEL) == "success"
                    and cluster.admin.core.read_node(node).status.allocatable.get(RESOURCE) == "4",
                    what=f"the node on {GEOMETRY}", timeout=30)
        operator.fail_next_mig(node)
        if step == "restoring":
            operator.hold_mig(node, GEOMETRY)
        async with crashing_worker(bed, temporal_dev_server, tmp_path / "worker.log") as worker:
            handle = worker.owns(await start_mig(temporal, worker.settings, node, "all-1g.10gb", {"1g.10gb": 7}))
            if step == "restoring":
                await until(lambda: f"{node}: mig config all-1g.10gb: failed" in operator.events_for(node)
                            and labels_of(bed, node).get(MIG_CONFIG_LABEL) == GEOMETRY
                            and labels_of(bed, node).get(MIG_STATE_LABEL) == "pending",
                            what="the previous geometry being restored", timeout=60)
                assert cordoned(bed, node)
                worker.crash(lambda: operator.release(node))

            outcome = await end(handle)
            assert outcome.phase == SharingPhase.FAILED
            assert outcome.message == (f"the MIG manager reported failed for all-1g.10gb on {node}; previous MIG "
                                       f"config {GEOMETRY} restored (success); node uncordoned")
            n: Any = cluster.admin.core.read_node(node)
            assert not n.spec.unschedulable
            assert (n.status.allocatable[RESOURCE], n.status.allocatable["nvidia.com/gpu"]) == ("4", "0")
            assert (n.metadata.labels[MIG_CONFIG_LABEL], n.metadata.labels[MIG_STATE_LABEL]) == (GEOMETRY, "success")
            assert operator.events_for(node).count(f"{node}: mig config {GEOMETRY}: success") == 2, \
                "set up once, restored once"
            assert worker.audit(outcome.operation) == ["failed", "proposed"]
            assert len(worker.procs) == (1 if step is None else 2)
