"""Observability of the worker: traces, metrics, logs (the gateway's metrics: ``gateway.metrics``).

- **Traces**: Temporal's ``TracingInterceptor`` on the client (so on every worker built from it), subclassed so
  that one operation is one trace (``workflows/observe.py``): each batch of a provisioning, each burst node (linked
  to its batch) from launch to return home, through every activity, retry, child workflow and worker restart
  (the context travels in Temporal headers, kept in the history). Cloud, hub and gateway calls add spans of their
  own (``activities/tracing.py``). Exported over OTLP/HTTP, configured by the standard ``OTEL_*`` variables
  (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``...); with
  neither an OTLP endpoint nor ``OTEL_TRACES_EXPORTER`` set, no exporter starts and nothing is said about it.
- **Metrics**: ``/metrics`` on the health port serves the product's metrics (``activities/product_metrics.py``;
  counted by ``ObservingInterceptor`` around activities, or read in the background by ``StateCollector``) followed
  by the Temporal SDK's own (its runtime's Prometheus endpoint, bound to loopback only, proxied).
- **Logs**: ``KUBEON_LOG_FORMAT=json`` writes one JSON object a line with the workflow ID, operation, policy and
  trace ID where there is one; the default is readable text.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import functools
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

import httpx
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from prometheus_client import REGISTRY
from prometheus_client import generate_latest
from temporalio import activity
from temporalio import client as temporal_client
from temporalio import worker as temporal_worker
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.runtime import PrometheusConfig
from temporalio.runtime import Runtime
from temporalio.runtime import TelemetryConfig
from temporalio.service import RPCError

from activities.telemetry import metrics as pm
from models import search_attributes as sa
from models.hub import HubSyncStatus
from models.hub import hub_sync_workflow_id
from models.ids import operation_id
from models.ids import provision_workflow_id
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_POLICY
from models.policy import location_of_label_value
from models.provisioning import ProvisionView
from worker.config import ConfigError
from workflows.observe import ROOT_SPAN_EXTERN
from workflows.observe import OperationTracingInbound
from workflows.observe import RootSpan

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from worker.runtime import Runtime as WorkerRuntime

log = logging.getLogger("kubeon.telemetry")
T = TypeVar("T")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
LOG_FORMATS = ("text", "json")
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


# ----- traces ----------------------------------------------------------------------------------------------------


def traces_exporter(environ: Mapping[str, str]) -> str | None:
    """Which span exporter the environment asks for: ``otlp``, ``console`` or None (tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    wanted = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if wanted == "none":
        return None
    if not wanted:
        return "otlp" if any(environ.get(v, "").strip() for v in OTLP_ENDPOINT_VARS) else None
    if wanted not in ("otlp", "console"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={wanted!r}: this version exports otlp (OTLP/HTTP), console or none")
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    if wanted == "otlp" and protocol.strip() not in ("", "http/protobuf"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: only http/protobuf is supported")
    return wanted


def setup_tracing(service_name: str, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install the global tracer provider the environment asks for; None (and no exporter, no thread, no log
    line) when it asks for none. ``OTEL_SERVICE_NAME`` overrides ``service_name``."""
    environ = os.environ if environ is None else environ
    exporter_name = traces_exporter(environ)
    if exporter_name is None:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    from opentelemetry.sdk.trace.export import SpanExporter

    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME wins over the default name.
    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME", "").strip() or service_name})
    exporter: SpanExporter
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, timeout, compression: the OTEL_EXPORTER_OTLP_* variables
    else:
        exporter = ConsoleSpanExporter(out=sys.stderr)
    provider = TracerProvider(resource=resource, id_generator=OperationIds())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    where = next((environ[v] for v in reversed(OTLP_ENDPOINT_VARS) if environ.get(v)), "the default endpoint")
    log.info("traces: %s as service %s", f"OTLP/HTTP to {where}" if exporter_name == "otlp" else "console",
             resource.attributes.get(SERVICE_NAME))
    return provider


# The IDs the next span must have (an operation's root span, derived by its workflow), else None.
_ROOT_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("kubeon_root_ids", default=None)


class OperationIds(IdGenerator):
    """Random IDs, except for an operation's root span: those its workflow derived from its ID and run, so that a
    replay on another worker continues the same trace (``workflows/observe.py``)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        ids = _ROOT_IDS.get()
        return ids[0] if ids else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        ids = _ROOT_IDS.get()
        return ids[1] if ids else self._random.generate_span_id()


class OperationTracingInterceptor(TracingInterceptor):
    """Temporal's interceptor, with one trace per operation in workflows (``OperationTracingInbound``) and the
    extern function that creates an operation's root span outside the sandbox."""

    def workflow_interceptor_class(self, input: temporal_worker.WorkflowInterceptorClassInput
                                   ) -> type[OperationTracingInbound]:
        super().workflow_interceptor_class(input)
        input.unsafe_extern_functions[ROOT_SPAN_EXTERN] = self._root_span
        return OperationTracingInbound

    def _root_span(self, root: RootSpan) -> bool:
        """Create the root span with the workflow's IDs (unless replaying); False when this process does not trace
        with an ``OperationIds`` generator (then the operation gets no trace context of its own)."""
        if not isinstance(getattr(trace.get_tracer_provider(), "id_generator", None), OperationIds):
            return False
        if not root.create:
            return True
        origins = [trace.get_current_span(self.text_map_propagator.extract(c)).get_span_context() for c in root.links]
        links = [trace.Link(origin) for origin in origins if origin.is_valid]
        token = _ROOT_IDS.set((root.trace_id, root.span_id))
        try:
            span = self.tracer.start_span(root.name, otel_context.Context(), attributes=dict(root.attributes),
                                          links=links, start_time=root.time_ns)
        finally:
            _ROOT_IDS.reset(token)
        span.end(end_time=root.time_ns)
        return True


def client_interceptors() -> list[temporal_client.Interceptor]:
    """For ``Client.connect``: they apply to the client's calls and to every worker built on that client."""
    return [OperationTracingInterceptor(), ObservingInterceptor()]


# ----- the Temporal SDK's metrics --------------------------------------------------------------------------------

_runtime: tuple[Runtime, int] | None = None


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def temporal_runtime() -> Runtime:
    """One Temporal runtime per process with its Prometheus endpoint on a loopback port; ``/metrics`` on the health
    port proxies it, so only one port is ever scraped."""
    global _runtime
    if _runtime is None:
        port = _free_loopback_port()
        runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
            bind_address=f"127.0.0.1:{port}", counters_total_suffix=True, unit_suffix=True,
            durations_as_seconds=True)))
        _runtime = (runtime, port)
    return _runtime[0]


async def sdk_metrics() -> bytes:
    if _runtime is None:
        return b""
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            response = await http.get(f"http://127.0.0.1:{_runtime[1]}/metrics")
        return response.content if response.status_code == 200 else b""
    except httpx.HTTPError:
        return b""


# ----- the product's metrics -------------------------------------------------------------------------------------

# (location, instance type) -> (compute USD/h, transfer USD/h) of one instance, from plans and price lists.
PRICES: dict[tuple[str, str], tuple[float, float]] = {}


def _remember_prices(offerings: Any) -> None:
    for o in offerings or ():
        PRICES[(o.location, o.instance_type)] = (float(o.instance_usd_per_hour),
                                                 float(o.transfer_usd_per_gpu_hour) * int(o.gpus))


class StateCollector:
    """What is true now, read from the sources every replica shares: burst Nodes, Temporal visibility, the
    provisioning and hub sync workflows' queries. A scrape never waits for them: it serves the values last read
    and, when the last read began ``min_interval`` seconds ago and is over, starts the next in the background
    (one at a time; each source cut off after ``source_timeout`` seconds, one source down or slow not taking the
    others with it). ``kubeon_metrics_snapshot_age_seconds`` says how old each source's values are."""

    SOURCES = ("kubernetes", "temporal", "provisioning", "hub")

    def __init__(self, temporal: temporal_client.Client, runtime: WorkerRuntime, *, min_interval: float = 2.0,
                 source_timeout: float = 10.0) -> None:
        # The same connection without the client's interceptors: a scrape's reads are no operation, and traced
        # they would make a trace (a query span and its handler's) per policy and scrape.
        self.temporal = temporal_client.Client(temporal.service_client, namespace=temporal.namespace,
                                               data_converter=temporal.data_converter)
        self.runtime = runtime
        self.cluster = runtime.settings.cluster
        self.min_interval = min_interval
        self.source_timeout = source_timeout
        # Each source is read by a task of its own, on its own cadence: a stalled Temporal (each read cut off at
        # source_timeout) never holds back the Kubernetes read, nor the other way round.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started: dict[str, float] = {}  # source -> when its last read started (monotonic)
        self._read_at: dict[str, float] = {}  # source -> when its values were last read (monotonic)
        # The policies the node and operation reads last saw: the provisioning read asks about each.
        self._policies: dict[str, set[str]] = {}
        self._price_checked: dict[str, float] = {}
        # Its own thread: the default executor is busy with the serving activities' checks under load, and a
        # read queued behind them would go stale.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")

    async def _blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args,
                                                                                                   **kwargs))

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def refresh(self) -> list[asyncio.Task[None]]:
        """For a scrape: start the next read of each source that is due and not still reading, and set the
        snapshot ages. Returns the reads under way (a caller that wants fresh values, e.g. a test, may await them)."""
        now = time.monotonic()
        for source in self.SOURCES:
            if source == "hub" and self.runtime.hub is None:
                continue
            running = self._tasks.get(source)
            if (running is None or running.done()) and now - self._started.get(source, -1e9) >= self.min_interval:
                self._started[source] = now
                self._tasks[source] = asyncio.create_task(self._read(source), name=f"metrics-{source}")
        for source, at in self._read_at.items():
            pm.SNAPSHOT_AGE.labels(source=source).set(round(now - at, 3))
        return [task for task in self._tasks.values() if not task.done()]

    async def _read(self, source: str) -> None:
        step = dict(zip(self.SOURCES, (self._nodes, self._operations, self._provisionings, self._hub),
                        strict=True))[source]
        seen: set[str] = set()
        policies = seen if source in ("kubernetes", "temporal") else set().union(*self._policies.values())
        try:
            # Each step sets its gauges only once all it reads is in: cut off, it leaves the last values.
            await asyncio.wait_for(step(policies), timeout=self.source_timeout)
            self._read_at[source] = time.monotonic()
            if source in ("kubernetes", "temporal"):
                self._policies[source] = seen
        except Exception as exc:  # one source down must not take the others' metrics with it
            pm.SCRAPE_ERRORS.labels(source=source).inc()
            log.debug("metrics: cannot read %s: %s", source, type(exc).__name__)

    async def _nodes(self, policies: set[str]) -> None:
        nodes = await self._blocking(self.runtime.kube.core.list_node, label_selector=LABEL_POLICY)
        counts: dict[tuple[str, str], int] = {}
        cost: dict[str, list[float]] = {}
        for node in nodes.items:
            labels = (node.metadata.labels if node.metadata else None) or {}
            policy, location = labels[LABEL_POLICY], location_of_label_value(labels.get(LABEL_LOCATION, ""))
            policies.add(policy)
            counts[(policy, location)] = counts.get((policy, location), 0) + 1
            price = await self._price(location, labels.get(LABEL_INSTANCE_TYPE, ""))
            total = cost.setdefault(policy, [0.0, 0.0])
            total[0] += price[0]
            total[1] += price[1]
        pm.BURST_NODES.clear()
        for (policy, location), n in counts.items():
            pm.BURST_NODES.labels(policy=policy, location=location).set(n)
        pm.COMMITTED_USD_PER_HOUR.clear()
        for policy, (compute, transfer) in cost.items():
            pm.COMMITTED_USD_PER_HOUR.labels(policy=policy, component="compute").set(round(compute, 6))
            pm.COMMITTED_USD_PER_HOUR.labels(policy=policy, component="transfer").set(round(transfer, 6))

    async def _price(self, location: str, instance_type: str) -> tuple[float, float]:
        key = (location, instance_type)
        if key not in PRICES and time.monotonic() - self._price_checked.get(location, -1e9) > 600:
            self._price_checked[location] = time.monotonic()
            provider = self.runtime.providers.get(location.split("/", 1)[0])
            if provider is not None:
                _remember_prices(await self._blocking(provider.price_offerings, location))
        return PRICES.get(key, (0.0, 0.0))

    async def _operations(self, policies: set[str]) -> None:
        counts: dict[tuple[str, str], int] = {}
        query = f"ExecutionStatus = 'Running' AND {sa.CLUSTER.name} = '{self.cluster}'"
        async for wf in self.temporal.list_workflows(query, limit=10000):
            attrs = wf.typed_search_attributes
            kind, phase = attrs.get(sa.OPERATION_KIND), attrs.get(sa.PHASE)
            if kind:
                counts[(kind, phase or "")] = counts.get((kind, phase or ""), 0) + 1
            if attrs.get(sa.POLICY):
                policies.add(str(attrs.get(sa.POLICY)))
        pm.OPERATIONS.clear()
        for (kind, phase), n in counts.items():
            pm.OPERATIONS.labels(kind=kind, phase=phase).set(n)

    async def _provisionings(self, policies: set[str]) -> None:
        """Each policy's provisioning (it holds maxNodes): the nodes it holds and the pods waiting for one."""
        views: dict[str, ProvisionView] = {}
        for policy in sorted(policies):
            handle = self.temporal.get_workflow_handle(provision_workflow_id(self.cluster, policy))
            try:
                views[policy] = await handle.query("state", result_type=ProvisionView,
                                                   rpc_timeout=dt.timedelta(seconds=3))
            except (RPCError, temporal_client.WorkflowQueryFailedError):
                continue  # no provisioning (yet) for this policy
        pm.PROVISION_NODES.clear()
        pm.PROVISION_WAITING.clear()
        for policy, view in views.items():
            pm.PROVISION_NODES.labels(policy=policy).set(len(view.nodes))
            pm.PROVISION_WAITING.labels(policy=policy).set(len(view.waiting))

    async def _hub(self, _: set[str]) -> None:
        handle = self.temporal.get_workflow_handle(hub_sync_workflow_id(self.cluster))
        status = await handle.query("status", result_type=HubSyncStatus, rpc_timeout=dt.timedelta(seconds=3))
        pm.HUB_REPORTS_QUEUED.set(status.pending_reports)
        pm.HUB_CONNECTED.set(1 if status.state == "connected" else 0)
        if status.last_poll_at is not None:
            pm.HUB_LAST_POLL.set(status.last_poll_at.timestamp())


