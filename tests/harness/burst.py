"""A burst stack for end-to-end tests: CRD, the optimizer's and the gateway's own ServiceAccounts, sim/aws
locations, and settings for a worker (in-process or as a `kubeon-gpu worker` subprocess), with the gateway in
the worker's process (``BurstStack.runtime``, ``worker_process(..., stack=)``: its own credentials and key, never
the optimizer's) or as its own process (``gateway_process``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import TypeVar
from typing import overload

from kubernetes import client
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.service import RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from models.ids import provision_workflow_id
from models.labels import LABEL_LOCATION
from models.node import BurstResult
from models.node import OperationView
from models.policy import API_GROUP
from models.policy import PLURAL
from models.provisioning import ProvisionView
from tests.harness.crd import install_gpupolicy_crd
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import GATEWAY_SA
from tests.harness.rbac import OPTIMIZER_SA
from tests.harness.rbac import install_chart_identities
from tests.harness.workloads import gpu_pods
from worker.config import ENV
from worker.config import Settings
from worker.main import worker_services
from worker.runtime import Runtime

if TYPE_CHECKING:
    from activities.clients.gateway import HttpGatewayClient
    from activities.providers.sim import BootHook
    from gateway.attestation import AttestationVerifier
    from gateway.service import KubeGateway
    from gateway.slots import AddressPlan
    from models.drain import DrainStatus
    from worker.runtime import Runtime

BURST_TAINT_KEY = "gpu.kubeon.io/burst"

SIM_LOCATIONS: list[dict[str, Any]] = [
    {"name": "sim/eu-west", "sim": {"bootSeconds": 0.5},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.9},
                   {"instanceType": "sim.h100.8", "gpus": 8, "gpuProduct": "NVIDIA-H100", "usdPerHour": 40.0}]},
    {"name": "sim/us-west", "sim": {"bootSeconds": 0.5},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 1.4}]},
    # Cheapest of all, but no test policy lists it: it must never be used.
    {"name": "sim/ap-cheap", "sim": {"bootSeconds": 0.5},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.1}]},
]


def sim_location(name: str, product: str, *, capacity: int | None = None, price: float = 0.9,
                 four: float | None = None, boot_seconds: float = 0.3) -> dict[str, Any]:
    """A sim location offering 1-GPU nodes of ``product`` at ``price`` $/h (and 4-GPU ones at ``four``), which
    boot in ``boot_seconds`` and hold at most ``capacity`` instances (unset: the provider's default)."""
    offerings = [{"instanceType": "sim.gpu.1", "gpus": 1, "gpuProduct": product, "usdPerHour": price}]
    if four is not None:
        offerings.append({"instanceType": "sim.gpu.4", "gpus": 4, "gpuProduct": product, "usdPerHour": four})
    sim: dict[str, Any] = {"bootSeconds": boot_seconds}
    if capacity is not None:
        sim["capacity"] = capacity
    return {"name": name, "sim": sim, "offerings": offerings}


@dataclass
class BurstStack:
    cluster: Cluster
    workdir: Path
    optimizer: Kube
    optimizer_kubeconfig: Path
    gateway_kubeconfig: Path
    ticket_key_file: Path

    def settings(self, *, temporal_address: str, task_queue: str, locations: list[dict[str, Any]],
                 cluster_name: str = "test", **overrides: Any) -> Settings:
        state = self.workdir / f"state-{task_queue}"
        state.mkdir(parents=True, exist_ok=True)
        loc_file = state / "locations.json"
        loc_file.write_text(json.dumps(locations))
        values: dict[str, Any] = {
            "cluster": cluster_name, "temporal_address": temporal_address, "task_queue": task_queue,
            "kubeconfig": self.optimizer_kubeconfig, "burst_enabled": True,
            "burst_locations_file": loc_file, "state_dir": state, "home_location": "aws/us-east-1",
            "serve_check_seconds": 1, "health_port": 0,
            # No home autoscaler unless a test asks for one (capacity_provider="karpenter"): the session's real
            # Karpenter, started by the tests that need it, is no home for the other tests' bursts.
            "capacity_provider": "none",
        }
        values.update(overrides)
        return Settings.model_validate(values)

    def gateway(self, plan: AddressPlan | None = None, attestation: AttestationVerifier | None = None
                ) -> KubeGateway:
        """The gateway in this process, with its own ServiceAccount and the ticket key (never the optimizer's), its
        reconciler running (stopped with the runtime that holds it); ``plan``: its address plan (default: the
        gateway's default); ``attestation``: the instance identities it verifies (default: none)."""
        from tests.harness.inproc_worker import inproc_gateway

        return inproc_gateway(self.gateway_kubeconfig, self.ticket_key_file, plan, attestation)

    def runtime(self, settings: Settings, plan: AddressPlan | None = None,
                attestation: AttestationVerifier | None = None) -> Runtime:
        """The worker's runtime with the gateway in this process: sim instances redeem their ticket with it."""
        from worker.runtime import build_runtime

        gateway = self.gateway(plan, attestation)
        return build_runtime(settings, gateway=gateway, redeem=gateway.join)

    def http_runtime(self, settings: Settings, gateway: HttpGatewayClient, on_boot: BootHook) -> Runtime:
        """The worker's runtime as in a cluster: the optimizer's own credentials, the gateway over HTTP(S)
        (``gateway``, closed with the runtime), sim instances booted by ``on_boot(instance, user_data,
        capacity, gpu_health)``, the audit log in the state directory."""
        from activities.clients.audit_log import AuditLog
        from activities.clients.kube import KubeOps
        from activities.providers.sim import SimProvider

        burst = settings.burst_config()
        sim = SimProvider(burst, settings.state_dir / "sim-instances.json", on_boot=on_boot)
        return Runtime(settings=settings, kube=KubeOps(self.optimizer.api), burst=burst, gateway=gateway,
                       providers={"sim": sim}, audit=AuditLog(settings.state_dir / "audit.jsonl"),
                       closers=[sim.stop, gateway.close])

    def gateway_env(self) -> dict[str, str]:
        """What ``tests.harness.inproc_worker`` builds the worker's in-process gateway from."""
        return {"KUBEON_GATEWAY_KUBECONFIG": str(self.gateway_kubeconfig),
                "KUBEON_GATEWAY_TICKET_KEY_FILE": str(self.ticket_key_file)}

    def create_policy(self, name: str, *, mode: str | None, locations: list[str], max_nodes: int = 4,
                      max_gpu_hour: float = 4.5, return_home: bool = True,
                      burn_in: dict[str, Any] | None = None) -> None:
        spec: dict[str, Any] = {
            "kind": "Burst", "workloads": {"tolerate": BURST_TAINT_KEY}, "locations": locations,
            "limits": {"maxNodes": max_nodes, "maxGpuHour": max_gpu_hour}, "returnHome": return_home,
        }
        if burn_in is not None:
            spec["burnIn"] = burn_in
        if mode:
            spec["mode"] = mode
        self.cluster.admin.custom.create_cluster_custom_object(
            API_GROUP, "v1", PLURAL,
            {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name}, "spec": spec})

    def delete_policy(self, name: str) -> None:
        try:
            self.cluster.admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def set_policy_mode(self, name: str, mode: str) -> None:
        self.cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, name,
                                                              {"spec": {"mode": mode}})


