"""Cost on actuals end to end (issue 27, part 1 on the worker's side): a sim burst node serves, its transfer is
read from the gateway while it serves and once more before its removal, and `ops show`, the workflow's state
query, the "removed" audit record (the hub's report detail) and ``kubeon_burst_cost_usd_total`` carry compute
hours x $/h plus the measured egress x the location's $/GB.

Stand-in: sim nodes have no tunnel, so the in-process gateway (``KubeGateway``) reports ``measuredAt`` 0 for them;
here its ``transfer`` is replaced by one that hands out growing counters (and fails its first call, as an
unreachable gateway does: ``GatewayUnavailable``). Everything else is the real gateway, control plane, dev server
and worker. The counting itself is the gateway's, tested on real WireGuard in ``tests/gateway/test_transfer*.py``."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import REGISTRY
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.clients.gateway import GatewayUnavailable
from gateway.service import KubeGateway
from models.cost import BYTES_PER_GB
from models.join import GatewayCapacity
from models.join import JoinTicketRequest
from models.join import NodeIdentity
from models.join import NodeProbe
from models.join import NodeTransfer
from models.join import TicketGrant
from models.labels import LABEL_POLICY
from models.node import NodePhase
from models.node import OperationView
from models.provisioning import ProvisionView
from tests.harness.burst import BurstStack
from tests.harness.burst import drain_blocked
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import node_workflows
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.kube import until
from worker import ops
from worker.cli import _render_view as render_view
from worker.main import worker_services

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

LOCATION = "sim/cost-west"
RATE = 0.05  # USD/GB, the location's transfer.usdPerGb
OTHER = "sim/cost-east"  # the same offering elsewhere: where a policy's next node goes once one location is dear
LOCATIONS: list[dict[str, Any]] = [{
    "name": name, "sim": {"bootSeconds": 0.3}, "transfer": {"usdPerGb": RATE, "egressGbPerGpuHour": 2},
    "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.9}]}
    for name in (LOCATION, OTHER)]


class MeteredGateway:
    """The in-process gateway, its transfer answered from growing counters: call n (n >= 2) reports n GB egress
    and n MiB ingress; the first call fails as an unreachable gateway does."""

    def __init__(self, gateway: KubeGateway, stack: BurstStack) -> None:
        self.gateway = gateway
        self.stack = stack
        self.calls: list[int] = []  # rx handed out (0: the failed call)
        self.cordoned: list[bool] = []  # whether the Node was cordoned (draining) at each call

    def stop(self) -> None:  # the runtime's close stops the gateway's reconciler
        self.gateway.stop()

    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant:
        return self.gateway.issue_ticket(request)

    def capacity(self) -> GatewayCapacity:
        return self.gateway.capacity()

    def remove_node(self, node_name: str, *, operation: str) -> bool:
        return self.gateway.remove_node(node_name, operation=operation)

    def probe(self, node_name: str, *, operation: str) -> NodeProbe:
        return self.gateway.probe(node_name, operation=operation)

    def identity(self, node_name: str, *, operation: str) -> NodeIdentity:
        return self.gateway.identity(node_name, operation=operation)

    def transfer(self, node_name: str, *, operation: str) -> NodeTransfer:
        self.gateway.transfer(node_name, operation=operation)  # the real gateway still checks ownership
        node = self.stack.cluster.admin.core.read_node(node_name)
        self.cordoned.append(bool(node.spec.unschedulable))
        n = len(self.calls) + 1
        if n == 1:
            self.calls.append(0)
            raise GatewayUnavailable("burst gateway https://gw.test: the transfer failed: cannot connect")
        self.calls.append(n * BYTES_PER_GB)
        return NodeTransfer.model_validate({"rxBytes": n * BYTES_PER_GB, "txBytes": n * 2 ** 20,
                                            "measuredAt": time.time()})


@pytest.fixture
async def metered(stack: BurstStack, temporal_dev_server: WorkflowEnvironment
                  ) -> AsyncIterator[tuple[Client, str, MeteredGateway, Path]]:
    from worker.runtime import build_runtime

    queue = unique("q")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=LOCATIONS, cluster_name=queue, transfer_check_seconds=1)
    inner = stack.gateway()
    gateway = MeteredGateway(inner, stack)
    runtime = build_runtime(settings, gateway=gateway, redeem=inner.join)
    async with worker_services(settings, runtime) as (temporal, _runtime, _watcher):
        yield temporal, settings.cluster, gateway, runtime.audit.path


def _counted(kind: str) -> float:
    return REGISTRY.get_sample_value("kubeon_burst_cost_usd_total", {"location": LOCATION, "kind": kind}) or 0.0


async def test_a_served_node_shows_its_actual_cost_beside_the_estimate(
        stack: BurstStack, metered: tuple[Client, str, MeteredGateway, Path], namespace: str, policy: str) -> None:
    temporal, cluster, gateway, audit_file = metered
    before = {k: _counted(k) for k in ("compute", "transfer")}
    stack.create_policy(policy, mode="Automatic", locations=[LOCATION], max_nodes=1)
    deploy = unique("egress")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    handle = await node_for(temporal, cluster, policy, f"{namespace}/{deploy}-")
    serving = await wait_phase(handle, NodePhase.SERVING)
    # While serving the failed read did not end the serve and a later one succeeded.
    await until(lambda: len(gateway.calls) >= 3, timeout=30, what="transfer read while serving")
    assert gateway.calls[0] == 0
    # `ops show` prices the serve's newest reading (in its heartbeat) while the node serves.
    live = await ops.show(temporal, serving.operation)
    assert isinstance(live, OperationView) and live.cost is not None and not live.cost.final
    assert live.cost.transfer_measured and live.cost.egress_bytes >= 2 * BYTES_PER_GB, live.cost

    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    done = await result(handle)
    assert done.phase == NodePhase.COMPLETED, done.message
    view = await handle.query("state", result_type=OperationView)
    cost = view.cost
    assert cost is not None and cost.final and cost.transfer_measured
    # The drain's read before removal (the Node cordoned) is the last one: the cost is priced from it.
    last = gateway.calls[-1]
    assert gateway.cordoned[-1] and not gateway.cordoned[0], gateway.cordoned
    assert cost.egress_bytes == last and cost.ingress_bytes == last // 1024
    assert cost.transfer_usd == pytest.approx(last / 2 ** 30 * RATE)
    assert cost.compute_usd == pytest.approx(0.9 * cost.compute_hours, abs=1e-6) and 0 < cost.compute_hours < 0.1
    assert cost.total_usd == pytest.approx(cost.compute_usd + cost.transfer_usd, abs=1e-5)
    # The estimate made at the proposal: 0.9 $/h + 2 GB/GPU-h x 0.05 $/GB.
    assert cost.estimated_usd_per_gpu_hour == pytest.approx(1.0)
    assert cost.usd_per_gpu_hour > 1.0  # so much egress in so few seconds is dearer than estimated

    shown = await ops.show(temporal, serving.operation)
    assert isinstance(shown, OperationView) and shown.cost == cost
    text = render_view(shown)
    assert f"transfer ${cost.transfer_usd:.4f} (measured: {last} B egress" in text, text
    assert "$1.0000 estimated at the proposal" in text, text

    removed = [r for r in _audit(audit_file) if r.get("operation") == serving.operation
               and r.get("action") == "removed"]
    assert removed and f"transfer ${cost.transfer_usd:.4f}" in removed[0]["detail"], removed
    assert _counted("compute") - before["compute"] == pytest.approx(cost.compute_usd)
    assert _counted("transfer") - before["transfer"] == pytest.approx(cost.transfer_usd)

    # The estimate learns: the provisioning keeps the egress per GPU-hour the node measured in its location, and
    # the policy's next plan prices transfer at it (so many GB in seconds: over maxGpuHour), saying so.
    view_p = await provision_state(temporal, cluster, policy, lambda v: LOCATION in v.learned_egress)
    learned = view_p.learned_egress[LOCATION]
    assert learned.nodes == 1
    assert learned.gb_per_gpu_hour == pytest.approx(last / BYTES_PER_GB / cost.compute_hours, rel=1e-3)
    again = unique("egress")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(again))

    def refused_on_measured(v: ProvisionView) -> bool:
        # Priced at what the provisioning has learned when it plans (read in the same view: a later reading of
        # the node may still refine it), the transfer rounded to 4 decimals as the planner does.
        rate = v.learned_egress[LOCATION].gb_per_gpu_hour if LOCATION in v.learned_egress else None
        for line in v.waiting:
            found = re.search(r"\$([0-9.]+)/GPU-h with measured transfer over maxGpuHour", line)
            if rate is not None and found and line.startswith(f"{namespace}/{again}-"):
                return abs(float(found.group(1)) - (round(rate * RATE, 4) + 0.9)) <= 0.0051
        return False

    await provision_state(temporal, cluster, policy, refused_on_measured)
    stack.cluster.admin.apps.delete_namespaced_deployment(again, namespace)


def _audit(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _set_over_budget(stack: BurstStack, policy: str, action: str) -> None:
    from models.policy import API_GROUP
    from models.policy import PLURAL

    stack.cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, policy,
                                                           {"spec": {"limits": {"onOverBudget": action}}})


async def test_over_budget_on_actuals_reported_then_drained(
        stack: BurstStack, metered: tuple[Client, str, MeteredGateway, Path], namespace: str, policy: str) -> None:
    """maxGpuHour 1.5 admits the offering (estimated $1.00/GPU-h) but not GBs of egress within seconds: Report
    (the default) records it and the node serves on; switched to Drain, the next node drains with the reason. That
    next node is in the other location: the first one's measured egress priced its own location over the limit."""
    temporal, cluster, _gateway, _audit_file = metered
    stack.create_policy(policy, mode="Automatic", locations=[LOCATION, OTHER], max_nodes=1, max_gpu_hour=1.5)
    deploy = unique("over")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    handle = await node_for(temporal, cluster, policy, f"{namespace}/{deploy}-")

    async def reported() -> OperationView:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            view = await handle.query("state", result_type=OperationView)
            if view.over_budget:
                return view
            await asyncio.sleep(0.5)
        raise AssertionError("no over-budget report within 60 s")

    view = await reported()
    assert view.phase == NodePhase.SERVING and view.over_budget.endswith(": reported"), view.over_budget
    assert "maxGpuHour $1.5000" in view.over_budget and "onOverBudget Report" in view.over_budget
    assert sum("over budget on actuals" in h for h in view.history) == 1  # reported once, not every reading

    # Drain: the node goes home with the reason, through the drain (cordon, Eviction API), while its pod still runs,
    # and as slowly as the pod's disruption budget says: blocked while it allows no eviction, done once relaxed.
    _set_over_budget(stack, policy, "Drain")
    stack.cluster.admin.apps.patch_namespaced_deployment(deploy, namespace, {"spec": {"replicas": 0}})
    done = await result(handle)
    assert done.phase == NodePhase.COMPLETED
    admin = stack.cluster.admin
    admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="keep-one"),
        spec=client.V1PodDisruptionBudgetSpec(min_available=1,
                                              selector=client.V1LabelSelector(match_labels={"app": deploy}))))
    admin.apps.patch_namespaced_deployment(deploy, namespace, {"spec": {"replicas": 1}})
    second = await node_for_other(temporal, cluster, policy, f"{namespace}/{deploy}-", handle.id)
    served = await wait_phase(second, NodePhase.DRAINING, timeout=60)
    _drain, status = await drain_blocked(temporal, second.id, served.operation)
    assert set(status.blocked.values()) == {"blocked by PDB keep-one"}
    [pod] = admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
    assert pod.spec.node_name == served.node_name and pod.metadata.deletion_timestamp is None  # still serving
    admin.policy.patch_namespaced_pod_disruption_budget("keep-one", namespace, {"spec": {"minAvailable": 0}})
    drained = await result(second)
    assert drained.phase == NodePhase.COMPLETED and "over budget on actuals" in drained.message, drained.message
    state = await second.query("state", result_type=OperationView)
    assert state.over_budget.endswith(": draining") and "onOverBudget Drain" in state.over_budget
    assert view.instance is not None and state.instance is not None
    assert {view.instance.location, state.instance.location} == {LOCATION, OTHER}
    assert state.cost is not None and state.cost.usd_per_gpu_hour > 1.5
    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    await until(lambda: not stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items,
                timeout=120, what="every burst node of the policy gone")


async def node_for_other(temporal: Client, cluster: str, policy: str, pod_prefix: str, not_id: str) -> Any:
    view = await provision_state(temporal, cluster, policy,
                                 lambda v: [w for w in node_workflows(v, pod_prefix) if w != not_id])
    return temporal.get_workflow_handle(next(w for w in node_workflows(view, pod_prefix) if w != not_id))
