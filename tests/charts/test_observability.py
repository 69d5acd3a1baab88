"""The chart's observability values: scrape annotations, the OTEL_* variables, JSON logs, the optional
ServiceMonitor and Grafana dashboard ConfigMap. Rendered by the pinned helm; the settings the worker reads from
the rendered environment are checked with its own parser."""

from __future__ import annotations

import json

import yaml

from tests.charts.helm import BURST_VALUES
from tests.charts.helm import CHART
from tests.charts.helm import NAMESPACE
from tests.charts.helm import container
from tests.charts.helm import env
from tests.charts.helm import template
from tests.harness.dashboard import DASHBOARD
from tests.harness.dashboard import dashboard_metric_names
from worker import telemetry

OPTIMIZER = "kubeon-gpu-optimizer"
GATEWAY = "kubeon-gpu-optimizer-gateway"
SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": "8080", "prometheus.io/path": "/metrics"}


def pod_annotations(deployment: dict) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"].get("annotations") or {})


def test_defaults_scrape_annotations_and_no_tracing_no_monitor() -> None:
    rendered = template(values=[BURST_VALUES])
    for name in (OPTIMIZER, GATEWAY):
        deployment = rendered.get("Deployment", name)
        assert SCRAPE.items() <= pod_annotations(deployment).items(), name
        ports = {p["name"]: p["containerPort"] for p in container(deployment, name.rsplit("-", 1)[-1]
                                                                   if name == GATEWAY else "worker")["ports"]}
        assert ports["health"] == 8080
    worker_env = env(container(rendered.get("Deployment", OPTIMIZER), "worker"))
    assert not [k for k in worker_env if k.startswith("OTEL_") or k == "KUBEON_LOG_FORMAT"]
    assert telemetry.traces_exporter(worker_env) is None  # the worker starts no exporter
    assert not rendered.all("ServiceMonitor") and not rendered.find("ConfigMap", f"{OPTIMIZER}-dashboard")
    values = yaml.safe_load((CHART / "values.yaml").read_text())["observability"]
    assert values["metrics"]["serviceMonitor"]["enabled"] is False and values["tracing"]["otlpEndpoint"] == ""


def test_tracing_and_json_logs_from_values() -> None:
    rendered = template("--set", "observability.tracing.otlpEndpoint=http://otel-collector.monitoring.svc:4318",
                        "--set", "observability.tracing.resourceAttributes=deployment.environment=prod",
                        "--set-json", "observability.tracing.sampleRatio=0.25", "--set", "observability.logFormat=json",
                        "--set", "observability.metrics.scrapeAnnotations=false", values=[BURST_VALUES])
    worker = rendered.get("Deployment", OPTIMIZER)
    e = env(container(worker, "worker"))
    assert {k: v for k, v in e.items() if k.startswith("OTEL_") or k == "KUBEON_LOG_FORMAT"} == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector.monitoring.svc:4318",
        "OTEL_SERVICE_NAME": "kubeon-gpu-optimizer", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod",
        "KUBEON_LOG_FORMAT": "json"}
    assert telemetry.traces_exporter(e) == "otlp" and telemetry.log_format(e) == "json"
    gateway_env = env(container(rendered.get("Deployment", GATEWAY), "gateway"))
    assert gateway_env["KUBEON_LOG_FORMAT"] == "json" and not [k for k in gateway_env if k.startswith("OTEL_")]
    assert not SCRAPE.keys() & pod_annotations(worker).keys()


def test_service_monitor_scrapes_worker_and_gateway_health_ports() -> None:
    rendered = template("--set", "observability.metrics.serviceMonitor.enabled=true",
                        "--set", "observability.metrics.serviceMonitor.labels.release=prom",
                        "--set", "observability.metrics.serviceMonitor.interval=15s", values=[BURST_VALUES])
    (monitor,) = rendered.all("ServiceMonitor")
    assert monitor["metadata"]["namespace"] == NAMESPACE and monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "health", "path": "/metrics", "interval": "15s"}]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for component, deployment in (("worker", OPTIMIZER), ("gateway", GATEWAY)):
        service = rendered.get("Service", f"{OPTIMIZER}-{component}-metrics", NAMESPACE)
        assert selector.items() <= service["metadata"]["labels"].items()
        pod_labels = rendered.get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert service["spec"]["ports"] == [{"name": "health", "port": 8080, "targetPort": "health",
                                             "protocol": "TCP"}]
    without_burst = template("--set", "observability.metrics.serviceMonitor.enabled=true")
    assert not without_burst.find("Service", f"{OPTIMIZER}-gateway-metrics")


def test_grafana_dashboard_configmap_carries_the_dashboard() -> None:
    rendered = template("--set", "observability.metrics.grafanaDashboard=true")
    cm = rendered.get("ConfigMap", f"{OPTIMIZER}-dashboard", NAMESPACE)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["kubeon-gpu-optimizer.json"])
    assert shipped == json.loads(DASHBOARD.read_text())
    assert "kubeon_launch_duration_seconds_bucket" in dashboard_metric_names()
