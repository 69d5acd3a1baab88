"""The burst gateway seam: join tickets and Node admission/removal.

The optimizer's ClusterRole (R5.1) cannot create or delete Nodes and reads no Secret. Admitting a burst node
and removing its Node object belong to the gateway, which runs with its own ServiceAccount and alone holds the
ticket signing key. Activities talk to it through ``GatewayClient``; ``KubeGateway`` is the gateway's side,
constructed with the gateway's credentials, never the optimizer's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from kubernetes import client
from pydantic import BaseModel, Field

from models.operation import LABEL_OPERATION, Taint

TICKET_NONCE_ANNOTATION = "gpu.kubeon.io/join-ticket"
DEFAULT_TICKET_TTL_SECONDS = 900


class TicketError(Exception):
    """A join ticket is forged, expired, or bound to another node; the message says which."""


class JoinTicketRequest(BaseModel):
    operation: str
    policy: str
    location: str
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]
    ttl_seconds: int = DEFAULT_TICKET_TTL_SECONDS


class JoinTicket(BaseModel):
    operation: str
    policy: str
    location: str
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]
    expires_at: float
    nonce: str = Field(default_factory=lambda: secrets.token_hex(8))


class TicketGrant(BaseModel):
    """The gateway's answer to a ticket request: the ticket, and where the node joins (``endpoint``, an https URL,
    and ``server_name``, the name its certificate is verified against). Both empty: the worker's configured
    URL (an in-process gateway without a public address)."""

    ticket: str
    endpoint: str = ""
    server_name: str = ""


class GatewayClient(Protocol):
    """What the optimizer's activities may ask of the gateway."""

    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant: ...

    def remove_node(self, node_name: str, *, operation: str) -> bool: ...


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class GatewayAddressPending(Exception):
    """The gateway has no address burst nodes can reach yet (its LoadBalancer is being provisioned): retry."""


class GatewayAddressUnknown(Exception):
    """The gateway cannot tell burst nodes where it is: no public URL and its Service is no LoadBalancer."""


def url_host(url: str) -> str:
    """The host of an URL, lower case, without port or IPv6 brackets."""
    return (urlsplit(url).hostname or "").lower()


@dataclass(frozen=True)
class ServiceRef:
    """The gateway's own Service, whose LoadBalancer address burst nodes connect to."""

    name: str
    namespace: str

    @property
    def dns_name(self) -> str:
        """The name the chart's certificate carries and burst nodes verify it against (tls-server-name)."""
        return f"{self.name}.{self.namespace}.svc"


def endpoint_from_service(service: client.V1Service, ref: ServiceRef) -> tuple[str, str]:
    """``(https://<lb-host>:<port>, <name>.<ns>.svc)`` from a LoadBalancer Service's status and its port."""
    kind = service.spec.type if service.spec is not None else None
    if kind != "LoadBalancer":
        raise GatewayAddressUnknown(
            f"gateway Service {ref.name} is of type {kind}, not LoadBalancer, so it has no address burst nodes "
            f"can reach: set burst.gateway.publicUrl (e.g. https://<node address>:<nodePort>)")
    lb = service.status.load_balancer if service.status is not None else None
    ingress = [i for i in ((lb.ingress if lb is not None else None) or []) if i.hostname or i.ip]
    if not ingress:
        raise GatewayAddressPending(f"gateway Service {ref.name} has no LoadBalancer address yet (namespace "
                                    f"{ref.namespace}); retry once `kubectl -n {ref.namespace} get svc {ref.name}` "
                                    f"shows an EXTERNAL-IP, or set burst.gateway.publicUrl")
    host = str(ingress[0].hostname or ingress[0].ip)
    ports = (service.spec.ports if service.spec is not None else None) or []
    port = next((p for p in ports if p.name == "tunnel"), ports[0] if ports else None)
    if port is None:
        raise GatewayAddressUnknown(f"gateway Service {ref.name} has no port")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"https://{host}:{port.port}", ref.dns_name


