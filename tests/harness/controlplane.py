"""A real Kubernetes control plane for tests and `make dev`.

etcd, kube-apiserver (Node,RBAC authorization, NodeRestriction admission), kube-controller-manager (signing
kubelet client certificates with the cluster CA), kube-scheduler and kwok (simulated kubelets for Nodes
annotated ``kwok.x-k8s.io/node=fake``), built from the Go module proxy by ``build-binaries.sh`` and started on
free loopback ports in a temporary directory. ``stop()`` leaves no process behind: every component runs in a
process group of its own and is killed with it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

HARNESS_DIR = Path(__file__).resolve().parent
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started; the message says which part and why."""


def read_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for line in (HARNESS_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key] = value
    return versions


def binary_dir() -> Path:
    cache = os.environ.get("KUBEON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeon-gpu"
    )
    return Path(os.environ.get("KUBEON_BIN_DIR") or os.path.join(cache, "bin"))


def ensure_binaries(components: tuple[str, ...] = ("etcd", "kubernetes", "kwok")) -> dict[str, Path]:
    """Paths of the pinned binaries, building any that are missing (a clear error if that fails)."""
    v = read_versions()
    wanted = {
        "etcd": ("etcd", v["ETCD_VERSION"]),
        "kube-apiserver": ("kubernetes", v["KUBERNETES_VERSION"]),
        "kube-controller-manager": ("kubernetes", v["KUBERNETES_VERSION"]),
        "kube-scheduler": ("kubernetes", v["KUBERNETES_VERSION"]),
        "kwok": ("kwok", v["KWOK_VERSION"]),
        "helm": ("helm", v["HELM_VERSION"]),
        "karpenter": ("karpenter", v["KARPENTER_VERSION"]),
    }
    paths = {name: binary_dir() / f"{name}-{version}" for name, (_, version) in wanted.items()}
    missing = sorted({wanted[n][0] for n, p in paths.items() if wanted[n][0] in components and not p.exists()})
    if missing:
        proc = subprocess.run(
            ["bash", str(HARNESS_DIR / "build-binaries.sh"), *missing],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise ControlPlaneError(
                f"building {', '.join(missing)} from the Go module proxy failed "
                f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
    return {n: p for n, p in paths.items() if wanted[n][0] in components}


# Below Linux's ephemeral range (32768-60999): a port the kernel hands to outgoing connections could be taken by
# one of them between this choice and the server's bind, which fails a long start-up minutes later.
_PORTS = range(20_000, 32_768)


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range (random, so parallel tests rarely pick the same)."""
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

# The chart's admission policy for burst nodes, installed on every control plane the tests start.
NODE_ADMISSION_POLICY = (Path(__file__).resolve().parents[2] / "charts" / "kubeon-gpu-optimizer" / "files"
                         / "node-admission-policy.yaml")


def _probe_csr() -> bytes:
    """A kubelet client CSR of the admission probe (PEM): what a burst node's certificate rotation would send."""
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name("system:node:burst-admission-probe",
                                                                     "system:nodes"))
    return csr.sign(ec.generate_private_key(ec.SECP256R1()), hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass
class _Cert:
    cert: x509.Certificate
    key: rsa.RSAPrivateKey

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        crt, key = directory / f"{name}.crt", directory / f"{name}.key"
        crt.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        key.write_bytes(
            self.key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        return crt, key


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _issue(
    subject: x509.Name,
    ca: _Cert | None,
    *,
    is_ca: bool = False,
    server_names: tuple[str, ...] = (),
    server_ips: tuple[str, ...] = (),
    client: bool = False,
) -> _Cert:
    key = _new_key()
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    else:
        usages = [x509.ExtendedKeyUsageOID.CLIENT_AUTH] if client else [x509.ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names or server_ips:
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key if ca else key, hashes.SHA256())
    return _Cert(cert, key)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def write_kubeconfig(
    path: Path, server: str, ca_file: Path, *, cert: tuple[Path, Path] | None = None, token: str | None = None,
    user: str = "admin",
) -> Path:
    user_entry: dict[str, str] = {}
    if cert:
        user_entry = {"client-certificate": str(cert[0]), "client-key": str(cert[1])}
    if token:
        user_entry = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubeon-test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "kubeon-test", "context": {"cluster": "kubeon-test", "user": user}}],
        "current-context": "kubeon-test",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class ControlPlane:
    """One control plane in ``workdir``; ``start()`` returns once the apiserver is ready and kwok runs."""

    workdir: Path
    binaries: dict[str, Path] = field(default_factory=dict)
    server: str = ""
    admin_kubeconfig: Path = field(default_factory=Path)
    ca_file: Path = field(default_factory=Path)
    ca_key_file: Path = field(default_factory=Path)
    started_seconds: float = 0.0
    # How components are started: `make dev` passes its registry's (pids recorded, killed with the harness).
    popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _ca: _Cert | None = None

    def start(self, timeout: float = 120.0) -> ControlPlane:
        t0 = time.monotonic()
        self.binaries = self.binaries or ensure_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        ca = self._ca = _issue(_name("kubeon-test-ca"), None, is_ca=True)
        self.ca_file, self.ca_key_file = ca.write(pki, "ca")
        serving = _issue(
            _name("kube-apiserver"), ca,
            server_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                          "kubernetes.default.svc.cluster.local"),
            server_ips=("127.0.0.1", "10.96.0.1"),
        ).write(pki, "apiserver")
        admin = _issue(_name("kubeon-admin", "system:masters"), ca, client=True).write(pki, "admin")
        sa_key = _new_key()
        sa_key_file = pki / "sa.key"
        sa_key_file.write_bytes(
            sa_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        sa_pub_file = pki / "sa.pub"
        sa_pub_file.write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        self._spawn("etcd", [
            str(self.binaries["etcd"]),
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ])
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("kube-apiserver", [
            str(self.binaries["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--tls-cert-file={serving[0]}",
            f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.ca_file}",
            "--authorization-mode=Node,RBAC",
            # As a real cluster: a node's credentials reach only its own Node, Lease and pods' status.
            "--enable-admission-plugins=NodeRestriction",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_pub_file}",
            f"--service-account-signing-key-file={sa_key_file}",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--allow-privileged=true",
            f"--cert-dir={pki}",
            "--v=0",
        ])
        self.admin_kubeconfig = write_kubeconfig(self.workdir / "admin.kubeconfig", self.server, self.ca_file,
                                                 cert=admin)
        self._wait_ready(admin, deadline=t0 + timeout)
        self._install_node_admission_policy(deadline=t0 + timeout)
        self._spawn("kube-controller-manager", [
            str(self.binaries["kube-controller-manager"]),
            f"--kubeconfig={self.admin_kubeconfig}",
            f"--authentication-kubeconfig={self.admin_kubeconfig}",
            f"--authorization-kubeconfig={self.admin_kubeconfig}",
            f"--root-ca-file={self.ca_file}",
            f"--service-account-private-key-file={sa_key_file}",
            # The csrsigning controller signs approved kubelet client CSRs (the gateway approves them).
            f"--cluster-signing-cert-file={self.ca_file}",
            f"--cluster-signing-key-file={self.ca_key_file}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--node-monitor-grace-period=40s",
        ])
        self._spawn("kube-scheduler", [
            str(self.binaries["kube-scheduler"]),
            f"--kubeconfig={self.admin_kubeconfig}",
            f"--authentication-kubeconfig={self.admin_kubeconfig}",
            f"--authorization-kubeconfig={self.admin_kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
        ])
        self._spawn("kwok", [
            str(self.binaries["kwok"]),
            f"--kubeconfig={self.admin_kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--server-address=127.0.0.1:{free_port()}",
            "--node-lease-duration-seconds=40",
            f"--config={HARNESS_DIR / 'kwok-stages.yaml'}",
        ])
        self._check_alive()
        self.started_seconds = time.monotonic() - t0
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed when the process ends
        self._procs[name] = self.popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{tail}")

    def _wait_ready(self, admin: tuple[Path, Path], deadline: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(admin[0]), str(admin[1]))
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except Exception as exc:  # not ready yet: connection refused, 500 while post-start hooks run
                last = str(exc)
            time.sleep(0.2)
        raise ControlPlaneError(f"kube-apiserver not ready at {self.server}/readyz: {last}")

    def node_kubeconfig(self, node_name: str) -> Path:
        """A kubeconfig with a kubelet client certificate of ``system:node:<node_name>`` (group system:nodes), signed
        by the cluster CA: what a node's approved CSR gives it, for tests that act as a node."""
        assert self._ca is not None, "start() first"
        cert = _issue(_name(f"system:node:{node_name}", "system:nodes"), self._ca, client=True)
        files = cert.write(self.workdir / "pki", f"node-{node_name}")
        return write_kubeconfig(self.workdir / f"node-{node_name}.kubeconfig", self.server, self.ca_file, cert=files,
                                user=f"node-{node_name}")

    def _install_node_admission_policy(self, deadline: float) -> None:
        """The chart's ValidatingAdmissionPolicy for burst nodes (charts/.../files/node-admission-policy.yaml), as a
        real cluster with the chart installed has it; returns once the API server enforces it (a burst node's
        dry-run registration without the joining taint is denied), since the policy takes effect asynchronously."""
        from kubernetes import client
        from kubernetes import config
        from kubernetes import utils

        api = config.new_client_from_config(config_file=str(self.admin_kubeconfig))
        utils.create_from_yaml(api, str(NODE_ADMISSION_POLICY))
        probe = config.new_client_from_config(config_file=str(self.node_kubeconfig("burst-admission-probe")))
        node = client.V1Node(metadata=client.V1ObjectMeta(name="burst-admission-probe"))
        csr = client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name="burst-admission-probe"),
            spec=client.V1CertificateSigningRequestSpec(request=base64.b64encode(_probe_csr()).decode(),
                                                        signer_name="kubernetes.io/kube-apiserver-client-kubelet",
                                                        usages=["digital signature", "client auth"]))
        # Each policy takes effect on its own: wait for both.
        probes: dict[str, Callable[[], object]] = {
            "a dry-run registration without the joining taint": lambda: client.CoreV1Api(probe).create_node(
                node, dry_run="All"),
            "a dry-run kubelet CSR": lambda: client.CertificatesV1Api(probe).create_certificate_signing_request(
                csr, dry_run="All")}
        last = ""
        while probes and time.monotonic() < deadline:
            for what, call in list(probes.items()):
                try:
                    call()
                    last = f"{what} was admitted"
                except client.ApiException as exc:
                    if exc.status == 403 and "ValidatingAdmissionPolicy" in str(exc.body):
                        del probes[what]
                    else:
                        last = f"{what}: {exc.status}: {exc.body}"
            if probes:
                time.sleep(0.2)
        if probes:
            raise ControlPlaneError(f"the burst node admission policy is not enforced: {last}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> list[str]:
        """SIGTERM each process's group, SIGKILL what remains after 10 s (or once ``hurry()``): the apiserver and its
        clients first, etcd once they are gone (an apiserver whose etcd went first retries etcd in its shutdown
        until it is killed). Returns the names that needed SIGKILL."""
        killed: list[str] = []
        clients = [(name, proc) for name, proc in reversed(self._procs.items()) if name != "etcd"]
        for wave in (clients, [(name, proc) for name, proc in self._procs.items() if name == "etcd"]):
            for _, proc in wave:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while any(proc.poll() is None for _, proc in wave) and time.monotonic() < deadline and not hurry():
                time.sleep(0.05)
            for name, proc in wave:
                if proc.poll() is None:
                    killed.append(name)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._procs.clear()
        return killed

    @property
    def pids(self) -> set[int]:
        return {proc.pid for proc in self._procs.values()}
