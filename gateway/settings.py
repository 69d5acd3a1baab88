"""The gateway's configuration: the chart's values reach it as ``KUBEON_*`` environment variables, as they reach
the worker (the same names; the worker reads only its client's: ``KUBEON_GATEWAY_URL``, ``..._PUBLIC_URL``,
``..._CA_FILE``, ``..._TOKEN_FILE``)."""

from __future__ import annotations

import ipaddress
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Final

from cryptography import x509
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import field_validator

from gateway.pool_tokens import DEFAULT_CLAIM_KEYS_FILE
from gateway.slots import AddressPlan
from models.env import ConfigError
from models.env import env_names
from models.env import from_env
from models.env import url_setting
from tunnel import link

DEFAULT_LISTEN: Final = "0.0.0.0:8443"
DEFAULT_ALLOWED_CLIENTS: Final = "system:serviceaccount:kubeon-gpu:kubeon-gpu-optimizer"
MAX_BODY_BYTES: Final = 64 * 1024


# Short, since a certificate cannot be revoked: a removed node's ends within this (and its tombstone outlives it).
DEFAULT_CERT_SECONDS = 4 * 3600

class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The gateway's own credentials: KUBEON_GATEWAY_KUBECONFIG, else KUBEON_KUBECONFIG, else in-cluster.
    kubeconfig: Path | None = None
    gateway_kubeconfig: Path | None = None
    gateway_ticket_key_file: Path | None = None
    health_port: int = 8080
    # Where burst nodes in other clouds reach the gateway (the chart's burst.gateway.publicUrl); empty: its
    # Service's LoadBalancer address.
    gateway_public_url: str = ""
    # The gateway's own Service and namespace: with no public URL, burst nodes connect to its LoadBalancer
    # address and verify the certificate as <service>.<namespace>.svc.
    gateway_service: str = ""
    gateway_service_namespace: str = "kubeon-gpu"
    gateway_listen: str = DEFAULT_LISTEN
    gateway_tls_cert_file: Path | None = None
    gateway_tls_key_file: Path | None = None
    gateway_allowed_clients: str = DEFAULT_ALLOWED_CLIENTS
    gateway_token_audiences: str = ""
    # On-prem pools' join tokens (each location's existingSecret at <dir>/onprem.<pool>/token).
    hub_claim_keys_file: Path = DEFAULT_CLAIM_KEYS_FILE
    # The WireGuard tunnel (R4.3). No interface: no tunnel (sim nodes reach the API server directly, with the
    # same certificates). The UDP port is the gateway Service's `wireguard` port.
    gateway_tunnel_interface: str = ""
    gateway_wireguard_key_file: Path | None = None
    gateway_udp_port: int = Field(default=51820, gt=0, lt=65536)
    # host:port nodes send UDP to; empty: the host nodes join at (public URL or LoadBalancer) and the UDP port.
    gateway_tunnel_endpoint: str = ""
    gateway_tunnel_cidr: str = "10.250.0.0/16"
    gateway_pod_cidr: str = "10.245.0.0/16"
    gateway_node_cidr_mask: int = Field(default=24, ge=8, le=30)
    gateway_service_cidr: str = "10.96.0.0/12"
    gateway_tunnel_mtu: int = Field(default=1380, ge=1280, le=1420)
    # host:port of the API server the tunnel's proxy forwards to; empty: the gateway's own API server.
    gateway_api_upstream: str = ""
    # What a burst node or pod may reach through the tunnel (comma-separated CIDRs): destinations inside the
    # service CIDR (empty: all of it), the cluster's pod CIDRs (empty: none), and what is refused even there
    # (node networks; never reachable anyway unless inside the allowed ones). 169.254.0.0/16 is always refused.
    gateway_tunnel_allowed_destinations: str = ""
    gateway_tunnel_cluster_pod_cidrs: str = ""
    gateway_tunnel_denied_cidrs: str = ""
    # Services in the gateway's namespace whose ClusterIP the tunnel refuses (the chart: the embedded Temporal),
    # read with the gateway's Role at start and every 30 s.
    gateway_tunnel_denied_services: str = ""
    # Abuse limits (issue 21, finding 9): a request's headers and body within this many seconds; connections at
    # once, in all and per source address; failed authentications per source a minute (then 429, no
    # TokenReview); the tunnel's API server proxy: connections per tunnel peer and in all.
    gateway_request_timeout: float = Field(default=10.0, gt=0, le=300)
    gateway_max_connections: int = Field(default=128, ge=1)
    gateway_max_connections_per_source: int = Field(default=32, ge=1)
    gateway_auth_failures_per_minute: int = Field(default=10, ge=1)
    gateway_proxy_max_per_peer: int = Field(default=64, ge=1)
    gateway_proxy_max_connections: int = Field(default=1024, ge=1)
    # Lifetime of the kubelet certificates the gateway signs (issue 21, finding 7): a removed node's last one ends
    # at most this long after its removal; joined nodes renew at two thirds of it (POST /v1/renew). The API
    # server's minimum is 10 minutes.
    gateway_cert_seconds: int = Field(default=DEFAULT_CERT_SECONDS, ge=600, le=7 * 24 * 3600)
    # How often at most each node's tunnel transfer counters are written to its slot record (issue 27): a gateway
    # that dies without stopping loses at most what moved since (a stopping gateway writes them first).
    gateway_transfer_seconds: float = Field(default=10.0, ge=0.5, le=300)
    # Location attested at join (issue 27): a directory of trust roots, <provider>.pem (aws, gcp, azure: the cloud's
    # published signing certificates or a CA issuing them); a provider with a file there requires its nodes'
    # signed identity. The accounts nodes must be in ("aws=123456789012,gcp=my-project,azure=<subscription>"), and
    # the audience of GCP identity tokens (empty: the public URL).
    gateway_attestation_roots_dir: Path | None = None
    gateway_attestation_accounts: str = ""
    gateway_attestation_audience: str = ""

    @field_validator("gateway_public_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return url_setting(value) or ""

    def address_plan(self) -> AddressPlan:
        """The address plan of these settings; ``ValueError`` naming the CIDR that is wrong."""
        return AddressPlan(tunnel_cidr=self.gateway_tunnel_cidr, pod_cidr=self.gateway_pod_cidr,
                           node_mask=self.gateway_node_cidr_mask, service_cidr=self.gateway_service_cidr)


ENV = env_names(GatewaySettings)


def load_settings(environ: Mapping[str, str] | None = None) -> GatewaySettings:
    """Settings from the environment; an invalid value fails naming the variable that holds it."""
    return from_env(GatewaySettings, environ)


@dataclass(frozen=True)
class ServiceRef:
    """The gateway's own Service, whose LoadBalancer address burst nodes connect to."""

    name: str
    namespace: str

    @property
    def dns_name(self) -> str:
        """The name the chart's certificate carries and burst nodes verify it against (tls-server-name)."""
        return f"{self.name}.{self.namespace}.svc"


LINK_LOCAL: Final = ipaddress.ip_network("169.254.0.0/16")
SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _cidrs(value: str, var: str) -> tuple[str, ...]:
    """Comma-separated IPv4 CIDRs (host bits must be zero), normalised."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        try:
            net = ipaddress.ip_network(item)
        except ValueError as exc:
            raise ConfigError(f"{var}: {item!r}: {exc}") from None
        if net.version != 4:
            raise ConfigError(f"{var}: {item!r}: the tunnel is IPv4 only")
        out.append(str(net))
    return tuple(out)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"KUBEON_GATEWAY_LISTEN {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass(frozen=True)
class GatewayServerConfig:
    host: str
    port: int
    health_port: int
    ticket_key_file: Path
    kubeconfig: Path | None = None  # None: in-cluster ServiceAccount credentials (the gateway's own)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    allowed_clients: frozenset[str] = frozenset({DEFAULT_ALLOWED_CLIENTS})
    # Empty: the API server's own audiences (the default ServiceAccount token). Set to make the optimizer send a
    # projected token only the gateway accepts, so the gateway never holds a token usable against the API server.
    token_audiences: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    # Where burst nodes join: public_url, else the LoadBalancer address of service; neither: the worker's URL.
    public_url: str = ""
    service: ServiceRef | None = None
    namespace: str = "kubeon-gpu"
    plan: AddressPlan = field(default_factory=AddressPlan)
    tunnel_interface: str = ""
    wireguard_key_file: Path | None = None
    udp_port: int = 51820
    tunnel_endpoint: str = ""
    mtu: int = 1380
    api_upstream: str = ""
    tunnel_allowed: tuple[str, ...] = ()
    tunnel_cluster_pod_cidrs: tuple[str, ...] = ()
    tunnel_denied: tuple[str, ...] = ()
    tunnel_denied_services: tuple[str, ...] = ()
    request_timeout: float = 10.0
    max_connections: int = 128
    max_connections_per_source: int = 32
    auth_failures_per_minute: int = 10
    proxy_max_per_peer: int = 64
    proxy_max_connections: int = 1024
    cert_seconds: int = DEFAULT_CERT_SECONDS
    transfer_seconds: float = 10.0
    attestation_roots: tuple[tuple[str, str], ...] = ()  # (provider, PEM)
    attestation_accounts: tuple[tuple[str, str], ...] = ()
    attestation_audience: str = ""

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayServerConfig:
        host, port = parse_listen(settings.gateway_listen)
        if settings.gateway_ticket_key_file is None:
            raise ConfigError("KUBEON_GATEWAY_TICKET_KEY_FILE is required: the file holding the join ticket key")
        cert, key = settings.gateway_tls_cert_file, settings.gateway_tls_key_file
        if bool(cert) != bool(key):
            raise ConfigError("KUBEON_GATEWAY_TLS_CERT_FILE and KUBEON_GATEWAY_TLS_KEY_FILE go together")
        clients = frozenset(c.strip() for c in settings.gateway_allowed_clients.split(",") if c.strip())
        if not clients:
            raise ConfigError("KUBEON_GATEWAY_ALLOWED_CLIENTS is empty: name the optimizer's ServiceAccount user, "
                              f"e.g. {DEFAULT_ALLOWED_CLIENTS}")
        audiences = settings.gateway_token_audiences
        # The gateway's own credentials: KUBEON_GATEWAY_KUBECONFIG, else KUBEON_KUBECONFIG, else in-cluster.
        kubeconfig = settings.gateway_kubeconfig or settings.kubeconfig
        service = (ServiceRef(settings.gateway_service, settings.gateway_service_namespace)
                   if settings.gateway_service else None)
        try:
            plan = settings.address_plan()
        except ValueError as exc:
            raise ConfigError(f"KUBEON_GATEWAY_TUNNEL_CIDR / KUBEON_GATEWAY_POD_CIDR / KUBEON_GATEWAY_SERVICE_CIDR: "
                              f"{exc}") from None
        if settings.gateway_tunnel_interface:
            link.check_ifname(settings.gateway_tunnel_interface)
            if settings.gateway_wireguard_key_file is None:
                raise ConfigError("KUBEON_GATEWAY_WIREGUARD_KEY_FILE is required with KUBEON_GATEWAY_TUNNEL_INTERFACE:"
                                  " the gateway's WireGuard private key (it must survive restarts)")
        allowed = _cidrs(settings.gateway_tunnel_allowed_destinations, "KUBEON_GATEWAY_TUNNEL_ALLOWED_DESTINATIONS")
        service_net = ipaddress.ip_network(plan.service_cidr)
        for cidr in allowed:
            if not ipaddress.ip_network(cidr).subnet_of(service_net):  # type: ignore[arg-type]
                raise ConfigError(f"KUBEON_GATEWAY_TUNNEL_ALLOWED_DESTINATIONS: {cidr} is not inside the service "
                                  f"CIDR {plan.service_cidr}; allow cluster pod CIDRs with "
                                  "KUBEON_GATEWAY_TUNNEL_CLUSTER_POD_CIDRS")
        pods = _cidrs(settings.gateway_tunnel_cluster_pod_cidrs, "KUBEON_GATEWAY_TUNNEL_CLUSTER_POD_CIDRS")
        for cidr in pods:
            if ipaddress.ip_network(cidr).overlaps(LINK_LOCAL):
                raise ConfigError(f"KUBEON_GATEWAY_TUNNEL_CLUSTER_POD_CIDRS: {cidr} overlaps {LINK_LOCAL}, which "
                                  "the tunnel never reaches (cloud metadata endpoints)")
        denied = _cidrs(settings.gateway_tunnel_denied_cidrs, "KUBEON_GATEWAY_TUNNEL_DENIED_CIDRS")
        denied_services = tuple(n.strip() for n in settings.gateway_tunnel_denied_services.split(",") if n.strip())
        for name in denied_services:
            if not SERVICE_NAME.match(name):
                raise ConfigError(f"KUBEON_GATEWAY_TUNNEL_DENIED_SERVICES: {name!r} is not a Service name")
        return cls(
            tunnel_allowed=allowed, tunnel_cluster_pod_cidrs=pods, tunnel_denied=denied,
            tunnel_denied_services=denied_services,
            request_timeout=settings.gateway_request_timeout, max_connections=settings.gateway_max_connections,
            max_connections_per_source=settings.gateway_max_connections_per_source,
            auth_failures_per_minute=settings.gateway_auth_failures_per_minute,
            proxy_max_per_peer=settings.gateway_proxy_max_per_peer,
            proxy_max_connections=settings.gateway_proxy_max_connections,
            cert_seconds=settings.gateway_cert_seconds, transfer_seconds=settings.gateway_transfer_seconds,
            host=host, port=port, health_port=settings.health_port, ticket_key_file=settings.gateway_ticket_key_file,
            kubeconfig=kubeconfig, tls_cert_file=cert, tls_key_file=key, allowed_clients=clients,
            token_audiences=tuple(a.strip() for a in audiences.split(",") if a.strip()),
            public_url=settings.gateway_public_url, service=service,
            namespace=settings.gateway_service_namespace, plan=plan,
            tunnel_interface=settings.gateway_tunnel_interface, wireguard_key_file=settings.gateway_wireguard_key_file,
            udp_port=settings.gateway_udp_port, tunnel_endpoint=settings.gateway_tunnel_endpoint,
            mtu=settings.gateway_tunnel_mtu, api_upstream=settings.gateway_api_upstream,
            attestation_roots=_attestation_roots(settings.gateway_attestation_roots_dir),
            attestation_accounts=_pairs(settings.gateway_attestation_accounts, "KUBEON_GATEWAY_ATTESTATION_ACCOUNTS"),
            attestation_audience=settings.gateway_attestation_audience or settings.gateway_public_url,
        )


ATTESTED_PROVIDERS = ("aws", "gcp", "azure")


def _attestation_roots(directory: Path | None) -> tuple[tuple[str, str], ...]:
    if directory is None:
        return ()
    roots = []
    for provider in ATTESTED_PROVIDERS:
        path = directory / f"{provider}.pem"
        if path.exists():
            pem = path.read_text()
            try:
                x509.load_pem_x509_certificates(pem.encode())
            except ValueError as exc:
                raise ConfigError(f"KUBEON_GATEWAY_ATTESTATION_ROOTS_DIR: {path}: {exc}") from None
            roots.append((provider, pem))
    return tuple(roots)


def _pairs(value: str, var: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in (i.strip() for i in value.split(",") if i.strip()):
        key, sep, val = item.partition("=")
        if not sep or key.strip() not in ATTESTED_PROVIDERS or not val.strip():
            raise ConfigError(f"{var}: {item!r} is not <aws|gcp|azure>=<account>")
        out.append((key.strip(), val.strip()))
    return tuple(out)


def check_tls_files(cfg: GatewayServerConfig) -> None:
    """The certificate and key load and belong together (the chart mounts them from the gateway's TLS Secret)."""
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"KUBEON_GATEWAY_TLS_CERT_FILE {cfg.tls_cert_file} / KUBEON_GATEWAY_TLS_KEY_FILE "
                          f"{cfg.tls_key_file}: cannot load the certificate and key: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
