"""The optimizer's side of the hub (R2.x), end to end: the hub as a real process (`python -m hub.server`), the
real control plane, the Temporal dev server and the worker with its HubSync workflow polling every second."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError

from hub.db import Cluster as HubCluster
from hub.db import Database
from hub.db import Policy as HubPolicy
from hub.plans import parse_plan
from models.decisions import Approval
from models.drain import DrainStatus
from models.hub import CONDITION_HUB_CONNECTED
from models.hub import CONDITION_READY
from models.hub import LABEL_SOURCE
from models.hub import REASON_UNAUTHORIZED
from models.hub import REASON_UNKNOWN_LOCATION
from models.hub import REASON_UNREACHABLE
from models.hub import HubSyncStatus
from models.hub import PolicySyncOutcome
from models.hub import hub_sync_workflow_id
from models.node import NodePhase
from models.policy import API_GROUP
from models.policy import PLURAL
from models.provisioning import BatchPhase
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import provision_state
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.crd import read_gpupolicy
from tests.harness.kube import until
from tests.hub.process import SeededHub
from worker import ops
from worker.audit_verify import fetch_hub
from worker.audit_verify import verify_file_against_hub
from worker.audit_verify import verify_hub

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
POLL = 1.0


def policy(name: str, *, mode: str, max_nodes: int = 2, locations: list[str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
            "spec": {"kind": "Burst", "mode": mode, "workloads": {"tolerate": BURST_TAINT_KEY},
                     "locations": locations or ["sim/eu-west"],
                     "limits": {"maxNodes": max_nodes, "maxGpuHour": 4.5}, "returnHome": True}}


@dataclass
class Hub(SeededHub):
    """The seeded hub, with what these tests do through its admin API."""

    def put(self, doc: dict[str, Any]) -> None:
        r = self.admin.put(f"/v1/clusters/{self.cluster}/policies/{doc['metadata']['name']}", json=doc)
        assert r.status_code in (200, 201), r.text

    def delete(self, name: str) -> None:
        assert self.admin.delete(f"/v1/clusters/{self.cluster}/policies/{name}").status_code == 200

    def decide(self, operation: str, decision: str, **extra: Any) -> httpx.Response:
        return self.admin.post(f"/v1/clusters/{self.cluster}/approvals",
                               json={"operation": operation, "decision": decision, **extra})

    async def decide_when_proposed(self, operation: str, decision: str, **extra: Any) -> None:
        """The hub takes a decision only once the cluster's `proposed` report arrived (its next poll)."""
        await until(lambda: any(r["operation"] == operation and r["action"] == "proposed" for r in self.reports()),
                    timeout=30, what=f"the proposal of {operation} reported to the hub")
        r = self.decide(operation, decision, **extra)
        assert r.status_code == 201, r.text

    def rotate(self) -> str:
        r = self.admin.post(f"/v1/clusters/{self.cluster}/token/rotate")
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]
        return token

    def revoke(self) -> None:
        assert self.admin.post(f"/v1/clusters/{self.cluster}/token/revoke").status_code == 200

    def mount(self, token: str) -> None:
        """What the kubelet does with a rotated Secret: a new file swapped in atomically."""
        tmp = self.token_file.with_suffix(".new")
        tmp.write_text(token + "\n")
        tmp.replace(self.token_file)

    def reports(self) -> list[dict[str, Any]]:
        r = self.admin.get(f"/v1/clusters/{self.cluster}/reports", params={"limit": 500})
        assert r.status_code == 200, r.text
        reports: list[dict[str, Any]] = r.json()["reports"]
        return reports

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.admin.get(f"/v1/clusters/{self.cluster}").json()
        return info


