"""The real Karpenter (``sigs.k8s.io/karpenter/kwok``, its kwok cloud provider) against the harness's control plane.

``build-binaries.sh karpenter`` builds it from the Go module proxy at ``KARPENTER_VERSION`` and copies the CRDs of
the same module version next to it (``karpenter-crds-<v>/``). ``Karpenter.start()`` installs those CRDs and a
``KWOKNodeClass`` named ``default``, and runs the controller with the GPU instance types of
``karpenter-instance-types.json``: g6.xlarge / g6.12xlarge / g6.48xlarge (1, 4, 8 NVIDIA-L4) and a2-highgpu-1g /
-4g / -8g (1, 4, 8 NVIDIA-A100-SXM4-40GB) at their on-demand list prices (AWS us-east-1, GCP us-central1; spot at
40 %), one zone ``test-zone-a``. ``nvidia.com/gpu.product`` and ``nvidia.com/gpu.count`` are single-value offering
requirements, which the kwok provider turns into Node labels (kwok/cloudprovider/cloudprovider.go
``addInstanceLabels``) and Karpenter treats as well-known labels (a pod's nodeSelector on them is served).

The Nodes Karpenter creates carry ``kwok.x-k8s.io/node: fake``, so the control plane's kwok plays their kubelet:
they turn Ready, Karpenter registers and initializes them (``nvidia.com/gpu`` is in their allocatable).

Sharing one Karpenter between tests: Karpenter serves only pods that fit a NodePool, so every test's NodePool
carries a taint of its own (``gpu_nodepool(taint=...)``) and only that test's pods tolerate it; no other test's
pending pod ever gets a Karpenter node, and the tests' pools do not serve each other's pods.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import cast

from kubernetes import client

from tests.harness.controlplane import HARNESS_DIR
from tests.harness.controlplane import ControlPlane
from tests.harness.controlplane import ControlPlaneError
from tests.harness.controlplane import binary_dir
from tests.harness.controlplane import ensure_binaries
from tests.harness.controlplane import free_port
from tests.harness.controlplane import read_versions
from tests.harness.crd import install_crds
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.workloads import SMALL_REQUESTS
from tests.harness.workloads import gpu_pods

INSTANCE_TYPES_FILE = HARNESS_DIR / "karpenter-instance-types.json"
KARPENTER_GROUP = "karpenter.sh"
KARPENTER_VERSION = "v1"
NODE_CLASS = {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"}
# The taint key of the tests' NodePools; its value is the test's own.
TEST_TAINT_KEY = "gpu.kubeon.io/karpenter-test"

L4 = "NVIDIA-L4"
A100 = "NVIDIA-A100-SXM4-40GB"


def crd_dir() -> Path:
    return binary_dir() / f"karpenter-crds-{read_versions()['KARPENTER_VERSION']}"


def gpu_nodepool(
    name: str, *, taint: str, gpu_limit: int | None = None, products: tuple[str, ...] = (L4,),
    gpu_counts: tuple[int, ...] | None = None, instance_types: tuple[str, ...] | None = None,
    consolidation: str = "WhenEmpty", consolidate_after: str = "Never",
    budgets: list[dict[str, Any]] | None = None, labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A GPU NodePool as users write them (GPU product requirement, the GPU taint, a GPU limit), plus the test's
    own taint ``TEST_TAINT_KEY=<taint>:NoSchedule`` so that only the test's pods are served by it."""
    requirements: list[dict[str, Any]] = [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": list(products)},
        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
    ]
    if gpu_counts:
        requirements.append({"key": "nvidia.com/gpu.count", "operator": "In", "values": [str(c) for c in gpu_counts]})
    if instance_types:
        requirements.append({"key": "node.kubernetes.io/instance-type", "operator": "In",
                             "values": list(instance_types)})
    spec: dict[str, Any] = {
        "template": {
            "metadata": {"labels": labels or {}},
            "spec": {
                "nodeClassRef": NODE_CLASS,
                "requirements": requirements,
                "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
                           {"key": TEST_TAINT_KEY, "value": taint, "effect": "NoSchedule"}],
                "expireAfter": "Never",
            },
        },
        "disruption": {"consolidationPolicy": consolidation, "consolidateAfter": consolidate_after,
                       "budgets": budgets if budgets is not None else [{"nodes": "10%"}]},
    }
    if gpu_limit is not None:
        spec["limits"] = {"nvidia.com/gpu": str(gpu_limit)}
    return {"apiVersion": f"{KARPENTER_GROUP}/{KARPENTER_VERSION}", "kind": "NodePool",
            "metadata": {"name": name}, "spec": spec}


def gpu_tolerations(taint: str) -> list[client.V1Toleration]:
    """What a test's pods need to land on its NodePool's nodes."""
    return [client.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
            client.V1Toleration(key=TEST_TAINT_KEY, operator="Equal", value=taint, effect="NoSchedule")]


