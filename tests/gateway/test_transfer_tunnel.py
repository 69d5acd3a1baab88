"""Egress measured at the gateway (issue 27 part 1), in the tunnel test bed: a burst node sends 50 MB to a Service
at home through its tunnel, in two halves with a gateway restart between them, and the gateway's measured
``rxBytes`` (node -> home: what leaves the remote cloud) is the bytes sent plus the tunnel's overhead, within 2 %.

The overhead expected, per TCP segment of ``mss`` payload bytes (a full one fills the node's tunnel MTU: 1380):
the inner IP and TCP headers (20 + 20, + 12 with TCP timestamps), then WireGuard's transport header (16 bytes:
type, receiver index, counter) and Poly1305 tag (16 bytes), with the plaintext padded to a multiple of 16 but
never past the MTU (a full segment: no padding). wireguard-go's ``rx_bytes`` counts exactly that (the decrypted
packet plus the 32 bytes: the UDP payload), not the outer IP/UDP headers (28 bytes more on the wire)."""

from __future__ import annotations

import math
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from activities.clients.gateway import GatewayRefused
from activities.clients.gateway import HttpGatewayClient
from models.errors import TicketError
from models.join import NodeIdentity
from models.join import NodeTransfer
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.netbed import Gateway
from tests.harness.netbed import Joined
from tests.harness.netbed import NetBed
from tests.harness.netbed import sh
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA

pytestmark = pytest.mark.cluster

SINK_IP = "10.96.77.88"
SINK_PORT = 9000
HALF = 25 * 1000 * 1000  # bytes per half; 50 MB in all
WIREGUARD_OVERHEAD = 16 + 16  # transport header + Poly1305 tag, per packet

# At home: a TCP sink that reads each connection to its end and answers the count it received.
SINK = f"""
import socket, threading
srv = socket.create_server(({SINK_IP!r}, {SINK_PORT}))
def take(conn):
    with conn:
        got = 0
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
        conn.sendall(str(got).encode())
while True:
    conn, _ = srv.accept()
    threading.Thread(target=take, args=(conn,), daemon=True).start()
"""

# On the burst node: send N bytes to the sink (the connection waits out a tunnel re-handshake), at most RATE bytes
# a second when given (in 64 KiB writes: little is in flight when the gateway goes away), print the segment size
# (MSS) its TCP settled on and the count the sink answered.
SENDER = f"""
import socket, sys, time
n = int(sys.argv[1])
rate = int(sys.argv[2]) if len(sys.argv) > 2 else 0
s = socket.create_connection(({SINK_IP!r}, {SINK_PORT}), timeout=60)
s.settimeout(60)
buf = b"x" * ((1 << 16) if rate else (1 << 20))
left = n
start = time.monotonic()
while left:
    left -= s.send(buf[:min(left, len(buf))])
    if rate:
        time.sleep(max(0.0, start + (n - left) / rate - time.monotonic()))
mss = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
s.shutdown(socket.SHUT_WR)
answer = b""
while chunk := s.recv(64):
    answer += chunk
print(mss, int(answer))
"""


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"KUBEON_GATEWAY_TRANSFER_SECONDS": "1"}


