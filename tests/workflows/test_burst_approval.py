"""A policy's provisioning under the time-skipping server: a trickle of pods under load is gathered into one
plan, one proposal per batch, an unapproved proposal expires
(without waiting an hour), a rejection launches nothing, the update validator refuses a stale plan or a decision
in the wrong phase, an approval starts one node workflow per planned node, the hub's hold keeps an approved node
from launching, and the state survives continue-as-new.

The side effects here are test activities under the production activity names (the workflows are what is
tested; the real activities are tested on the real parts elsewhere). Planning runs the real pure planner."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.client import WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models import provisioning
from models.audit import AuditRecord
from models.decisions import Approval
from models.decisions import Rejection
from models.hub import GateRequest
from models.hub import GateState
from models.ids import SERVE_QUEUE_SUFFIX
from models.node import BurstResult
from models.node import CleanupRequest
from models.node import CleanupResult
from models.node import LaunchRequest
from models.node import NodePhase
from models.node import OperationView
from models.provisioning import BatchPhase
from models.provisioning import BatchPlan
from models.provisioning import BatchPlanRequest
from models.provisioning import LoadPolicyRequest
from models.provisioning import Offering
from models.provisioning import OperationSettings
from models.provisioning import PendingPod
from models.provisioning import PodsWaiting
from models.provisioning import PolicySnapshot
from models.provisioning import ProvisionInput
from models.provisioning import ProvisionPhase
from models.provisioning import ProvisionView
from planning.burst import plan_pods
from tests.harness.temporal import skip_time
from tests.harness.temporal import time_skipping_server_path
from worker import ops
from worker.main import workflow_runner
from worker.runtime import register_search_attributes
from workflows.burst import BurstNodeWorkflow
from workflows.provision import ProvisionWorkflow

pytestmark = pytest.mark.temporal
TAINT = "gpu.kubeon.io/burst"
OFFERINGS = [Offering(location="sim/eu-west", instance_type="sim.l4.1", gpus=1, gpu_product="NVIDIA-L4",
                      instance_usd_per_hour=0.9, transfer_usd_per_gpu_hour=0.01),
             Offering(location="sim/eu-west", instance_type="sim.l4.4", gpus=4, gpu_product="NVIDIA-L4",
                      instance_usd_per_hour=3.0, transfer_usd_per_gpu_hour=0.01)]


@dataclass
class Recorded:
    audit: list[AuditRecord] = field(default_factory=list)
    launches: list[LaunchRequest] = field(default_factory=list)
    cleanups: list[CleanupRequest] = field(default_factory=list)
    plans: list[BatchPlanRequest] = field(default_factory=list)
    # The hub's hold (R2.3): set while "the hub rejects the token"; cleared to let held operations go on.
    hold: str = ""
    released: asyncio.Event = field(default_factory=asyncio.Event)
    gate_checks: list[str] = field(default_factory=list)
    launch_hangs: bool = False
    provisionings: list[str] = field(default_factory=list)
    mode: str = "Approve"
    # While set and not yet released, plan_batch waits: pods sent meanwhile arrive while a plan is being made.
    plan_gate: asyncio.Event | None = None

    def serve_activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="await_actions_allowed")
        async def await_actions_allowed(req: GateRequest) -> GateState:
            await self.released.wait()
            return GateState(held=False)

        return [await_actions_allowed]

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="action_gate")
        async def action_gate(req: GateRequest) -> GateState:
            self.gate_checks.append(req.policy)
            return GateState(held=bool(self.hold), reason=self.hold)

        @activity.defn(name="load_policy")
        async def load_policy(req: LoadPolicyRequest) -> PolicySnapshot:
            return PolicySnapshot(name=req.policy, mode=self.mode, tolerate=TAINT, locations=["sim/eu-west"],
                                  max_nodes=2 if self.mode == "Approve" else 20, max_gpu_hour=4.5,
                                  return_home=True)

        @activity.defn(name="plan_batch")
        async def plan_batch(req: BatchPlanRequest) -> BatchPlan:
            self.plans.append(req)
            if self.plan_gate is not None:
                await self.plan_gate.wait()
            p = req.policy
            return plan_pods(batch=req.batch, policy=p.name, taint_key=p.tolerate, pods=req.pods, rooms=[],
                             offerings=OFFERINGS, locations=p.locations, max_gpu_hour=p.max_gpu_hour,
                             max_new_nodes=req.max_new_nodes, max_nodes=p.max_nodes)

        @activity.defn(name="record_audit")
        async def record_audit(record: AuditRecord) -> bool:
            self.audit.append(record)
            return True

        @activity.defn(name="launch_instance")
        async def launch_instance(req: LaunchRequest) -> None:
            self.launches.append(req)
            while self.launch_hangs:  # a launch still under way: its node holds its place under maxNodes
                activity.heartbeat("launching")
                await asyncio.sleep(0.2)
            raise ApplicationError("must not launch", type="ProviderRejected", non_retryable=True)

        @activity.defn(name="cleanup_operation")
        async def cleanup_operation(req: CleanupRequest) -> CleanupResult:
            self.cleanups.append(req)
            return CleanupResult()

        return [load_policy, plan_batch, record_audit, launch_instance, cleanup_operation, action_gate]

    def actions(self, operation: str) -> list[str]:
        return [r.action for r in self.audit if r.operation == operation]


Env = tuple[WorkflowEnvironment, str, Recorded]
RECORDED: dict[str, Recorded] = {}  # task queue -> what its test started


@pytest.fixture
async def own_time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping server of this test alone: a provisioning is long-lived (timers, a node's launch under
    way), and on the session's shared server what it leaves would hold up later tests' time skipping."""
    server = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=str(time_skipping_server_path()),
                                                           data_converter=pydantic_data_converter)
    await register_search_attributes(server.client)
    try:
        yield server
    finally:
        await server.shutdown()


