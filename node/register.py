"""Registering a Node as a kubelet does, with the node's own credentials (``system:node:<name>``): the Node
authorizer lets it create and update only its own Node; NodeRestriction lets it set the ticket's labels (none is
under kubernetes.io/ or k8s.io/ outside the kubelet's set) and taints at creation, never change taints later."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the Kubernetes client only where a Node is made: `node join` writes its registration without
    from kubernetes import client

    from models.join import GpuHealth, JoinAnswer


def node_api(kubeconfig: Path) -> client.ApiClient:
    """An API client with the node's kubeconfig (its certificate; ``tls-server-name`` honoured)."""
    from kubernetes import client, config

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


def node_object(registration: dict[str, Any], *, annotations: dict[str, str] | None = None) -> client.V1Node:
    from kubernetes import client

    name = registration["nodeName"]
    now = dt.datetime.now(dt.UTC)
    capacity = registration.get("capacity") or {}
    addresses = [client.V1NodeAddress(type="Hostname", address=name)]
    if registration.get("internalIP"):
        addresses.insert(0, client.V1NodeAddress(type="InternalIP", address=registration["internalIP"]))
    return client.V1Node(
        metadata=client.V1ObjectMeta(
            name=name, annotations=annotations or None,
            labels={"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **registration["labels"]}),
        spec=client.V1NodeSpec(
            taints=[client.V1Taint(key=t["key"], value=t.get("value"), effect=t["effect"])
                    for t in registration["taints"]],
            provider_id=registration.get("providerID") or None),
        status=client.V1NodeStatus(
            capacity=capacity, allocatable=capacity, addresses=addresses,
            conditions=[client.V1NodeCondition(type="Ready", status="True", reason="KubeletReady",
                                               message="kubelet is posting ready status",
                                               last_heartbeat_time=now, last_transition_time=now)]),
    )


def register(api: client.ApiClient, registration: dict[str, Any], *,
             annotations: dict[str, str] | None = None) -> client.V1Node:
    """Create the Node (idempotent: an existing one of this name is returned as it is)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    try:
        return core.create_node(node_object(registration, annotations=annotations))
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
                   gpu_health: GpuHealth | None = None) -> client.V1Node:
    """A simulated burst node at scale: the same join (its own keys and CSR, the ticket redeemed at the
    gateway), no tunnel (the API server over loopback), then it registers its own Node with its own certificate,
    annotated for kwok, which plays its kubelet. When its burn-in label asks for the GPU health check it posts
    ``gpu_health`` (default: a simulated node's pass) as a real node posts its diagnostic's result."""
    from models.join import SIMULATED_GPU_HEALTH
    from models.labels import burn_in_checks
    from node.health import post_gpu_health
    from node.join import NodeFiles, join

    files = NodeFiles(state_dir)
    answer = join(doc, files, redeem=redeem, tunnel=False)
    api = node_api(files.kubeconfig)
    try:
        node = register(api, registration_from(answer, provider_id=provider_id, capacity=capacity),
                        annotations=annotations)
        if "GpuHealth" in burn_in_checks(answer.labels):
            post_gpu_health(api, answer.node_name, gpu_health or SIMULATED_GPU_HEALTH)
        return node
    finally:
        api.close()
