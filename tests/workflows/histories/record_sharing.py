"""How histories/sharing-*.json were written: by the Sharing workflows of main at df6e5f1 (before the MIG
verification waited and the propagation counted from the key's write), on the dev server with test activities:
``git show df6e5f1:workflows/sharing.py > DIR/old_sharing.py``, then
``HISTORIES=<this folder> OLD=DIR python -m tests.workflows.histories.record_sharing``. test_replay replays them on
today's workflows."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner
from temporalio.worker import Worker

from models.drain import EvictionResult
from models.sharing import CleanupResult
from models.sharing import MigInput
from models.sharing import MigStateRequest
from models.sharing import MigStateResult
from models.sharing import MigVerifyRequest
from models.sharing import NodeConfig
from models.sharing import SharingSettings
from models.sharing import TimeSlicingInput
from models.sharing import UnservableResult
from models.sharing import VerifyRequest
from models.sharing import VerifyResult
from models.sharing import WriteKeyRequest
from models.sharing import WriteKeyResult
from models.sharing import time_slicing_key
from tests.workflows.histories.recording import action_gate
from tests.workflows.histories.recording import answering
from tests.workflows.histories.recording import dump
from tests.workflows.histories.recording import on_dev_server
from tests.workflows.histories.recording import record_audit
from tests.workflows.histories.recording import until_phase

sys.path.insert(0, os.environ["OLD"])
import old_sharing  # type: ignore[import-not-found]


def activities(*, written: bool, mig: str) -> list[Any]:
    @activity.defn(name="read_node_config")
    async def read_node_config(node: str) -> NodeConfig:
        return NodeConfig(node=node, gpus=2)

    @activity.defn(name="write_time_slicing_key")
    async def write_time_slicing_key(req: WriteKeyRequest) -> WriteKeyResult:
        return WriteKeyResult(key=time_slicing_key(req.replicas, req.fail_requests_greater_than_one),
                              written=written)

    @activity.defn(name="verify_time_slicing")
    async def verify_time_slicing(req: VerifyRequest) -> VerifyResult:
        return VerifyResult(ok=True, allocatable=req.gpus * req.replicas)

    @activity.defn(name="wait_mig_state")
    async def wait_mig_state(req: MigStateRequest) -> MigStateResult:
        return MigStateResult(state=mig if req.geometry != "all-disabled" else "success")

    @activity.defn(name="verify_mig_resources")
    async def verify_mig_resources(req: MigVerifyRequest) -> VerifyResult:
        return VerifyResult(ok=True, allocatable=sum(req.expected.values()))

    return [record_audit, action_gate, read_node_config, write_time_slicing_key, verify_time_slicing, wait_mig_state,
            verify_mig_resources, *answering({
                "set_device_plugin_config": None, "remove_unused_time_slicing_keys": CleanupResult(),
                "unservable_pods": UnservableResult(allocatable=2, requested=0),
                "read_mig_config": MigStateResult(state=""), "cordon_node": True,
                "evict_pods": EvictionResult(remaining=[]), "set_mig_config": None, "uncordon_node": None})]


async def record(client: Client) -> None:
    for name, written, mig in (("sharing-ts-written-undone", True, "success"),
                               ("sharing-ts-key-there-undone", False, "success"),
                               ("sharing-mig-undone", True, "success"),
                               ("sharing-mig-failed", True, "failed")):
        queue = f"record-{uuid.uuid4().hex[:6]}"
        async with Worker(client, task_queue=queue, workflows=[old_sharing.TimeSlicingWorkflow,
                                                               old_sharing.MigWorkflow],
                          activities=activities(written=written, mig=mig),
                          workflow_runner=UnsandboxedWorkflowRunner()):
            node = f"n-{uuid.uuid4().hex[:6]}"
            if name.startswith("sharing-ts"):
                handle = await client.start_workflow(
                    "TimeSlicing", TimeSlicingInput(cluster="c", policy="p", node=node, gpus=2, replicas=2,
                                                    mode="Automatic",
                                                    settings=SharingSettings(propagation_seconds=1)),
                    id=f"sharing/c/{node}", task_queue=queue)
            else:
                handle = await client.start_workflow(
                    "Mig", MigInput(cluster="c", policy="p", node=node, gpus=2, geometry="all-3g.40gb",
                                    slices={"3g.40gb": 2}, mode="Automatic"),
                    id=f"sharing/c/{node}", task_queue=queue)
            if mig != "failed":
                await until_phase(handle, "Shared")
                await handle.signal("undo")
            await handle.result()
            await dump(handle, name)


if __name__ == "__main__":
    on_dev_server(record)