@pytest.fixture
async def env(own_time_skipping: WorkflowEnvironment) -> AsyncIterator[Env]:
    temporal_time_skipping = own_time_skipping
    recorded = Recorded()
    queue = f"q-{uuid.uuid4().hex[:6]}"
    RECORDED[queue] = recorded
    client = temporal_time_skipping.client
    async with (
        Worker(client, task_queue=queue, workflows=[ProvisionWorkflow, BurstNodeWorkflow],
               activities=recorded.activities(), workflow_runner=workflow_runner()),
        Worker(client, task_queue=queue + SERVE_QUEUE_SUFFIX, activities=recorded.serve_activities()),
    ):
        yield temporal_time_skipping, queue, recorded
        # The time-skipping server is shared by the session: end what this test started (the provisioning is
        # long-lived; its timers would keep later tests' time skipping busy).
        recorded.launch_hangs = False
        for wf_id in recorded.provisionings:
            with contextlib.suppress(Exception):
                view: ProvisionView = await client.get_workflow_handle(wf_id).query(ProvisionWorkflow.state)
                for node in [n for b in view.batches for n in b.nodes]:
                    with contextlib.suppress(Exception):
                        await client.get_workflow_handle(node).terminate("test over")
            with contextlib.suppress(Exception):
                await client.get_workflow_handle(wf_id).terminate("test over")


def _pods(count: int, prefix: str = "infer") -> list[PendingPod]:
    return [PendingPod(namespace="ml", name=f"{prefix}-{i}", uid=f"{prefix}-{i}", gpus=1,
                       node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}, tolerations=[TAINT])
            for i in range(count)]


async def _send(client: Client, queue: str, wf_id: str, pods: list[PendingPod], **inp: Any
                ) -> WorkflowHandle[Any, Any]:
    """What every watcher replica does: signal-with-start the policy's provisioning."""
    RECORDED[queue].provisionings.append(wf_id)
    return await client.start_workflow(
        ProvisionWorkflow.run,
        ProvisionInput(cluster="c", policy="p", settings=OperationSettings(approval_timeout_seconds=3600), **inp),
        id=wf_id, task_queue=queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal="pods_waiting", start_signal_args=[PodsWaiting(pods=pods)])


