"""Telemetry set-up: which exporter the OTEL_* variables ask for, JSON logs with the operation's context, the
Temporal SDK's metrics on /metrics, and the cloud-call spans of any provider."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from temporalio import activity
from temporalio.client import Client
from temporalio.common import SearchAttributePair
from temporalio.common import TypedSearchAttributes
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.providers.errors import InsufficientCapacityError
from activities.providers.fake import FakeProvider
from activities.telemetry.tracing import traced
from models import search_attributes as sa
from models.converter import DATA_CONVERTER
from models.ids import operation_id
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_POLICY
from models.node import LaunchRequest
from models.provisioning import Offering
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import build_stack
from tests.harness.burst import unique
from tests.harness.kube import Cluster
from tests.harness.stall_proxy import StallingProxy
from worker import telemetry
from worker.config import ConfigError
from worker.telemetry import LOG_CONTEXT
from worker.telemetry import JsonFormatter
from worker.telemetry import operation_context
from worker.telemetry import traces_exporter

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, None),  # naming alone exports nothing
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "otlp"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, "otlp"),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, None),
])
def test_traces_exporter_follows_the_standard_variables(env: dict[str, str], expected: str | None) -> None:
    assert traces_exporter(env) == expected


@pytest.mark.parametrize(("env", "named"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
])
def test_unsupported_exporter_is_refused_naming_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        traces_exporter(env)


def test_without_otel_variables_nothing_is_installed() -> None:
    before = trace.get_tracer_provider()
    assert telemetry.setup_tracing("kubeon-gpu-worker", {}) is None
    assert trace.get_tracer_provider() is before
    assert not any("Otel" in t.name or "BatchSpan" in t.name for t in threading.enumerate())


def test_bad_log_format_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="KUBEON_LOG_FORMAT"):
        telemetry.configure_logging({"KUBEON_LOG_FORMAT": "xml"})


def test_worker_command_with_a_bad_log_format_exits_with_the_reason() -> None:
    proc = subprocess.run([sys.executable, "-m", "worker.cli", "worker"], cwd=ROOT, capture_output=True, text=True,
                          env={"KUBEON_LOG_FORMAT": "yaml", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2
    assert "KUBEON_LOG_FORMAT='yaml'" in proc.stderr


def test_operation_context_from_workflow_ids() -> None:
    wf = "burst/prod/inference-eu/0123456789ab"
    assert operation_context(wf, "run-1") == {"workflow_id": wf, "policy": "inference-eu",
                                              "operation": operation_id(wf, "run-1")}
    drain = f"drain/{wf}/op-aaaabbbbcccc"
    assert operation_context(drain, "run-2") == {"workflow_id": drain, "policy": "inference-eu",
                                                 "operation": "op-aaaabbbbcccc"}
    assert operation_context("provision/prod/p1", "r") == {"workflow_id": "provision/prod/p1", "policy": "p1"}

    class Arg:
        operation, policy = "op-fromarg", "p-arg"

    assert operation_context("hub-sync/prod", "r", Arg()) == {"workflow_id": "hub-sync/prod",
                                                              "operation": "op-fromarg", "policy": "p-arg"}


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider, once (OpenTelemetry allows one), recording into memory."""
    exporter = InMemorySpanExporter()
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        current = TracerProvider()
        trace.set_tracer_provider(current)
    current.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # the processor stays (OpenTelemetry cannot remove one): later spans are dropped