@dataclass
class Optimizer:
    temporal: Client
    cluster: str
    hub: Hub
    stack: BurstStack
    audit_log: Path

    @property
    def sync(self) -> WorkflowHandle[Any, Any]:
        return self.temporal.get_workflow_handle(hub_sync_workflow_id(self.cluster))

    async def sync_status(self) -> HubSyncStatus:
        status: HubSyncStatus = await self.sync.query("status", result_type=HubSyncStatus)
        return status

    def gpupolicy(self, name: str) -> dict[str, Any] | None:
        return read_gpupolicy(self.stack.cluster, name)

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        obj = self.gpupolicy(name) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return dict(cond)
        return None

    async def synced_policy(self, mode: str, max_nodes: int = 2) -> str:
        """A new policy put in the hub, once the sync has created its GpuPolicy."""
        name = unique("p")
        self.hub.put(policy(name, mode=mode, max_nodes=max_nodes))
        await until(lambda: self.gpupolicy(name), timeout=30, what=f"policy {name} synced")
        return name

    def create_workload(self, namespace: str) -> str:
        """A GPU Deployment home cannot fit."""
        deploy = unique("infer")
        self.stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        return deploy

    async def pending_workload(self, namespace: str, policy_name: str) -> tuple[str, WorkflowHandle[Any, Any]]:
        """A GPU Deployment home cannot fit, and the handle of the node workflow its batch starts."""
        deploy = self.create_workload(namespace)
        return deploy, await node_for(self.temporal, self.cluster, policy_name, f"{namespace}/{deploy}-")

    async def end_workload(self, namespace: str, deploy: str, handle: WorkflowHandle[Any, Any]) -> None:
        """The workload gone, its node workflow Completed (the burst node drained and removed)."""
        self.stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        await wait_phase(handle, NodePhase.COMPLETED, timeout=120)

    def burst_nodes(self, policy_name: str) -> list[str]:
        nodes = self.stack.cluster.admin.core.list_node(label_selector=f"gpu.kubeon.io/policy={policy_name}")
        return [str(n.metadata.name) for n in nodes.items]


@pytest.fixture
def hub_class() -> type[Hub]:
    return Hub


@pytest.fixture
async def optimizer(stack: BurstStack, hub: Hub, start_worker: StartWorker) -> AsyncIterator[Optimizer]:
    async with start_worker(SIM_LOCATIONS, cluster_name=hub.cluster, hub_url=hub.process.url,
                            hub_token_file=hub.token_file, hub_poll_interval=POLL) as (temporal, _settings, runtime):
        opt = Optimizer(temporal=temporal, cluster=hub.cluster, hub=hub, stack=stack, audit_log=runtime.audit.path)
        try:
            yield opt
        finally:
            await opt.sync.terminate("test over")
    # Hub-synced policies are cluster-scoped: remove what this test's hub made.
    for obj in stack.cluster.admin.custom.list_cluster_custom_object(
            API_GROUP, "v1", PLURAL, label_selector=f"{LABEL_SOURCE}=hub")["items"]:
        stack.delete_policy(obj["metadata"]["name"])


