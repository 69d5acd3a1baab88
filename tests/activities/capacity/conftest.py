"""What the capacity providers' tests share: the provider the worker builds from its environment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import cast

import pytest
from kubernetes import client

from activities.capacity import CapacityProvider


@pytest.fixture
def worker_capacity() -> Callable[[dict[str, str]], CapacityProvider | None]:
    """``build(env)``: the capacity provider of the worker's Runtime over the settings ``env`` loads (no cluster
    is called: a default API client, no gateway, burst providers or audit)."""
    from activities.clients.kube import KubeOps
    from worker.config import load_settings
    from worker.runtime import Runtime

    def build(env: dict[str, str]) -> CapacityProvider | None:
        settings = load_settings(env)
        return Runtime(settings=settings, kube=KubeOps(client.ApiClient()), burst=settings.burst_config(),
                       gateway=cast(Any, None), providers={}, audit=cast(Any, None)).capacity()

    return build
