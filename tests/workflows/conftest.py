"""What the workflow scenarios share (the workflows on the real parts: control plane, dev server, the worker; the
burst ``stack`` is the root conftest's):

- ``policy``: a fresh GpuPolicy name, deleted after the test;
- ``locations``: the sim locations the module's worker offers (``SIM_LOCATIONS``; a module overrides it);
- ``start_worker``: the worker factory, an in-process worker on the dev server over given locations;
- ``worker``: that worker over ``locations``, as (Temporal client, cluster name);
- ``hub``: a seeded hub as its own process (``hub_class``: which view of it the module's tests get).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiException
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from models.labels import LABEL_POLICY
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import in_process_worker
from tests.harness.burst import unique
from tests.hub.process import SeededHub
from tests.hub.process import seeded_hub
from worker.config import Settings
from worker.runtime import Runtime


@pytest.fixture
def policy(stack: BurstStack, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh policy name (after the module: ``burst-sim-…``), deleted after the test: policies are
    cluster-scoped and would match later tests' pods."""
    name = unique(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-"))
    yield name
    stack.delete_policy(name)
    # A test that failed half-way may leave its burst Nodes (its worker, which would send them home, is gone);
    # a leftover Node with free GPUs takes later tests' pods, which then never wait, and they fail in turn.
    left = stack.cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={name}").items
    for node in left:
        warnings.warn(f"policy {name} left Node {node.metadata.name}: deleted", stacklevel=1)
        with contextlib.suppress(ApiException):
            stack.cluster.admin.core.delete_node(str(node.metadata.name))


@pytest.fixture
def locations() -> list[dict[str, Any]]:
    return SIM_LOCATIONS


@pytest.fixture
def start_worker(stack: BurstStack, temporal_dev_server: WorkflowEnvironment) -> StartWorker:
    """``start_worker(locations, **settings)``: an in-process worker on the dev server (see
    ``tests.harness.burst.in_process_worker``), as an async context manager of (client, settings, runtime)."""

    def start(locations: list[dict[str, Any]], **overrides: Any
              ) -> contextlib.AbstractAsyncContextManager[tuple[Client, Settings, Runtime]]:
        return in_process_worker(stack, temporal_dev_server, locations, **overrides)

    return start


@pytest.fixture
async def worker(start_worker: StartWorker, locations: list[dict[str, Any]]) -> AsyncIterator[tuple[Client, str]]:
    async with start_worker(locations) as (temporal, settings, _runtime):
        yield temporal, settings.cluster


@pytest.fixture
def hub_class() -> type[SeededHub]:
    return SeededHub


@pytest.fixture
def hub(tmp_path: Path, hub_class: type[SeededHub]) -> Iterator[SeededHub]:
    with seeded_hub(tmp_path, unique("c"), hub_class) as seeded:
        yield seeded
