"""Fixtures for the real parts, shared by every suite: the Kubernetes control plane (and a fresh namespace), the
Temporal servers, moto, the local Compute Engine and Azure servers, the Temporal UI behind `kubeon-gpu console`,
and the burst stack (CRD and the chart's identities) a module's burst tests run on.

Nothing here skips: a missing Go toolchain, a failed build or a missing wheel fails the tests that need it
with a message that says what is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiException
from temporalio.testing import WorkflowEnvironment

from models.converter import DATA_CONVERTER
from tests.harness.burst import BurstStack
from tests.harness.burst import build_stack
from tests.harness.burst import unique
from tests.harness.clouds import local
from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.moto_server import MotoServer
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import aks_listing
from tests.harness.clouds.nodes import gke_listing
from tests.harness.console import console_server
from tests.harness.console import ui_dev_server
from tests.harness.controlplane import ControlPlane
from tests.harness.karpenter import Karpenter
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.temporal import start_dev_server
from tests.harness.temporal import time_skipping_server_path
from worker.runtime import register_search_attributes


@pytest.fixture(scope="session")
def session_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kubeon-test-"))
    yield path
    if not os.environ.get("KUBEON_KEEP_TEST_DIR"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(session_dir: Path) -> Iterator[Cluster]:
    plane = ControlPlane(session_dir / "controlplane")
    try:
        plane.start()
        admin = Kube.from_kubeconfig(plane.admin_kubeconfig)
        yield Cluster(plane=plane, admin=admin)
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def karpenter(cluster: Cluster, session_dir: Path) -> Iterator[Karpenter]:
    """The real Karpenter (kwok provider, the harness's GPU instance types) on the session's control plane. Each
    test's NodePool carries a taint of its own (``gpu_nodepool(taint=...)``), so it serves that test's pods only."""
    controller = Karpenter(cluster.plane, session_dir / "karpenter", cluster.admin)
    try:
        controller.start()
        yield controller
    finally:
        controller.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace, deleted after the test: a pod left Pending there would tolerate later tests' policies
    (they are cluster-scoped) and start operations in them."""
    name = cluster.create_namespace()
    yield name
    try:
        cluster.admin.core.delete_namespace(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture(scope="session")
async def temporal_time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(time_skipping_server_path()),
        data_converter=DATA_CONVERTER,
    )
    await register_search_attributes(env.client)
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
async def temporal_dev_server() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server()
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
def moto_server(session_dir: Path) -> Iterator[MotoServer]:
    server = MotoServer(session_dir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    """The local Compute Engine server, one per test module."""
    server = local.start_gcp(tmp_path_factory.mktemp("gcp"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    """The local Azure Resource Manager over HTTPS with its managed-identity endpoint, one per test module."""
    server = local.start_azure(tmp_path_factory.mktemp("azure"))
    yield server
    server.stop()


@pytest.fixture
async def ui() -> AsyncIterator[tuple[WorkflowEnvironment, str]]:
    """A dev server of the test's own with the Temporal UI: (the environment, the UI's URL)."""
    async with ui_dev_server() as server:
        yield server


@pytest.fixture
async def console(ui: tuple[WorkflowEnvironment, str]) -> AsyncIterator[str]:
    """`kubeon-gpu console` in front of the test's UI: its URL."""
    async with console_server(ui[1]) as url:
        yield url


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> BurstStack:
    """The burst stack of one test module (no GpuPolicy left by an earlier module), in a folder named after it."""
    return build_stack(cluster, tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]))


@pytest.fixture
def product() -> str:
    """A GPU type of this test alone, so its pods fit no other test's nodes."""
    return unique("NVIDIA-T")


# -- managed node groups (issue 24): each local cloud's groups, their instances as kwok Nodes ------------------
@pytest.fixture(scope="module")
def gke_nodes(gcp_server: FakeServer, cluster: Cluster) -> Iterator[NodeReconciler]:
    """The module's GKE node pools' VMs (seed them with ``gcp_server.seed(gke=...)``) as Nodes, as GKE's CCM."""
    with NodeReconciler(cluster.admin, unique("gke"), gke_listing(gcp_server)) as reconciler:
        yield reconciler


@pytest.fixture(scope="module")
def aks_nodes(azure_server: FakeServer, cluster: Cluster) -> Iterator[NodeReconciler]:
    """The module's AKS agent pools' machines (``azure_server.seed(aks=...)``) as Nodes, as AKS's CCM."""
    with NodeReconciler(cluster.admin, unique("aks"), aks_listing(azure_server)) as reconciler:
        yield reconciler


@pytest.fixture(scope="module")
def eks_nodegroups(moto_server: MotoServer) -> EksNodeGroups:
    """EKS node groups on the session's moto with the ASG behind each (``.create(...)``)."""
    return EksNodeGroups(moto_server.endpoint)


@pytest.fixture(scope="module")
def eks_nodes(eks_nodegroups: EksNodeGroups, cluster: Cluster) -> Iterator[NodeReconciler]:
    """The module's EKS node groups' instances as Nodes; each pass also keeps node group and ASG consistent."""
    with NodeReconciler(cluster.admin, unique("eks"), eks_nodegroups.listing, interval=0.3) as reconciler:
        yield reconciler


@pytest.fixture(scope="module")
def eks_api(moto_server: MotoServer) -> Iterator[MotoRecorder]:
    """Where the product's boto3 clients point for EKS/ASG (``.url``): moto, every request recorded."""
    with MotoRecorder(moto_server.endpoint) as recorder:
        yield recorder