class KubeGateway:
    """The gateway's own logic, with the gateway's Kubernetes credentials and signing key.

    Where burst nodes join: ``public_url`` when set (verified against its own host); else the LoadBalancer
    address of ``service`` (read at every ticket, verified against the Service's DNS name, which the chart's
    certificate carries); neither (dev, tests, in-process): the worker's configured URL."""

    def __init__(self, api: client.ApiClient, signing_key: bytes, *, clock: Any = time.time,
                 public_url: str = "", service: ServiceRef | None = None) -> None:
        if len(signing_key) < 16:
            raise ValueError("gateway ticket signing key must be at least 16 bytes")
        self._core = client.CoreV1Api(api)
        self._key = signing_key
        self._clock = clock
        self._public_url = public_url.rstrip("/")
        self._service = service

    # -- where nodes join ------------------------------------------------------------------------------------
    @property
    def public_url(self) -> str:
        return self._public_url

    @property
    def service(self) -> ServiceRef | None:
        return self._service

    def endpoint(self) -> tuple[str, str]:
        """``(endpoint URL, TLS server name)`` burst nodes use; ``("", "")`` when the worker's URL stands.
        Raises ``GatewayAddressPending`` until the LoadBalancer has an address, ``GatewayAddressUnknown`` when
        there can be none, ``ApiException`` when the Service cannot be read."""
        if self._public_url:
            return self._public_url, url_host(self._public_url)
        if self._service is None:
            return "", ""
        ref = self._service
        return endpoint_from_service(self._core.read_namespaced_service(ref.name, ref.namespace), ref)

    # -- tickets ---------------------------------------------------------------------------------------------
    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant:
        """A ticket and where to use it (the address first: no ticket while nodes could not reach us)."""
        endpoint, server_name = self.endpoint()
        return TicketGrant(ticket=self.sign_ticket(request), endpoint=endpoint, server_name=server_name)

    def sign_ticket(self, request: JoinTicketRequest) -> str:
        ticket = JoinTicket(
            operation=request.operation, policy=request.policy, location=request.location,
            node_name=request.node_name, labels=request.labels, taints=request.taints,
            expires_at=self._clock() + request.ttl_seconds,
        )
        body = _b64(ticket.model_dump_json().encode())
        return f"{body}.{_b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())}"

    def verify(self, token: str) -> JoinTicket:
        body, _, sig = token.partition(".")
        expected = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        if not sig or not hmac.compare_digest(sig, expected):
            raise TicketError("join ticket signature is invalid")
        try:
            ticket = JoinTicket.model_validate_json(_unb64(body))
        except ValueError as exc:
            raise TicketError(f"join ticket is malformed: {exc}") from None
        if ticket.expires_at < self._clock():
            raise TicketError(f"join ticket for {ticket.node_name} expired")
        return ticket

    # -- node admission and removal --------------------------------------------------------------------------
    def admit(self, token: str, *, capacity: dict[str, str], annotations: dict[str, str] | None = None,
              provider_id: str = "") -> client.V1Node:
        """Register the Node a ticket allows. Idempotent for a node retrying with the same ticket; a ticket is
        good for exactly one node (its nonce is recorded on the Node)."""
        ticket = self.verify(token)
        try:
            existing = self._core.read_node(ticket.node_name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        else:
            seen = (existing.metadata.annotations or {}).get(TICKET_NONCE_ANNOTATION)
            if seen == ticket.nonce:
                return existing
            raise TicketError(f"node {ticket.node_name} is already registered with another ticket")
        node = client.V1Node(
            metadata=client.V1ObjectMeta(
                name=ticket.node_name,
                labels={"kubernetes.io/hostname": ticket.node_name, "kubernetes.io/os": "linux",
                        **ticket.labels},
                annotations={**(annotations or {}), TICKET_NONCE_ANNOTATION: ticket.nonce},
            ),
            spec=client.V1NodeSpec(
                taints=[client.V1Taint(key=t.key, value=t.value, effect=t.effect) for t in ticket.taints],
                provider_id=provider_id or None,
            ),
            status=client.V1NodeStatus(capacity=capacity, allocatable=capacity),
        )
        try:
            return self._core.create_node(node)
        except client.ApiException as exc:
            if exc.status == 409:  # a concurrent retry of the same join won the race
                return self._core.read_node(ticket.node_name)
            raise

    def remove_node(self, node_name: str, *, operation: str) -> bool:
        """Delete a burst Node of ``operation``. False if it is already gone; refuses any other node."""
        try:
            node = self._core.read_node(node_name)
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        owner = (node.metadata.labels or {}).get(LABEL_OPERATION)
        if owner != operation:
            raise TicketError(f"node {node_name} belongs to operation {owner!r}, not {operation}; not removing")
        try:
            self._core.delete_node(node_name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        return True


def parse_user_data_ticket(user_data: str) -> dict[str, Any]:
    """The join document embedded in a burst node's user data (see ``render_user_data``)."""
    start = user_data.index(USER_DATA_BEGIN) + len(USER_DATA_BEGIN)
    end = user_data.index(USER_DATA_END)
    doc: dict[str, Any] = json.loads(user_data[start:end])
    return doc


USER_DATA_BEGIN = "# --- kubeon join document ---\n"
USER_DATA_END = "\n# --- end kubeon join document ---"
# The smallest provider limit on user data: EC2's 16 KB before base64 (GCE and Azure allow more).
USER_DATA_MAX_BYTES = 16 * 1024


class UserDataTooLarge(ValueError):
    """The rendered user data is over ``USER_DATA_MAX_BYTES``: the cloud would refuse the launch."""


def render_user_data(*, gateway_url: str, ticket: str, node_name: str, labels: dict[str, str],
                     taints: list[Taint], ca_bundle: str = "", server_name: str = "") -> str:
    """User data for a burst node: where the gateway is (``gateway``, the endpoint it connects to), the name its
    certificate is verified against (``serverName``; default: the endpoint's host), the CA certificate(s) to
    verify it with (``caBundle``, PEM; absent: the node's system trust store), its one-time ticket, and what it
    must register as. At most ``USER_DATA_MAX_BYTES``."""
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
    user_data = (
        "#!/bin/bash\n"
        "# KubeOn burst node bootstrap: open the tunnel to the gateway, then register through it.\n"
        "set -euo pipefail\n"
        "mkdir -p /etc/kubeon\n"
        "cat > /etc/kubeon/join.json <<'KUBEON_JOIN'\n"
        f"{USER_DATA_BEGIN}{json.dumps(doc, indent=1, sort_keys=True)}{USER_DATA_END}\n"
        "KUBEON_JOIN\n"
        "exec /usr/local/bin/kubeon-node-join /etc/kubeon/join.json\n"
    )
    size = len(user_data.encode())
    if size > USER_DATA_MAX_BYTES:
        raise UserDataTooLarge(f"user data for {node_name} is {size} bytes, over the {USER_DATA_MAX_BYTES}-byte "
                               f"limit of EC2 (CA bundle {len(doc.get('caBundle', ''))} bytes, {len(labels)} labels)")
    return user_data
