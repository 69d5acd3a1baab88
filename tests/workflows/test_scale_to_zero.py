"""ScaleToZero end to end on the real parts: control plane (kwok GPU nodes, the chart's ServiceAccount, ClusterRole
and per-namespace scale Role), a real Prometheus scraping the DCGM exporter fixture with backfilled history, the
Temporal dev server, and the worker (in-process, or its own process when it is SIGKILLed)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.scale import ScaleForbidden
from activities.scale import ScaleOps
from hub.plans import parse_plan
from models.capacity import NODEPOOL_LABEL
from models.decisions import Approval
from models.policy import API_GROUP
from models.policy import PLURAL
from models.scale import NO_PROMETHEUS
from models.scale import ScalePhase
from models.scale import ScaleRequest
from models.scale import WakeRequest
from models.scale import WorkloadRef
from models.scale import scale_workflow_id
from tests.harness.burst import worker_process
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.scale import ScaleStack
from tests.harness.scale import build_scale_stack
from tests.harness.scale import ended_in
from tests.harness.scale import unique
from tests.harness.scale import wait_scale_phase
from worker import ops
from worker.cli import main
from worker.config import Settings
from worker.main import worker_services

pytestmark = [pytest.mark.cluster, pytest.mark.temporal, pytest.mark.prometheus]


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaleStack]:
    s = build_scale_stack(cluster, tmp_path_factory.mktemp("scale"))
    try:
        yield s
    finally:
        s.prometheus.stop()
        s.exporter.stop()


@pytest.fixture
def policy(stack: ScaleStack) -> Iterator[str]:
    name = unique("stz")
    yield name
    stack.burst.delete_policy(name)


@pytest.fixture
def allowed_ns(stack: ScaleStack, namespace: str) -> str:
    stack.grant_scale_role(namespace)
    return namespace


@pytest.fixture
def other_ns(stack: ScaleStack) -> Iterator[str]:
    """A namespace without the chart's scale Role."""
    name = stack.cluster.create_namespace("noscale")
    yield name
    stack.cluster.admin.core.delete_namespace(name)


def _settings(stack: ScaleStack, env: WorkflowEnvironment, **kw: Any) -> Settings:
    return stack.settings(temporal_address=env.client.service_client.config.target_host, task_queue=unique("sq"),
                          **kw)


@pytest.fixture
async def worker(stack: ScaleStack, temporal_dev_server: WorkflowEnvironment) -> AsyncIterator[tuple[Client, Settings]]:
    settings = _settings(stack, temporal_dev_server)
    async with worker_services(settings, stack.burst.runtime(settings)) as (temporal, _runtime, _watcher):
        yield temporal, settings


def _handle(temporal: Client, settings: Settings, policy: str, namespace: str, name: str) -> Any:
    ref = WorkloadRef(namespace=namespace, kind="Deployment", name=name)
    return temporal.get_workflow_handle(scale_workflow_id(settings.cluster, policy, ref))


def _idle_deployment(stack: ScaleStack, namespace: str, name: str, replicas: int = 2, minutes: int = 40) -> None:
    stack.deploy(namespace, name, replicas=replicas)
    stack.give_gpus(namespace, stack.running_pods(namespace, name, replicas), activity=0.01, minutes=minutes)