@dataclass
class Karpenter:
    """One Karpenter controller on ``plane``; ``start()`` returns once its CRDs are established and it is ready."""

    plane: ControlPlane
    workdir: Path
    admin: Kube
    health_port: int = 0
    metrics_port: int = 0
    started_seconds: float = 0.0
    instance_types_file: Path = INSTANCE_TYPES_FILE  # a benchmark offers its own shapes and prices
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return self.admin.custom

    def start(self, timeout: float = 120.0) -> Karpenter:
        t0 = time.monotonic()
        binary = ensure_binaries(("karpenter",))["karpenter"]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.install_crds(deadline=t0 + timeout)
        with contextlib.suppress(client.ApiException):  # 409: a restart on the same control plane
            self.custom.create_cluster_custom_object("karpenter.kwok.sh", "v1alpha1", "kwoknodeclasses", {
                "apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
                "metadata": {"name": NODE_CLASS["name"]}})
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "KUBECONFIG": str(self.plane.admin_kubeconfig),
            "SYSTEM_NAMESPACE": "kube-system",
            "DISABLE_LEADER_ELECTION": "true",
            "HEALTH_PROBE_PORT": str(self.health_port),
            "METRICS_PORT": str(self.metrics_port),
            "INSTANCE_TYPES_FILE_PATH": str(self.instance_types_file),
            "LOG_LEVEL": "debug",
            # A pending pod is batched for at most this long before Karpenter launches (default 10 s / 1 s).
            "BATCH_MAX_DURATION": "2s",
            "BATCH_IDLE_DURATION": "500ms",
            "FEATURE_GATES": "StaticCapacity=true,NodeRepair=false,SpotToSpotConsolidation=false,NodeOverlay=false",
        }
        log = open(self.workdir / "karpenter.log", "wb")  # noqa: SIM115 - closed when the process ends
        self._proc = self.plane.popen([str(binary)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=env)
        self._wait_ready(deadline=t0 + timeout)
        self.started_seconds = time.monotonic() - t0
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, "Karpenter is not running"
        return self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def install_crds(self, deadline: float) -> None:
        install_crds(self.admin, sorted(crd_dir().glob("*.yaml")), timeout=deadline - time.monotonic())

    def _wait_ready(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise ControlPlaneError(f"karpenter exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except Exception as exc:  # not listening yet, or 500 while its caches sync
                last = str(exc)
            time.sleep(0.2)
        raise ControlPlaneError(f"karpenter not ready: {last}\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return (self.workdir / "karpenter.log").read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    # -- objects -------------------------------------------------------------------------------------------------
    def create_nodepool(self, body: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], self.custom.create_cluster_custom_object(
            KARPENTER_GROUP, KARPENTER_VERSION, "nodepools", body))

    def nodepool(self, name: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.custom.get_cluster_custom_object(
            KARPENTER_GROUP, KARPENTER_VERSION, "nodepools", name))

    def nodeclaims(self, nodepool: str) -> list[dict[str, Any]]:
        found = self.custom.list_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims",
                                                       label_selector=f"karpenter.sh/nodepool={nodepool}")
        return list(cast(dict[str, Any], found)["items"])

    def nodeclaim(self, name: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.custom.get_cluster_custom_object(
            KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims", name))

    def nodes(self, nodepool: str) -> list[client.V1Node]:
        return list(self.admin.core.list_node(label_selector=f"karpenter.sh/nodepool={nodepool}").items)

    def force_delete_nodepool(self, name: str) -> None:
        """Delete the pool, its NodeClaims and its Nodes at once, finalizers stripped: for a test whose own subject
        is not Karpenter's removal, so that nothing of its pool is left to other tests however Karpenter fares."""
        with contextlib.suppress(client.ApiException):
            self.custom.delete_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodepools", name)
        for claim in self.nodeclaims(name):
            claim_name = claim["metadata"]["name"]
            with contextlib.suppress(client.ApiException):
                self.custom.patch_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims", claim_name,
                                                        {"metadata": {"finalizers": None}})
                self.custom.delete_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims", claim_name)
        for node in self.nodes(name):
            node_name = str(node.metadata.name)
            with contextlib.suppress(client.ApiException):
                self.admin.core.patch_node(node_name, {"metadata": {"finalizers": None}})
                self.admin.core.delete_node(node_name)
        wait_for(lambda: not self.nodeclaims(name) and not self.nodes(name), timeout=60,
                 what=f"NodePool {name}'s NodeClaims and Nodes deleted")

    def delete_nodepool(self, name: str, timeout: float = 180.0) -> None:
        """Delete the pool and wait until its NodeClaims and Nodes are gone (Karpenter drains and removes them)."""
        with contextlib.suppress(client.ApiException):
            self.custom.delete_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodepools", name)
        wait_for(lambda: not self.nodeclaims(name) and not self.nodes(name), timeout=timeout,
                 what=f"NodePool {name}'s NodeClaims and Nodes gone")


def gpu_workload(name: str, *, taint: str, replicas: int = 1, gpus: int = 1, product: str | None = L4,
                 extra_tolerations: list[client.V1Toleration] | None = None,
                 pod_annotations: dict[str, str] | None = None) -> client.V1Deployment:
    """A Deployment of GPU pods that only the test's NodePool (``taint``) serves."""
    return gpu_pods(name, replicas=replicas, gpus=gpus, requests=SMALL_REQUESTS,
                    tolerations=gpu_tolerations(taint) + (extra_tolerations or []),
                    node_selector={"nvidia.com/gpu.product": product} if product else None,
                    pod_annotations=pod_annotations)
