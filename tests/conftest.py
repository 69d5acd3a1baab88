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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiException
from temporalio.testing import WorkflowEnvironment

from models import search_attributes
from models.converter import DATA_CONVERTER
from tests.harness.burst import BurstStack, build_stack, unique
from tests.harness.clouds import local
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.moto_server import MotoServer
from tests.harness.console import console_server, ui_dev_server
from tests.harness.controlplane import ControlPlane
from tests.harness.karpenter import Karpenter
from tests.harness.kube import Cluster, Kube
from tests.harness.temporal import dev_server_path, time_skipping_server_path
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
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(dev_server_path()),
        data_converter=DATA_CONVERTER,
        search_attributes=list(search_attributes.ALL),
        ui=False,
        dev_server_log_level="error",
    )
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