def _audit(settings: Settings) -> list[dict[str, Any]]:
    path = settings.state_dir / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_approved_idle_deployment_scaled_to_zero_and_woken_manually(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, other_ns: str, policy: str) -> None:
    temporal, settings = worker
    _idle_deployment(stack, allowed_ns, "llm")
    _idle_deployment(stack, other_ns, "llm", minutes=0)  # idle too, but the optimizer may not scale there
    stack.create_policy(policy, [allowed_ns, other_ns], mode="Approve")

    handle = _handle(temporal, settings, policy, allowed_ns, "llm")
    view = await wait_scale_phase(handle, ScalePhase.AWAITING_APPROVAL)
    assert view.replicas_before == 2
    assert stack.replicas(allowed_ns, "llm") == (2, 2)  # Approve: nothing before the approval

    # The other namespace is refused by name, in the policy's status; its workload is never touched.
    status = await until(lambda: stack.scale_status(policy) or None, what="policy status")
    assert status["refusedNamespaces"] == [other_ns]
    role = next(c for c in status["conditions"] if c["type"] == "ScaleRolePresent")
    assert role["status"] == "False" and other_ns in role["message"] and "scaleToZero.namespaces" in role["message"]
    assert not any(d["workload"].startswith(f"{other_ns}/") for d in status["decisions"])
    # ... and tried with the optimizer's own credentials, the apiserver says no.
    with pytest.raises(ScaleForbidden, match=f"scale Role is missing there.*{other_ns}|{other_ns}.*scale Role"):
        ScaleOps(stack.burst.optimizer.api, None).scale(ScaleRequest(
            operation="op-test", workload=WorkloadRef(namespace=other_ns, kind="Deployment", name="llm"),
            replicas=0, expect=2))

    decided = await ops.approve(temporal, view.operation, Approval(approver="alice", plan_id=f"{view.operation}-r2"))
    assert "approved by alice" in decided.message
    at_zero = await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO)
    assert at_zero.approver == "alice"
    assert stack.replicas(allowed_ns, "llm")[0] == 0
    entry = stack.scale_status(policy)["workloads"][f"{allowed_ns}/Deployment/llm"]
    assert entry["replicas"] == 2 and entry["operation"] == view.operation  # remembered outside the workflow

    woken = await ops.wake(temporal, view.operation, WakeRequest(by="bob", reason="demo"))
    assert "to 2 replica(s)" in woken.message
    await ended_in(handle, ScalePhase.COMPLETED)
    assert stack.replicas(allowed_ns, "llm") == (2, 2)
    assert f"{allowed_ns}/Deployment/llm" not in stack.scale_status(policy).get("workloads", {})
    assert stack.replicas(other_ns, "llm") == (2, 2)
    actions = [r["action"] for r in _audit(settings) if r["operation"] == view.operation]
    assert actions == ["proposed", "approved", "scaled", "woken", "verified"]
    # The hub is sent the proposal's plan: its Approvals page shows the workload and binds a decision to the plan id.
    sent = parse_plan(next(r["detail"] for r in _audit(settings)
                           if r["operation"] == view.operation and r["action"] == "proposed"))
    assert sent is not None and (sent.plan_id, sent.workload, sent.replicas) == (
        f"{view.operation}-r2", f"{allowed_ns}/Deployment/llm", 2)
    assert sent.idle_evidence
    with pytest.raises(ops.DecisionRefused, match="not running"):
        await ops.wake(temporal, view.operation, WakeRequest(by="bob"))


async def test_demand_query_wakes_the_workload(stack: ScaleStack, worker: tuple[Client, Settings],
                                               allowed_ns: str, policy: str) -> None:
    temporal, settings = worker
    _idle_deployment(stack, allowed_ns, "chat", replicas=1)
    query = f'sum(DCGM_FI_DEV_FB_USED{{namespace="{allowed_ns}",pod="queue-probe"}})'
    stack.create_policy(policy, [allowed_ns], mode="Automatic",
                        wake={"demand": {"query": query, "activationThreshold": 0, "pollInterval": "5s"}})
    handle = _handle(temporal, settings, policy, allowed_ns, "chat")
    await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO)
    assert stack.replicas(allowed_ns, "chat")[0] == 0
    # Demand appears: a series the query sees rises above the activation threshold.
    stack.exporter.assign(allowed_ns, "queue-probe", fb_used_mib=3)
    await ended_in(handle, ScalePhase.COMPLETED, "demand 3 > 0")
    assert stack.replicas(allowed_ns, "chat") == (1, 1)
    stack.exporter.release(allowed_ns, "queue-probe")


async def test_schedule_wakes_the_workload(stack: ScaleStack, worker: tuple[Client, Settings],
                                           allowed_ns: str, policy: str) -> None:
    temporal, settings = worker
    _idle_deployment(stack, allowed_ns, "batch", replicas=1)
    at = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)).strftime("%H:%M")
    stack.create_policy(policy, [allowed_ns], mode="Automatic", wake={"schedule": {"at": at}})
    handle = _handle(temporal, settings, policy, allowed_ns, "batch")
    await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO)
    await ended_in(handle, ScalePhase.COMPLETED, f"scheduled wake at {at}")
    assert stack.replicas(allowed_ns, "batch") == (1, 1)


async def test_busy_young_and_unmeasured_workloads_are_not_scaled(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, policy: str) -> None:
    temporal, settings = worker
    stack.deploy(allowed_ns, "busy", replicas=1)
    stack.give_gpus(allowed_ns, stack.running_pods(allowed_ns, "busy", 1), activity=0.6, minutes=40)
    stack.deploy(allowed_ns, "young", replicas=1)
    stack.give_gpus(allowed_ns, stack.running_pods(allowed_ns, "young", 1), activity=0.0, minutes=5)
    stack.deploy(allowed_ns, "cpu", replicas=1)  # no GPU series at all
    stack.running_pods(allowed_ns, "cpu", 1)
    stack.create_policy(policy, [allowed_ns], mode="Automatic")

    def reasons() -> dict[str, str] | None:
        got = {w: stack.decision(policy, f"{allowed_ns}/Deployment/{w}") for w in ("busy", "young", "cpu")}
        return {w: d["reason"] for w, d in got.items() if d} if all(got.values()) else None

    seen = await until(reasons, what="a decision for each workload")
    assert "busy: pod busy-" in seen["busy"] and "peaked at 60%" in seen["busy"]
    assert "too little history" in seen["young"]
    assert "no DCGM data for pod cpu-" in seen["cpu"]
    for w in ("busy", "young", "cpu"):
        assert stack.replicas(allowed_ns, w)[0] == 1
        with pytest.raises(RPCError, match=r"not found"):
            await _handle(temporal, settings, policy, allowed_ns, w).describe()