async def test_policies_sync_edits_are_undone_deletions_pruned_and_a_rotated_token_is_used(
        optimizer: Optimizer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kubeon.hub")
    hub, first, second = optimizer.hub, unique("p"), unique("p")
    hub.put(policy(first, mode="Recommend", max_nodes=3))
    hub.put(policy(second, mode="Approve"))

    def synced(name: str) -> dict[str, Any] | None:
        obj = optimizer.gpupolicy(name)
        ready = optimizer.condition(name, CONDITION_READY)
        return obj if obj and ready and ready["status"] == "True" else None

    obj = await until(lambda: synced(first), timeout=30, what=f"{first} synced from the hub")
    assert await until(lambda: synced(second), timeout=30, what=f"{second} synced")
    assert obj["spec"]["limits"]["maxNodes"] == 3 and obj["metadata"]["labels"][LABEL_SOURCE] == "hub"
    status = obj["status"]
    assert status["effectiveMode"] == "Recommend"  # the Enforced column
    assert status["observedGeneration"] == obj["metadata"]["generation"] and status["lastSyncTime"]
    assert optimizer.condition(first, CONDITION_HUB_CONNECTED)["status"] == "True"
    await until(lambda: any("policies synced" in r.getMessage() and r.levelno == logging.INFO
                            for r in caplog.records), timeout=10, what="the worker to log 'policies synced' (R1.5)")
    # Polls that change nothing log at DEBUG: at INFO one line per new outcome, not one per poll.
    def synced_lines(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if "policies synced" in r.getMessage() and r.levelno == level]

    await until(lambda: len(synced_lines(logging.DEBUG)) >= 3, timeout=30, what="three polls that change nothing")
    said = [line.removesuffix(", not modified on the hub") for line in synced_lines(logging.INFO)]
    assert len(said) == len(set(said)), said

    # A direct edit (kubectl edit) is overwritten on the next sync (R2.6).
    optimizer.stack.cluster.admin.custom.patch_cluster_custom_object(
        API_GROUP, "v1", PLURAL, first, {"spec": {"mode": "Automatic", "limits": {"maxNodes": 99}}})
    await until(lambda: (o := optimizer.gpupolicy(first)) and o["spec"]["limits"]["maxNodes"] == 3
             and o["spec"]["mode"] == "Recommend", timeout=30, what="the kubectl edit undone")

    # A change in the hub arrives; a policy deleted in the hub is pruned.
    hub.put(policy(first, mode="Approve", max_nodes=3))
    hub.delete(second)
    await until(lambda: optimizer.gpupolicy(second) is None, timeout=30, what=f"{second} pruned")
    await until(lambda: (o := optimizer.gpupolicy(first)) and o["status"].get("effectiveMode") == "Approve",
             timeout=30, what="the hub's change applied and its status updated")

    # Rotation: the new token, swapped into the mounted file, is used without a restart; the old one then dies.
    hub.mount(hub.rotate())
    await until(lambda: [t for t in hub.info()["tokens"] if t["state"] == "superseded"], timeout=30,
             what="the old token superseded by the new one's first use")
    status_before = (await optimizer.sync_status()).polls
    await until(lambda: hub.info()["status"] == "connected", timeout=10, what="the cluster connected")
    await _polled_again(optimizer, status_before)
    assert (await optimizer.sync_status()).state == "connected"


async def _synced_with(optimizer: Optimizer, check: Callable[[PolicySyncOutcome], bool]) -> HubSyncStatus:
    """The sync's status once its last policy sync passes ``check`` (the poll that reported to the hub may still
    be finishing when the report is seen there)."""
    for _ in range(300):
        status = await optimizer.sync_status()
        if status.last_sync is not None and check(status.last_sync):
            return status
        await asyncio.sleep(0.1)
    raise AssertionError(f"the hub sync's status never showed the expected policy sync: {status}")


async def _polled_again(optimizer: Optimizer, polls: int, times: int = 2) -> HubSyncStatus:
    for _ in range(300):
        status = await optimizer.sync_status()
        if status.polls >= polls + times:
            return status
        await asyncio.sleep(0.1)
    raise AssertionError(f"the hub sync did not poll {times} more times: {status}")


async def test_approval_in_the_hub_launches_and_a_rejection_launches_nothing(
        optimizer: Optimizer, namespace: str) -> None:
    hub = optimizer.hub
    name = await optimizer.synced_policy("Approve")
    apps = optimizer.stack.cluster.admin.apps
    # An operation the cluster never proposed: refused, nothing is stored that could never be acted on.
    never = hub.decide("op-000000000000", "approve")
    assert never.status_code == 404 and never.json()["error"] == "operation_not_proposed", never.text

    def proposal(not_batch: str = "") -> Any:
        return provision_state(optimizer.temporal, optimizer.cluster, name,
                               lambda v: v.proposal is not None and v.proposal.batch != not_batch)

    rejected_deploy = optimizer.create_workload(namespace)
    rejected = (await proposal()).proposal
    assert rejected is not None
    await hub.decide_when_proposed(rejected.batch, "reject", reason="too dear")
    view = await provision_state(optimizer.temporal, optimizer.cluster, name,
                                 lambda v: bool(v.batches) and v.batches[-1].batch == rejected.batch)
    assert view.batches[-1].phase == BatchPhase.REJECTED and "too dear" in view.batches[-1].message
    apps.delete_namespaced_deployment(rejected_deploy, namespace)

    approved_deploy = optimizer.create_workload(namespace)
    approved = (await proposal(rejected.batch)).proposal
    assert approved is not None
    await hub.decide_when_proposed(approved.batch, "approve", plan_id=approved.plan.plan_id, reason="needed")
    handle = await node_for(optimizer.temporal, optimizer.cluster, name, f"{namespace}/{approved_deploy}-")
    serving = await wait_phase(handle, NodePhase.SERVING)
    view = await provision_state(optimizer.temporal, optimizer.cluster, name)
    assert view.batches[-1].approver is not None and view.batches[-1].approver.startswith("hub:")
    assert optimizer.burst_nodes(name) == [serving.node_name]  # one node: the approved batch's

    apps.delete_namespaced_deployment(approved_deploy, namespace)
    await wait_phase(handle, NodePhase.COMPLETED, timeout=120)
    await until(lambda: not optimizer.burst_nodes(name), timeout=30, what="the burst node removed")

    def reported() -> dict[str, list[str]] | None:
        by_op: dict[str, list[str]] = {}
        for r in hub.reports():
            by_op.setdefault(r["operation"], []).append(r["action"])
        return by_op if "removed" in by_op.get(serving.operation, []) and by_op.get(rejected.batch) else None

    by_op = await until(reported, timeout=30, what="every action reported to the hub")
    assert by_op[approved.batch] == ["proposed", "approved"]  # the batch ...
    assert by_op[serving.operation] == ["launched", "joined", "verified", "drained", "removed"]  # ... its node
    assert by_op[rejected.batch] == ["proposed", "rejected"]
    launched = next(r for r in hub.reports() if r["action"] == "launched")
    assert launched["location"] == "sim/eu-west" and launched["instance"] and launched["node"]
    # The proposal carries its whole plan, as the hub's Approvals page shows it and binds a decision to it.
    proposed = next(r for r in hub.reports() if r["operation"] == approved.batch and r["action"] == "proposed")
    plan = parse_plan(proposed["detail"])
    assert plan is not None and plan.plan_id == approved.plan.plan_id and plan.batch == approved.batch
    assert [(n.location, n.instance_type, n.pods) for n in plan.nodes] == [
        (n.offering.location, n.offering.instance_type, n.pods) for n in approved.plan.new_nodes]
    assert plan.total == approved.plan.total_usd_per_hour
    # Each report names its record's place in the worker's audit log; the hub's copy anchors the file.
    assert all(r["audit_chain"] and r["audit_seq"] for r in hub.reports()
               if r["operation"] in (approved.batch, serving.operation, rejected.batch))
    async with httpx.AsyncClient(base_url=hub.process.url, headers=dict(hub.admin.headers)) as admin:
        data = await fetch_hub(admin)
    outcomes = [*verify_file_against_hub(optimizer.audit_log, data), *verify_hub(data)]
    assert all(o.ok for o in outcomes), "\n".join(o.render() for o in outcomes)
    assert [h["problem"] for h in data.reported] == [None]
    # A decision for a batch no longer awaiting approval is refused, not applied to a later proposal.
    with pytest.raises(ops.DecisionRefused):
        await ops.approve(optimizer.temporal, approved.batch, Approval(approver="late"))


async def test_revoked_token_stops_all_actions_until_a_valid_token_is_mounted(
        optimizer: Optimizer, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kubeon.hub")
    hub = optimizer.hub
    name = await optimizer.synced_policy("Automatic")
    hub.revoke()
    cond = await until(lambda: (c := optimizer.condition(name, CONDITION_HUB_CONNECTED)) and c["status"] == "False"
                    and c, timeout=10, what="the policy marked disconnected within a poll")
    assert cond["reason"] == REASON_UNAUTHORIZED
    assert any("rejected this cluster's token" in r.getMessage() for r in caplog.records)
    assert (await optimizer.sync_status()).state == "unauthorized"

    # A pending workload under an Automatic policy: the operation holds; nothing is launched in the cluster.
    deploy = optimizer.create_workload(namespace)
    handle = await node_for(optimizer.temporal, optimizer.cluster, name, f"{namespace}/{deploy}-")
    held = await wait_phase(handle, NodePhase.HELD)
    assert "token" in held.message and held.instance is None
    status_before = await optimizer.sync_status()
    await _polled_again(optimizer, status_before.polls)
    assert (await wait_phase(handle, NodePhase.HELD)).instance is None
    assert optimizer.burst_nodes(name) == []

    # A valid token, mounted without a restart: the operation goes on from where it held.
    hub.mount(hub.rotate())
    serving = await wait_phase(handle, NodePhase.SERVING, timeout=60)
    assert optimizer.burst_nodes(name) == [serving.node_name]
    assert optimizer.condition(name, CONDITION_HUB_CONNECTED)["status"] == "True"
    await optimizer.end_workload(namespace, deploy, handle)


async def test_hub_down_keeps_policies_enforced_and_reports_arrive_once_when_it_returns(
        optimizer: Optimizer, namespace: str) -> None:
    hub = optimizer.hub
    name = await optimizer.synced_policy("Automatic")
    hub.process.stop()

    cond = await until(lambda: (c := optimizer.condition(name, CONDITION_HUB_CONNECTED)) and c["status"] == "False"
                    and c, timeout=10, what="the policy marked unreachable")
    assert cond["reason"] == REASON_UNREACHABLE
    # The last policies stay enforced: a burst runs to Serving with the hub down.
    deploy, handle = await optimizer.pending_workload(namespace, name)
    serving = await wait_phase(handle, NodePhase.SERVING, timeout=60)
    status = await _polled_again(optimizer, (await optimizer.sync_status()).polls)
    assert status.state == "unreachable" and status.pending_reports == 3  # launched, joined, verified

    hub.process.start()

    def delivered() -> list[dict[str, Any]] | None:
        reports = [r for r in hub.reports() if r["operation"] == serving.operation]
        return reports if len(reports) >= 3 else None

    keys = await until(delivered, timeout=30, what="the queued reports delivered")
    assert [r["action"] for r in keys] == ["launched", "joined", "verified"]
    assert len({r["idempotency_key"] for r in keys}) == len(keys)
    await _polled_again(optimizer, (await optimizer.sync_status()).polls)
    assert (await optimizer.sync_status()).pending_reports == 0
    assert len([r for r in hub.reports() if r["operation"] == serving.operation]) == 3  # delivered once
    await optimizer.end_workload(namespace, deploy, handle)


async def test_invalid_policy_from_the_hub_keeps_the_last_good_one_and_is_reported(
        optimizer: Optimizer, tmp_path: Path) -> None:
    hub = optimizer.hub
    name = await optimizer.synced_policy("Approve")

    # A newer hub may hold a document this optimizer version refuses (this hub validates with the same models,
    # so write it into its database as such a hub would have stored it).
    db = Database(f"sqlite:///{tmp_path / 'hub.db'}")
    try:
        with db.session() as s:
            cluster = s.scalar(select(HubCluster).where(HubCluster.name == hub.cluster))
            row = s.scalar(select(HubPolicy).where(HubPolicy.name == name))
            assert cluster is not None and row is not None
            bad = policy(name, mode="Automatic", max_nodes=9)
            bad["spec"]["locations"] = ["Not A Location"]
            cluster.policy_revision += 1
            row.document, row.revision = bad, cluster.policy_revision
            s.commit()
    finally:
        db.dispose()

    ready = await until(lambda: (c := optimizer.condition(name, CONDITION_READY)) and c["status"] == "False" and c,
                        timeout=30, what="the invalid policy's status to say why")
    assert ready["reason"] == "InvalidPolicy" and "spec.locations[0]" in ready["message"]
    live = optimizer.gpupolicy(name)
    assert live is not None  # the last good version stays in force
    assert live["spec"]["mode"] == "Approve" and live["spec"]["limits"]["maxNodes"] == 2
    failed = await until(lambda: [r for r in hub.reports() if r["operation"] == f"policy/{name}"], timeout=30,
                         what="the refusal reported to the hub")
    assert failed[0]["action"] == "failed" and "spec.locations[0]" in failed[0]["detail"]
    await _synced_with(optimizer, lambda sync: sync.invalid.keys() == {name})


async def test_policy_naming_a_location_this_cluster_does_not_configure_is_not_ready_and_reported(
        optimizer: Optimizer) -> None:
    hub, name = optimizer.hub, unique("p")
    hub.put(policy(name, mode="Automatic", locations=["sim/eu-west", "sim/nowhere"]))

    ready = await until(lambda: (c := optimizer.condition(name, CONDITION_READY)) and c["status"] == "False" and c,
                        timeout=30, what=f"{name} marked not ready")
    assert ready["reason"] == REASON_UNKNOWN_LOCATION
    assert "spec.locations[1]: location 'sim/nowhere' is not configured on this cluster" in ready["message"]
    assert "sim/eu-west" in ready["message"].split("burst.locations:")[1]  # what is configured, to compare
    failed = await until(lambda: [r for r in hub.reports() if r["operation"] == f"policy/{name}"], timeout=30,
                         what="the policy's problem reported to the hub")
    assert failed[0]["action"] == "failed" and "sim/nowhere" in failed[0]["detail"]
    await _synced_with(optimizer, lambda sync: sync.not_ready.keys() == {name})

    # Fixed in the hub: Ready again.
    hub.put(policy(name, mode="Automatic", locations=["sim/eu-west"]))
    await until(lambda: (c := optimizer.condition(name, CONDITION_READY)) and c["status"] == "True", timeout=30,
                what=f"{name} ready again")


async def test_revoked_token_holds_a_return_home_until_a_valid_token_is_mounted(
        optimizer: Optimizer, namespace: str) -> None:
    hub = optimizer.hub
    name = await optimizer.synced_policy("Automatic")
    deploy, handle = await optimizer.pending_workload(namespace, name)
    serving = await wait_phase(handle, NodePhase.SERVING, timeout=60)

    hub.revoke()
    await until(lambda: (c := optimizer.condition(name, CONDITION_HUB_CONNECTED)) and c["status"] == "False",
                timeout=10, what="the policy marked disconnected")
    # The workload goes: return home would start now, but no drain starts while the token is refused.
    optimizer.stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    drain = optimizer.temporal.get_workflow_handle(f"drain/{handle.id}/{serving.operation}")

    async def drain_status() -> str:
        try:
            status: DrainStatus = await drain.query("status", result_type=DrainStatus)
        except RPCError:
            return "not started"
        return status.status

    for _ in range(300):
        if (status := await drain_status()).startswith("held"):
            break
        await asyncio.sleep(0.1)
    assert status.startswith("held") and "token" in status
    node = optimizer.stack.cluster.admin.core.read_node(str(serving.node_name))
    assert not node.spec.unschedulable  # not even cordoned

    hub.mount(hub.rotate())
    done = await wait_phase(handle, NodePhase.COMPLETED, timeout=120)
    assert "returned home" in done.message
    assert optimizer.burst_nodes(name) == []