def build_stack(cluster: Cluster, workdir: Path) -> BurstStack:
    install_gpupolicy_crd(cluster)
    # GpuPolicies are cluster-scoped and the watcher gives a pod to the first matching policy by name: one left
    # by an earlier test module would take this module's pods. Each burst module starts with none.
    for leftover in cluster.admin.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL)["items"]:
        cluster.admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, leftover["metadata"]["name"])
    optimizer, _gateway = install_chart_identities(cluster)
    workdir.mkdir(parents=True, exist_ok=True)
    key = workdir / "ticket.key"
    key.write_text(secrets.token_hex(32))
    return BurstStack(
        cluster=cluster, workdir=workdir, optimizer=optimizer,
        optimizer_kubeconfig=cluster.service_account_kubeconfig("kubeon-gpu", OPTIMIZER_SA, create=False),
        gateway_kubeconfig=cluster.service_account_kubeconfig("kubeon-gpu", GATEWAY_SA, create=False),
        ticket_key_file=key,
    )


# What the ``start_worker`` fixture gives: ``start_worker(locations, **settings)`` -> ``in_process_worker(...)``.
StartWorker = Callable[..., contextlib.AbstractAsyncContextManager[tuple[Client, Settings, Runtime]]]


@contextlib.asynccontextmanager
async def in_process_worker(stack: BurstStack, temporal: WorkflowEnvironment, locations: list[dict[str, Any]], *,
                            cluster_name: str | None = None, watch: bool = True, plan: AddressPlan | None = None,
                            attestation: AttestationVerifier | None = None,
                            **overrides: Any) -> AsyncIterator[tuple[Client, Settings, Runtime]]:
    """The worker's services in this process (workflows, activities and, with ``watch``, the pending-pod watcher)
    on a task queue of their own, against ``temporal`` over ``locations``, with the gateway in this process (its
    address ``plan``, the identities it verifies: ``attestation``); the cluster is named after the queue unless
    ``cluster_name`` is given; ``overrides``: more settings."""
    queue = unique("q")
    settings = stack.settings(temporal_address=temporal.client.service_client.config.target_host,
                              task_queue=queue, locations=locations, cluster_name=cluster_name or queue, **overrides)
    runtime_ = stack.runtime(settings, plan, attestation)
    async with worker_services(settings, runtime_, watch=watch) as (client_, runtime, _watcher):
        yield client_, settings, runtime


