"""Helpers for tests on the real control plane: clients, waiting on conditions, kwok nodes, namespaces."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import Generic
from typing import TypeVar

from kubernetes import client
from kubernetes import config

from tests.harness.controlplane import KWOK_NODE_ANNOTATION
from tests.harness.controlplane import ControlPlane
from tests.harness.controlplane import write_kubeconfig

T = TypeVar("T")
A = TypeVar("A")


def wait_for(check: Callable[[], T | None], *, timeout: float = 60.0, what: str, interval: float = 0.2,
             retry_on: tuple[type[Exception], ...] = (client.ApiException,)) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value or error seen.
    Errors of ``retry_on`` count as "not yet"; any other error fails at once."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


async def until(check: Callable[[], T | None], *, timeout: float = 60.0, what: str, interval: float = 0.2,
                retry_on: tuple[type[Exception], ...] = (client.ApiException,)) -> T:
    """``wait_for`` from async tests: polls in a thread, so an in-process worker on the event loop keeps running."""
    return await asyncio.to_thread(wait_for, check, timeout=timeout, what=what, interval=interval,
                                   retry_on=retry_on)


class _ApiGroup(Generic[A]):
    """A Kube attribute that reads as ``api_class`` over the Kube's ApiClient, made anew on each read (the API
    classes are thin wrappers of the client)."""

    def __init__(self, api_class: Callable[[client.ApiClient], A]) -> None:
        self.api_class = api_class

    def __get__(self, kube: Kube, owner: type[Kube]) -> A:
        return self.api_class(kube.api)


@dataclass
class Kube:
    """Typed API groups over one ApiClient."""

    api: client.ApiClient
    core = _ApiGroup(client.CoreV1Api)
    apps = _ApiGroup(client.AppsV1Api)
    policy = _ApiGroup(client.PolicyV1Api)
    rbac = _ApiGroup(client.RbacAuthorizationV1Api)
    custom = _ApiGroup(client.CustomObjectsApi)
    apiext = _ApiGroup(client.ApiextensionsV1Api)

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Kube:
        return cls(config.new_client_from_config(config_file=str(path)))


@dataclass
class Cluster:
    plane: ControlPlane
    admin: Kube

    def service_account_kubeconfig(self, namespace: str, name: str, *, create: bool = True) -> Path:
        """A kubeconfig that authenticates as ``system:serviceaccount:<namespace>:<name>`` (TokenRequest API)."""
        core = self.admin.core
        if create:
            try:
                core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
                    metadata=client.V1ObjectMeta(name=name)))
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
        token = self.service_account_token(namespace, name)
        path = self.plane.workdir / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(path, self.plane.server, self.plane.ca_file, token=token, user=f"{namespace}-{name}")

    def service_account_token(self, namespace: str, name: str, *, audiences: list[str] | None = None,
                              seconds: int = 3600) -> str:
        """A token of ServiceAccount ``namespace/name`` from the TokenRequest API (as the kubelet projects one
        into a pod), for ``audiences`` (none: the API server's), valid ``seconds``."""
        granted = self.admin.core.create_namespaced_service_account_token(
            name, namespace, client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=audiences or [], expiration_seconds=seconds)))
        assert granted.status is not None, "the token request came back without a status"
        return str(granted.status.token)

    def service_account_client(self, namespace: str, name: str, *, create: bool = True) -> Kube:
        return Kube.from_kubeconfig(self.service_account_kubeconfig(namespace, name, create=create))

    def create_namespace(self, prefix: str = "t") -> str:
        """A fresh namespace whose default ServiceAccount exists (pods are refused until it does)."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        wait_for(lambda: self.admin.core.read_namespaced_service_account("default", name),
                 what=f"default ServiceAccount in {name}", timeout=30)
        return name

    def create_kwok_node(
        self, name: str, *, labels: dict[str, str] | None = None, taints: list[client.V1Taint] | None = None,
        gpus: int = 1,
    ) -> client.V1Node:
        """A Node that kwok runs as a simulated kubelet (it sets it Ready and plays its pods)."""
        node = client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name,
                annotations={KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                labels={"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok",
                        **(labels or {})},
            ),
            spec=client.V1NodeSpec(taints=taints, provider_id=f"kwok://{name}"),
            status=client.V1NodeStatus(
                allocatable={"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
                capacity={"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
            ),
        )
        return self.admin.core.create_node(node)

    def node_ready(self, name: str) -> bool:
        node = self.admin.core.read_node(name)
        return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
