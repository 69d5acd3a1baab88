"""The burst node join protocol (``POST /v1/join`` at the gateway) and the join document in a node's user data.

The node sends its ticket, its WireGuard public key and its kubelet client CSR; the private halves never leave it.
The gateway answers with what the node needs to bring the tunnel up and to register itself through it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any
from typing import Final
from urllib.parse import urlsplit

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field

from models.labels import Taint

USER_DATA_BEGIN: Final = "# --- kubeon join document ---\n"
USER_DATA_END: Final = "\n# --- end kubeon join document ---"

KUBELET_CLIENT_SIGNER: Final = "kubernetes.io/kube-apiserver-client-kubelet"
# The usages of a kubelet client certificate: exactly these, "key encipherment" optional (RSA keys).
KUBELET_CLIENT_USAGES: Final = ("digital signature", "client auth")
KUBELET_CLIENT_OPTIONAL_USAGES: Final = ("key encipherment",)
NODES_GROUP: Final = "system:nodes"
NODE_USER_PREFIX: Final = "system:node:"

# Every burst node is named after its operation (``burst-<operation ID>``, ``models.ids.operation_id``: op- and 12
# hex digits; workflows.burst): the gateway issues tickets for exactly that name of the ticket's operation, and the
# chart's node admission policy confines the nodes ``system:node:burst-*``.
BURST_NODE_PREFIX: Final = "burst-"

_BURST_NODE_NAME: Final = re.compile(r"^burst-op-[0-9a-f]{12}$")


def burst_node_name(operation: str) -> str:
    """The name of the node an operation launches."""
    return f"{BURST_NODE_PREFIX}{operation}"


def burst_node_name_problem(name: str, operation: str | None = None) -> str:
    """Why ``name`` cannot be a burst node's (of ``operation``, if given; empty: it can): ``burst-<operation ID>``,
    so its kubelet certificate (``system:node:<name>``) is one the node admission policy confines, never a home
    node's, and a ticket of one operation never names another operation's node."""
    if not _BURST_NODE_NAME.match(name):
        return (f"node_name {name[:80]!r} is not a burst node's name: tickets are only for "
                f"{BURST_NODE_PREFIX}<operation ID> ({BURST_NODE_PREFIX}op-<12 hex digits>)")
    if operation is not None and name != burst_node_name(operation):
        return (f"node_name {name!r} is not the node of operation {operation[:80]!r} "
                f"({burst_node_name(operation)[:90]}): a ticket names its own operation's node only")
    return ""


# An on-prem server presents its pool's join token in this header besides its ticket (R4.5; the gateway checks it).
JOIN_TOKEN_HEADER: Final = "X-Kubeon-Join-Token"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Attestation(_Wire):
    """The node's signed instance identity, as its cloud's metadata service gave it (``gateway.attestation``
    verifies it): ``aws`` the instance identity document (``document``, JSON) and its base64 RSA-SHA256
    ``signature``; ``gcp`` the instance identity token (``document``, a JWT whose audience is the gateway); ``azure``
    the attested data, a base64 PKCS7 SignedData (``signature``) holding the signed JSON and the signer's
    certificates, as IMDS gives it; ``onprem`` nothing (the server's join
    credential is the proof); ``none``: no identity (sim nodes). ``certificate``: the signer's certificate (PEM),
    when the metadata service hands it out; it must be a trust root or issued by one."""

    method: str = Field(default="none", pattern="^(none|aws|gcp|azure|onprem)$")
    document: str = Field(default="", max_length=16 * 1024)
    signature: str = Field(default="", max_length=16 * 1024)  # Azure's PKCS7 carries its certificate chain
    certificate: str = Field(default="", max_length=8 * 1024)


class GpuHealth(BaseModel):
    """The burn-in's GPU health check as the node ran it (``node.health``): posted as the condition
    ``GPU_HEALTH_CONDITION`` of its own Node (status, reason, message), which the burn-in reads."""

    healthy: bool
    reason: str  # CamelCase, as a condition's reason: DcgmDiagPassed, DcgmDiagFailed, ...
    message: str = Field(max_length=1024)


# A simulated node has no GPUs to diagnose: it says so, and passes (as its allocatable GPUs are what the sim says).
SIMULATED_GPU_HEALTH = GpuHealth(healthy=True, reason="Simulated", message="simulated node: no GPUs to diagnose")


def attestation_nonce(ticket: str) -> str:
    """The nonce a node asks its cloud to sign into its identity (Azure's attested data: up to 32 alphanumeric
    characters), derived from its ticket: an identity fetched for another ticket does not redeem this one."""
    return hashlib.sha256(ticket.encode()).hexdigest()[:32]


class JoinRedeem(_Wire):
    """What a booting burst node sends: the ticket from its user data, the public halves of its keys and its
    cloud's signed identity (``attestation``; absent: method ``none``)."""

    ticket: str = Field(min_length=1, max_length=16 * 1024)
    wireguard_public_key: str = Field(alias="wireguardPublicKey", min_length=1, max_length=64)
    csr: str = Field(min_length=1, max_length=16 * 1024, description="PEM CERTIFICATE REQUEST of the kubelet key")
    usages: list[str] = Field(default_factory=lambda: list(KUBELET_CLIENT_USAGES), max_length=8)
    attestation: Attestation = Field(default_factory=Attestation)


