"""How histories/ was written: run in a checkout of the code before the skeleton (18613aa), as
``HISTORIES=<this folder> pytest -p no:cacheprovider <this file>`` (pytest collects test_*.py only: not run here)."""
from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from temporalio import activity
from temporalio.worker import Worker

from models.decisions import Approval
from models.decisions import Rejection
from models.provisioning import PodsGone
from models.scale import Observation
from models.scale import ObserveRequest
from models.scale import ReadyRequest
from models.scale import ReadyResult
from models.scale import ScaleInput
from models.scale import ScalePhase
from models.scale import ScalePolicyRequest
from models.scale import ScalePolicySnapshot
from models.scale import ScaleRequest
from models.scale import ScaleResult
from models.scale import ScaleSettings
from models.scale import ScaleStatusUpdate
from models.scale import WakeRequest
from models.scale import WorkloadRef
from tests.harness.temporal import skip_time
from tests.workflows.histories.recording import action_gate
from tests.workflows.histories.recording import dump
from tests.workflows.histories.recording import record_audit
from tests.workflows.histories.recording import until_phase
from tests.workflows.test_burst_approval import BurstResult
from tests.workflows.test_burst_approval import Env
from tests.workflows.test_burst_approval import ProvisionWorkflow
from tests.workflows.test_burst_approval import _pods
from tests.workflows.test_burst_approval import _proposal
from tests.workflows.test_burst_approval import _until
from tests.workflows.test_burst_approval import env  # noqa: F401  (fixtures)
from tests.workflows.test_burst_approval import ops
from tests.workflows.test_burst_approval import own_time_skipping  # noqa: F401  (fixtures)
from worker.main import workflow_runner
from workflows.scale import ScaleWorkflow


async def _history_grows(handle, events: int) -> None:
    """Until the history holds more than ``events`` events (what the skipped time made it do), at most 10 s."""
    for _ in range(200):
        if len((await handle.fetch_history()).events) > events:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the history stayed at {events} events")


async def test_provision_histories(env: Env) -> None:  # noqa: F811
    server, queue, _ = env
    handle, view = await _proposal(server.client, queue, _pods(1))
    await ops.approve(server.client, handle.id, Approval(approver="alice"))
    view = await _until(handle, lambda v: bool(v.batches) and bool(v.batches[0].nodes))
    node = server.client.get_workflow_handle(view.batches[0].nodes[0], result_type=BurstResult)
    await node.result()
    await _until(handle, lambda v: not v.nodes)
    await handle.signal(ProvisionWorkflow.pods_gone, PodsGone(uids=["infer-0"]))
    await _until(handle, lambda v: not v.waiting)
    await dump(handle, "provision-approved-node-failed")
    await dump(node, "burstnode-launch-refused")

    handle, view = await _proposal(server.client, queue, _pods(2, prefix="other"))
    await handle.signal("reject", Rejection(approver="carol", reason="cost"))
    await _until(handle, lambda v: bool(v.batches))
    await dump(handle, "provision-rejected")


def _scale_activities(mode: str) -> list:
    @activity.defn(name="load_scale_policy")
    async def load_scale_policy(req: ScalePolicyRequest) -> ScalePolicySnapshot:
        return ScalePolicySnapshot(name=req.policy, mode=mode)

    @activity.defn(name="observe_workload")
    async def observe_workload(req: ObserveRequest) -> Observation:
        return Observation(replicas=2, idle=True, reason="idle for 30m")

    @activity.defn(name="update_scale_status")
    async def update_scale_status(req: ScaleStatusUpdate) -> None:
        return None

    @activity.defn(name="scale_workload")
    async def scale_workload(req: ScaleRequest) -> ScaleResult:
        return ScaleResult(done=True, found=req.expect, message=f"scaled to {req.replicas}")

    @activity.defn(name="read_replicas")
    async def read_replicas(ref: WorkloadRef) -> int:
        return 0

    @activity.defn(name="wait_workload_ready")
    async def wait_workload_ready(req: ReadyRequest) -> ReadyResult:
        return ReadyResult(ready=req.replicas, replicas=req.replicas)

    return [load_scale_policy, observe_workload, record_audit, update_scale_status, action_gate, scale_workload,
            read_replicas, wait_workload_ready]


async def test_scale_histories(own_time_skipping) -> None:  # noqa: F811
    server = own_time_skipping
    client = server.client
    workload = WorkloadRef(namespace="ml", kind="Deployment", name="infer")
    for mode in ("Recommend", "Approve"):
        queue = f"s-{uuid.uuid4().hex[:6]}"
        async with Worker(client, task_queue=queue, workflows=[ScaleWorkflow], activities=_scale_activities(mode),
                          workflow_runner=workflow_runner()):
            handle = await client.start_workflow(
                ScaleWorkflow.run, ScaleInput(cluster="c", policy="p", workload=workload, default_mode=mode,
                                              prometheus_configured=True, settings=ScaleSettings()),
                id=f"scale/c/p/{uuid.uuid4().hex[:6]}", task_queue=queue)
            if mode == "Recommend":
                await until_phase(handle, ScalePhase.PROPOSED.value)
                before = len((await handle.fetch_history()).events)
                await skip_time(server, timedelta(seconds=200))  # the proposal re-observed, re-set each minute
                await _history_grows(handle, before)
                await dump(handle, "scale-recommend-open")
                await handle.terminate("test over")
                continue
            await until_phase(handle, ScalePhase.AWAITING_APPROVAL.value)
            await handle.execute_update("approve_plan", Approval(approver="alice"))
            await until_phase(handle, ScalePhase.SCALED_TO_ZERO.value)
            await skip_time(server, timedelta(seconds=70))
            await handle.execute_update("wake", WakeRequest(by="bob"))
            await handle.result()
            await dump(handle, "scale-approved-woken")