def gpu_deployment(name: str, *, replicas: int = 1, gpus: int = 1, gpu_product: str | None = "NVIDIA-L4",
                   tolerate: bool = True) -> client.V1Deployment:
    """GPU pods for burst nodes: they tolerate the burst taint (``tolerate``) and ask for ``gpu_product``."""
    return gpu_pods(name, replicas=replicas, gpus=gpus,
                    node_selector={"nvidia.com/gpu.product": gpu_product} if gpu_product else None,
                    tolerations=[client.V1Toleration(key=BURST_TAINT_KEY, operator="Exists", effect="NoSchedule")]
                    if tolerate else None)


def assert_serves_on_burst_node(stack: BurstStack, view: OperationView, namespace: str, deploy: str,
                                location: str) -> client.V1Node:
    """An operation in Serving: its Node is in ``location`` (the label's value, ``aws.eu-central-1``), tainted for
    burst pods only, and ``deploy``'s pods run there and nowhere else. The Node, for more checks."""
    node = stack.cluster.admin.core.read_node(str(view.node_name))
    assert node.metadata.labels[LABEL_LOCATION] == location
    assert any(t.key == BURST_TAINT_KEY and t.effect == "NoSchedule" for t in node.spec.taints), node.spec.taints
    pods = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
    assert [p.spec.node_name for p in pods] == [view.node_name]
    return node


def node_gone(stack: BurstStack, name: str | None) -> bool:
    return not stack.cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items


class PhasedView(Protocol):
    phase: Any
    history: list[str]


V = TypeVar("V", bound=PhasedView)


async def drain_blocked(temporal: Client, node_workflow_id: str, operation: str, timeout: float = 60.0
                        ) -> tuple[Any, DrainStatus]:
    """A node's drain (its child workflow) once it reports an eviction blocked (by a PDB, ...): its handle and that
    status, waited for up to ``timeout``."""
    from models.drain import DrainStatus

    drain = temporal.get_workflow_handle(f"drain/{node_workflow_id}/{operation}")

    async def blocked() -> DrainStatus:
        while True:
            try:
                status = await drain.query("status", result_type=DrainStatus)
            except RPCError as err:
                # The node shows Draining before its workflow task starts the child: not there yet is not a failure.
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
            else:
                if status.blocked:
                    return status
            await asyncio.sleep(0.3)

    return drain, await asyncio.wait_for(blocked(), timeout)


@overload
async def wait_phase(handle: Any, *phases: str, timeout: float = 90.0) -> OperationView: ...
@overload
async def wait_phase(handle: Any, *phases: str, timeout: float = 90.0, view: type[V]) -> V: ...
async def wait_phase(handle: Any, *phases: str, timeout: float = 90.0, view: type[Any] = OperationView) -> Any:
    """Query an operation's ``state`` (as ``view``) until its phase is one of ``phases``; fail with its history."""
    import asyncio
    import time
    from datetime import timedelta

    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await handle.query("state", result_type=view, rpc_timeout=timedelta(seconds=10))
        except Exception:  # not started yet, or the worker is restarting
            last = last
        if last is not None and last.phase in phases:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"operation never reached {[str(p) for p in phases]}; last: "
                         f"{last.phase.value if last else None} {last.history if last else ''}")