class CertRenewal(_Wire):
    """What a joined burst node sends before its kubelet certificate expires (``kubeon-gpu node renew``): a CSR of
    the same kubelet key it joined with, which proves it holds that key. Burst nodes have no certificate rotation
    of their own (the node admission policy refuses their CSRs)."""

    node_name: str = Field(alias="nodeName", min_length=1, max_length=63)
    csr: str = Field(min_length=1, max_length=16 * 1024, description="PEM CERTIFICATE REQUEST of the kubelet key")
    usages: list[str] = Field(default_factory=lambda: list(KUBELET_CLIENT_USAGES), max_length=8)


class CertRenewalAnswer(_Wire):
    certificate: str = Field(description="the new kubelet client certificate (PEM), signed by the cluster")


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



DEFAULT_TICKET_TTL_SECONDS = 900


class TicketSubject(BaseModel):
    """What a join ticket names: the node, its operation, policy and location, and the labels and taints it
    registers with. The worker's request and the gateway's signed ticket both carry it."""

    operation: str
    policy: str
    location: str
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]


class JoinTicketRequest(TicketSubject):
    ttl_seconds: int = DEFAULT_TICKET_TTL_SECONDS
    # GPUs of the offering launched: a node reporting more fails its join (cordoned). 0: not checked.
    gpus: int = 0


class TicketGrant(BaseModel):
    """The gateway's answer to a ticket request: the ticket, and where the node joins (``endpoint``, an https URL,
    and ``server_name``, the name its certificate is verified against). Both empty: the worker's configured
    URL (an in-process gateway without a public address)."""

    ticket: str
    endpoint: str = ""
    server_name: str = ""
    # What the node must send with its join (``{"method", "audience"}`` for the user data's ``attestation``): its
    # cloud's signed instance identity where the gateway verifies that provider's; empty: nothing asked.
    attestation: dict[str, str] = Field(default_factory=dict)


def gateway_route(path: str) -> str:
    """The path template of a gateway request (its metric label and span name carry no node name)."""
    if path.startswith("/v1/nodes/"):
        tail = path.rsplit("/", 1)[-1]
        return f"/v1/nodes/{{name}}/{tail}" if tail in ("transfer", "probe") else "/v1/nodes/{name}"
    return path


class NodeProbe(_Wire):
    """``POST /v1/nodes/{name}/probe``: whether the node's tunnel carries a packet of the tunnel's full MTU (an
    ICMP echo with Don't Fragment from the gateway to the node's tunnel address; the burn-in's ``Tunnel`` check)."""

    tunnel: bool = Field(description="false: the node has no tunnel at this gateway (nothing to probe)")
    mtu: int = Field(default=0, ge=0, description="the packet's size in bytes, IP header included")
    answered: bool = False
    rtt_ms: float | None = Field(default=None, alias="rttMs")
    detail: str = Field(default="", max_length=500)


