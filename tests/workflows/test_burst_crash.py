"""Crash safety: the worker (`kubeon-gpu worker`, its own process) is SIGKILLed while waiting for the join,
while draining, and just after the launch call returns. After a restart each operation completes, exactly one
instance was ever launched for it, and none is left running."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from models.labels import TAG_OPERATION
from models.node import NodePhase
from models.node import OperationView
from tests.harness.burst import BurstStack
from tests.harness.burst import WorkerProcesses
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import result
from tests.harness.burst import sim_location
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.burst import wait_phase
from worker.config import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture
def scenario(stack: BurstStack, temporal_dev_server: WorkflowEnvironment, request: pytest.FixtureRequest
             ) -> Iterator[dict[str, Any]]:
    product = unique("NVIDIA-C")
    location = sim_location("sim/eu-west", product, price=1.0)
    location["sim"].update(getattr(request, "param", {}))
    queue = unique("crash")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=[location], cluster_name=queue)
    policy = unique("crash")
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], return_home=True)
    workers = WorkerProcesses(settings, stack.workdir / f"{queue}.log", stack)
    try:
        yield {"settings": settings, "policy": policy, "product": product, "workers": workers,
               "temporal": temporal_dev_server.client}
    finally:
        workers.stop_all()
        stack.delete_policy(policy)


def sim_instances(settings: Settings, operation: str) -> list[dict[str, Any]]:
    state = json.loads((settings.state_dir / "sim-instances.json").read_text())
    return [rec for rec in state.values() if rec["tags"].get(TAG_OPERATION) == operation]


async def _start_workload(stack: BurstStack, s: dict[str, Any], namespace: str, *, find: bool = True
                          ) -> tuple[Any, str]:
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product=s["product"]))
    return (await _node(s, namespace, deploy) if find else None), deploy


async def _node(s: dict[str, Any], namespace: str, deploy: str) -> Any:
    """The node workflow the pod's batch started (asked of the provisioning, so a worker must be running)."""
    return await node_for(s["temporal"], s["settings"].cluster, s["policy"], f"{namespace}/{deploy}-", timeout=90)


async def _finish(stack: BurstStack, s: dict[str, Any], handle: Any, namespace: str, deploy: str) -> OperationView:
    view = await wait_phase(handle, NodePhase.SERVING, timeout=150)
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    done = await result(handle, timeout=150)
    assert done.phase == NodePhase.COMPLETED, done.message
    return view


def _exactly_one_instance_none_left(s: dict[str, Any], stack: BurstStack, view: OperationView) -> None:
    launched = sim_instances(s["settings"], view.operation)
    assert len(launched) == 1, launched
    assert launched[0]["state"] == "terminated"
    assert not stack.cluster.admin.core.list_node(field_selector=f"metadata.name={view.node_name}").items


@pytest.mark.parametrize("scenario", [{"bootSeconds": 6}], indirect=True)
async def test_killed_while_waiting_for_join(stack: BurstStack, scenario: dict[str, Any], namespace: str) -> None:
    s = scenario
    s["workers"].start()
    handle, deploy = await _start_workload(stack, s, namespace)
    joining = await wait_phase(handle, NodePhase.JOINING, timeout=90)
    assert len(sim_instances(s["settings"], joining.operation)) == 1
    s["workers"].kill()  # the simulated instance is still booting; its boot resumes with the next worker
    s["workers"].start()
    view = await _finish(stack, s, handle, namespace, deploy)
    _exactly_one_instance_none_left(s, stack, view)


@pytest.mark.parametrize("scenario", [{"killWorkerAfterLaunch": True}], indirect=True)
async def test_killed_just_after_launch_returns(stack: BurstStack, scenario: dict[str, Any], namespace: str) -> None:
    s = scenario
    first = s["workers"].start()
    _, deploy = await _start_workload(stack, s, namespace, find=False)
    # The simulated cloud kills the worker right after starting the instance: the launch never reported back.
    wait_for(lambda: first.poll() is not None, what="worker killed inside the launch", timeout=90)
    assert first.returncode == -signal.SIGKILL
    s["workers"].start()
    handle = await _node(s, namespace, deploy)
    view = await _finish(stack, s, handle, namespace, deploy)
    _exactly_one_instance_none_left(s, stack, view)


async def test_killed_while_draining(stack: BurstStack, scenario: dict[str, Any], namespace: str) -> None:
    s = scenario
    admin = stack.cluster.admin
    s["workers"].start()
    handle, deploy = await _start_workload(stack, s, namespace)
    admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="hold"),
        spec=client.V1PodDisruptionBudgetSpec(min_available=1,
                                              selector=client.V1LabelSelector(match_labels={"app": deploy}))))
    view = await wait_phase(handle, NodePhase.SERVING, timeout=90)
    home = unique("home")
    stack.cluster.create_kwok_node(home, labels={"nvidia.com/gpu.product": s["product"]})
    try:
        await wait_phase(handle, NodePhase.DRAINING, timeout=60)  # held there by the PDB
        s["workers"].kill()
        s["workers"].start()
        admin.policy.patch_namespaced_pod_disruption_budget("hold", namespace, {"spec": {"minAvailable": 0}})
        done = await result(handle, timeout=150)
        assert done.phase == NodePhase.COMPLETED, done.message
        _exactly_one_instance_none_left(s, stack, view)
    finally:
        admin.apps.delete_namespaced_deployment(deploy, namespace)
        admin.core.delete_node(home)


async def test_killed_while_serving_drains_within_seconds(stack: BurstStack, scenario: dict[str, Any],
                                                          namespace: str) -> None:
    """Issue 26: after a SIGKILL and a restart, a serving node whose workload is deleted starts draining within
    seconds of the new worker being up (its serve activity's 5 s heartbeat timeout; the 2 s sticky timeout), not
    after the minute the old 60 s heartbeat timeout cost. The bound tells the two apart with room for a loaded
    CI machine (5.3 s seen there); the figure (2.3 s on an idle machine) is printed and kept in bench/README.md."""
    s = scenario
    s["workers"].start()
    handle, deploy = await _start_workload(stack, s, namespace)
    view = await wait_phase(handle, NodePhase.SERVING, timeout=150)
    s["workers"].kill()
    s["workers"].start(wait=True)
    t0 = time.monotonic()
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    await wait_phase(handle, NodePhase.DRAINING, NodePhase.COMPLETED, timeout=60)
    took = time.monotonic() - t0
    print(f"delete -> Draining {took:.2f} s after the worker restart")
    assert took < 20.0, f"delete -> Draining {took:.1f} s after the worker restart"
    done = await result(handle, timeout=150)
    assert done.phase == NodePhase.COMPLETED, done.message
    _exactly_one_instance_none_left(s, stack, view)
