"""The Kubernetes client the worker and the gateway build alike, and the one 404 idiom they share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kubernetes import client, config

T = TypeVar("T")


def kube_api(kubeconfig: Path | None, *, pool_size: int = 32) -> client.ApiClient:
    """``kubeconfig``, else the in-cluster ServiceAccount; a connection pool sized for the threads that share it
    (the default of 10 makes concurrent activities or joins open a new TLS connection per request)."""
    configuration = client.Configuration()
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def read_or_none(read: Callable[[], T]) -> T | None:
    """``read()``, or None when the object does not exist (404); any other API error is raised."""
    try:
        return read()
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