async def test_prometheus_down_scales_nothing_and_says_why(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, policy: str) -> None:
    _idle_deployment(stack, allowed_ns, "idle", replicas=1)
    stack.prometheus.stop()
    try:
        stack.create_policy(policy, [allowed_ns], mode="Automatic")
        decision = await until(lambda: stack.decision(policy, f"{allowed_ns}/Deployment/idle"),
                               what="a decision while Prometheus is down")
        assert not decision["idle"] and "unreachable" in decision["reason"]
        metrics = next(c for c in stack.scale_status(policy)["conditions"] if c["type"] == "GpuMetrics")
        assert metrics["status"] == "False" and "unreachable" in metrics["message"]
        assert stack.replicas(allowed_ns, "idle")[0] == 1
    finally:
        stack.prometheus.start()
        stack.prometheus.wait_scraped()


async def test_without_prometheus_url_policies_only_recommend(
        stack: ScaleStack, temporal_dev_server: WorkflowEnvironment, allowed_ns: str, policy: str) -> None:
    settings = _settings(stack, temporal_dev_server, prometheus=False)
    _idle_deployment(stack, allowed_ns, "idle", replicas=1)
    async with worker_services(settings, stack.burst.runtime(settings)):
        stack.create_policy(policy, [allowed_ns], mode="Automatic")
        status = await until(lambda: stack.scale_status(policy).get("enforcedMode") and stack.scale_status(policy),
                             what="the enforced mode in the status")
        assert status["enforcedMode"] == "Recommend" and status["modeReason"] == NO_PROMETHEUS
        prom = next(c for c in status["conditions"] if c["type"] == "PrometheusConfigured")
        assert prom["status"] == "False" and "R1.3" in prom["message"]
        assert stack.replicas(allowed_ns, "idle")[0] == 1


async def test_rescaled_by_something_else_is_left_alone(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, policy: str) -> None:
    temporal, settings = worker
    _idle_deployment(stack, allowed_ns, "hpa", replicas=2)
    _idle_deployment(stack, allowed_ns, "gitops", replicas=1)
    stack.create_policy(policy, [allowed_ns], mode="Approve")
    apps = stack.cluster.admin.apps
    # An HPA scales it up while the proposal waits for approval: withdrawn, never scaled.
    hpa = _handle(temporal, settings, policy, allowed_ns, "hpa")
    await wait_scale_phase(hpa, ScalePhase.AWAITING_APPROVAL)
    apps.patch_namespaced_deployment_scale("hpa", allowed_ns, {"spec": {"replicas": 3}})
    await ended_in(hpa, ScalePhase.WITHDRAWN, "replicas changed from 2 to 3 meanwhile")
    assert stack.replicas(allowed_ns, "hpa")[0] == 3
    # GitOps puts it back while at zero: left alone, nothing restored on top.
    gitops = _handle(temporal, settings, policy, allowed_ns, "gitops")
    view = await wait_scale_phase(gitops, ScalePhase.AWAITING_APPROVAL)
    await ops.approve(temporal, view.operation, Approval(approver="alice"))
    await wait_scale_phase(gitops, ScalePhase.SCALED_TO_ZERO)
    apps.patch_namespaced_deployment_scale("gitops", allowed_ns, {"spec": {"replicas": 4}})
    await ended_in(gitops, ScalePhase.LEFT_ALONE, "by something else while at zero: left alone")
    assert stack.replicas(allowed_ns, "gitops")[0] == 4
    assert f"{allowed_ns}/Deployment/gitops" not in stack.scale_status(policy).get("workloads", {})


async def test_worker_killed_at_zero_wakes_once_to_the_right_count(
        stack: ScaleStack, temporal_dev_server: WorkflowEnvironment, allowed_ns: str, policy: str,
        tmp_path: Path) -> None:
    settings = _settings(stack, temporal_dev_server)
    temporal = temporal_dev_server.client
    _idle_deployment(stack, allowed_ns, "crash", replicas=3)
    stack.create_policy(policy, [allowed_ns], mode="Automatic")
    procs = [worker_process(settings, tmp_path / "worker.log", stack=stack.burst)]
    try:
        handle = _handle(temporal, settings, policy, allowed_ns, "crash")
        view = await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO, timeout=120)
        assert stack.replicas(allowed_ns, "crash")[0] == 0
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
        procs.append(worker_process(settings, tmp_path / "worker.log", stack=stack.burst))
        await ops.wake(temporal, view.operation, WakeRequest(by="carol"))
        await ended_in(handle, ScalePhase.COMPLETED)
        assert stack.replicas(allowed_ns, "crash") == (3, 3)
        woken = [r for r in _audit(settings) if r["operation"] == view.operation and r["action"] == "woken"]
        assert len(woken) == 1
        # Exactly one scale-up: the Deployment's spec went 3 -> 0 -> 3 and its generation shows no more changes.
        deployment = stack.cluster.admin.apps.read_namespaced_deployment("crash", allowed_ns)
        assert deployment.metadata.generation == 3
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