_collector: StateCollector | None = None


def attach(collector: StateCollector | None) -> None:
    """The collector ``/metrics`` refreshes (the running worker's); None detaches (and closes) it."""
    global _collector
    if _collector is not None and _collector is not collector:
        _collector.close()
    _collector = collector


async def metrics_body() -> bytes:
    """The whole ``/metrics`` answer: the product's metrics (and the process's), then the Temporal SDK's."""
    if _collector is not None:
        _collector.refresh()  # in the background: this scrape serves the values last read
    ours = generate_latest(REGISTRY)
    return ours + (b"" if ours.endswith(b"\n") else b"\n") + await sdk_metrics()


# ----- facts counted around activities ---------------------------------------------------------------------------

# What JSON log lines of the running activity carry (workflow ID, operation, policy).
LOG_CONTEXT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("kubeon_log_context",
                                                                                    default=None)


def operation_context(workflow_id: str | None, run_id: str | None, arg: Any = None) -> dict[str, str]:
    """Workflow ID, operation and policy of a workflow or its activity. The activity's argument says best (its
    ``operation`` and ``policy`` fields); else they are read from the workflow ID's documented shapes:
    ``burst/<cluster>/<policy>/<batch>-<n>`` (a node; operation: derived from the run),
    ``provision/<cluster>/<policy>``, ``drain/<node workflow ID>/<operation>``."""
    ctx: dict[str, str] = {}
    if workflow_id:
        ctx["workflow_id"] = workflow_id
        parts = workflow_id.split("/")
        if parts[0] == "drain" and len(parts) >= 6:
            ctx["operation"] = parts[-1]
            parts = parts[1:]
        if parts[0] in ("burst", "provision") and len(parts) >= 3:
            ctx["policy"] = parts[2]
        if parts[0] == "burst" and run_id and "operation" not in ctx and len(parts) == 4:
            ctx["operation"] = operation_id(workflow_id, run_id)
    for key in ("operation", "policy"):
        value = getattr(arg, key, None)
        if isinstance(value, str) and value:
            ctx[key] = value
    return ctx


