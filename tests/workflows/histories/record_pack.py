"""How histories/pack-*.json were written: by PackWorkflow of main at 46d06a2 (before rounds were audited and
cordoned every planned node first), on the dev server with test activities:
``git show 46d06a2:workflows/pack.py > DIR/old_pack.py``, then
``HISTORIES=<this folder> OLD=DIR python -m tests.workflows.histories.record_pack``. test_replay replays them on
today's workflows: a round approved that empties two nodes of one pool, one stopped by a pod that cannot be
re-placed (compensated), one rejected."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner
from temporalio.worker import Worker

from models.decisions import Approval
from models.decisions import Rejection
from models.packing import EvictOutcome
from models.packing import NodeRef2
from models.packing import PackInput
from models.packing import PackMove
from models.packing import PackPlan
from models.packing import PackSettings
from models.packing import PodRef
from models.packing import ReplacementState
from tests.workflows.histories.recording import answering
from tests.workflows.histories.recording import dump
from tests.workflows.histories.recording import on_dev_server
from tests.workflows.histories.recording import until_phase

sys.path.insert(0, os.environ["OLD"])
import old_pack  # type: ignore[import-not-found]

PLAN = PackPlan(empty=["n-b", "n-c"], group_of={"n-b": "gpu", "n-c": "gpu"}, usd_per_hour_saved=9.2032, moves=[
    PackMove(pod="ml/p-1", source="n-b", target="n-a", gpus=1), PackMove(pod="ml/p-2", source="n-c", target="n-a",
                                                                        gpus=1)])


def activities(*, replaced: bool) -> list[Any]:
    @activity.defn(name="pack_pods_on_node")
    async def pack_pods_on_node(req: NodeRef2) -> list[PodRef]:
        return [PodRef(namespace="ml", name="p-1" if req.node == "n-b" else "p-2", owner_uid="rs-1", ready_before=2)]

    return [pack_pods_on_node, *answering({
        "pack_plan": PLAN, "pack_freeze": None, "pack_unfreeze": None, "pack_cordon": True, "pack_uncordon": True,
        "pack_evict_pod": EvictOutcome(outcome="evicted", owner_uid="rs-1", ready_before=2),
        "pack_replacement_ready": ReplacementState(ready=replaced,
                                                   detail="" if replaced else "the replacement Pending"),
        "pack_remove_node": None, "pack_node_gone": True})]


async def record(client: Client) -> None:
    settings = PackSettings(poll_seconds=0.2, replacement_timeout_seconds=1)
    for name, replaced, decision in (("pack-approved-done", True, "approve"),
                                     ("pack-replacement-stopped", False, "approve"),
                                     ("pack-rejected", True, "reject")):
        queue = f"record-{uuid.uuid4().hex[:6]}"
        async with Worker(client, task_queue=queue, workflows=[old_pack.PackWorkflow],
                          activities=activities(replaced=replaced), workflow_runner=UnsandboxedWorkflowRunner()):
            wid = f"packing/c/p-{uuid.uuid4().hex[:6]}"
            handle = await client.start_workflow(
                "PackWorkflow", PackInput(cluster="c", policy="p", groups=["gpu"], mode="Approve", max_nodes=2,
                                          settings=settings), id=wid, task_queue=queue)
            await until_phase(handle, "AwaitingApproval")
            if decision == "approve":
                await handle.execute_update("approve_plan", Approval(approver="rec", plan_id=wid))
            else:
                await handle.execute_update("reject_plan", Rejection(approver="rec", reason="not now"))
            await handle.result()
            await dump(handle, name)


if __name__ == "__main__":
    on_dev_server(record)
