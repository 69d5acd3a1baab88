"""Burst node joins for tests: kubelet client CSRs of every shape (right and wrong), and a simulated node that
joins with the product's node code and registers with its own certificate."""

from __future__ import annotations

import ipaddress
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from kubernetes import client

from models.join import JoinAnswer, JoinRedeem
from node.join import NodeFiles, kubelet_csr, kubelet_key, wireguard_private_key
from node.register import node_api, register, registration_from
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


__all__ = ["csr", "node_client", "redeem_for", "register_self", "weak_rsa_csr"]