async def result(handle: Any, timeout: float = 120.0) -> BurstResult:
    import asyncio

    from temporalio.service import RPCError

    async def started_then_result() -> Any:
        while True:  # the watcher may not have started it yet
            try:
                await handle.describe()
                break
            except RPCError:
                await asyncio.sleep(0.2)
        return await handle.result()

    try:
        raw = await asyncio.wait_for(started_then_result(), timeout)
    except TimeoutError:
        raise AssertionError(f"{handle.id} not done after {timeout}s: {await why_not_done(handle)}") from None
    return raw if isinstance(raw, BurstResult) else BurstResult.model_validate(raw)


async def why_not_done(handle: Any) -> str:
    """What a stuck workflow is at: its state query, or, when a failed workflow task keeps it from answering one
    (a non-determinism, a deadlock, an exception in workflow code), the last such failure from its history."""
    from temporalio.service import RPCError

    try:
        view = await handle.query("state", result_type=OperationView)
        return f"{view.phase.value}; {view.history[-4:]}"
    except RPCError as exc:
        failures = [event.workflow_task_failed_event_attributes
                    async for event in handle.fetch_history_events()
                    if event.HasField("workflow_task_failed_event_attributes")]
        if not failures:
            return f"state query failed: {exc}"
        last = failures[-1]
        return (f"state query failed ({exc}); {len(failures)} failed workflow task(s), the last: "
                f"{last.cause} {last.failure.message} {last.failure.stack_trace[-1500:]}")


def provisioning(temporal: Any, cluster: str, policy: str) -> Any:
    """The handle of a policy's provisioning workflow (started by the watcher on the first waiting pod)."""
    return temporal.get_workflow_handle(provision_workflow_id(cluster, policy))


async def provision_state(temporal: Any, cluster: str, policy: str, check: Any = None,
                          timeout: float = 90.0) -> ProvisionView:
    """The provisioning's state once ``check(view)`` holds (or once it answers, without a check)."""
    import asyncio
    import contextlib
    import time
    from datetime import timedelta

    handle = provisioning(temporal, cluster, policy)
    deadline = time.monotonic() + timeout
    last: ProvisionView | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # not started yet, or the worker is restarting
            last = await handle.query("state", result_type=ProvisionView, rpc_timeout=timedelta(seconds=10))
        if last is not None and (check is None or check(last)):
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"provisioning of {policy} never got there; last: "
                         f"{last.model_dump_json(indent=1)[:3000] if last else None}")


def node_workflows(view: ProvisionView, pod_prefix: str = "") -> list[str]:
    """Node workflow IDs of the batches, optionally only those planned for pods named ``pod_prefix``..."""
    out = []
    for batch in view.batches:
        planned = {i: n.pods for i, n in enumerate(batch.plan.new_nodes)}
        for wf_id in batch.nodes:
            index = int(wf_id.rsplit("-", 1)[1])
            if not pod_prefix or any(p.startswith(pod_prefix) for p in planned.get(index, [])):
                out.append(wf_id)
    return out


async def node_for(temporal: Any, cluster: str, policy: str, pod_prefix: str, timeout: float = 90.0) -> Any:
    """The handle of the (first) node workflow started for pods named ``pod_prefix``... (e.g. ``ns/deploy-``)."""
    view = await provision_state(temporal, cluster, policy, lambda v: node_workflows(v, pod_prefix), timeout)
    return temporal.get_workflow_handle(node_workflows(view, pod_prefix)[0])


async def approve_batch(temporal: Any, cluster: str, policy: str, pod_prefix: str, approver: str = "alice"
                        ) -> tuple[Any, Any]:
    """Approve (Approve mode) the proposal covering pods named ``pod_prefix``...: (the batch record, the handle
    of the node workflow started for those pods)."""
    from models.decisions import Approval
    from worker import ops

    view = await provision_state(temporal, cluster, policy, lambda v: v.proposal is not None and any(
        p.startswith(pod_prefix) for n in v.proposal.plan.new_nodes for p in n.pods))
    assert view.proposal is not None
    await ops.approve(temporal, view.proposal.batch, Approval(approver=approver,
                                                              plan_id=view.proposal.plan.plan_id))
    return view.proposal, await node_for(temporal, cluster, policy, pod_prefix)