def test_json_log_line_carries_operation_and_trace(spans: InMemorySpanExporter) -> None:
    formatter = JsonFormatter()
    token = LOG_CONTEXT.set({"workflow_id": "burst/c/p/g", "operation": "op-1", "policy": "p"})
    try:
        with trace.get_tracer("test").start_as_current_span("s") as span:
            record = logging.LogRecord("kubeon.x", logging.INFO, __file__, 1, "launched %s", ("i-1",), None)
            line = formatter.format(record)
    finally:
        LOG_CONTEXT.reset(token)
    doc = json.loads(line)
    assert "\n" not in line
    assert doc["message"] == "launched i-1" and doc["level"] == "INFO" and doc["logger"] == "kubeon.x"
    assert (doc["workflow_id"], doc["operation"], doc["policy"]) == ("burst/c/p/g", "op-1", "p")
    assert doc["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_json_log_line_of_a_workflow_logger_names_its_operation() -> None:
    wf = "burst/prod/inference-eu/0123456789ab"
    record = logging.LogRecord("temporalio.workflow", logging.WARNING, __file__, 1, "release not delivered", (),
                               None)
    record.temporal_workflow = {"workflow_id": wf, "run_id": "run-9", "workflow_type": "BurstWorkflow"}
    doc = json.loads(JsonFormatter().format(record))
    assert (doc["workflow_id"], doc["policy"], doc["operation"]) == (wf, "inference-eu", operation_id(wf, "run-9"))
    assert doc["level"] == "WARNING" and "trace_id" not in doc  # no span here


def test_every_provider_call_is_a_span_with_outcome(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    spans.clear()
    fake = FakeProvider()
    fake.fail_next("launch", InsufficientCapacityError("fake/a: no f.gpu.1 now"))
    provider = traced(fake)
    offering = Offering(location="fake/a", instance_type="f.gpu.1", gpus=1, gpu_product="NVIDIA-L4",
                        instance_usd_per_hour=1.0, transfer_usd_per_gpu_hour=0.1)
    request = LaunchRequest(operation="op-1", cluster="c", policy="p", allowed_locations=["fake/a"],
                            offering=offering, node_name="burst-op-1", labels={}, taints=[])
    with pytest.raises(InsufficientCapacityError):
        provider.launch(request, "#!/bin/sh\nsecret-user-data")
    provider.launch(request, "#!/bin/sh\nsecret-user-data")
    refused, launched = [s for s in spans.get_finished_spans() if s.name == "cloud.launch"]
    assert launched.kind == trace.SpanKind.CLIENT
    assert dict(launched.attributes or {}) == {
        "cloud.provider": "fake", "cloud.region": "fake/a", "kubeon.location": "fake/a",
        "kubeon.instance_type": "f.gpu.1", "kubeon.instance_state": "running", "kubeon.outcome": "ok"}
    assert (refused.attributes or {})["kubeon.outcome"] == "insufficient_capacity"
    assert refused.status.status_code == trace.StatusCode.ERROR
    assert "secret" not in repr([dict(s.attributes or {}) for s in spans.get_finished_spans()])


@activity.defn(name="noop")
async def noop() -> str:
    return "done"


@pytest.mark.temporal
async def test_metrics_endpoint_serves_ours_and_the_sdks(temporal_dev_server: WorkflowEnvironment) -> None:
    target = temporal_dev_server.client.service_client.config.target_host
    temporal = await Client.connect(target, runtime=telemetry.temporal_runtime(),
                                    interceptors=telemetry.client_interceptors())
    async with Worker(temporal, task_queue="telemetry-metrics", activities=[noop]):
        await temporal.count_workflows()
    body = (await telemetry.metrics_body()).decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples = {s.name for f in families.values() for s in f.samples}
    assert "kubeon_launch_duration_seconds" in families and "kubeon_operation_actions" in families  # ours
    assert "process_resident_memory_bytes" in samples  # the process's
    assert any(name.startswith("temporal_") for name in samples), sorted(samples)[:20]  # the SDK's
    assert "temporal_worker_start_total" in samples


class Scrape:
    """One in-process scrape of /metrics (what the health port serves), timed."""

    def __init__(self, seconds: float, body: str) -> None:
        self.seconds = seconds
        self.samples = [s for f in text_string_to_metric_families(body) for s in f.samples]

    def value(self, name: str, **labels: str) -> float | None:
        found = [s.value for s in self.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else None


async def scrape() -> Scrape:
    started = time.monotonic()
    body = (await telemetry.metrics_body()).decode()
    return Scrape(time.monotonic() - started, body)


async def scrapes_until(check: Callable[[Scrape], bool], *, timeout: float, what: str) -> list[Scrape]:
    """Scrape every 0.2 s until ``check`` holds; every scrape made on the way."""
    done: list[Scrape] = []
    deadline = time.monotonic() + timeout
    while True:
        done.append(await scrape())
        if check(done[-1]):
            return done
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        await asyncio.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.temporal
async def test_a_scrape_serves_the_last_values_at_once_while_temporal_stalls(
        cluster: Cluster, temporal_dev_server: WorkflowEnvironment, tmp_path: Path) -> None:
    direct = temporal_dev_server.client
    stack = build_stack(cluster, tmp_path / "stack")
    name, policy = unique("slow"), unique("slow")
    settings = stack.settings(temporal_address=direct.service_client.config.target_host, task_queue=name,
                              locations=SIM_LOCATIONS, cluster_name=name)
    runtime = stack.runtime(settings)
    nodes: list[str] = []
    runs: list[str] = []

    def burst_node() -> None:
        nodes.append(unique("burst-slow"))
        cluster.create_kwok_node(nodes[-1], labels={LABEL_POLICY: policy, LABEL_LOCATION: "sim.eu-west",
                                                    LABEL_INSTANCE_TYPE: "sim.l4.1"})

    async def open_operation() -> None:  # a running workflow as visibility lists it (no worker takes it)
        runs.append(unique(f"burst/{name}/{policy}/op"))
        await direct.start_workflow("BurstNode", id=runs[-1], task_queue=name, search_attributes=TypedSearchAttributes(
            [SearchAttributePair(sa.CLUSTER, name), SearchAttributePair(sa.OPERATION_KIND, "Burst"),
             SearchAttributePair(sa.PHASE, "Serving")]))

    async with StallingProxy(direct.service_client.config.target_host) as proxy:
        # The collector reads Temporal through the proxy: stalled, its calls hang as on an overloaded server.
        temporal = await Client.connect(proxy.address, data_converter=DATA_CONVERTER)
        collector = telemetry.StateCollector(temporal, runtime, min_interval=0.2, source_timeout=3.0)
        telemetry.attach(collector)
        try:
            burst_node()
            await open_operation()
            await scrapes_until(lambda m: m.value("kubeon_burst_nodes", policy=policy) == 1
                                and m.value("kubeon_operations", kind="Burst", phase="Serving") == 1,
                                timeout=30, what="both sources read")
            errors = (await scrape()).value("kubeon_scrape_errors_total", source="temporal") or 0.0

            proxy.stall()
            burst_node()
            await open_operation()
            stalled = await scrapes_until(
                lambda m: m.value("kubeon_burst_nodes", policy=policy) == 2
                and (m.value("kubeon_metrics_snapshot_age_seconds", source="temporal") or 0) > 5
                and (m.value("kubeon_scrape_errors_total", source="temporal") or 0) > errors,
                timeout=30, what="the nodes read again while Temporal stalls, its values ageing")
            # Every scrape answered at once (well within the 3 s a read of Temporal is given), with Temporal's
            # last values (not cleared, not waited for), while the Kubernetes read went on.
            assert max(m.seconds for m in stalled) < 1.0, [round(m.seconds, 2) for m in stalled]
            assert all(m.value("kubeon_operations", kind="Burst", phase="Serving") == 1 for m in stalled)
            last = stalled[-1]
            ages = {source: last.value("kubeon_metrics_snapshot_age_seconds", source=source)
                    for source in ("kubernetes", "temporal")}
            assert ages["kubernetes"] is not None and ages["temporal"] is not None
            assert ages["kubernetes"] < ages["temporal"] - 2, ages
            assert last.value("kubeon_metrics_snapshot_age_seconds", source="hub") is None  # no hub configured

            proxy.flow()
            await scrapes_until(lambda m: m.value("kubeon_operations", kind="Burst", phase="Serving") == 2
                                and (m.value("kubeon_metrics_snapshot_age_seconds", source="temporal") or 99) < 5,
                                timeout=60, what="Temporal read again once it answers")
        finally:
            telemetry.attach(None)
            runtime.close()
            for wf in runs:
                with contextlib.suppress(Exception):
                    await direct.get_workflow_handle(wf).terminate("test over")
            for node in nodes:
                cluster.admin.core.delete_node(node)
