"""A client of the WireGuard cross-platform userspace API (``wireguard-go``'s UNIX socket
``/var/run/wireguard/<interface>.sock``; wireguard.com/xplatform).

Keys are base64 here and lowercase hex on the wire. A ``set`` is not transactional (an invalid line after
``replace_allowed_ips`` leaves the peer with none), so every value is validated before it is sent and the peer is
re-read after it is set.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from tunnel.keys import check_key
from tunnel.keys import from_hex
from tunnel.keys import to_hex

SOCKET_DIR = Path("/var/run/wireguard")


class UapiError(RuntimeError):
    """The interface could not be read or configured; the message names the interface and the errno."""


@dataclass
class Peer:
    public_key: str
    allowed_ips: list[str] = field(default_factory=list)
    endpoint: str = ""
    persistent_keepalive: int = 0
    last_handshake: float = 0.0
    rx_bytes: int = 0
    tx_bytes: int = 0


@dataclass
class Device:
    listen_port: int = 0
    has_private_key: bool = False
    peers: dict[str, Peer] = field(default_factory=dict)


def normalise_cidrs(cidrs: list[str], what: str) -> list[str]:
    out = []
    for cidr in cidrs:
        try:
            out.append(str(ipaddress.ip_network(cidr, strict=True)))
        except ValueError as exc:
            raise UapiError(f"{what}: allowed IP {cidr!r} is not a network: {exc}") from None
    return out


class Uapi:
    def __init__(self, interface: str, socket_dir: Path = SOCKET_DIR, timeout: float = 5.0) -> None:
        self.interface = interface
        self.path = socket_dir / f"{interface}.sock"
        self._timeout = timeout

    def _call(self, request: str) -> list[tuple[str, str]]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self._timeout)
                sock.connect(str(self.path))
                sock.sendall(request.encode())
                data = b""
                while not data.endswith(b"\n\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise UapiError(f"WireGuard interface {self.interface}: cannot talk to {self.path}: "
                            f"{exc.strerror or exc}") from None
        pairs = []
        for line in data.decode().splitlines():
            if line:
                key, _, value = line.partition("=")
                pairs.append((key, value))
        errno = next((v for k, v in reversed(pairs) if k == "errno"), None)
        if errno != "0":
            raise UapiError(f"WireGuard interface {self.interface}: the request failed with errno={errno}")
        return [(k, v) for k, v in pairs if k != "errno"]

    def get(self) -> Device:
        device = Device()
        peer: Peer | None = None
        for key, value in self._call("get=1\n\n"):
            if key == "public_key":
                peer = Peer(public_key=from_hex(value))
                device.peers[peer.public_key] = peer
            elif peer is None:
                if key == "listen_port":
                    device.listen_port = int(value)
                elif key == "private_key":
                    device.has_private_key = value.strip("0") != ""
            elif key == "allowed_ip":
                peer.allowed_ips.append(value)
            elif key == "endpoint":
                peer.endpoint = value
            elif key == "persistent_keepalive_interval":
                peer.persistent_keepalive = int(value)
            elif key == "last_handshake_time_sec":
                peer.last_handshake += int(value)
            elif key == "last_handshake_time_nsec":
                peer.last_handshake += int(value) / 1e9
            elif key == "rx_bytes":
                peer.rx_bytes = int(value)
            elif key == "tx_bytes":
                peer.tx_bytes = int(value)
        return device

    def configure(self, private_key: str, listen_port: int | None = None) -> None:
        lines = [f"private_key={to_hex(check_key(private_key, 'private key'))}"]
        if listen_port is not None:
            if not 0 < listen_port < 65536:
                raise UapiError(f"WireGuard interface {self.interface}: listen port {listen_port} out of range")
            lines.append(f"listen_port={listen_port}")
        self._call("set=1\n" + "".join(f"{line}\n" for line in lines) + "\n")

    def set_peer(self, public_key: str, allowed_ips: list[str], *, endpoint: str = "",
                 persistent_keepalive: int | None = None) -> Peer:
        """Add or update a peer with exactly ``allowed_ips``; the peer as the device has it afterwards."""
        key = check_key(public_key, "peer public key")
        cidrs = normalise_cidrs(allowed_ips, f"peer {key}")
        lines = [f"public_key={to_hex(key)}"]
        if endpoint:
            lines.append(f"endpoint={endpoint}")
        if persistent_keepalive is not None:
            lines.append(f"persistent_keepalive_interval={int(persistent_keepalive)}")
        lines.append("replace_allowed_ips=true")
        lines += [f"allowed_ip={c}" for c in cidrs]
        self._call("set=1\n" + "".join(f"{line}\n" for line in lines) + "\n")
        peer = self.get().peers.get(key)
        if peer is None or sorted(peer.allowed_ips) != sorted(cidrs):
            raise UapiError(f"WireGuard interface {self.interface}: peer {key} reads back as "
                            f"{peer.allowed_ips if peer else 'absent'}, expected {cidrs}")
        return peer

    def remove_peer(self, public_key: str) -> bool:
        key = check_key(public_key, "peer public key")
        if key not in self.get().peers:
            return False
        self._call(f"set=1\npublic_key={to_hex(key)}\nremove=true\n\n")
        return True
