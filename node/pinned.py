"""What a server that may serve several clusters (an on-prem pool's) trusts of a join, and how it leaves one.

* ``GatewayPin``: for each cluster the server may join, the gateway's URL, the CA that verifies it, and the routes
  the cluster may install (its tunnel, pod and service CIDRs). Configured on the server by its operator; never
  taken from the claim's user data, which comes from whoever holds a cluster token.
* ``pinned_redeemer``: redeems only at the pinned gateway, verified with the pinned CA, and refuses an answer
  whose tunnel routes, addresses, pod CIDR or API server lie outside the pinned CIDRs (before anything is written
  or brought up).
* ``teardown``: what leaving a cluster undoes: the kubelet and wireguard-go stopped, the tunnel interface (and so
  its routes) deleted, the kubelet's directory (the last tenant's pods' volumes and images) emptied.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from models.join import JoinAnswer
from models.join import JoinRedeem
from node.join import JoinError
from node.join import NodeFiles
from node.join import Redeemer
from node.join import redeem_over_https

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class PinRefused(JoinError):
    """The claim or the gateway's answer goes beyond what this server's configuration pins for the cluster."""


@dataclass(frozen=True)
class GatewayPin:
    cluster: str
    url: str
    ca_file: Path | None = None
    server_name: str = ""
    allowed_routes: tuple[Network, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        loopback = (parts.hostname or "") in ("127.0.0.1", "::1", "localhost")
        if parts.scheme != "https" and not (parts.scheme == "http" and loopback):
            raise ValueError(f"cluster {self.cluster}: gateway {self.url!r} must be https:// (http only on loopback)")
        if not parts.hostname:
            raise ValueError(f"cluster {self.cluster}: gateway {self.url!r} has no host")
        if not self.allowed_routes:
            raise ValueError(f"cluster {self.cluster}: allowedRoutes (its tunnel, pod and service CIDRs) is empty")

    @classmethod
    def parse(cls, cluster: str, doc: dict[str, Any], base: Path) -> GatewayPin:
        unknown = set(doc) - {"gateway", "caFile", "serverName", "allowedRoutes"}
        if unknown:
            raise ValueError(f"cluster {cluster}: unknown keys {', '.join(sorted(unknown))}")
        ca = doc.get("caFile")
        try:
            routes = tuple(ipaddress.ip_network(str(c), strict=True) for c in doc.get("allowedRoutes") or [])
        except ValueError as exc:
            raise ValueError(f"cluster {cluster}: allowedRoutes: {exc}") from None
        return cls(cluster=cluster, url=str(doc.get("gateway") or ""), ca_file=(base / ca) if ca else None,
                   server_name=str(doc.get("serverName") or ""), allowed_routes=routes)

    def same_gateway(self, url: str) -> bool:
        def key(u: str) -> tuple[str, str, int | None]:
            p = urlsplit(u)
            return p.scheme, (p.hostname or "").lower(), p.port or (443 if p.scheme == "https" else 80)

        return key(url.rstrip("/")) == key(self.url.rstrip("/"))

    def inside(self, cidr: str) -> bool:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            return False
        return any(net.version == a.version and net.subnet_of(a) for a in self.allowed_routes)  # type: ignore[arg-type]


def load_pins(path: Path) -> dict[str, GatewayPin]:
    """``clusters: {<cluster>: {gateway, caFile, serverName, allowedRoutes}}`` (YAML or JSON)."""
    import yaml

    doc = yaml.safe_load(path.read_text()) or {}
    clusters = doc.get("clusters") if isinstance(doc, dict) else None
    if not isinstance(clusters, dict):
        raise ValueError(f"{path}: expected 'clusters: {{<cluster name>: {{gateway: ..., allowedRoutes: [...]}}}}'")
    return {str(name): GatewayPin.parse(str(name), spec or {}, path.parent) for name, spec in clusters.items()}


def check_answer(pin: GatewayPin, answer: JoinAnswer) -> None:
    """Refuse an answer that would route or point the server anywhere the pin does not allow."""
    wrong: list[str] = []
    if not pin.inside(answer.pod_cidr):
        wrong.append(f"podCIDR {answer.pod_cidr}")
    host = urlsplit(answer.api_server).hostname or ""
    try:
        api_ip = ipaddress.ip_address(host)
    except ValueError:
        wrong.append(f"apiServer {answer.api_server} (not an address)")
    else:
        if not pin.inside(str(api_ip)):
            wrong.append(f"apiServer {answer.api_server}")
    if answer.tunnel is not None:
        t = answer.tunnel
        named = {f"tunnel address {t.address}": t.address, f"gatewayAddress {t.gateway_address}": t.gateway_address,
                 **{f"allowedIPs {c}": c for c in t.allowed_ips}}
        wrong += [what for what, cidr in named.items() if not pin.inside(cidr)]
    if wrong:
        raise PinRefused(f"the gateway of cluster {pin.cluster} answered with {', '.join(wrong)}, outside this "
                         f"server's allowedRoutes for it ({', '.join(map(str, pin.allowed_routes))}): refused, "
                         "nothing applied")


def pinned_redeemer(pin: GatewayPin, doc: dict[str, Any], *, header: tuple[str, str] | None = None
                    ) -> Redeemer:
    """Redeem ``doc``'s ticket at the pinned gateway (never the one ``doc`` names: that must be the same, or it is
    refused before anything is sent), verified with the pinned CA, and check the answer against the pin."""
    named = str(doc.get("gateway") or "")
    if not pin.same_gateway(named):
        raise PinRefused(f"the claim names gateway {named!r}; cluster {pin.cluster}'s gateway is {pin.url!r} "
                         "(this server's configuration): refused, nothing sent")
    pinned = {**doc, "gateway": pin.url, "serverName": pin.server_name or (urlsplit(pin.url).hostname or ""),
              "caBundle": None}

    def transport(verify: Any) -> httpx.BaseTransport:
        return _WithHeader(httpx.HTTPTransport(verify=verify), header)

    inner = redeem_over_https(pinned, ca_file=pin.ca_file, transport=transport)

    def redeem(request: JoinRedeem) -> JoinAnswer:
        answer = inner(request)
        check_answer(pin, answer)
        return answer

    return redeem


class _WithHeader(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, header: tuple[str, str] | None) -> None:
        self._inner, self._header = inner, header

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._header is not None:
            request.headers[self._header[0]] = self._header[1]
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


# ----- leaving a cluster -----


def _stop_pid(pid_file: Path, *, expect: str | None = None, timeout: float = 5.0) -> str | None:
    """Stop the process (group) whose pid ``pid_file`` holds, if it is still running (and, with ``expect``, its
    command line names it: a reused pid is left alone). Returns what was stopped."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None  # gone
    if expect is not None and expect not in cmdline:
        return None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:  # started in its own session (node.join, link): its children too
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                return f"{pid_file.stem} (pid {pid})"
            time.sleep(0.05)
    return f"{pid_file.stem} (pid {pid}, still running)"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _mounts_under(directory: Path, mounts: Path = Path("/proc/self/mounts")) -> list[Path]:
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return []
    root = directory.resolve()
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) > 1:
            point = Path(fields[1].encode().decode("unicode_escape"))
            if point != root and root in point.parents:
                found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)  # deepest first


