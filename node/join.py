"""``kubeon-gpu node join``: what a booting burst node runs from its user data.

1. Keys, made on the node and kept in ``state_dir`` (0600): the WireGuard X25519 private key and the kubelet's
   EC P-256 client key. Only the public halves leave the node (the WireGuard public key and a CSR
   ``CN=system:node:<node>, O=system:nodes``).
2. The ticket is redeemed at the gateway over HTTPS, verified with the CA bundle of the user data as
   ``serverName`` (never unverified). The answer: the signed kubelet certificate, the cluster CA, the API server
   address (through the tunnel), the tunnel's parameters, the node's pod CIDR, labels and taints.
3. The tunnel: ``wireguard-go`` (no kernel module needed), MTU 1380, persistent keepalive: the node initiates,
   so it works from behind NAT with no inbound port. Routes through it: the gateway's tunnel address, the service
   CIDR, the burst pod CIDR.
4. The kubelet kubeconfig (its certificate and key, the cluster CA, the API server through the tunnel verified
   as ``kubernetes.default.svc``), ``registration.json`` (labels, taints, pod CIDR, provider ID) and ``kubelet.env``
   (the same as kubelet flags, for the image's systemd unit), then the kubelet is started (a systemd unit on a
   real image; a stand-in in tests).

Idempotent: a rerun (after a reboot) reuses the keys and the saved answer, and only brings things up again. Once
the answer is saved, the join document (``--config``, which holds the ticket) is deleted; a rerun without it uses
the saved answer and the document's other fields, kept without the ticket (``join-document.json``, 0600).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pydantic import BaseModel

from models.errors import JoinRefused
from models.join import NODE_USER_PREFIX
from models.join import NODES_GROUP
from models.join import CertRenewal
from models.join import CertRenewalAnswer
from models.join import GpuHealth
from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import TunnelAnswer
from models.labels import burn_in_checks
from node.health import DEFAULT_GPU_HEALTH_COMMAND
from node.health import GpuHealthRun
from node.health import HealthNotPosted
from node.health import post_gpu_health
from node.identity import IdentityUnavailable
from node.identity import fetch_attestation
from tunnel import keys
from tunnel import link
from tunnel.uapi import Uapi

DEFAULT_STATE_DIR = Path("/var/lib/kubeon")
DEFAULT_INTERFACE = "kubeon0"
DEFAULT_KUBELET_COMMAND = "systemctl restart kubelet"
TIMEOUT_SECONDS = 30.0
# How long `node join` keeps trying a gateway that does not answer (restarting, busy with a burst of joins, the
# VM's network not up yet) before it gives up; the optimizer's join timeout is 15 minutes.
RETRY_SECONDS = 900.0
RETRY_FIRST_WAIT, RETRY_MAX_WAIT = 1.0, 30.0

# The join at the gateway: (request) -> answer. Over HTTPS by default; in-process for the simulated provider.
Redeemer = Callable[[JoinRedeem], JoinAnswer]
# A certificate renewal at the gateway (burst nodes have no certificate rotation of their own).
Renewer = Callable[[CertRenewal], CertRenewalAnswer]
# Renew once this much of a certificate's lifetime has passed (the kubelet's own rotation: 70-90 %).
RENEW_AT = 2 / 3


class JoinError(RuntimeError):
    """The join failed; the message says at which step and why."""


class JoinUnavailable(JoinError):
    """The gateway could not be reached, its certificate did not verify, or it answered 5xx: retry."""


class JoinRefusedByGateway(JoinError):
    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class NodeFiles:
    state_dir: Path

    def __post_init__(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    wireguard_key = property(lambda self: self.state_dir / "wireguard.key")
    kubelet_key = property(lambda self: self.state_dir / "kubelet.key")
    kubelet_cert = property(lambda self: self.state_dir / "kubelet.crt")
    ca = property(lambda self: self.state_dir / "ca.crt")
    answer = property(lambda self: self.state_dir / "join-answer.json")
    kubeconfig = property(lambda self: self.state_dir / "kubelet.kubeconfig")
    registration = property(lambda self: self.state_dir / "registration.json")
    document = property(lambda self: self.state_dir / "join-document.json")  # the join document, no ticket
    wireguard_pid = property(lambda self: self.state_dir / "wireguard-go.pid")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def wireguard_private_key(files: NodeFiles) -> str:
    if files.wireguard_key.exists():
        return keys.check_key(files.wireguard_key.read_text().strip(), str(files.wireguard_key))
    key = keys.generate_private_key()
    _write_private(files.wireguard_key, key.encode() + b"\n")
    return key


def kubelet_key(files: NodeFiles) -> ec.EllipticCurvePrivateKey:
    if files.kubelet_key.exists():
        loaded = serialization.load_pem_private_key(files.kubelet_key.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise JoinError(f"{files.kubelet_key}: not an EC private key")
        return loaded
    key = ec.generate_private_key(ec.SECP256R1())
    _write_private(files.kubelet_key, key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return key


def kubelet_csr(key: ec.EllipticCurvePrivateKey, node_name: str) -> str:
    """The kubelet client CSR, exactly as the kubelet makes it: O=system:nodes, CN=system:node:<node>."""
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, NODES_GROUP),
        x509.NameAttribute(NameOID.COMMON_NAME, f"{NODE_USER_PREFIX}{node_name}"),
    ])).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _gateway_post(doc: dict[str, Any], *, timeout: float, ca_file: Path | None,
                  transport: Callable[[Any], httpx.BaseTransport] | None) -> Callable[[str, BaseModel, str], Any]:
    """``post(path, body, what)`` at the gateway the join document names, verified with its caBundle (else
    ``ca_file``, else the system trust store) as its serverName. Verification is never off. No answer or a 5xx:
    ``JoinUnavailable`` (retry); another refusal: ``JoinRefusedByGateway``."""
    import ssl

    base = str(doc["gateway"]).rstrip("/")
    ca_bundle = doc.get("caBundle") or None
    verify: ssl.SSLContext | bool = True
    if ca_bundle or ca_file:
        verify = ssl.create_default_context(cafile=None if ca_bundle else str(ca_file), cadata=ca_bundle)
    server_name = str(doc.get("serverName") or "") or None

    def post(path: str, body: BaseModel, what: str) -> Any:
        extensions = {"sni_hostname": server_name} if server_name else None
        with httpx.Client(base_url=base, verify=verify, timeout=timeout, follow_redirects=False,
                          transport=transport(verify) if transport is not None else None,
                          headers={"User-Agent": "kubeon-node-join"}) as http:
            req = http.build_request("POST", path, json=body.model_dump(mode="json", by_alias=True),
                                     extensions=extensions)
            try:
                response = http.send(req)
            except httpx.HTTPError as exc:
                raise JoinUnavailable(f"{what} at {base}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            try:
                answer = response.json()
                code, message = str(answer.get("error", "")), str(answer.get("message", ""))
            except ValueError:
                code, message = "", response.text[:300]
            text = f"the gateway {base} refused {what} (HTTP {response.status_code} {code}): {message}"
            if response.status_code >= 500:
                raise JoinUnavailable(text)
            raise JoinRefusedByGateway(text, status=response.status_code, code=code)
        return response.json()

    return post


def redeem_over_https(doc: dict[str, Any], *, timeout: float = TIMEOUT_SECONDS, ca_file: Path | None = None,
                      transport: Callable[[Any], httpx.BaseTransport] | None = None) -> Redeemer:
    """POST /v1/join at the gateway the join document names (see ``_gateway_post``)."""
    post = _gateway_post(doc, timeout=timeout, ca_file=ca_file, transport=transport)
    return lambda request: JoinAnswer.model_validate(post("/v1/join", request, "the join"))


def renew_over_https(doc: dict[str, Any], *, timeout: float = TIMEOUT_SECONDS, ca_file: Path | None = None,
                     transport: Callable[[Any], httpx.BaseTransport] | None = None) -> Renewer:
    """POST /v1/renew at the gateway the join document names (see ``_gateway_post``)."""
    post = _gateway_post(doc, timeout=timeout, ca_file=ca_file, transport=transport)
    return lambda request: CertRenewalAnswer.model_validate(post("/v1/renew", request, "the certificate renewal"))


def renewal_due(certificate: str, *, now: dt.datetime | None = None, fraction: float = RENEW_AT) -> bool:
    """Whether ``fraction`` of the certificate's lifetime has passed (or it expired)."""
    cert = x509.load_pem_x509_certificate(certificate.encode())
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return (now or dt.datetime.now(dt.UTC)) >= start + (end - start) * fraction


