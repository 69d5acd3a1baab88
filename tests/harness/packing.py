"""Packing rounds in tests: a worker serving PackWorkflow over any capacity provider with the optimizer's own
credentials, and a round started in Approve mode up to its proposal."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from activities.capacity import CapacityProvider
from activities.clients.kube import KubeOps
from activities.packing import PackActivities
from models.packing import PackInput, PackSettings, PackView
from worker.main import workflow_runner
from workflows.pack import PackWorkflow

# A round's waits shortened for tests: PDB retries each second, replacements and removals bounded.
FAST = PackSettings(pdb_retry_seconds=1, poll_seconds=0.5, replacement_timeout_seconds=30,
                    removal_timeout_seconds=60)


async def until_async(check: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 30) -> None:
    """Await ``check`` until it is true (a workflow query, say); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def pack_worker(temporal: Client, queue: str, optimizer: client.ApiClient,
                      capacity: CapacityProvider) -> AsyncIterator[None]:
    """PackWorkflow and its activities on ``queue``, with the optimizer's credentials and ``capacity``."""
    acts = PackActivities(KubeOps(optimizer), capacity)
    with ThreadPoolExecutor(8) as executor:
        async with Worker(temporal, task_queue=queue, workflows=[PackWorkflow], activities=acts.all(),
                          activity_executor=executor, workflow_runner=workflow_runner()):
            yield


async def proposed_round(temporal: Client, queue: str, groups: list[str],
                         max_nodes: int = 2) -> tuple[WorkflowHandle[PackWorkflow, PackView], PackView]:
    """A round over ``groups`` in Approve mode, once it awaits approval: its handle and its proposal."""
    handle = await temporal.start_workflow(
        PackWorkflow.run, PackInput(cluster="t", policy="pack", groups=groups, mode="Approve", max_nodes=max_nodes,
                                    settings=FAST),
        id=f"pack-{uuid.uuid4().hex[:6]}", task_queue=queue)

    async def proposed() -> bool:
        return (await handle.query(PackWorkflow.state)).phase == "AwaitingApproval"

    await until_async(proposed, what="the round's proposal")
    return handle, await handle.query(PackWorkflow.state)
