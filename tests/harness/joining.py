"""Burst node joins for tests: kubelet client CSRs of every shape (right and wrong), and a simulated node that
joins with the product's node code and registers with its own certificate."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from kubernetes import client

from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import burst_node_name
from models.join import parse_user_data
from node.join import NodeFiles
from node.join import kubelet_csr
from node.join import kubelet_key
from node.join import redeem_over_https
from node.join import wireguard_private_key
from node.register import join_simulated
from node.register import node_api
from node.register import register
from node.register import registration_from
from tunnel import keys


def csr(node: str, *, org: str = "system:nodes", cn: str | None = None, dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (), key: Any = None, extra: x509.ExtensionType | None = None) -> str:
    key = key or ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org)] if org else []
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn or f"system:node:{node}"))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(attrs))
    if dns or ips:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]), critical=False)
    if extra is not None:
        builder = builder.add_extension(extra, critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def weak_rsa_csr(node: str) -> str:
    return csr(node, key=rsa.generate_private_key(public_exponent=65537, key_size=1024))



def new_burst_node() -> tuple[str, str]:
    """A fresh operation ID and its burst node's name (``burst-op-<12 hex>``), the only names tickets are for."""
    operation = f"op-{uuid.uuid4().hex[:12]}"
    return operation, burst_node_name(operation)

def redeem_for(files: NodeFiles, ticket: str, node: str) -> JoinRedeem:
    """The request the product's node code sends (its own keys, kept in ``files``)."""
    return JoinRedeem(ticket=ticket, wireguard_public_key=keys.public_key(wireguard_private_key(files)),
                      csr=kubelet_csr(kubelet_key(files), node))


def node_client(files: NodeFiles, answer: JoinAnswer) -> client.ApiClient:
    """An API client with only the node's own credentials (the kubeconfig the join wrote)."""
    from node.join import write_kubeconfig

    write_kubeconfig(files, answer)
    return node_api(files.kubeconfig)


def register_self(api: client.ApiClient, answer: JoinAnswer, *, gpus: int = 1,
                  annotations: dict[str, str] | None = None) -> client.V1Node:
    capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return register(api, registration_from(answer, provider_id=f"sim://test/{answer.node_name}", capacity=capacity),
                    annotations=annotations)


def join_over_http(url: str, ticket: str, capacity: dict[str, str], annotations: dict[str, str], provider_id: str,
                   *, ca_file: Path | None = None, ca_bundle: str | None = None, server_name: str | None = None,
                   transport: Any = None, node_name: str | None = None) -> str:
    """A simulated node's whole join over HTTPS with the product's node code (keys kept per ticket, so a retry
    reuses them), registering its own Node; the Node's name."""
    doc: dict[str, Any] = {"gateway": url, "ticket": ticket, "nodeName": node_name or ticket_node(ticket)}
    if ca_bundle:
        doc["caBundle"] = ca_bundle
    if server_name:
        doc["serverName"] = server_name
    return join_document(doc, capacity, annotations, provider_id, ca_file=ca_file, transport=transport)


def join_with_user_data(user_data: str, capacity: dict[str, str], annotations: dict[str, str], provider_id: str,
                        *, ca_file: Path | None = None, transport: Any = None) -> str:
    return join_document(parse_user_data(user_data), capacity, annotations, provider_id, ca_file=ca_file,
                         transport=transport)


def join_document(doc: dict[str, Any], capacity: dict[str, str], annotations: dict[str, str], provider_id: str,
                  *, ca_file: Path | None = None, transport: Any = None) -> str:
    digest = hashlib.sha256(str(doc["ticket"]).encode()).hexdigest()[:20]
    state = Path(tempfile.gettempdir()) / "kubeon-test-nodes" / digest
    node = join_simulated(doc, state, redeem_over_https(doc, ca_file=ca_file, transport=transport),
                          provider_id=provider_id, capacity=capacity, annotations=annotations)
    return str(node.metadata.name)


def ticket_node(ticket: str) -> str:
    """The node a ticket names (read, not verified: the node knows its name from its user data)."""
    try:
        body = ticket.split(".")[0]
        return str(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["node_name"])
    except (ValueError, KeyError, IndexError):
        return "unknown-node"


__all__ = ["csr", "join_over_http", "join_with_user_data", "node_client", "redeem_for", "register_self",
           "weak_rsa_csr"]


class FixedClock:
    """The gateway's clock, moved by the test (ticket expiry, reservation release)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gateway_credentials(cluster: Any) -> client.ApiClient:
    """The gateway's credentials: its ServiceAccount with the gateway's rules only, never admin."""
    from tests.harness.rbac import GATEWAY_RULES
    from tests.harness.rbac import GATEWAY_SA
    from tests.harness.rbac import GATEWAY_SERVICE_RULES
    from tests.harness.rbac import grant
    from tests.harness.rbac import grant_namespaced

    api: client.ApiClient = grant(cluster, GATEWAY_SA, GATEWAY_RULES).api
    grant_namespaced(cluster, GATEWAY_SA, GATEWAY_SERVICE_RULES)
    return api
