"""`kubeon-gpu worker`: the Temporal worker (workflows + activities), the pending-pod watcher and health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxRestrictions

from activities.burst import BurstActivities
from activities.hub import HubActivities
from activities.packing import PackActivities
from activities.scale import ScaleOps
from activities.sharing import SharingOps
from models.ids import SERVE_QUEUE_SUFFIX
from worker import telemetry
from worker.background import running
from worker.config import Settings
from worker.packing_watcher import PackingWatcher
from worker.runtime import Runtime
from worker.runtime import build_runtime
from worker.runtime import connect_temporal
from worker.runtime import register_search_attributes
from worker.scale_watcher import ScaleWatcher
from worker.sharing_watcher import SharingWatcher
from worker.watcher import PendingPodWatcher
from workflows.burst import BurstNodeWorkflow
from workflows.drain import DrainWorkflow
from workflows.gpu_products import GpuProductsWorkflow
from workflows.hub_sync import HubSyncWorkflow
from workflows.pack import PackWorkflow
from workflows.provision import ProvisionWorkflow
from workflows.scale import ScaleWorkflow
from workflows.sharing import MigWorkflow
from workflows.sharing import TimeSlicingWorkflow

log = logging.getLogger("kubeon.worker")
RuntimeFactory = Callable[[Settings], Runtime]
WORKFLOWS = [ProvisionWorkflow, BurstNodeWorkflow, DrainWorkflow, HubSyncWorkflow, ScaleWorkflow,
             TimeSlicingWorkflow, MigWorkflow, PackWorkflow, GpuProductsWorkflow]
# Activities get this long to finish on shutdown; the chart's terminationGracePeriodSeconds is longer.
GRACEFUL_SHUTDOWN = timedelta(seconds=30)
# A workflow task waits this long on the sticky queue of the worker that holds the workflow cached before the
# server gives it to any worker (which replays the history). The SDK's 10 s cost every workflow whose worker
# died 10 s at each step (issue 26); 2 s still lets a busy worker take its own tasks, beyond that a task is
# replayed elsewhere (CPU for the replay and a WorkflowTaskTimedOut event in the history, nothing lost).
STICKY_TIMEOUT = timedelta(seconds=2)


def workflow_runner() -> SandboxedWorkflowRunner:
    # Our models are deterministic pydantic classes: pass them through instead of re-importing per workflow.
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("models", "pydantic", "pydantic_core",
                                                                          "opentelemetry"))


def make_worker(temporal: Client, activities: BurstActivities, settings: Settings,
                executor: ThreadPoolExecutor, hub: HubActivities | None = None,
                scale: ScaleOps | None = None, sharing: SharingOps | None = None,
                pack: PackActivities | None = None) -> Worker:
    return Worker(
        temporal, task_queue=settings.task_queue, workflows=WORKFLOWS,
        activities=activities.all() + ([hub.hub_poll] if hub else []) + (scale.all() if scale else [])
        + (sharing.all() if sharing else []) + (pack.all() if pack else []),
        activity_executor=executor, max_concurrent_activities=settings.max_concurrent_activities,
        workflow_runner=workflow_runner(), graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        sticky_queue_schedule_to_start_timeout=STICKY_TIMEOUT,
    )


async def _health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        line = await reader.readline()
        path = line.split(b" ")[1:2]
        ok = path in ([b"/healthz"], [b"/readyz"], [b"/metrics"])
        status = b"200 OK" if ok else b"404 Not Found"
        body = b"ok\n" if ok else b"not found\n"
        content_type = b"text/plain"
        if path == [b"/metrics"]:
            body, content_type = await telemetry.metrics_body(), telemetry.METRICS_CONTENT_TYPE.encode()
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def worker_services(settings: Settings, runtime: Runtime | None = None, *, watch: bool = True,
                          build: RuntimeFactory = build_runtime,
                          ) -> AsyncIterator[tuple[Client, Runtime, PendingPodWatcher]]:
    """The worker's Temporal workers and watchers, around ``runtime`` (else ``build(settings)``: the harness builds
    one holding an in-process gateway)."""
    temporal = await connect_temporal(settings, runtime=telemetry.temporal_runtime())
    await register_search_attributes(temporal)
    runtime = runtime or build(settings)
    executor = ThreadPoolExecutor(max_workers=settings.max_concurrent_activities, thread_name_prefix="activity")
    runtime_activities = runtime.activities(temporal)
    hub = runtime.hub_activities(temporal)
    worker = make_worker(temporal, runtime_activities, settings, executor, hub, runtime.scale_ops(),
                         runtime.sharing_ops(), runtime.pack_activities())
    watcher = PendingPodWatcher(kube=runtime.kube, temporal=temporal, cluster=settings.cluster,
                                task_queue=settings.task_queue, default_mode=lambda: settings.default_mode,
                                settings=settings.operation_settings())
    # Serving operations wait in one async activity each; their own queue and slot limit keep them from starving
    # the activities that launch, join and drain.
    serve_worker = Worker(temporal, task_queue=settings.task_queue + SERVE_QUEUE_SUFFIX,
                          activities=runtime_activities.held_long(),
                          max_concurrent_activities=10000,
                          graceful_shutdown_timeout=GRACEFUL_SHUTDOWN)
    telemetry.attach(telemetry.StateCollector(temporal, runtime))
    try:
        async with worker, serve_worker:
            if hub is not None:
                log.info("hub sync %s: %s every %gs", await runtime.start_hub_sync(temporal), settings.hub_url,
                         settings.hub_poll_interval)
            if watch:
                scaler = ScaleWatcher(runtime.scale_ops(), temporal, cluster=settings.cluster,
                                      task_queue=settings.task_queue, default_mode=lambda: settings.default_mode,
                                      settings=settings.scale_settings(), resync_seconds=settings.scale_resync_seconds,
                                      prerequisites=runtime.prerequisites)
                sharer = SharingWatcher(runtime.sharing_ops(), temporal, cluster=settings.cluster,
                                        task_queue=settings.task_queue, default_mode=settings.default_mode,
                                        settings=settings.sharing_settings(),
                                        namespace=settings.gpu_operator_namespace,
                                        config_map=settings.time_slicing_configmap,
                                        resync_seconds=settings.scale_resync_seconds)
                capacity = runtime.capacity()
                packer = PackingWatcher(runtime.kube.api, capacity, temporal, cluster=settings.cluster,
                                        task_queue=settings.task_queue, default_mode=lambda: settings.default_mode,
                                        resync_seconds=settings.scale_resync_seconds) if capacity else None
                async with contextlib.AsyncExitStack() as loops:
                    await loops.enter_async_context(
                        running(watcher, name="pending-pod-watcher", cancel=True, grace_seconds=5))
                    await loops.enter_async_context(
                        running(scaler, name="scale-watcher", cancel=False, grace_seconds=30))
                    await loops.enter_async_context(
                        running(sharer, name="sharing-watcher", cancel=False, grace_seconds=30))
                    if packer is not None:  # capacity.provider: karpenter
                        await loops.enter_async_context(
                            running(packer, name="packing-watcher", cancel=False, grace_seconds=30))
                    yield temporal, runtime, watcher
            else:
                yield temporal, runtime, watcher
    finally:
        telemetry.attach(None)
        runtime.close()
        executor.shutdown(wait=False, cancel_futures=True)


async def serve(settings: Settings, *, build: RuntimeFactory = build_runtime) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = await asyncio.start_server(_health, "0.0.0.0", settings.health_port)
    async with health, worker_services(settings, build=build):
        log.info("worker started: cluster %s, task queue %s, Temporal %s", settings.cluster, settings.task_queue,
                 settings.temporal_address)
        await stop.wait()
        log.info("shutting down")
