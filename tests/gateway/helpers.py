"""What the gateway's tests share besides fixtures (those are in conftest.py): ticket requests for burst nodes a
test may create, the gateway with a fresh key, and what it left in the API."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from kubernetes import client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.service import KubeGateway
from models.join import JoinAnswer
from models.join import JoinTicketRequest
from models.join import burst_node_name
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from node.join import NodeFiles
from tests.charts.helm import NAMESPACE
from tests.harness.joining import node_client
from tests.harness.joining import redeem_for
from tests.harness.joining import register_self
from tests.harness.kube import Cluster

BURST_TAINT = "gpu.kubeon.io/burst"


CAPACITY = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}


def ticket_request(nodes: list[str], *, operation: str | None = None, ttl: int = 900) -> JoinTicketRequest:
    op = operation or f"op-{uuid.uuid4().hex[:12]}"
    name = burst_node_name(op)
    nodes.append(name)
    return JoinTicketRequest(
        operation=op, policy="inference-burst", location="sim/eu-west", node_name=name,
        labels={LABEL_OPERATION: op, LABEL_POLICY: "inference-burst", LABEL_LOCATION: "sim.eu-west"},
        taints=[Taint(key=BURST_TAINT)], ttl_seconds=ttl,
    )


def node_absent(cluster: Cluster, name: str) -> bool:
    return not cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items


def delete_nodes(cluster: Cluster, names: list[str]) -> None:
    """Delete the Nodes of ``names`` a test created; one already gone is fine."""
    for name in names:
        try:
            cluster.admin.core.delete_node(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def gateway(api: client.ApiClient, key: bytes | None = None, **kwargs: Any) -> KubeGateway:
    return KubeGateway(api, key or secrets.token_bytes(32), namespace=NAMESPACE, **kwargs)


def join_and_register(gw: KubeGateway, req: JoinTicketRequest, files: NodeFiles, *, issued: bool = False,
                      gpus: int = 1, labels: dict[str, str] | None = None) -> tuple[JoinAnswer, client.ApiClient]:
    """``req``'s node (its keys in ``files``) joined through ``gw`` with a ticket only signed, or with ``issued`` one
    issued as the optimizer's are (its slot reserved first), then registered as a kwok node by its own credentials,
    with ``gpus`` and ``labels`` set over those the gateway gave it (a node labelling itself as it likes). The
    gateway's answer and the node's own API client."""
    ticket = gw.issue_ticket(req).ticket if issued else gw.sign_ticket(req)
    answer = gw.join(redeem_for(files, ticket, req.node_name))
    api = node_client(files, answer)
    registered = answer.model_copy(update={"labels": {**answer.labels, **labels}}) if labels else answer
    register_self(api, registered, gpus=gpus, annotations=KWOK_ANNOTATIONS)
    return answer, api


def records(cluster: Cluster, nonce: str) -> list[str]:
    """The gateway's records and CSR for a ticket: nothing may exist for a refused one."""
    names = [cm.metadata.name for cm in cluster.admin.core.list_namespaced_config_map(NAMESPACE).items
             if cm.metadata.name == f"kubeon-ticket-{nonce}" or (cm.data or {}).get("ticket") == nonce]
    csrs = client.CertificatesV1Api(cluster.admin.api).list_certificate_signing_request().items
    return [str(n) for n in names] + [str(c.metadata.name) for c in csrs if c.metadata.name == f"kubeon-join-{nonce}"]


def nonce_of(gw: KubeGateway, ticket: str) -> str:
    return gw.verify(ticket).nonce