def _spki(key: Any) -> bytes:
    return bytes(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def renew(files: NodeFiles, *, renewer: Renewer | None = None, force: bool = False) -> JoinAnswer | None:
    """A new kubelet certificate from the gateway once two thirds of the current one's lifetime passed (or
    ``force``), for the kubelet key the node joined with; written where the kubeconfig points. None: not due.
    The new certificate must be for this node's name and key, or nothing is written."""
    if not files.answer.exists() or not files.document.exists():
        raise JoinError(f"{files.state_dir}: this node has not joined (no saved join answer)")
    saved = JoinAnswer.model_validate_json(files.answer.read_text())
    if not force and not renewal_due(saved.certificate):
        return None
    key = kubelet_key(files)
    request = CertRenewal(node_name=saved.node_name, csr=kubelet_csr(key, saved.node_name))
    got = (renewer or renew_over_https(json.loads(files.document.read_text())))(request)
    cert = x509.load_pem_x509_certificate(got.certificate.encode())
    subject = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if subject != [f"{NODE_USER_PREFIX}{saved.node_name}"] or _spki(cert.public_key()) != _spki(key.public_key()):
        raise JoinError(f"the gateway's renewed certificate is not for {NODE_USER_PREFIX}{saved.node_name} and this "
                        "node's kubelet key; kept the current one")
    updated = saved.model_copy(update={"certificate": got.certificate})
    files.answer.write_text(updated.model_dump_json(by_alias=True))
    write_kubeconfig(files, updated)
    return updated


def write_kubeconfig(files: NodeFiles, answer: JoinAnswer) -> Path:
    files.kubelet_cert.write_text(answer.certificate)
    files.ca.write_text(answer.ca_bundle)
    cluster: dict[str, Any] = {"server": answer.api_server, "certificate-authority": str(files.ca)}
    if answer.api_server_name:
        cluster["tls-server-name"] = answer.api_server_name
    doc = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "kubeon", "cluster": cluster}],
        "users": [{"name": "kubelet", "user": {"client-certificate": str(files.kubelet_cert),
                                                "client-key": str(files.kubelet_key)}}],
        "contexts": [{"name": "kubeon", "context": {"cluster": "kubeon", "user": "kubelet"}}],
        "current-context": "kubeon",
    }
    _write_private(files.kubeconfig, yaml.safe_dump(doc).encode())
    return files.kubeconfig


