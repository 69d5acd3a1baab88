"""Registering a Node as a kubelet does, with the node's own credentials (``system:node:<name>``): the Node
authorizer lets it create and update only its own Node; NodeRestriction lets it set the ticket's labels (none is
under kubernetes.io/ or k8s.io/ outside the kubelet's set) and taints at creation, never change taints later."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:  # the Kubernetes client only where a Node is made: `node join` writes its registration without
    from kubernetes import client

    from models.join import GpuHealth
    from models.join import JoinAnswer


def node_api(kubeconfig: Path) -> client.ApiClient:
    """An API client with the node's kubeconfig (its certificate; ``tls-server-name`` honoured)."""
    from kubernetes import client
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    doc_cluster = _cluster(kubeconfig)
    if doc_cluster.get("tls-server-name"):
        cfg.tls_server_name = doc_cluster["tls-server-name"]
    return client.ApiClient(cfg)


def _cluster(kubeconfig: Path) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load(kubeconfig.read_text())
    cluster: dict[str, Any] = doc["clusters"][0]["cluster"]
    return cluster


def node_manifest(registration: dict[str, Any], *, annotations: dict[str, str] | None = None,
                  now: dt.datetime | None = None) -> dict[str, Any]:
    """The Node a kubelet registers (``POST /api/v1/nodes``), as the API's JSON: the registration's labels
    (``--node-labels``) and taints (``--register-with-taints``), provider ID, capacity (= allocatable), addresses
    and its Ready condition. The one definition for the product's simulated nodes and the tests' kubelet
    stand-in."""
    name = registration["nodeName"]
    stamp = (now or dt.datetime.now(dt.UTC)).isoformat().replace("+00:00", "Z")
    capacity = registration.get("capacity") or {}
    addresses = [{"type": "Hostname", "address": name}]
    if registration.get("internalIP"):
        addresses.insert(0, {"type": "InternalIP", "address": registration["internalIP"]})
    metadata: dict[str, Any] = {
        "name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                 **registration["labels"]}}
    if annotations:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {"taints": [{k: t[k] for k in ("key", "value", "effect") if t.get(k) is not None}
                                       for t in registration["taints"]]}
    if registration.get("providerID"):
        spec["providerID"] = registration["providerID"]
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": metadata, "spec": spec,
        "status": {"capacity": capacity, "allocatable": capacity, "addresses": addresses,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "message": "kubelet is posting ready status",
                                   "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]},
    }


def register(api: client.ApiClient, registration: dict[str, Any], *,
             annotations: dict[str, str] | None = None) -> client.V1Node:
    """Create the Node (idempotent: an existing one of this name is returned as it is)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    try:
        # the client sends a dict body as it is (the Node as the API's JSON)
        return core.create_node(node_manifest(registration, annotations=annotations))  # type: ignore[arg-type]
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        return core.read_node(registration["nodeName"])


def registration_from(answer: JoinAnswer, *, provider_id: str, capacity: dict[str, str]) -> dict[str, Any]:
    return {"nodeName": answer.node_name, "labels": answer.labels, "taints": [t.model_dump() for t in answer.taints],
            "podCIDR": answer.pod_cidr, "providerID": provider_id, "capacity": capacity,
            "internalIP": answer.tunnel.address.split("/")[0] if answer.tunnel else ""}


def load_registration(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def join_simulated(doc: dict[str, Any], state_dir: Path, redeem: Any, *, provider_id: str,
                   capacity: dict[str, str], annotations: dict[str, str],
                   gpu_health: GpuHealth | None = None, retry_seconds: float = 0.0) -> client.V1Node:
    """A simulated burst node at scale: the same join (its own keys and CSR, the ticket redeemed at the
    gateway), no tunnel (the API server over loopback), then it registers its own Node with its own certificate,
    annotated for kwok, which plays its kubelet. When its burn-in label asks for the GPU health check it posts
    ``gpu_health`` (default: a simulated node's pass) as a real node posts its diagnostic's result. An unavailable
    gateway is tried again for ``retry_seconds`` (0: callers with a retry loop of their own, like the on-prem
    agent, whose next heartbeat tries again and may meanwhile be told the claim was released)."""
    from models.join import SIMULATED_GPU_HEALTH
    from models.labels import burn_in_checks
    from node.health import post_gpu_health
    from node.join import NodeFiles
    from node.join import join

    files = NodeFiles(state_dir)
    answer = join(doc, files, redeem=redeem, tunnel=False, retry_seconds=retry_seconds)
    api = node_api(files.kubeconfig)
    try:
        node = register(api, registration_from(answer, provider_id=provider_id, capacity=capacity),
                        annotations=annotations)
        if "GpuHealth" in burn_in_checks(answer.labels):
            post_gpu_health(api, answer.node_name, gpu_health or SIMULATED_GPU_HEALTH)
        return node
    finally:
        api.close()