async def _until(handle: WorkflowHandle[Any, Any], check: Callable[[ProvisionView], bool]) -> ProvisionView:
    for _ in range(600):
        view: ProvisionView = await handle.query(ProvisionWorkflow.state)
        if check(view):
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"never reached: {view}")


async def _proposal(client: Client, queue: str, pods: list[PendingPod]) -> tuple[WorkflowHandle[Any, Any],
                                                                                 ProvisionView]:
    handle = await _send(client, queue, f"provision/c/p-{uuid.uuid4().hex[:6]}", pods)
    return handle, await _until(handle, lambda v: v.proposal is not None)


async def test_pods_arriving_while_a_plan_is_made_are_gathered_into_the_next_plan(env: Env) -> None:
    """Automatic plans a lone pod at once; under load (pods arrived while planning) the next plan waits for the
    trickle (KUBEON_BATCH_LOAD_IDLE_SECONDS) rather than planning whatever waits at that moment."""
    server, queue, recorded = env
    recorded.mode, recorded.launch_hangs, recorded.plan_gate = "Automatic", True, asyncio.Event()
    handle = await _send(server.client, queue, f"provision/c/p-{uuid.uuid4().hex[:6]}", _pods(1, prefix="first"))
    await _until(handle, lambda v: v.phase == ProvisionPhase.PLANNING)
    assert [len(r.pods) for r in recorded.plans] == [1]  # planned at once, nothing gathered
    for i in range(3):  # a trickle while the first plan is made
        await _send(server.client, queue, handle.id, _pods(1, prefix=f"trickle{i}"))
    await _until(handle, lambda v: len(v.waiting) == 4)
    recorded.plan_gate.set()
    await _until(handle, lambda v: len(v.batches) == 1 and bool(v.batches[0].nodes))
    # The first batch's node is started; a pod arriving now still goes into the next plan with the trickle.
    await _send(server.client, queue, handle.id, _pods(1, prefix="straggler"))
    await _until(handle, lambda v: len(v.batches) == 2)
    # (The first pod waits on, until the watcher says it is bound: this test's planner knows no nodes' room.)
    assert len(recorded.plans) == 2
    assert sorted(p.name for p in recorded.plans[1].pods if not p.name.startswith("first")) == sorted(
        ["straggler-0"] + [f"trickle{i}-0" for i in range(3)])


def _names(req: BatchPlanRequest) -> list[str]:
    """The pods a plan was asked about, but the first one (it waits on: this test's planner knows no room)."""
    return sorted(p.name for p in req.pods if not p.name.startswith("first"))


async def test_pods_coming_faster_than_one_a_window_are_gathered_into_one_plan(env: Env) -> None:
    """A quick plan has no pod arrive while it is made: a lone pod is still planned at once, but a second pod within
    KUBEON_BATCH_LOAD_IDLE_SECONDS makes a trickle, gathered into one plan rather than planned a pod at a time."""
    server, queue, recorded = env
    recorded.mode, recorded.launch_hangs = "Automatic", True
    handle = await _send(server.client, queue, f"provision/c/p-{uuid.uuid4().hex[:6]}", _pods(1, prefix="first"))
    await _until(handle, lambda v: len(v.batches) == 1 and bool(v.batches[0].nodes))
    await asyncio.sleep(1.2)  # the first pod's arrival out of the window
    for i in range(3):
        await _send(server.client, queue, handle.id, _pods(1, prefix=f"trickle{i}"))
        await asyncio.sleep(0.2)
    await _until(handle, lambda v: len(v.batches) == 3)
    assert [_names(r) for r in recorded.plans] == [[], ["trickle0-0"], ["trickle0-0", "trickle1-0", "trickle2-0"]]


