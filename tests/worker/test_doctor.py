"""Prerequisite detection (R1.6) on the real control plane, with the chart's ServiceAccount and ClusterRole, and a
real Prometheus for the DCGM check."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from activities.clients.prometheus import PrometheusClient
from tests.harness.controlplane import free_port
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.prometheus import Prometheus
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA
from tests.harness.rbac import install_chart_identities
from worker.cli import main
from worker.doctor import PrerequisiteLog
from worker.doctor import run_checks

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus]


@pytest.fixture(scope="module")
def optimizer_kubeconfig(cluster: Cluster) -> Path:
    install_chart_identities(cluster)
    return cluster.service_account_kubeconfig(OPTIMIZER_NAMESPACE, OPTIMIZER_SA, create=False)


@pytest.fixture(scope="module")
def dcgm_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exporter = DcgmExporter().start()
    exporter.add_node("gpu-doctor", gpus=1)
    prom = Prometheus(tmp_path_factory.mktemp("doctor-prom"), targets=[exporter.address]).start()
    prom.wait_scraped()
    try:
        yield prom.url
    finally:
        prom.stop()
        exporter.stop()


def _karpenter_installed(cluster: Cluster) -> bool:
    return any(c.metadata.name == "nodepools.karpenter.sh"
               for c in cluster.admin.apiext.list_custom_resource_definition().items)


def test_doctor_names_missing_gpu_operator_and_prometheus(optimizer_kubeconfig: Path, cluster: Cluster,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBEON_PROMETHEUS_URL", raising=False)
    assert main(["doctor", "--kubeconfig", str(optimizer_kubeconfig)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0]: line for line in out.splitlines()[1:]}
    assert "missing" in lines["NVIDIA GPU Operator"]
    assert "Deployment gpu-operator/gpu-operator not found" in lines["NVIDIA GPU Operator"]
    assert "sharing (time-slicing and MIG" in lines["NVIDIA GPU Operator"]
    assert "missing" in lines["DCGM exporter + Prometheus"]
    assert "prometheus.url is not set" in lines["DCGM exporter + Prometheus"]
    assert "scale to zero (Recommend only, R1.3), sharing and GPU type fit" in lines["DCGM exporter + Prometheus"]
    assert "missing" in lines["KubeOn agent"]
    # Karpenter is missing unless a test of this session started the real one on this control plane (its CRDs stay).
    assert ("found" if _karpenter_installed(cluster) else "missing") in lines["Karpenter"]
    assert out.splitlines()[0].split() == ["PREREQUISITE", "STATUS", "DETAIL", "DISABLES", "WHEN", "MISSING", "FIX"]


def test_gpu_operator_found_by_node_labels(cluster: Cluster, optimizer_kubeconfig: Path) -> None:
    from common.kube import kube_api

    node = f"gpu-op-{uuid.uuid4().hex[:6]}"
    cluster.create_kwok_node(node, labels={"nvidia.com/gpu.deploy.device-plugin": "true"})
    try:
        checks = {p.name: p for p in run_checks(kube_api(optimizer_kubeconfig), None,
                                                gpu_operator_namespace="gpu-operator", capacity_provider="karpenter")}
        assert checks["NVIDIA GPU Operator"].status == "found"
        assert "1 node(s) carry its nvidia.com/gpu.deploy.* labels" in checks["NVIDIA GPU Operator"].detail
    finally:
        cluster.admin.core.delete_node(node)


def test_dcgm_series_found_and_prometheus_down_reported(optimizer_kubeconfig: Path, dcgm_prometheus: str) -> None:
    from common.kube import kube_api

    api = kube_api(optimizer_kubeconfig)
    found = {p.name: p for p in run_checks(api, PrometheusClient(dcgm_prometheus), gpu_operator_namespace="x",
                                           capacity_provider="karpenter")}
    dcgm = found["DCGM exporter + Prometheus"]
    assert dcgm.status == "found" and "pods labelled pod/namespace" in dcgm.detail
    down = {p.name: p for p in run_checks(api, PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout=2),
                                          gpu_operator_namespace="x", capacity_provider="eks-nodegroups")}
    assert down["DCGM exporter + Prometheus"].status == "missing"
    assert "unreachable" in down["DCGM exporter + Prometheus"].detail
    assert down["capacity (eks-nodegroups)"].status == "unknown"


def test_one_log_line_each_then_only_changes(caplog: pytest.LogCaptureFixture, optimizer_kubeconfig: Path) -> None:
    from common.kube import kube_api

    prereqs = run_checks(kube_api(optimizer_kubeconfig), None, gpu_operator_namespace="gpu-operator",
                         capacity_provider="karpenter")
    report = PrerequisiteLog()
    with caplog.at_level(logging.INFO, logger="kubeon.prerequisites"):
        report.report(prereqs)
        report.report(prereqs)
    lines = [r.getMessage() for r in caplog.records if r.name == "kubeon.prerequisites"]
    assert len(lines) == len(prereqs) == 6
    assert any(line.startswith("prerequisite NVIDIA GPU Operator: missing") and "fix: install the NVIDIA GPU Operator"
               in line for line in lines)


def test_time_slicing_configmap_and_device_plugin_by_node_labels(cluster: Cluster,
                                                                  optimizer_kubeconfig: Path) -> None:
    """Without the chart's time-slicing Role the ConfigMap is forbidden (R5.3); with it, readable; whether the
    device plugin reads it is judged from a node naming one of its keys and the replicas it shows."""
    from kubernetes import client

    from common.kube import kube_api
    from tests.harness.gpu_operator import GpuOperator
    from tests.harness.gpu_operator import grant_time_slicing_role
    from worker.doctor import check_mig_strategy
    from worker.doctor import check_time_slicing

    api = kube_api(optimizer_kubeconfig)
    ns = cluster.create_namespace("gpuop")
    node = f"doctor-{uuid.uuid4().hex[:6]}"
    try:
        cluster.admin.core.create_namespaced_config_map(ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="time-slicing-config"),
            data={"ts-2": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                          "      - name: nvidia.com/gpu\n        replicas: 2\n"}))
        forbidden = check_time_slicing(api, ns, "time-slicing-config")
        assert [(p.name, p.status) for p in forbidden] == [("time-slicing ConfigMap", "missing")]
        assert "forbidden" in forbidden[0].detail and "gpuOperator.createRole" in forbidden[0].fix
        grant_time_slicing_role(cluster, ns)

        def readable() -> list[Any] | None:
            got = check_time_slicing(api, ns, "time-slicing-config")
            return got if got[0].status == "found" else None
        found = wait_for(readable, what="the Role in force", timeout=30)
        assert found[1].status == "unknown" and "no node names one of its keys" in found[1].detail
        cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels("NVIDIA-A100-SXM4-80GB", 1),
                                               "nvidia.com/device-plugin.config": "ts-2"})
        stale = check_time_slicing(api, ns, "time-slicing-config")
        assert stale[1].status == "missing" and f"{node} (ts-2: replicas 2, shows 1)" in stale[1].detail
        assert "devicePlugin" in stale[1].fix
        cluster.admin.core.patch_node(node, {"metadata": {"labels": {"nvidia.com/gpu.replicas": "2"}}})
        shown = check_time_slicing(api, ns, "time-slicing-config")
        assert shown[1].status == "found"
        cluster.admin.core.patch_node(node, {"metadata": {"labels": {"nvidia.com/mig.strategy": "single"}}})
        assert check_mig_strategy(api).status == "missing"
    finally:
        cluster.admin.core.delete_namespace(ns)
        with contextlib.suppress(client.ApiException):
            cluster.admin.core.delete_node(node)


def test_doctor_finds_the_real_karpenter_and_its_gpu_nodepools(optimizer_kubeconfig: Path, karpenter: Karpenter,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    name = f"gpu-doctor-{uuid.uuid4().hex[:6]}"
    karpenter.create_nodepool(gpu_nodepool(name, taint=name))
    try:
        assert main(["doctor", "--kubeconfig", str(optimizer_kubeconfig)]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Karpenter"))
        assert "found" in line and "with GPUs: " in line and name in line
    finally:
        karpenter.delete_nodepool(name)
