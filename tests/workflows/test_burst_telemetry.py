"""Observability end to end: `kubeon-gpu worker` as its own process exports one trace per operation to a real
OTLP/HTTP endpoint (decoded with opentelemetry-proto): each batch of a provisioning (plan, approval, the nodes'
starts) and each burst node (launch to return home, linked to its batch), kept across a SIGKILL; it serves the
expected counts on /metrics, writes JSON logs with the operation, and leaks no secret into any of them. With OTEL_*
unset it exports nothing."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.testing import WorkflowEnvironment

from models.hub import hub_sync_workflow_id
from models.ids import provision_workflow_id
from models.join import parse_user_data
from models.labels import TAG_OPERATION
from models.node import NodePhase
from models.policy import API_GROUP
from models.policy import PLURAL
from models.provisioning import BatchPhase
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import sim_location
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.burst import worker_process
from tests.harness.controlplane import free_port
from tests.harness.dashboard import dashboard_metric_names
from tests.harness.kube import until
from tests.harness.kube import wait_for
from tests.harness.otlp import OtlpReceiver
from tests.harness.otlp import ReceivedSpan
from tests.harness.processes import answers_ok
from tests.harness.processes import stop_process
from tests.hub.process import SeededHub
from worker.config import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

# The node's phases; the batch's (planning, awaiting its approval) are in the batch's trace.
PHASES = ("Launching", "Joining", "Verifying", "Serving", "Draining", "Completed")
BATCH_PHASES = {"Phase:Planning", "Phase:AwaitingApproval"}


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("OTEL_"):
            monkeypatch.delenv(var)


class Samples:
    """One scrape of /metrics, parsed with prometheus_client's parser."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        self.names = {s.name for s in self.samples}

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@dataclass
class Worker:
    settings: Settings
    log: Path
    env: dict[str, str]
    stack: BurstStack
    proc: subprocess.Popen[bytes] | None = None

    def start(self, **more_env: str) -> None:
        self.proc = worker_process(self.settings, self.log, {**self.env, **more_env}, stack=self.stack)
        wait_for(self.healthy, what="worker /healthz", timeout=60)

    def healthy(self) -> bool:
        assert self.proc is not None
        return answers_ok(self.proc, f"{self.url}/healthz", name="worker", log=lambda: self.log.read_text()[-3000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.health_port}"

    def metrics(self) -> Samples:
        response = httpx.get(f"{self.url}/metrics", timeout=10)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        return Samples(response.text)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        """SIGTERM (the worker flushes its spans), then nothing of its process group is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        stop_process(proc, 60, group=True)
        return proc.returncode


def otel_env(otlp: OtlpReceiver, instance: str = "first") -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_SERVICE_NAME": "kubeon-test-worker", "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={instance}",
            "KUBEON_LOG_FORMAT": "json"}


def operation_spans(spans: list[ReceivedSpan], workflow_id: str) -> list[ReceivedSpan]:
    """Spans of the node's workflow and its drain child, and of their activities (Temporal's interceptor tags
    those with the run; a client's call on the workflow is the caller's)."""
    return [s for s in spans if "temporalRunID" in s.attributes and (
        s.attributes.get("temporalWorkflowID") == workflow_id
        or str(s.attributes.get("temporalWorkflowID", "")).startswith(f"drain/{workflow_id}/"))]


def one_trace(otlp: OtlpReceiver, workflow_id: str) -> list[ReceivedSpan]:
    """Every span of the operation's trace (none yet: empty); the operation's spans must all be in one."""
    spans = otlp.snapshot()
    traces = {s.trace_id for s in operation_spans(spans, workflow_id)}
    assert len(traces) <= 1, f"{workflow_id}: spans in {len(traces)} traces: " + repr(
        sorted((s.trace_id[:6], s.name) for s in operation_spans(spans, workflow_id)))
    return [s for s in spans if s.trace_id in traces]


def root(spans: list[ReceivedSpan]) -> ReceivedSpan:
    roots = [s for s in spans if not s.parent_span_id]
    assert len(roots) == 1, sorted(s.name for s in roots)
    return roots[0]


def check_node_trace(otlp: OtlpReceiver, node: list[ReceivedSpan], *, workflow_id: str, operation: str,
                     policy: str) -> list[ReceivedSpan]:
    """The node's trace is its own: rooted at its BurstNode span (which names it), without the batch's planning,
    and linked to the span of a separate batch trace that started it. Returns that batch trace."""
    node_root = root(node)
    assert node_root.name == "BurstNode", node_root.name
    assert {k: node_root.attributes.get(k) for k in ("kubeon.operation", "kubeon.policy")} == {
        "kubeon.operation": operation, "kubeon.policy": policy}
    names = {s.name for s in node}
    assert not names & ({"RunActivity:plan_batch", "RunWorkflow:Provision"} | BATCH_PHASES), sorted(names)
    (link,) = node_root.links
    assert link.trace_id != node_root.trace_id
    batch = [s for s in otlp.snapshot() if s.trace_id == link.trace_id]
    batch_root = root(batch)
    assert batch_root.name == "Batch"
    assert {k: batch_root.attributes.get(k) for k in ("kubeon.batch", "kubeon.operation", "kubeon.policy")} == {
        "kubeon.batch": node_root.attributes["kubeon.batch"], "kubeon.operation": node_root.attributes["kubeon.batch"],
        "kubeon.policy": policy}
    (started,) = [s for s in batch if s.span_id == link.span_id]
    assert started.name == "StartChildWorkflow:BurstNode"
    # The batch links to the watcher's signals that brought its pods, each sent in a trace of its own.
    sent = {(s.trace_id, s.span_id): s for s in otlp.snapshot()}
    arrivals = [sent.get((a.trace_id, a.span_id)) for a in batch_root.links]
    assert arrivals and all(a is not None and a.name == "SignalWithStartWorkflow:Provision" and not a.parent_span_id
                            and a.trace_id != batch_root.trace_id for a in arrivals), arrivals
    assert {"RunActivity:load_policy", "RunActivity:plan_batch", "Phase:Planning"} <= {s.name for s in batch}
    assert not any(s.attributes.get("temporalWorkflowID") == workflow_id for s in batch)
    return batch


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def sim_records(settings: Settings, operation: str) -> list[dict[str, Any]]:
    state = json.loads((settings.state_dir / "sim-instances.json").read_text())
    return [rec for rec in state.values() if rec["tags"].get(TAG_OPERATION) == operation]


async def test_a_burst_is_one_trace_counted_in_metrics_and_leaks_no_secret(
        stack: BurstStack, hub: SeededHub, temporal_dev_server: WorkflowEnvironment, namespace: str,
        tmp_path: Path) -> None:
    temporal = temporal_dev_server.client
    policy = unique("obs")
    with OtlpReceiver() as otlp:
        settings = stack.settings(
            temporal_address=temporal.service_client.config.target_host, task_queue=unique("q"),
            locations=SIM_LOCATIONS, cluster_name=hub.cluster, hub_url=hub.process.url,
            hub_token_file=hub.token_file, hub_poll_interval=1.0, health_port=free_port())
        worker = Worker(settings, tmp_path / "worker.log", otel_env(otlp), stack)
        worker.start()
        try:
            created = hub.admin.put(f"/v1/clusters/{hub.cluster}/policies/{policy}", json={
                "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": policy},
                "spec": {"kind": "Burst", "mode": "Approve", "workloads": {"tolerate": BURST_TAINT_KEY},
                         "locations": ["sim/eu-west", "sim/us-west"], "limits": {"maxNodes": 2, "maxGpuHour": 4.5},
                         "returnHome": True}})
            assert created.status_code in (200, 201), created.text
            await until(lambda: stack.cluster.admin.custom.list_cluster_custom_object(
                API_GROUP, "v1", PLURAL, field_selector=f"metadata.name={policy}")["items"], timeout=60,
                what="policy synced from the hub")
            deploy = unique("infer")
            stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
            pods = f"{namespace}/{deploy}-"
            view = await provision_state(temporal, hub.cluster, policy, lambda v: v.proposal is not None and any(
                p.startswith(pods) for n in v.proposal.plan.new_nodes for p in n.pods), timeout=120)
            assert view.proposal is not None
            batch = view.proposal.batch

            def reported() -> bool:  # the hub takes a decision only once the cluster's `proposed` report arrived
                r = hub.admin.get(f"/v1/clusters/{hub.cluster}/reports", params={"limit": 500})
                return any(x["operation"] == batch and x["action"] == "proposed" for x in r.json()["reports"])

            await until(reported, timeout=30, what="the proposal reported to the hub")
            decided = hub.admin.post(f"/v1/clusters/{hub.cluster}/approvals", json={
                "operation": batch, "decision": "approve", "plan_id": view.proposal.plan.plan_id})
            assert decided.status_code == 201, decided.text
            handle = await node_for(temporal, hub.cluster, policy, pods, timeout=120)
            wf_id = handle.id
            serving = await wait_phase(handle, NodePhase.SERVING, timeout=120)

            # While it serves: its node, what it costs, its phase and the node its provisioning holds.
            def serving_metrics() -> Samples | None:
                m = worker.metrics()
                ok = (m.value("kubeon_burst_nodes", policy=policy, location="sim/eu-west") == 1
                      and m.value("kubeon_operations", kind="Burst", phase="Serving") >= 1
                      and m.value("kubeon_provision_nodes", policy=policy) == 1)
                return m if ok else None

            during = await until(serving_metrics, timeout=60, what="metrics of the serving burst")
            assert during.value("kubeon_committed_usd_per_hour", policy=policy, component="compute") == 0.9
            assert during.value("kubeon_committed_usd_per_hour", policy=policy, component="transfer") > 0

            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            done = await result(handle, timeout=150)
            assert done.phase == NodePhase.COMPLETED, done.message

            # -- the node's trace: every phase of the node, the cloud call a child of the launch activity; linked to
            # its batch's trace, which holds the planning and the approval -----------------------------------------
            def finished_trace() -> list[ReceivedSpan] | None:
                spans = one_trace(otlp, wf_id)
                names = {s.name for s in spans}
                return spans if {"Phase:Completed", "RunActivity:remove_node"} <= names else None

            spans = await until(finished_trace, timeout=30, what="the whole trace exported")
            names = {s.name for s in spans}
            expected = {f"Phase:{p}" for p in PHASES} | {f"RunActivity:{a}" for a in (
                "load_policy", "record_audit", "launch_instance", "wait_for_node", "verify_node",
                "serve_until_done", "cordon_node", "evict_pods", "terminate_instance", "remove_node")} | {
                "BurstNode", "RunWorkflow:BurstNode", "StartChildWorkflow:DrainWorkflow", "RunWorkflow:DrainWorkflow",
                "cloud.launch", "cloud.terminate"}
            assert expected <= names, sorted(expected - names)
            (run_node,) = [s for s in by_name(spans, "RunWorkflow:BurstNode")
                           if s.attributes.get("temporalWorkflowID") == wf_id]
            assert run_node.parent_span_id == root(spans).span_id
            assert root(spans).attributes["kubeon.batch"] == batch
            batch_spans = check_node_trace(otlp, spans, workflow_id=wf_id, operation=serving.operation,
                                           policy=policy)
            batch_names = {s.name for s in batch_spans}
            assert BATCH_PHASES | {"RunActivity:record_audit", "HandleUpdate:approve_plan"} <= batch_names, sorted(
                batch_names)
            # Only the provisioning's own workflow and activity spans (the proposal's report to the hub, a client
            # call of record_audit, is in it too).
            assert {s.attributes["temporalWorkflowID"] for s in batch_spans if "temporalRunID" in s.attributes} == {
                provision_workflow_id(hub.cluster, policy)}
            (launch,) = by_name(spans, "cloud.launch")
            (launch_activity,) = by_name(spans, "RunActivity:launch_instance")
            assert launch.parent_span_id == launch_activity.span_id
            assert {k: launch.attributes[k] for k in ("cloud.provider", "kubeon.location", "kubeon.instance_type",
                                                      "kubeon.outcome")} == {
                "cloud.provider": "sim", "kubeon.location": "sim/eu-west", "kubeon.instance_type": "sim.l4.1",
                "kubeon.outcome": "ok"}
            (terminate,) = by_name(spans, "cloud.terminate")
            assert terminate.parent_span_id == by_name(spans, "RunActivity:terminate_instance")[0].span_id
            # /metrics was scraped all along: its reads of Temporal make no trace.
            assert not [s.name for s in otlp.snapshot() if s.name.startswith(("QueryWorkflow:", "HandleQuery:"))]
            hub_calls = [s for s in otlp.snapshot() if s.name.startswith("hub ")]
            assert {"hub GET /v1/cluster/policies", "hub POST /v1/cluster/reports"} <= {s.name for s in hub_calls}
            # Each hub poll is a trace of its own, rooted at its HubPoll span: not one trace as long as the worker.
            polls = {s.trace_id for s in hub_calls if s.name == "hub GET /v1/cluster/policies"}
            assert len(polls) >= 3, polls
            for trace_id in polls:
                poll_root = root([s for s in otlp.snapshot() if s.trace_id == trace_id])
                assert poll_root.name == "HubPoll" and poll_root.attributes["kubeon.cluster"] == hub.cluster

            # -- the metrics after the return home --------------------------------------------------------------
            def settled() -> Samples | None:
                m = worker.metrics()
                gone = m.value("kubeon_burst_nodes", policy=policy) == 0
                removed = m.value("kubeon_operation_actions_total", policy=policy, action="removed")
                return m if gone and removed else None

            after = await until(settled, timeout=60, what="metrics after the return home")
            for action in ("proposed", "approved", "launched", "joined", "verified", "drained", "removed"):
                assert after.value("kubeon_operation_actions_total", kind="Burst", policy=policy,
                                   action=action) == 1, action
            assert after.value("kubeon_launch_duration_seconds_count", policy=policy, location="sim/eu-west") == 1
            assert after.value("kubeon_launch_duration_seconds_sum", policy=policy) > 0
            assert after.value("kubeon_join_duration_seconds_count", policy=policy) == 1
            assert after.value("kubeon_join_duration_seconds_sum", policy=policy) > 0.1  # the sim boots in 0.5 s
            assert after.value("kubeon_join_duration_seconds_bucket", policy=policy, le="+Inf") == 1
            assert after.value("kubeon_cloud_requests_total", provider="sim", call="launch", outcome="ok") == 1
            assert after.value("kubeon_cloud_requests_total", provider="sim", call="terminate") >= 1
            assert after.value("kubeon_hub_polls_total", state="connected") >= 1
            assert after.value("kubeon_hub_last_sync_timestamp_seconds") > time.time() - 60
            assert after.value("kubeon_hub_connected") == 1
            assert after.value("kubeon_http_client_requests_total", peer="hub", route="/v1/cluster/reports",
                               outcome="ok") >= 1
            assert after.value("temporal_activity_execution_latency_seconds_count") > 0  # the SDK's own
            # The dashboard shows only what the worker exports (the gateway's panels: tests/worker).
            # (Gauges of what is gone are absent after the return home: the scrape while serving has them.)
            missing = {n for n in dashboard_metric_names() if not n.startswith("kubeon_gateway_")} - (
                during.names | after.names)
            assert not missing, sorted(missing)
        finally:
            code = worker.stop()
            with contextlib.suppress(Exception):
                await temporal.get_workflow_handle(hub_sync_workflow_id(hub.cluster)).terminate("test over")
            stack.delete_policy(policy)  # synced from the hub; cluster-scoped, it would take later tests' pods
        assert code == 0, worker.log.read_text()[-3000:]

        # -- JSON logs with the operation and its trace -----------------------------------------------------------
        lines = [json.loads(line) for line in worker.log.read_text().splitlines() if line.strip()]
        trace_id = root(spans).trace_id
        launched = [d for d in lines if d.get("operation") == serving.operation and d["message"].endswith("launched")]
        assert launched and launched[0]["policy"] == policy and launched[0]["trace_id"] == trace_id
        assert launched[0]["workflow_id"] == wf_id

        # -- no secret anywhere: logs, spans as exported, metrics ------------------------------------------------
        (record,) = sim_records(settings, serving.operation)
        user_data: str = record["user_data"]
        ticket: str = parse_user_data(user_data)["ticket"]
        secrets = {"hub token": hub.token_file.read_text().strip(), "join ticket": ticket, "user data": user_data}
        haystacks = {"logs": worker.log.read_bytes(), "spans": b"\n".join(otlp.bodies),
                     "decoded spans": repr(otlp.snapshot()).encode(), "metrics": after.text.encode()}
        for what, secret in secrets.items():
            assert len(secret) >= 16, what
            for form in {secret.encode(), base64.b64encode(secret.encode())}:
                for where, data in haystacks.items():
                    assert form not in data, f"the {what} is in the {where}"


async def test_the_trace_survives_a_worker_killed_mid_join(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, tmp_path: Path) -> None:
    temporal = temporal_dev_server.client
    product = unique("NVIDIA-T")
    location = sim_location("sim/eu-west", product, price=1.0, boot_seconds=6)
    queue = unique("trace")
    policy = unique("trace")
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"])
    with OtlpReceiver() as otlp:
        settings = stack.settings(temporal_address=temporal.service_client.config.target_host, task_queue=queue,
                                  locations=[location], cluster_name=queue, health_port=free_port())
        worker = Worker(settings, tmp_path / "worker.log", otel_env(otlp, "first"), stack)
        try:
            worker.start()
            deploy = unique("infer")
            stack.cluster.admin.apps.create_namespaced_deployment(namespace,
                                                                  gpu_deployment(deploy, gpu_product=product))
            handle = await node_for(temporal, queue, policy, f"{namespace}/{deploy}-", timeout=90)
            wf_id = handle.id
            operation = (await wait_phase(handle, NodePhase.JOINING, timeout=90)).operation
            await until(lambda: by_name(otlp.snapshot(), "StartActivity:wait_for_node"), timeout=10,
                        what="the join's scheduling exported")
            worker.kill()  # mid-join: the instance is still booting
            worker.start(OTEL_RESOURCE_ATTRIBUTES="service.instance.id=second")
            await wait_phase(handle, NodePhase.SERVING, timeout=150)
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            done = await result(handle, timeout=150)
            assert done.phase == NodePhase.COMPLETED, done.message

            def completed_trace() -> list[ReceivedSpan] | None:
                trace = one_trace(otlp, wf_id)
                return trace if by_name(trace, "Phase:Completed") else None

            spans = await until(completed_trace, timeout=30, what="the trace after the restart")
        finally:
            worker.stop()
            stack.delete_policy(policy)

    def of(instance: str) -> set[str]:
        return {s.name for s in spans if s.resource.get("service.instance.id") == instance}

    assert {"RunActivity:launch_instance", "cloud.launch", "StartActivity:wait_for_node"} <= of("first")
    assert {"RunActivity:wait_for_node", "RunActivity:verify_node", "Phase:Serving", "RunWorkflow:DrainWorkflow",
            "Phase:Completed"} <= of("second")
    # The resumed join is the child of the span that scheduled it before the kill: the same trace, unbroken.
    (scheduled,) = by_name(spans, "StartActivity:wait_for_node")
    resumed = [s for s in by_name(spans, "RunActivity:wait_for_node") if s.resource["service.instance.id"] == "second"]
    assert resumed and all(s.parent_span_id == scheduled.span_id for s in resumed)
    # A replay adds no duplicate, and re-derives the same trace: one root, made before the kill.
    assert not {"BurstNode", "RunWorkflow:BurstNode"} & of("second")
    assert root(spans).name == "BurstNode" and root(spans).resource["service.instance.id"] == "first"
    check_node_trace(otlp, spans, workflow_id=wf_id, operation=operation, policy=policy)


async def test_worker_without_otel_variables_exports_nothing_and_says_nothing(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, namespace: str, tmp_path: Path,
        no_otel_env: None) -> None:
    temporal = temporal_dev_server.client
    queue, policy = unique("plain"), unique("plain")
    stack.create_policy(policy, mode=None, locations=["sim/eu-west"])  # Recommend: a proposal, nothing launched
    settings = stack.settings(temporal_address=temporal.service_client.config.target_host, task_queue=queue,
                              locations=SIM_LOCATIONS, cluster_name=queue, health_port=free_port())
    worker = Worker(settings, tmp_path / "worker.log", {}, stack)
    try:
        worker.start()
        deploy = unique("infer")
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        view = await provision_state(temporal, queue, policy, lambda v: any(
            b.phase == BatchPhase.PROPOSED for b in v.batches), timeout=120)
        assert not view.nodes  # a proposal, nothing launched

        def counted() -> Samples | None:
            m = worker.metrics()
            return m if m.value("kubeon_operation_actions_total", policy=policy, action="proposed") == 1 else None

        m = await until(counted, timeout=30, what="the proposal counted")
        assert "temporal_activity_execution_latency_seconds_count" in m.names  # the SDK's own
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    finally:
        code = worker.stop()
        stack.delete_policy(policy)
    assert code == 0
    log = worker.log.read_text()
    assert "worker started" in log
    # (The prerequisites check names the NVIDIA DCGM exporter, a metrics source: no word about tracing.)
    said = log.lower().replace("dcgm exporter", "dcgm")
    for word in ("otel", "opentelemetry", "otlp", "exporter", "traces", "tracing", "span"):
        assert word not in said, f"{word!r} in the log of a worker without OTEL_*:\n{log}"