# Workflow type -> the operation kind its audited actions count under: a batch's proposal and approval (the
# provisioning) and its nodes' launch to return home are all of one burst.
ACTION_KINDS = {"BurstNode": "Burst", "Provision": "Burst", "DrainWorkflow": "Drain", "ScaleWorkflow": "Scale",
                "TimeSlicing": "Sharing", "Mig": "Sharing"}


def _kind(workflow_type: str | None) -> str:
    name = workflow_type or ""
    return ACTION_KINDS.get(name) or name.removesuffix("Workflow") or "?"


def _observe(info: activity.Info, arg: Any, result: Any, ctx: Mapping[str, str]) -> None:
    kind = _kind(info.workflow_type)
    policy = ctx.get("policy", "")
    elapsed = (dt.datetime.now(dt.UTC) - info.scheduled_time).total_seconds()
    name = info.activity_type
    if name == "record_audit" and result is True:
        action = str(getattr(arg, "action", ""))
        pm.OPERATION_ACTIONS.labels(kind=kind, policy=policy, action=action).inc()
        log.info("%s operation %s: %s", kind.lower(), ctx.get("operation", "?"), action)
    elif name == "launch_instance":
        offering = getattr(arg, "offering", None)
        pm.LAUNCH_SECONDS.labels(policy=policy, location=str(getattr(offering, "location", ""))).observe(elapsed)
    elif name == "wait_for_node":
        pm.JOIN_SECONDS.labels(policy=policy).observe(elapsed)
    elif name == "plan_batch":
        _remember_prices([o for n in getattr(result, "new_nodes", None) or ()
                          for o in (n.offering, *n.alternatives)])
    elif name == "hub_poll":
        state = str(getattr(result, "state", "?"))
        pm.HUB_POLLS.labels(state=state).inc()
        if state == "connected":
            pm.HUB_LAST_SYNC.set(time.time())


