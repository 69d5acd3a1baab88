"""The burst node join protocol (``POST /v1/join`` at the gateway) and the join document in a node's user data.

The node sends its ticket, its WireGuard public key and its kubelet client CSR; the private halves never leave it.
The gateway answers with what the node needs to bring the tunnel up and to register itself through it.
"""

from __future__ import annotations

import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from models.labels import Taint

USER_DATA_BEGIN: Final = "# --- kubeon join document ---\n"
USER_DATA_END: Final = "\n# --- end kubeon join document ---"

KUBELET_CLIENT_SIGNER: Final = "kubernetes.io/kube-apiserver-client-kubelet"
# The usages of a kubelet client certificate: exactly these, "key encipherment" optional (RSA keys).
KUBELET_CLIENT_USAGES: Final = ("digital signature", "client auth")
KUBELET_CLIENT_OPTIONAL_USAGES: Final = ("key encipherment",)
NODES_GROUP: Final = "system:nodes"
NODE_USER_PREFIX: Final = "system:node:"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JoinRedeem(_Wire):
    """What a booting burst node sends: the ticket from its user data and the public halves of its keys."""

    ticket: str = Field(min_length=1, max_length=16 * 1024)
    wireguard_public_key: str = Field(alias="wireguardPublicKey", min_length=1, max_length=64)
    csr: str = Field(min_length=1, max_length=16 * 1024, description="PEM CERTIFICATE REQUEST of the kubelet key")
    usages: list[str] = Field(default_factory=lambda: list(KUBELET_CLIENT_USAGES), max_length=8)


class TunnelAnswer(_Wire):
    """The node's side of the WireGuard tunnel."""

    gateway_public_key: str = Field(alias="gatewayPublicKey")
    endpoint: str = Field(description="host:port of the gateway's UDP listener")
    address: str = Field(description="the node's tunnel address, CIDR /32")
    gateway_address: str = Field(alias="gatewayAddress")
    allowed_ips: list[str] = Field(alias="allowedIPs", description="routed through the tunnel")
    mtu: int
    persistent_keepalive: int = Field(alias="persistentKeepalive")


class JoinAnswer(_Wire):
    node_name: str = Field(alias="nodeName")
    certificate: str = Field(description="the kubelet client certificate (PEM), signed by the cluster")
    ca_bundle: str = Field(alias="caBundle", description="the cluster CA (PEM) to verify the API server with")
    api_server: str = Field(alias="apiServer", description="the API server URL as the node reaches it")
    api_server_name: str = Field(default="", alias="apiServerName", description="TLS server name to verify")
    pod_cidr: str = Field(alias="podCIDR")
    labels: dict[str, str]
    taints: list[Taint]
    tunnel: TunnelAnswer | None = Field(default=None, description="absent: the gateway runs no tunnel (sim)")


def parse_user_data(user_data: str) -> dict[str, Any]:
    """The join document embedded in a burst node's user data."""
    try:
        start = user_data.index(USER_DATA_BEGIN) + len(USER_DATA_BEGIN)
        end = user_data.index(USER_DATA_END)
    except ValueError:
        raise ValueError("user data holds no kubeon join document") from None
    doc: dict[str, Any] = json.loads(user_data[start:end])
    return doc
