"""The burn-in's tunnel probe (issue 27): does the tunnel to a node carry a full-MTU packet? An ICMP echo of
exactly the tunnel's MTU, Don't Fragment set, from the gateway to the node's tunnel address: its kernel answers
without any program of ours. A path that drops large packets (a PMTU black hole under the tunnel, a middlebox
dropping big UDP) passes the join's small packets and breaks bulk transfers later; this finds it before any
workload lands.

A datagram ICMP socket (``net.ipv4.ping_group_range``) when the gateway may open one, else a raw one (root or
CAP_NET_RAW, which the gateway holds for WireGuard anyway)."""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import dataclass

# Linux <linux/in.h>: IP_MTU_DISCOVER, IP_PMTUDISC_DO (set DF, never fragment locally).
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IP_HEADER, ICMP_HEADER = 20, 8
ECHO_REQUEST, ECHO_REPLY = 8, 0


@dataclass(frozen=True)
class ProbeResult:
    answered: bool
    rtt_ms: float | None
    detail: str


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _echo(ident: int, seq: int, payload: bytes) -> bytes:
    header = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, _checksum(header + payload), ident, seq) + payload


def _socket() -> tuple[socket.socket, bool]:
    """(socket, raw): replies on a raw socket carry their IP header, and every ICMP packet arrives on it."""
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP), False
    except PermissionError:
        return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), True


def probe_mtu(address: str, mtu: int, *, attempts: int = 3, timeout: float = 1.0) -> ProbeResult:
    """Up to ``attempts`` echoes of ``mtu`` bytes (IP header included) with DF to ``address``, ``timeout`` each;
    answered at the first reply of the full size. Refused locally (the route's MTU is below ``mtu``) is not
    answered either, and says so."""
    payload = os.urandom(mtu - IP_HEADER - ICMP_HEADER)
    sock, raw = _socket()
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        ident = os.getpid() & 0xFFFF
        for seq in range(1, attempts + 1):
            sent = time.monotonic()
            try:
                sock.sendto(_echo(ident, seq, payload), (address, 0))
            except OSError as exc:  # EMSGSIZE: the gateway's own route to the node is narrower than the MTU
                return ProbeResult(False, None, f"a {mtu}-byte packet to {address} with DF could not be sent: "
                                                f"{exc.strerror or exc}")
            deadline = sent + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([sock], [], [], left)[0]:
                    break
                data, (source, _) = sock.recvfrom(mtu + 64)
                reply = data[(data[0] & 0x0F) * 4:] if raw else data
                if source != address or len(reply) < ICMP_HEADER:
                    continue
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", reply[:ICMP_HEADER])
                # A datagram socket's kernel rewrites the identifier to its own port: only the sequence is ours.
                if kind == ECHO_REPLY and rseq == seq and (rid == ident or not raw):
                    if reply[ICMP_HEADER:] != payload:
                        return ProbeResult(False, None, f"the {mtu}-byte echo from {address} came back altered")
                    return ProbeResult(True, round((time.monotonic() - sent) * 1000, 2),
                                       f"a {mtu}-byte packet with DF reached {address} and came back")
        return ProbeResult(False, None, f"no answer from {address} to {attempts} {mtu}-byte packets with DF "
                                        f"({timeout:.0f}s each): the path drops full-MTU packets")
    finally:
        sock.close()