class _ObservingActivityInbound(temporal_worker.ActivityInboundInterceptor):
    async def execute_activity(self, input: temporal_worker.ExecuteActivityInput) -> Any:
        info = activity.info()
        arg = input.args[0] if input.args else None
        ctx = operation_context(info.workflow_id, info.workflow_run_id, arg)
        token = LOG_CONTEXT.set(ctx)  # copied into the thread of a sync activity
        try:
            try:
                result = await super().execute_activity(input)
            except BaseException:
                if info.activity_type == "hub_poll":
                    pm.HUB_POLLS.labels(state="error").inc()
                raise
            try:
                _observe(info, arg, result, ctx)
            except Exception as exc:  # a metric must never fail an activity
                log.debug("metrics of %s: %s", info.activity_type, exc)
            return result
        finally:
            LOG_CONTEXT.reset(token)


class ObservingInterceptor(temporal_client.Interceptor, temporal_worker.Interceptor):
    """Counts the product's facts around activities (audited actions, launch and join latency, hub polls) and
    gives their log lines the operation's context. A client interceptor too, so every worker of the client
    gets it."""

    def intercept_activity(self, next: temporal_worker.ActivityInboundInterceptor
                           ) -> temporal_worker.ActivityInboundInterceptor:
        return _ObservingActivityInbound(next)