class NodeTransfer(_Wire):
    """``GET /v1/nodes/{name}/transfer``: what a burst node moved through its tunnel so far, measured at the
    gateway's WireGuard interface (encrypted UDP payload: the inner IP packets plus WireGuard's 32 bytes each, and
    its padding). ``rxBytes``: received by the gateway from the node, i.e. node -> home, the traffic LEAVING the
    remote cloud (what it charges egress for); ``txBytes``: home -> node. Kept across gateway restarts, and after the
    node's removal while its ticket's tombstone stands (``KUBEON_GATEWAY_CERT_SECONDS``)."""

    rx_bytes: int = Field(alias="rxBytes", ge=0, description="node -> home (egress of the node's cloud)")
    tx_bytes: int = Field(alias="txBytes", ge=0, description="home -> node (ingress of the node's cloud)")
    measured_at: float = Field(alias="measuredAt", description="epoch seconds of the counters read; 0: never "
                               "measured (no tunnel at this gateway, or the node never joined)")


class NodeIdentity(_Wire):
    """``GET /v1/nodes/{name}/identity``: what the gateway verified of the signed instance identity the node joined
    with (``gateway.attestation``; kept in its ticket's redemption record). The optimizer checks it names the very
    instance it launched for the operation (``bind_attested_instance``) and records it in the node's ``joined``
    audit record."""

    method: str = Field(description="aws, gcp, azure, onprem (the hub's pool claim) or none (nothing attested)")
    verified: bool = Field(description="false: method none, nothing verified")
    region: str = ""
    zone: str = ""
    instance_id: str = Field(default="", alias="instanceId", description="AWS instance ID, GCE numeric ID, "
                             "Azure vmId")
    instance_name: str = Field(default="", alias="instanceName", description="GCE: the instance's name")
    account: str = Field(default="", description="AWS account, GCP project, Azure subscription")

    def describe(self) -> str:
        if not self.verified:
            return f"identity not attested (method {self.method})"
        if self.method == "onprem":
            return f"on-prem server of pool {self.region}, attested by the hub's pool claim"
        name = f" {self.instance_name}" if self.instance_name else ""
        where = self.zone or self.region or "an unsigned region"
        account = f", {'project' if self.method == 'gcp' else 'account'} {self.account}" if self.account else ""
        return f"attested {self.method} instance {self.instance_id}{name} in {where}{account}"


def bind_attested_instance(identity: NodeIdentity, provider: str, instance_id: str, attested_id: str
                           ) -> tuple[bool, str]:
    """Whether ``identity`` names the instance launched for the operation: ``(True, "")`` it does, ``(False, why)``
    it names another machine, ``(False, "")`` there is nothing to bind (nothing attested; an on-prem server, which
    the hub's pool claim bound; an Azure VM whose vmId the launch did not record). The gateway verified the
    identity's signature, location and account, but any instance of that account and region holding the ticket
    (read from the launched instance's user data) could present one. ``instance_id`` is the provider's ID of the
    launched instance; ``attested_id`` the ID its cloud signs into the identity where that differs (Azure's vmId)."""
    if not identity.verified or identity.method == "onprem":
        return False, ""
    if identity.method != provider:
        return False, f"the node attested a {identity.method} identity, the operation launched a {provider} instance"
    signed, launched = {"aws": (identity.instance_id, instance_id),
                        # the provider's ID is zone/name; the token names both
                        "gcp": (f"{identity.zone}/{identity.instance_name}", instance_id),
                        "azure": (identity.instance_id, attested_id)}[provider]
    if not launched:
        return False, ""
    if signed != launched:
        return False, (f"the node joined with the attested identity of {identity.method} instance {signed}, not of "
                       f"the launched instance {launched}: its ticket was redeemed by another machine")
    return True, ""