async def test_a_trickle_is_planned_at_the_latest_its_window_after_its_first_pod_turned_unschedulable(
        env: Env) -> None:
    """The window under load counts from when the trickle's first pod turned Unschedulable (the scheduler's
    condition; the watcher's own gathering is inside it), not from when it arrived: pods that have waited longer
    than the window are planned at once, without waiting for the pods behind them."""
    server, queue, recorded = env
    recorded.mode, recorded.launch_hangs, recorded.plan_gate = "Automatic", True, asyncio.Event()
    handle = await _send(server.client, queue, f"provision/c/p-{uuid.uuid4().hex[:6]}", _pods(1, prefix="first"))
    await _until(handle, lambda v: v.phase == ProvisionPhase.PLANNING)
    long_ago = datetime.now(UTC) - timedelta(minutes=1)
    # Two pods that turned Unschedulable a minute ago (the watcher was down, say) arrive while the first is planned:
    # the next plan is under load.
    await _send(server.client, queue, handle.id, [p.model_copy(update={"unschedulable_since": long_ago})
                                                  for p in _pods(2, prefix="late")])
    await _until(handle, lambda v: len(v.waiting) == 3)
    recorded.plan_gate.set()
    await asyncio.sleep(0.3)  # inside the 1 s idle window of a trickle counted from its arrival
    await _send(server.client, queue, handle.id, _pods(1, prefix="behind"))
    await _until(handle, lambda v: len(v.batches) == 3)
    assert [_names(r) for r in recorded.plans] == [[], ["late-0", "late-1"], ["behind-0", "late-0", "late-1"]]


async def test_unapproved_proposal_expires(env: Env) -> None:
    server, queue, recorded = env
    handle, view = await _proposal(server.client, queue, _pods(1))
    assert view.phase == BatchPhase.AWAITING_APPROVAL
    await skip_time(server, timedelta(seconds=3610))  # an hour of workflow time, skipped
    view = await _until(handle, lambda v: bool(v.batches))
    assert view.batches[0].phase == BatchPhase.EXPIRED and view.proposal is None
    assert recorded.launches == []
    assert recorded.actions(view.batches[0].batch) == ["proposed", "expired"]
    assert "expired" in view.waiting[0]  # the pod still waits, and says why


async def test_one_proposal_covers_the_batch_and_pods_arriving_meanwhile_go_into_the_next(env: Env) -> None:
    server, queue, recorded = env
    recorded.launch_hangs = True
    handle, view = await _proposal(server.client, queue, _pods(5))
    assert view.proposal is not None
    first = view.proposal
    # Five one-GPU pods: one 4-GPU node and one 1-GPU node is the cheapest ($4.95/h against 5 x $0.91).
    assert sorted(n.offering.instance_type for n in first.plan.new_nodes) == ["sim.l4.1", "sim.l4.4"]
    assert sorted(p for n in first.plan.new_nodes for p in n.pods) == [f"ml/infer-{i}" for i in range(5)]
    await _send(server.client, queue, handle.id, _pods(2, prefix="late"))
    view = await _until(handle, lambda v: len(v.waiting) == 7)
    assert view.proposal is not None and view.proposal.plan.plan_id == first.plan.plan_id  # unchanged
    await handle.execute_update(ProvisionWorkflow.approve_update,
                                Approval(approver="alice", plan_id=first.plan.plan_id))
    # maxNodes 2 is held by the first batch's two nodes: the late pods are planned next, and wait, saying why.
    view = await _until(handle, lambda v: v.phase == ProvisionPhase.WAITING_FOR_CAPACITY)
    assert any(w.startswith("ml/late-0: maxNodes 2 reached") for w in view.waiting), view.waiting
    assert recorded.plans[0].max_new_nodes == 2 and recorded.plans[-1].max_new_nodes == 0
    assert len(view.nodes) == 2 and view.proposal is None
    assert recorded.actions(first.batch) == ["proposed", "approved"]