# ----- logs ------------------------------------------------------------------------------------------------------


def _record_context(record: logging.LogRecord) -> dict[str, str]:
    ctx = LOG_CONTEXT.get()
    if ctx:
        return dict(ctx)
    details = getattr(record, "temporal_activity", None) or getattr(record, "temporal_workflow", None)
    if isinstance(details, Mapping):
        return operation_context(details.get("workflow_id"), details.get("workflow_run_id") or details.get("run_id"))
    return {}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the operation's context and trace where known."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        doc.update(_record_context(record))
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            doc["trace_id"] = format(span.trace_id, "032x")
            doc["span_id"] = format(span.span_id, "016x")
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def log_format(environ: Mapping[str, str]) -> str:
    value = environ.get("KUBEON_LOG_FORMAT", "").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ConfigError(f"KUBEON_LOG_FORMAT={value!r}: use text (the default) or json")
    return value


def configure_logging(environ: Mapping[str, str] | None = None, *, level: int = logging.INFO) -> None:
    environ = os.environ if environ is None else environ
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format(environ) == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)


__all__ = [
    "JsonFormatter",
    "ObservingInterceptor",
    "StateCollector",
    "attach",
    "client_interceptors",
    "configure_logging",
    "metrics_body",
    "operation_context",
    "setup_tracing",
    "temporal_runtime",
    "traces_exporter",
]