def bring_up_tunnel(files: NodeFiles, tunnel: TunnelAnswer, private_key: str, interface: str) -> None:
    """wireguard-go (started once, its pid kept), the gateway as the one peer, the address and the routes."""
    link.check_ifname(interface)
    uapi = Uapi(interface)
    if not uapi.path.exists():
        proc = link.start_wireguard_go(interface)
        files.wireguard_pid.write_text(f"{proc.pid}\n")
    uapi.configure(private_key)
    uapi.set_peer(tunnel.gateway_public_key, tunnel.allowed_ips, endpoint=tunnel.endpoint,
                  persistent_keepalive=tunnel.persistent_keepalive)
    routes = [c for c in tunnel.allowed_ips if c != f"{tunnel.gateway_address}/32"]
    link.bring_up(interface, tunnel.address, mtu=tunnel.mtu, routes=[f"{tunnel.gateway_address}/32", *routes])


def redeem_retrying(redeem: Redeemer, request: JoinRedeem, *, retry_seconds: float,
                    sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] | None = None,
                    ) -> JoinAnswer:
    """``redeem``, tried again while the gateway is unavailable (no answer, 5xx) for up to ``retry_seconds``,
    waiting 1 s, 2 s, 4 s ... at most 30 s between tries (with jitter: a burst of nodes does not retry in step).
    Safe: the same keys redeem the same ticket again and get the same answer. A refusal is never retried, but
    for the gateway's own 5xx ones (a slot changed while it joined: a retried launch re-pointed the reservation),
    which an in-process gateway raises as they are and which reach a node over HTTPS as a 5xx."""
    deadline = time.monotonic() + retry_seconds
    wait, attempt = RETRY_FIRST_WAIT, 1
    while True:
        try:
            return redeem(request)
        except (JoinUnavailable, JoinRefused) as exc:
            if isinstance(exc, JoinRefused) and exc.status < 500:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                if attempt == 1:
                    raise
                raise JoinUnavailable(f"{exc} (gave up after {attempt} attempts in {retry_seconds:.0f}s)") from None
            pause = min(left, wait * random.uniform(0.5, 1.0))
            (say or _stderr)(f"kubeon-gpu node join: attempt {attempt}: {exc}; trying again in {pause:.1f}s")
            sleep(pause)
            wait, attempt = min(RETRY_MAX_WAIT, wait * 2), attempt + 1


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def join(doc: dict[str, Any], files: NodeFiles, *, redeem: Redeemer | None = None,
         interface: str = DEFAULT_INTERFACE, tunnel: bool = True, retry_seconds: float = 0.0,
         renewer: Renewer | None = None) -> JoinAnswer:
    """The join up to a usable kubeconfig (the kubelet is started by ``run``). ``tunnel=False``: the gateway's
    answer must carry no tunnel (sim at scale: the API server over loopback, same credentials). An unavailable
    gateway is tried again for ``retry_seconds`` (0: not at all; callers with a retry loop of their own)."""
    node_name = str(doc["nodeName"])
    wg_key = wireguard_private_key(files)
    key = kubelet_key(files)
    answer: JoinAnswer | None = None
    if files.answer.exists():
        saved = JoinAnswer.model_validate_json(files.answer.read_text())
        cert = x509.load_pem_x509_certificate(saved.certificate.encode())
        if saved.node_name == node_name and cert.not_valid_after_utc > dt.datetime.now(dt.UTC):
            answer = saved
        elif saved.node_name == node_name and "ticket" not in doc and files.document.exists():
            # A rerun after its certificate expired (a long reboot): the ticket is redeemed and gone; the kubelet
            # key it joined with proves the node to the gateway, which renews while the node holds its slot.
            answer = renew(files, renewer=renewer, force=True)
    if answer is None:
        try:
            attestation = fetch_attestation(doc)
        except IdentityUnavailable as exc:
            raise JoinError(f"reading the instance identity: {exc}") from None
        request = JoinRedeem(ticket=str(doc["ticket"]), wireguard_public_key=keys.public_key(wg_key),
                             csr=kubelet_csr(key, node_name), attestation=attestation)
        answer = redeem_retrying(redeem or redeem_over_https(doc), request, retry_seconds=retry_seconds)
        if answer.node_name != node_name:
            raise JoinError(f"the gateway answered for node {answer.node_name}, this node is {node_name}")
        files.answer.write_text(answer.model_dump_json(by_alias=True))
    if answer.tunnel is not None and tunnel:
        bring_up_tunnel(files, answer.tunnel, wg_key, interface)
    elif answer.tunnel is None and tunnel:
        raise JoinError("the gateway runs no tunnel; join with --no-tunnel (simulated nodes only)")
    write_kubeconfig(files, answer)
    return answer


