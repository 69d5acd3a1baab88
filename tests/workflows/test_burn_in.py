"""The burn-in gate (issue 27, part 4) with the sim provider: a node that registers with fewer allocatable GPUs than
its offering, or whose GPU health check fails, keeps its joining taint, is terminated before any workload lands,
and its pod is planned again onto a node that passes (in another of the policy's locations where it has one); the
reason is in the node's operation, the provisioning workflow's history and the audit."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from kubernetes import watch

from models.labels import BURNED_IN_ANNOTATION
from models.labels import JOINING_TAINT
from models.labels import LABEL_LOCATION
from models.labels import LABEL_POLICY
from models.node import NodePhase
from tests.harness.background import Background
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import node_gone
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.kube import until

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

# The first instance launched here registers one GPU fewer than its offering (the sim's fault injection); the
# next is whole.
LOCATIONS: list[dict[str, Any]] = [
    {"name": "sim/burn-short", "sim": {"bootSeconds": 0.3, "shortGpusFirst": 1},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.9}]},
]


def _pods(stack: BurstStack, namespace: str) -> list[client.V1Pod]:
    return [p for p in stack.cluster.admin.core.list_namespaced_pod(namespace).items
            if p.metadata.deletion_timestamp is None]


class NodeTaints(Background):
    """The taint keys of each of a policy's burst Nodes in every state a watch sees it in."""

    def __init__(self, core: client.CoreV1Api, policy: str) -> None:
        super().__init__()
        self.core, self.policy = core, policy
        self.seen: dict[str, list[set[str]]] = defaultdict(list)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(self.core.list_node, label_selector=f"{LABEL_POLICY}={self.policy}",
                                                  timeout_seconds=2):
                    node = event["object"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.seen[str(node.metadata.name)].append({t.key for t in node.spec.taints or []})
            except Exception:  # a broken watch: watch again (a node seen twice adds a state, never hides one)
                self._stop.wait(0.2)


@dataclass(frozen=True)
class Fault:
    """A node fault the sim injects in its location's first instance, the checks that find it, what they say."""

    location: dict[str, Any]
    checks: list[str]
    failure: str  # in the failed node's message
    passed: str  # the replacement's burned-in annotation starts with it


SHORT_OF_GPUS = Fault(LOCATIONS[0], ["Gpus"], "allocatable nvidia.com/gpu is 0", "Gpus: allocatable")
# Its first node's DCGM diagnostic fails (the sim posts the failure as a real node's program would).
FAILING_GPU_HEALTH = Fault(
    {**LOCATIONS[0], "name": "sim/burn-sick", "sim": {"bootSeconds": 0.3, "failingGpuHealthFirst": 1}},
    ["Gpus", "GpuHealth"], "its GPU health check failed (DcgmDiagFailed): simulated `dcgmi diag -r 1` failed",
    "Gpus: allocatable nvidia.com/gpu 1; GpuHealth: simulated node: no GPUs to diagnose")


@pytest.mark.parametrize("fault", [SHORT_OF_GPUS, FAILING_GPU_HEALTH], ids=["short-of-gpus", "failing-gpu-health"])
async def test_a_failing_node_is_terminated_before_any_pod_lands_and_replaced(
        stack: BurstStack, start_worker: StartWorker, namespace: str, policy: str, fault: Fault) -> None:
    location = str(fault.location["name"])
    async with start_worker([fault.location], node_retry_seconds=1) as (temporal, settings, runtime):
        stack.create_policy(policy, mode="Automatic", locations=[location], max_nodes=1,
                            burn_in={"checks": fault.checks, "timeoutSeconds": 5})
        deploy = unique("burn")
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        try:
            await until(lambda: len(_pods(stack, namespace)) == 1, timeout=30, what="the workload's pod")
            (pod,) = _pods(stack, namespace)
            pod_name = str(pod.metadata.name)

            with NodeTaints(stack.cluster.admin.core, policy) as taints:
                first = await node_for(temporal, settings.cluster, policy, f"{namespace}/{deploy}-")
                failed = await result(first)
            assert failed.phase == NodePhase.FAILED, failed.message
            assert "burn-in failed" in failed.message and fault.failure in failed.message, failed.message
            assert node_gone(stack, failed.node_name)
            # Under burn-in the gateway kept the joining taint in every state the failed node was seen in: nothing
            # could land on it.
            seen = taints.seen[failed.node_name]
            assert seen and all(JOINING_TAINT.key in keys for keys in seen), seen
            live = runtime.providers["sim"].list(location, operation=failed.operation)
            assert [i.state for i in live] == ["terminated"]

            # Planned again: a second node passes, loses its joining taint, and the same pod (never bound before) runs.
            def served() -> str | None:
                p = stack.cluster.admin.core.read_namespaced_pod(pod_name, namespace)
                return str(p.spec.node_name) if p.spec.node_name else None

            await until(served, timeout=60, what="the pod on the replacement node")
            replacement = stack.cluster.admin.core.read_node(str(served()))
            assert replacement.metadata.name != failed.node_name
            assert replacement.metadata.labels[LABEL_POLICY] == policy
            assert replacement.metadata.annotations[BURNED_IN_ANNOTATION].startswith(fault.passed)
            assert [p.metadata.uid for p in _pods(stack, namespace)] == [pod.metadata.uid]

            view = await provision_state(temporal, settings.cluster, policy)
            assert any("burn-in failed" in line for line in view.history), view.history
            # Its only location: planned there again, and the plan says so.
            replanned = [b.plan for b in view.batches if b.plan.new_nodes][-1]
            assert replanned.refused[0].startswith(f"{location}: planned again although until "), replanned.refused
            assert replanned.refused[0].endswith("(no other location of the policy)"), replanned.refused
            records = runtime.audit.read()
            mine = [(r.action, r.detail) for r in records if r.operation == failed.operation]
            assert any(a == "failed" and "burn-in failed" in d for a, d in mine), mine
            assert not any(a == "verified" for a, _ in mine), mine
            # The replacement's "verified" record (written once it serves, after the taint was lifted) names the check.
            await until(lambda: [r for r in runtime.audit.read() if r.action == "verified"
                                 and r.node_name == replacement.metadata.name
                                 and r.detail.startswith(f"burn-in passed: {fault.passed}")],
                        timeout=30, what="the replacement's verified record with its burn-in")
        finally:  # a failed assertion leaves no serving burst node behind for the tests after it
            with contextlib.suppress(client.ApiException):
                stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            await until(lambda: not stack.cluster.admin.core.list_node(
                label_selector=f"{LABEL_POLICY}={policy}").items, timeout=120, what="the burst node home")


async def test_the_pods_of_a_node_that_failed_are_planned_in_another_location(
        stack: BurstStack, start_worker: StartWorker, namespace: str, policy: str) -> None:
    # burn-short is the cheaper location and its first node is short of GPUs; burn-ok is dearer and whole.
    locations = [*LOCATIONS, {"name": "sim/burn-ok", "sim": {"bootSeconds": 0.3}, "offerings": [
        {"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 1.5}]}]
    async with start_worker(locations, node_retry_seconds=1) as (temporal, settings, _runtime):
        stack.create_policy(policy, mode="Automatic", locations=["sim/burn-short", "sim/burn-ok"], max_nodes=1,
                            burn_in={"checks": ["Gpus"], "timeoutSeconds": 5})
        deploy = unique("burn")
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        try:
            first = await node_for(temporal, settings.cluster, policy, f"{namespace}/{deploy}-")
            failed = await result(first)
            assert failed.phase == NodePhase.FAILED and "burn-in failed" in failed.message, failed.message
            view = await provision_state(temporal, settings.cluster, policy,
                                         lambda v: len([b for b in v.batches if b.plan.new_nodes]) == 2, timeout=60)
            plans = [b.plan for b in view.batches if b.plan.new_nodes]
            assert [n.offering.location for p in plans for n in p.new_nodes] == ["sim/burn-short", "sim/burn-ok"]
            [left_out] = [r for r in plans[1].refused if r.startswith("sim/burn-short")]
            assert left_out.startswith("sim/burn-short: left out, until ") and "burn-in failed" in left_out, left_out
            assert any("sim/burn-short left out of the plans until" in line for line in view.history), view.history

            def served() -> bool:
                pods = _pods(stack, namespace)
                return len(pods) == 1 and bool(pods[0].spec.node_name) and pods[0].status.phase == "Running"

            await until(served, timeout=60, what="the pod on the replacement node in sim/burn-ok")
            (pod,) = _pods(stack, namespace)
            node = stack.cluster.admin.core.read_node(str(pod.spec.node_name))
            assert node.metadata.labels[LABEL_LOCATION] == "sim.burn-ok"
        finally:
            with contextlib.suppress(client.ApiException):
                stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            await until(lambda: not stack.cluster.admin.core.list_node(
                label_selector=f"{LABEL_POLICY}={policy}").items, timeout=120, what="the burst node home")
