"""The burn-in gate (issue 27, part 4) with the sim provider: a node that registers with fewer allocatable GPUs than
its offering keeps its joining taint, is terminated before any workload lands, and its pod is planned again onto a
node that passes (in another of the policy's locations where it has one); the reason is in the node's operation,
the provisioning workflow's history and the audit."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from kubernetes import client

from models.labels import BURNED_IN_ANNOTATION, JOINING_TAINT, LABEL_LOCATION, LABEL_POLICY
from models.node import NodePhase
from tests.harness.burst import (
    BurstStack,
    StartWorker,
    gpu_deployment,
    node_for,
    node_gone,
    provision_state,
    result,
    unique,
    wait_phase,
)
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


async def test_a_node_short_of_gpus_is_terminated_before_any_pod_lands_and_replaced(
        stack: BurstStack, start_worker: StartWorker, namespace: str, policy: str) -> None:
    async with start_worker(LOCATIONS, node_retry_seconds=1) as (temporal, settings, runtime):
        stack.create_policy(policy, mode="Automatic", locations=["sim/burn-short"], max_nodes=1,
                            burn_in={"checks": ["Gpus"], "timeoutSeconds": 5})
        deploy = unique("burn")
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        try:
            await until(lambda: len(_pods(stack, namespace)) == 1, timeout=30, what="the workload's pod")
            (pod,) = _pods(stack, namespace)
            pod_name = str(pod.metadata.name)

            first = await node_for(temporal, settings.cluster, policy, f"{namespace}/{deploy}-")
            joined = await wait_phase(first, NodePhase.VERIFYING)
            # Under burn-in the gateway keeps the joining taint: nothing can land on the node.
            await until(lambda: stack.cluster.admin.core.read_node(str(joined.node_name)).status.allocatable
                        is not None, timeout=30, what="the short node registered")
            node = stack.cluster.admin.core.read_node(str(joined.node_name))
            assert any(t.key == JOINING_TAINT.key for t in node.spec.taints or []), node.spec.taints
            failed = await result(first)
            assert failed.phase == NodePhase.FAILED, failed.message
            assert "burn-in failed" in failed.message and "allocatable nvidia.com/gpu is 0" in failed.message
            assert node_gone(stack, failed.node_name)
            live = runtime.providers["sim"].list("sim/burn-short", operation=failed.operation)
            assert [i.state for i in live] == ["terminated"]

            # Planned again: a second node passes, loses its joining taint, and the same pod (never bound before) runs.
            def served() -> str | None:
                p = stack.cluster.admin.core.read_namespaced_pod(pod_name, namespace)
                return str(p.spec.node_name) if p.spec.node_name else None

            await until(served, timeout=60, what="the pod on the replacement node")
            replacement = stack.cluster.admin.core.read_node(str(served()))
            assert replacement.metadata.name != failed.node_name
            assert replacement.metadata.labels[LABEL_POLICY] == policy
            assert replacement.metadata.annotations[BURNED_IN_ANNOTATION].startswith("Gpus: allocatable")
            assert [p.metadata.uid for p in _pods(stack, namespace)] == [pod.metadata.uid]

            view = await provision_state(temporal, settings.cluster, policy)
            assert any("burn-in failed" in line for line in view.history), view.history
            # Its only location: planned there again, and the plan says so.
            replanned = [b.plan for b in view.batches if b.plan.new_nodes][-1]
            assert replanned.refused[0].startswith("sim/burn-short: planned again although until "), replanned.refused
            assert replanned.refused[0].endswith("(no other location of the policy)"), replanned.refused
            records = runtime.audit.read()
            mine = [(r.action, r.detail) for r in records if r.operation == failed.operation]
            assert any(a == "failed" and "burn-in failed" in d for a, d in mine), mine
            assert not any(a == "verified" for a, _ in mine), mine
            # The replacement's "verified" record (written once it serves, after the taint was lifted) names the check.
            await until(lambda: [r for r in runtime.audit.read() if r.action == "verified"
                                 and r.node_name == replacement.metadata.name
                                 and r.detail.startswith("burn-in passed: Gpus: allocatable")],
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