async def test_rejection_launches_nothing_and_stale_or_late_decisions_are_refused(env: Env) -> None:
    server, queue, recorded = env
    handle, view = await _proposal(server.client, queue, _pods(1))
    assert view.proposal is not None
    batch = view.proposal.batch
    with pytest.raises(WorkflowUpdateFailedError) as stale:
        await handle.execute_update(ProvisionWorkflow.approve_update, Approval(approver="dave", plan_id="plan-0"))
    assert "plan plan-0 is stale" in str(stale.value.cause)
    with pytest.raises(ops.DecisionRefused, match="not awaiting approval"):
        await ops.approve(server.client, handle.id, Approval(approver="dave", operation="op-other"))
    decided = await ops.reject(server.client, handle.id, Rejection(approver="carol", reason="cost"))
    assert "carol" in decided.message and decided.operation == batch
    view = await _until(handle, lambda v: bool(v.batches))
    assert view.batches[0].phase == BatchPhase.REJECTED
    assert recorded.launches == []
    assert recorded.actions(batch) == ["proposed", "rejected"]
    with pytest.raises(ops.DecisionRefused, match="not awaiting approval"):
        await ops.approve(server.client, handle.id, Approval(approver="dave"))
    with pytest.raises(ops.DecisionRefused, match="the policy's provisioning, not a node"):
        await ops.cancel(server.client, handle.id)  # it holds maxNodes and every batch's nodes


async def test_signal_approval_from_the_ui_starts_one_node_workflow_per_planned_node(env: Env) -> None:
    server, queue, recorded = env
    handle, view = await _proposal(server.client, queue, _pods(1))
    await handle.signal("approve")  # what `temporal workflow signal --name approve` sends
    view = await _until(handle, lambda v: bool(v.batches) and bool(v.batches[0].nodes))
    (node_id,) = view.batches[0].nodes
    node = server.client.get_workflow_handle(node_id, result_type=BurstResult)
    result = await node.result()
    # The (test) launch refuses: the node fails after compensation, and gives its place under maxNodes back.
    assert result.phase == NodePhase.FAILED
    assert recorded.launches and recorded.launches[0].offering.instance_type == "sim.l4.1"
    assert [c.operation for c in recorded.cleanups] == [recorded.launches[0].operation]
    assert recorded.actions(result.operation)[-1] == "failed"
    await _until(handle, lambda v: not v.nodes)


async def test_hub_hold_keeps_an_approved_node_from_launching_until_released(env: Env) -> None:
    server, queue, recorded = env
    recorded.hold = "hub rejected this cluster's token (revoked or unknown)"
    handle, view = await _proposal(server.client, queue, _pods(1))
    await ops.approve(server.client, handle.id, Approval(approver="erin"))
    view = await _until(handle, lambda v: bool(v.batches) and bool(v.batches[0].nodes))
    node = server.client.get_workflow_handle(view.batches[0].nodes[0], result_type=BurstResult)
    for _ in range(200):
        state: OperationView = await node.query(BurstNodeWorkflow.state)
        if state.phase == NodePhase.HELD:
            break
        await asyncio.sleep(0.05)
    assert state.phase == NodePhase.HELD and "revoked" in state.message
    assert recorded.launches == [] and recorded.gate_checks == ["p"]
    recorded.hold = ""
    recorded.released.set()
    result = await node.result()
    assert recorded.launches and result.phase == NodePhase.FAILED  # the test launch refuses, as above
    actions = recorded.actions(result.operation)
    assert actions.index("held") < actions.index("resumed") < actions.index("failed")


async def test_state_survives_continue_as_new(env: Env) -> None:
    server, queue, recorded = env
    handle = await _send(server.client, queue, f"provision/c/p-{uuid.uuid4().hex[:6]}", _pods(1),
                         continue_after_events=30)
    first = await _until(handle, lambda v: v.proposal is not None)
    await handle.execute_update(ProvisionWorkflow.approve_update, Approval(approver="alice"))
    for i in range(12):  # each signal adds events: the history passes 30 and the workflow continues as new
        await handle.signal(ProvisionWorkflow.pods_waiting, PodsWaiting(pods=_pods(1, prefix=f"more{i}")))
    for _ in range(200):
        desc = await server.client.get_workflow_handle(handle.id).describe()
        if desc.run_id != handle.result_run_id:
            break
        await asyncio.sleep(0.05)
    assert desc.run_id != handle.result_run_id, "never continued as new"
    view = await _until(handle, lambda v: len([w for w in v.waiting if "more" in w]) == 12)
    assert first.proposal is not None
    assert [b.batch for b in view.batches] == [first.proposal.batch]  # its batches and nodes carried over
    assert len(view.nodes) + len(recorded.cleanups) >= 1