def write_registration(files: NodeFiles, answer: JoinAnswer, *, provider_id: str = "",
                       capacity: dict[str, str] | None = None) -> Path:
    """What the kubelet registers with: the ticket's labels and taints, the pod CIDR, the provider ID (as
    ``--node-labels``, ``--register-with-taints``, ``--provider-id`` would), and its tunnel address."""
    from node.register import registration_from

    registration = registration_from(answer, provider_id=provider_id, capacity=capacity or {})
    files.registration.write_text(json.dumps(registration, indent=1, sort_keys=True))
    # The same for a real kubelet's systemd unit (EnvironmentFile=): its flags.
    flags = [f"--kubeconfig={files.kubeconfig}",
             "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(answer.labels.items())),
             "--register-with-taints=" + ",".join(f"{t.key}={t.value}:{t.effect}" for t in answer.taints)]
    if provider_id:
        flags.append(f"--provider-id={provider_id}")
    if registration["internalIP"]:
        flags.append(f"--node-ip={registration['internalIP']}")
    (files.state_dir / "kubelet.env").write_text(f"KUBELET_KUBEON_ARGS={shlex.quote(' '.join(flags))}\n")
    return files.registration


def start_kubelet(files: NodeFiles, command: str) -> subprocess.Popen[bytes] | None:
    """Start the kubelet: ``command`` with KUBEON_NODE_DIR set (a systemd unit reads the kubeconfig and
    registration there). Returns the process when ``command`` keeps running (a stand-in), else None."""
    env = {**os.environ, "KUBEON_NODE_DIR": str(files.state_dir)}
    argv = shlex.split(command)
    if argv[:1] == ["systemctl"]:
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise JoinError(f"`{command}` failed: {done.stderr.strip()[:300]}")
        return None
    log = open(files.state_dir / "kubelet.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    (files.state_dir / "kubelet.pid").write_text(f"{proc.pid}\n")
    return proc


def main_join(config: Path, state_dir: Path, *, interface: str, kubelet_command: str, provider_id: str,
              capacity: dict[str, str], tunnel: bool, retry_seconds: float = RETRY_SECONDS,
              redeem: Redeemer | None = None, gpu_health_command: str = DEFAULT_GPU_HEALTH_COMMAND) -> int:
    from models.join import parse_user_data

    files = NodeFiles(state_dir)
    if config.exists():
        text = config.read_text()
        doc = parse_user_data(text) if "# --- kubeon join document ---" in text else json.loads(text)
    elif files.document.exists() and files.answer.exists():  # a rerun: the ticket was redeemed and deleted
        doc = json.loads(files.document.read_text())
    else:
        raise JoinError(f"{config}: no join document (and no earlier join in {state_dir})")
    answer = join(doc, files, redeem=redeem, interface=interface, tunnel=tunnel, retry_seconds=retry_seconds)
    _write_private(files.document, json.dumps({k: v for k, v in doc.items() if k != "ticket"}).encode())
    if config.exists():
        config.unlink()  # the ticket is redeemed: nothing on disk to replay (issue 21)
    write_registration(files, answer, provider_id=provider_id, capacity=capacity)
    # The burn-in's GPU health check when the node's label asks for it: started before the kubelet (it needs the
    # driver only), posted on the Node once the kubelet has registered it.
    health = GpuHealthRun(gpu_health_command) if "GpuHealth" in burn_in_checks(answer.labels) else None
    start_kubelet(files, kubelet_command)
    print(f"joined as {answer.node_name}: pod CIDR {answer.pod_cidr}, API server {answer.api_server}"
          + (f", tunnel {answer.tunnel.address} via {answer.tunnel.endpoint}" if answer.tunnel else ""), flush=True)
    if health is not None:
        report_gpu_health(files, answer.node_name, health.result())
    return 0


def report_gpu_health(files: NodeFiles, node_name: str, health: GpuHealth) -> None:
    from node.register import node_api

    api = node_api(files.kubeconfig)
    try:
        post_gpu_health(api, node_name, health)
    except HealthNotPosted as exc:
        raise JoinError(f"the GPU health check's result ({health.reason}): {exc}") from None
    finally:
        api.close()
    print(f"GPU health check: {health.reason}: {health.message}", flush=True)


def main_renew(state_dir: Path, *, kubelet_command: str, force: bool, renewer: Renewer | None = None) -> int:
    """``kubeon-gpu node renew`` (a systemd timer on a burst image runs it every 10 minutes): renew the kubelet's
    certificate at the gateway when due, then restart the kubelet with ``kubelet_command`` so it uses the new one
    (a kubelet restart keeps its pods running)."""
    files = NodeFiles(state_dir)
    renewed = renew(files, renewer=renewer, force=force)
    saved = JoinAnswer.model_validate_json(files.answer.read_text())
    until = x509.load_pem_x509_certificate(saved.certificate.encode()).not_valid_after_utc
    if renewed is None:
        print(f"{saved.node_name}: the kubelet certificate is valid until {until:%Y-%m-%dT%H:%M:%SZ}; not due")
        return 0
    if kubelet_command:
        start_kubelet(files, kubelet_command)
    print(f"{saved.node_name}: renewed the kubelet certificate, valid until {until:%Y-%m-%dT%H:%M:%SZ}")
    return 0