class GatewayCapacity(BaseModel):
    """The gateway's address slots: how many there are, and the nodes holding one (joined, or reserved by a
    ticket not redeemed yet). Every burst node needs one, so the free ones cap how many new nodes may launch."""

    total: int
    nodes: list[str] = Field(default_factory=list)

    @property
    def held(self) -> int:
        return len(self.nodes)

    @property
    def free(self) -> int:
        return max(0, self.total - self.held)


def url_host(url: str) -> str:
    """The host of an URL, lower case, without port or IPv6 brackets."""
    return (urlsplit(url).hostname or "").lower()

# The smallest provider limit on user data: EC2's 16 KB before base64 (GCE and Azure allow more).
USER_DATA_MAX_BYTES = 16 * 1024


class UserDataTooLarge(ValueError):
    """The rendered user data is over ``USER_DATA_MAX_BYTES``: the cloud would refuse the launch."""


def render_user_data(*, gateway_url: str, ticket: str, node_name: str, labels: dict[str, str],
                     taints: list[Taint], ca_bundle: str = "", server_name: str = "",
                     attestation: dict[str, str] | None = None, metadata_url: str = "") -> str:
    """User data for a burst node: where the gateway is (``gateway``, the endpoint it connects to), the name its
    certificate is verified against (``serverName``; default: the endpoint's host), the CA certificate(s) to
    verify it with (``caBundle``, PEM; absent: the node's system trust store), its one-time ticket, what it
    must register as, and the signed instance identity it sends (``attestation``: ``{"method", "audience"}``, read
    from ``metadataUrl``, default its cloud's metadata address; ``node.identity``). At most ``USER_DATA_MAX_BYTES``."""
    doc: dict[str, Any] = {
        "gateway": gateway_url,
        "serverName": server_name or url_host(gateway_url),
        "ticket": ticket,
        "nodeName": node_name,
        "labels": labels,
        "taints": [t.model_dump() for t in taints],
    }
    if ca_bundle.strip():
        doc["caBundle"] = ca_bundle.strip() + "\n"
    if attestation:
        doc["attestation"] = dict(attestation)
    if metadata_url:
        doc["metadataUrl"] = metadata_url
    user_data = (
        "#!/bin/bash\n"
        "# KubeOn burst node bootstrap: open the tunnel to the gateway, then register through it.\n"
        "set -euo pipefail\n"
        "umask 077  # the ticket is a secret until redeemed: root only (the node join deletes it then)\n"
        "mkdir -p /etc/kubeon\n"
        "chmod 0700 /etc/kubeon\n"
        "cat > /etc/kubeon/join.json <<'KUBEON_JOIN'\n"
        f"{USER_DATA_BEGIN}{json.dumps(doc, indent=1, sort_keys=True)}{USER_DATA_END}\n"
        "KUBEON_JOIN\n"
        "# Burst nodes have no certificate rotation of their own: renew at the gateway (when due) every 10 minutes.\n"
        "if [ -d /run/systemd/system ]; then\n"
        "  printf '[Service]\\nType=oneshot\\nExecStart=/usr/bin/env kubeon-gpu node renew\\n' "
        "> /etc/systemd/system/kubeon-renew.service\n"
        "  printf '[Timer]\\nOnBootSec=10min\\nOnUnitActiveSec=10min\\n[Install]\\nWantedBy=timers.target\\n' "
        "> /etc/systemd/system/kubeon-renew.timer\n"
        "  systemctl daemon-reload && systemctl enable --now kubeon-renew.timer || "
        "echo 'kubeon: the certificate renewal timer could not be enabled' >&2\n"
        "fi\n"
        "exec kubeon-gpu node join --config /etc/kubeon/join.json\n"
    )
    size = len(user_data.encode())
    if size > USER_DATA_MAX_BYTES:
        raise UserDataTooLarge(f"user data for {node_name} is {size} bytes, over the {USER_DATA_MAX_BYTES}-byte "
                               f"limit of EC2 (CA bundle {len(doc.get('caBundle', ''))} bytes, {len(labels)} labels)")
    return user_data