def _empty(directory: Path, call: Callable[[list[str]], object]) -> list[str]:
    """Unmount what the kubelet mounted under ``directory`` (the pods' volumes), then delete its contents without
    ever crossing into another filesystem (a mount that would not go away, a hostPath bind): those are kept."""
    if not directory.is_dir():
        return []
    for point in _mounts_under(directory):
        call(["umount", "--lazy", str(point)])
    device = directory.stat().st_dev
    kept: list[str] = []

    def remove(path: Path) -> None:
        st = path.lstat()
        if st.st_dev != device:
            kept.append(str(path))
            return
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                remove(child)
            if not any(k.startswith(str(path) + os.sep) for k in kept):
                path.rmdir()
        else:
            path.unlink()

    for entry in list(directory.iterdir()):
        with contextlib.suppress(OSError):
            remove(entry)
    return kept


def teardown(files: NodeFiles, *, interface: str, kubelet_stop_command: str = "", kubelet_dir: Path | None = None,
             sys_net: Path = Path("/sys/class/net"), run: Callable[[list[str]], object] | None = None
             ) -> list[str]:
    """Undo a join on this server: the kubelet stopped (its stand-in by pid, or ``kubelet_stop_command``),
    wireguard-go stopped and the tunnel interface deleted (its routes with it), the kubelet's directory emptied.
    Returns what it did. Safe to run twice, and when nothing was up."""
    def runner(argv: list[str]) -> object:
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    call = run or runner
    done: list[str] = []
    if kubelet_stop_command:
        call(shlex.split(kubelet_stop_command))
        done.append(f"`{kubelet_stop_command}`")
    for what, expect in (("kubelet", None), ("wireguard-go", "wireguard-go")):
        stopped = _stop_pid(files.state_dir / f"{what}.pid", expect=expect)
        if stopped:
            done.append(stopped)
    if interface and (sys_net / interface).exists():
        call(["ip", "link", "del", "dev", interface])
        done.append(f"interface {interface} deleted (its routes with it)")
    if kubelet_dir is not None and kubelet_dir.is_dir():
        kept = _empty(kubelet_dir, call)
        done.append(f"{kubelet_dir} emptied" + (f" (kept, on other filesystems: {', '.join(kept)})" if kept else ""))
    return done