def worker_env(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: this process's, the settings as KUBEON_* variables, ``extra`` (OTEL_*)."""
    return {**os.environ, **{ENV[k]: str(v) for k, v in settings.model_dump().items() if v is not None},
            **(extra or {})}


WORKER_ARGV = [sys.executable, "-m", "worker.cli", "worker"]
INPROC_WORKER_ARGV = [sys.executable, "-m", "tests.harness.inproc_worker"]


def worker_process(settings: Settings, log: Path, env: dict[str, str] | None = None, *,
                   stack: BurstStack | None = None) -> subprocess.Popen[bytes]:
    """`kubeon-gpu worker` as its own process (crash tests SIGKILL it); ``env``: more variables (OTEL_*);
    ``stack``: with the stack's gateway in the worker's process (``tests.harness.inproc_worker``)."""
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    argv, more = (INPROC_WORKER_ARGV, stack.gateway_env()) if stack is not None else (WORKER_ARGV, {})
    return subprocess.Popen(argv, env=worker_env(settings, {**more, **(env or {})}), stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


class WorkerProcesses:
    """`kubeon-gpu worker` processes on one task queue, as crash tests start and SIGKILL them (each in its own
    process group); :meth:`stop_all` leaves none running. ``stack``: the gateway in the worker's process (see
    :func:`worker_process`)."""

    def __init__(self, settings: Settings, log: Path, stack: BurstStack | None = None) -> None:
        self.settings, self.log, self.stack = settings, log, stack
        self.procs: list[subprocess.Popen[bytes]] = []

    def started_count(self) -> int:
        """How many workers said "worker started" in the log (they serve the task queue from then)."""
        return self.log.read_text(errors="replace").count("worker started") if self.log.exists() else 0

    def start(self, *, wait: bool = False) -> subprocess.Popen[bytes]:
        """A new worker; with ``wait``, once it serves the task queue (its start time printed)."""
        import time

        before, t0 = self.started_count(), time.monotonic()
        proc = worker_process(self.settings, self.log, stack=self.stack)
        self.procs.append(proc)
        if wait:
            wait_for(lambda: self.started_count() > before or proc.poll() is not None, what="the worker started",
                     timeout=60)
            assert proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
            print(f"worker started in {time.monotonic() - t0:.1f} s")
        return proc

    def kill(self) -> None:
        """SIGKILL the newest worker, and wait for it to be gone."""
        proc = self.procs[-1]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def gateway_process(stack: BurstStack, log: Path, port: int, *, extra_env: dict[str, str] | None = None,
                    popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
                    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """`kubeon-gpu gateway` as its own process with its own ServiceAccount and the ticket key (as the chart runs
    it; no tunnel: sim nodes reach the API server over loopback), on 127.0.0.1:``port``; and the settings a
    worker needs to use it over HTTP with the optimizer's ServiceAccount token."""
    token = stack.workdir / "optimizer.token"
    token.write_text(stack.cluster.service_account_token("kubeon-gpu", OPTIMIZER_SA, seconds=86400))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEON_")}
    env.update({"KUBEON_CLUSTER": "dev", "KUBEON_GATEWAY_KUBECONFIG": str(stack.gateway_kubeconfig),
                "KUBEON_GATEWAY_TICKET_KEY_FILE": str(stack.ticket_key_file),
                "KUBEON_GATEWAY_LISTEN": f"127.0.0.1:{port}", "KUBEON_HEALTH_PORT": str(port),
                "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    proc = popen([sys.executable, "-m", "worker.cli", "gateway"], env=env, stdout=out,
                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, {"gateway_url": f"http://127.0.0.1:{port}", "gateway_token_file": token}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


__all__ = ["WORKER_ARGV", "BurstStack", "StartWorker", "approve_batch", "build_stack", "gateway_process",
           "gpu_deployment", "in_process_worker", "node_for", "node_workflows", "provision_state", "provisioning",
           "result", "sim_location", "unique", "wait_for", "wait_phase", "worker_env", "worker_process"]