@pytest.fixture(scope="module")
def optimizer(cluster: Cluster, gateway: Gateway, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[HttpGatewayClient]:
    token = tmp_path_factory.mktemp("optimizer") / "token"
    token.write_text(cluster.service_account_token(OPTIMIZER_NAMESPACE, OPTIMIZER_SA))
    with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
        yield http


@pytest.fixture(scope="module")
def sink(bed: NetBed, tmp_path_factory: pytest.TempPathFactory) -> str:
    log = tmp_path_factory.mktemp("sink") / "sink.log"
    sh("ip", "addr", "add", f"{SINK_IP}/32", "dev", "lo", netns=bed.cl)
    bed.spawn([sys.executable, "-c", SINK], netns=bed.cl, log=log)
    wait_for(lambda: f"{SINK_IP}:{SINK_PORT}" in sh("ss", "-ltn", netns=bed.cl), timeout=10, what="the sink")
    return SINK_IP


def start_sending(joined: Joined, size: int, rate: int = 0) -> subprocess.Popen[str]:
    """One connection from the node's namespace sending ``size`` bytes home (at most ``rate`` bytes a second)."""
    return subprocess.Popen(["ip", "netns", "exec", joined.node.netns, sys.executable, "-c", SENDER, str(size),
                             str(rate)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sent(sender: subprocess.Popen[str], timeout: float = 120) -> tuple[int, int]:
    """``(mss, bytes the sink received)`` of a connection started by ``start_sending``, bounded in time."""
    try:
        out, err = sender.communicate(timeout=timeout)
    finally:
        if sender.poll() is None:
            sender.kill()
    assert sender.returncode == 0, err
    mss, received = out.split()
    return int(mss), int(received)


def send_home(joined: Joined, size: int) -> tuple[int, int]:
    return sent(start_sending(joined, size), timeout=60)


def expected_rx(payload: int, mss: int, mtu: int, timestamps: bool) -> int:
    """What WireGuard counts for ``payload`` bytes sent in segments of ``mss``: each inner packet (headers and
    payload) padded to 16 (capped at the MTU), plus 32 bytes."""
    headers = 40 + (12 if timestamps else 0)
    full, rest = divmod(payload, mss)
    def counted(inner: int) -> int:
        return min(math.ceil(inner / 16) * 16, mtu) + WIREGUARD_OVERHEAD
    return full * counted(mss + headers) + (counted(rest + headers) if rest else 0)


def test_egress_is_measured_at_the_gateway_and_survives_its_restart(
        gateway: Gateway, joined: Joined, optimizer: HttpGatewayClient, sink: str) -> None:
    started = time.monotonic()
    mtu = int(sh("cat", f"/sys/class/net/{joined.node.interface}/mtu", netns=joined.node.netns))
    timestamps = sh("sysctl", "-n", "net.ipv4.tcp_timestamps", netns=joined.node.netns).strip() != "0"
    before = optimizer.transfer(joined.name, operation=joined.operation)

    mss, got = send_home(joined, HALF)
    assert got == HALF
    first = optimizer.transfer(joined.name, operation=joined.operation)
    assert first.measured_at >= before.measured_at

    # The second half in one connection, and the gateway restarted while it is under way (its wireguard-go, and so
    # every counter, goes with it): the bytes counted before stay, the connection waits out the node's
    # re-handshake with the new interface and ends, and what it sent after is counted on top.
    # Paced so that it outlasts the old process's shutdown (it drains its HTTP connections for up to 5 s, the
    # tunnel forwarding meanwhile) and the new one's start: the rest goes through the restarted gateway.
    sender = start_sending(joined, HALF, rate=1_250_000)
    try:
        def a_fifth_counted() -> NodeTransfer | None:
            t = optimizer.transfer(joined.name, operation=joined.operation)
            return t if t.rx_bytes - first.rx_bytes >= HALF // 5 else None
        under_way = wait_for(a_fifth_counted, timeout=30, what="a fifth of the second half")
        assert sender.poll() is None, "the second half ended before the restart"
        assert gateway.stop() in (0, -signal.SIGTERM), gateway.log
        gateway.start()
        restarted = optimizer.transfer(joined.name, operation=joined.operation)
        assert restarted.rx_bytes >= under_way.rx_bytes and restarted.tx_bytes >= under_way.tx_bytes
        assert "cannot write the tunnel transfer counters" not in gateway.log
    finally:
        mss2, got = sent(sender)
    assert got == HALF and mss2 == mss

    def settled() -> NodeTransfer | None:  # the last ACKed segments are counted by the time the sink answered
        t = optimizer.transfer(joined.name, operation=joined.operation)
        return t if t.rx_bytes - before.rx_bytes >= 2 * HALF else None
    after = wait_for(settled, timeout=10, what="the second half counted")
    rx, tx = after.rx_bytes - before.rx_bytes, after.tx_bytes - before.tx_bytes
    want = 2 * expected_rx(HALF, mss, mtu, timestamps)
    print(f"\nmtu {mtu} mss {mss} timestamps {timestamps}: sent {2 * HALF} B, expected rx {want} B "
          f"(overhead {want / (2 * HALF) - 1:.2%}), measured rx {rx} B ({rx / want - 1:+.3%}), tx {tx} B; "
          f"{time.monotonic() - started:.1f}s")
    assert abs(rx - want) <= 0.02 * want, (rx, want)
    # The direction: home -> node carried the ACKs only, a few % of it.
    assert 0 < tx < 0.05 * rx
    assert after.rx_bytes >= restarted.rx_bytes

    # The restarted gateway's metric: what its own process counted (all that moved since it started, and nothing
    # from before), by the node's location and direction; a Prometheus counter, so it starts again at 0 with the
    # process.
    def egress() -> dict[str, float]:
        text = httpx.get(f"{gateway.url}/metrics", verify=ssl.create_default_context(cafile=str(gateway.ca_file)),
                         timeout=5).text
        return {s.labels["direction"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kubeon_burst_transfer_bytes_total" and s.labels.get("location") == "tunnel.test"}
    # At least what moved after the first reading of the new process (the end of the connection and the sink's
    # answer, at the least, went through it; the metric is added to as slot records are written, once a second).
    rx_since = max(1, after.rx_bytes - restarted.rx_bytes)
    tx_since = max(1, after.tx_bytes - restarted.tx_bytes)
    counted = wait_for(lambda: (m := egress()) and m.get("egress", 0) >= rx_since and m.get("ingress", 0) >= tx_since
                       and m, timeout=10, what="what moved since the restart in kubeon_burst_transfer_bytes_total")
    # The restart was mid-transfer: a good part of the second half went through the new process.
    assert counted["egress"] >= HALF // 5, counted
    assert counted["egress"] <= after.rx_bytes - under_way.rx_bytes
    assert counted["ingress"] <= tx


def test_the_joined_nodes_identity_is_read_over_https(joined: Joined, optimizer: HttpGatewayClient) -> None:
    # This bed's node attests nothing (a sim location): the optimizer then binds nothing and says so.
    assert optimizer.identity(joined.name, operation=joined.operation) == NodeIdentity(method="none", verified=False)


@pytest.mark.parametrize(("endpoint", "answer_key"), [("transfer", "rxBytes"), ("identity", "verified")])
def test_another_operations_node_an_unknown_one_or_no_token_is_refused(
        gateway: Gateway, joined: Joined, optimizer: HttpGatewayClient, endpoint: str, answer_key: str) -> None:
    """What the optimizer reads about a node (its transfer; issue 27's identity, which it binds to the launched
    instance), for its own operation's node only, and only with its token."""
    read = getattr(optimizer, endpoint)
    with pytest.raises(TicketError, match="another operation"):
        read(joined.name, operation="op-000000000000")
    with pytest.raises(GatewayRefused) as refused:
        read("burst-op-ffffffffffff", operation="op-ffffffffffff")
    assert refused.value.status == 404
    anonymous = httpx.get(f"{optimizer.base_url}/v1/nodes/{joined.name}/{endpoint}",
                          params={"operation": joined.operation}, timeout=5,
                          verify=ssl.create_default_context(cafile=str(gateway.ca_file)))
    assert anonymous.status_code == 401 and answer_key not in anonymous.text


def test_the_record_keeps_the_totals_in_the_slot(cluster: Cluster, joined: Joined,
                                                  optimizer: HttpGatewayClient) -> None:
    """What survives a restart is in the node's slot ConfigMap: totals and the last raw counters."""
    from gateway.transfer import Transfer
    (cm,) = [c for c in cluster.admin.core.list_namespaced_config_map(
        OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
        if c.data["node"] == joined.name]
    stored = Transfer.loads(cm.data["transfer"])
    live = optimizer.transfer(joined.name, operation=joined.operation)
    assert 0 < stored.rx_bytes <= live.rx_bytes and stored.measured_at > 0



def test_the_final_counters_outlive_the_node(cluster: Cluster, joined: Joined, optimizer: HttpGatewayClient) -> None:
    """Removal reads the peer's last counters before the peer goes; the optimizer still gets them afterwards."""
    live = optimizer.transfer(joined.name, operation=joined.operation)
    assert optimizer.remove_node(joined.name, operation=joined.operation) is True
    gone = optimizer.transfer(joined.name, operation=joined.operation)
    assert gone.rx_bytes >= live.rx_bytes > 0 and gone.tx_bytes >= live.tx_bytes > 0
    assert gone.measured_at >= live.measured_at
    assert optimizer.transfer(joined.name, operation=joined.operation) == gone  # nothing counts any more
    with pytest.raises(TicketError, match="another operation"):
        optimizer.transfer(joined.name, operation="op-000000000000")