async def _after_a_failed_node_and_its_pod_gone(env: Env) -> tuple[WorkflowHandle[Any, Any], ProvisionView]:
    """A batch of one node, approved; the (test) launch refuses, so the node fails and frees its place; then its
    pod is bound elsewhere. Nothing of this changes the provisioning's phase: it stays Idle."""
    server, queue, _ = env
    handle, view = await _proposal(server.client, queue, _pods(1))
    await ops.approve(server.client, handle.id, Approval(approver="alice"))
    view = await _until(handle, lambda v: bool(v.batches) and bool(v.batches[0].nodes))
    await server.client.get_workflow_handle(view.batches[0].nodes[0], result_type=BurstResult).result()
    await _until(handle, lambda v: not v.nodes)
    await handle.signal(ProvisionWorkflow.pods_gone, provisioning.PodsGone(uids=["infer-0"]))
    return handle, await _until(handle, lambda v: not v.waiting)


async def test_the_idle_message_says_the_nodes_and_pods_there_are_now(env: Env) -> None:
    """`ops show` once said `phase Idle: 1 node(s), 1 pod(s) waiting` beside `nodes 0 of maxNodes 4`: the message
    was written only when a round ended, not when a node finished or a pod went. The query and the Temporal UI's
    details say what is true now."""
    handle, view = await _after_a_failed_node_and_its_pod_gone(env)
    assert view.phase == ProvisionPhase.IDLE
    assert view.message == "0 node(s), 0 pod(s) waiting"
    meta = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert "**Phase:** Idle — 0 node(s), 0 pod(s) waiting" in meta.current_details, meta.current_details
    assert "**Nodes:** 0 of maxNodes 2 · **waiting pods:** 0" in meta.current_details, meta.current_details


async def test_a_batch_whose_nodes_all_ended_says_what_became_of_them(env: Env) -> None:
    """Every batch once stayed `Launching (1 node(s) started)` after its nodes were gone."""
    _, view = await _after_a_failed_node_and_its_pod_gone(env)
    (batch,) = view.batches
    assert batch.phase == BatchPhase.FAILED, batch
    assert batch.message == "its 1 node(s) ended: 1 Failed"
    assert any(f"batch {batch.batch} Failed: its 1 node(s) ended: 1 Failed" in line for line in view.history)


async def test_waiting_for_capacity_ends_when_the_pods_waiting_for_it_go(env: Env) -> None:
    """maxNodes held, a late pod waits for a node to free up; when it goes (bound elsewhere, deleted) nothing
    waits for capacity any more: the provisioning is Idle, not WaitingForCapacity until some later round."""
    server, queue, recorded = env
    recorded.launch_hangs = True
    handle, view = await _proposal(server.client, queue, _pods(5))
    await ops.approve(server.client, handle.id, Approval(approver="alice"))
    await _until(handle, lambda v: len(v.nodes) == 2)
    await _send(server.client, queue, handle.id, _pods(1, prefix="late"))
    view = await _until(handle, lambda v: v.phase == ProvisionPhase.WAITING_FOR_CAPACITY)
    # (This test's planner knows no node's room: the first five wait on too, until bound.)
    assert view.message.startswith("6 pod(s) wait: maxNodes 2 reached"), view.message
    gone = [f"infer-{i}" for i in range(5)]
    await handle.signal(ProvisionWorkflow.pods_gone, provisioning.PodsGone(uids=gone))
    # The round the signal starts plans again (Planning, for as long as its plan takes), then waits on.
    view = await _until(handle, lambda v: len(v.waiting) == 1 and v.phase != ProvisionPhase.PLANNING)
    assert view.phase == ProvisionPhase.WAITING_FOR_CAPACITY and view.message.startswith("1 pod(s) wait: maxNodes")
    await handle.signal(ProvisionWorkflow.pods_gone, provisioning.PodsGone(uids=["late-0"]))
    view = await _until(handle, lambda v: v.phase == ProvisionPhase.IDLE)
    assert view.message == "2 node(s), 0 pod(s) waiting"
