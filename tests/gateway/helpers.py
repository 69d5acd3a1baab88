"""What the gateway's tests share besides fixtures (those are in conftest.py): ticket requests for burst nodes a
test may create, the gateway with a fresh key, and what it left in the API."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from kubernetes import client

from gateway.service import KubeGateway
from models.join import JoinTicketRequest
from models.labels import LABEL_LOCATION, LABEL_OPERATION, LABEL_POLICY, Taint
from tests.charts.helm import NAMESPACE
from tests.harness.kube import Cluster

BURST_TAINT = "gpu.kubeon.io/burst"


CAPACITY = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}


def ticket_request(nodes: list[str], *, operation: str | None = None, ttl: int = 900) -> JoinTicketRequest:
    op = operation or f"op-{uuid.uuid4().hex[:10]}"
    name = f"burst-{uuid.uuid4().hex[:8]}"
    nodes.append(name)
    return JoinTicketRequest(
        operation=op, policy="inference-burst", location="sim/eu-west", node_name=name,
        labels={LABEL_OPERATION: op, LABEL_POLICY: "inference-burst", LABEL_LOCATION: "sim.eu-west"},
        taints=[Taint(key=BURST_TAINT)], ttl_seconds=ttl,
    )


def node_absent(cluster: Cluster, name: str) -> bool:
    return not cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items


def gateway(api: client.ApiClient, key: bytes | None = None, **kwargs: Any) -> KubeGateway:
    return KubeGateway(api, key or secrets.token_bytes(32), namespace=NAMESPACE, **kwargs)


def records(cluster: Cluster, nonce: str) -> list[str]:
    """The gateway's records and CSR for a ticket: nothing may exist for a refused one."""
    names = [cm.metadata.name for cm in cluster.admin.core.list_namespaced_config_map(NAMESPACE).items
             if cm.metadata.name == f"kubeon-ticket-{nonce}" or (cm.data or {}).get("ticket") == nonce]
    csrs = client.CertificatesV1Api(cluster.admin.api).list_certificate_signing_request().items
    return [str(n) for n in names] + [str(c.metadata.name) for c in csrs if c.metadata.name == f"kubeon-join-{nonce}"]


def nonce_of(gw: KubeGateway, ticket: str) -> str:
    return gw.verify(ticket).nonce