async def test_gpu_type_fit_recommends_a_cheaper_type_for_a_small_peak_only(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, policy: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    core = stack.cluster.admin.core
    for name, gib in (("small", 9), ("large", 70)):
        stack.deploy(allowed_ns, name, replicas=1)
        stack.give_gpus(allowed_ns, stack.running_pods(allowed_ns, name, 1), activity=0.02,
                        fb_used_mib=gib * 1024, minutes=70)
    # The small workload's node is of a Karpenter NodePool (its label; no Karpenter needed to read it).
    small: Any = core.read_namespaced_pod(stack.running_pods(allowed_ns, "small", 1)[0], allowed_ns)
    node: Any = core.read_node(small.spec.node_name)
    pool = (node.metadata.labels or {}).get(NODEPOOL_LABEL) or unique("fit-pool")
    labelled = NODEPOOL_LABEL not in (node.metadata.labels or {})
    if labelled:
        core.patch_node(node.metadata.name, {"metadata": {"labels": {NODEPOOL_LABEL: pool}}})
    try:
        stack.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": policy},
            "spec": {"kind": "GpuTypeFit", "namespaces": [allowed_ns], "fit": {
                "window": "1h", "current": {"name": "a100-80gb", "memoryMiB": 81920, "usdPerHour": 4.1},
                "candidates": [{"name": "l4", "memoryMiB": 23034, "usdPerHour": 0.8, "relativeCompute": 0.3,
                                "product": "NVIDIA-L4"}]}}})

        def recommendations() -> dict[str, Any] | None:
            doc: Any = stack.cluster.admin.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, policy)
            recs = ((doc.get("status") or {}).get("gpuTypeFit") or {}).get("recommendations") or []
            return {r["workload"].split("/")[-1]: r for r in recs} if len(recs) == 2 else None

        recs = await until(recommendations, what="two GPU type fit recommendations")
    finally:
        if labelled:
            core.patch_node(node.metadata.name, {"metadata": {"labels": {NODEPOOL_LABEL: None}}})
    assert recs["small"]["recommended"] == "l4"
    assert recs["small"]["savingUsdPerMonth"] == round((4.1 - 0.8) * 730, 2)
    assert recs["small"]["peakMiB"] == 9 * 1024
    # The NodePool requirement that would serve it, and how to apply it; GPU type fit changes no NodePool.
    assert recs["small"]["product"] == "NVIDIA-L4"
    assert recs["small"]["nodePoolRequirements"] == [
        {"nodePool": pool, "key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]
    assert "set gpuProducts: [NVIDIA-L4] in an Autoscaling policy for that NodePool" in recs["small"]["reason"]
    assert recs["large"]["recommended"] == "" and "no cheaper GPU type fits" in recs["large"]["reason"]
    assert recs["large"]["nodePoolRequirements"] == []
    assert stack.replicas(allowed_ns, "small")[0] == 1  # recommend only: nothing changes
    # `kubeon-gpu ops fit` shows them, with the optimizer's own credentials (the requirement in the reason).
    assert main(["ops", "fit", "--kubeconfig", str(stack.burst.optimizer_kubeconfig)]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith(policy)]
    assert any(f"{allowed_ns}/Deployment/small" in line and " l4 " in line and "2,409.00" in line
               and f"nvidia.com/gpu.product In [NVIDIA-L4] on NodePool {pool};" in line for line in shown)
    assert any(f"{allowed_ns}/Deployment/large" in line and " - " in line for line in shown)


async def test_deleting_the_policy_gives_a_workload_at_zero_its_replicas_back(
        stack: ScaleStack, worker: tuple[Client, Settings], allowed_ns: str, policy: str) -> None:
    temporal, settings = worker
    _idle_deployment(stack, allowed_ns, "orphan", replicas=2)
    stack.create_policy(policy, [allowed_ns], mode="Automatic")
    handle = _handle(temporal, settings, policy, allowed_ns, "orphan")
    await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO)
    stack.burst.delete_policy(policy)
    await ended_in(handle, ScalePhase.COMPLETED, f"policy {policy} is gone: restoring its replicas")
    assert stack.replicas(allowed_ns, "orphan") == (2, 2)
