"""The gateway keeps serving under abuse (issue 21, finding 9): the real gateway process on loopback against the
harness API server. Slow connections come from 127.0.0.2 (all of 127.0.0.0/8 is loopback), the real clients
from 127.0.0.1; every loop is bounded in count and time."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from activities.clients.gateway import HttpGatewayClient
from tests.gateway.helpers import ticket_request
from tests.gateway.test_app import GatewayProcess
from tests.gateway.test_app import Setup
from tests.gateway.test_app import join_raw
from tests.gateway.test_app import setup  # noqa: F401 - the module's fixture
from tunnel.proxy import TcpProxy

pytestmark = pytest.mark.cluster

SLOW = 128
RECEIPT_TIMEOUT = 3
PER_SOURCE = 16


@pytest.fixture(scope="module")
def limited(setup: Setup) -> Iterator[GatewayProcess]:  # noqa: F811
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_REQUEST_TIMEOUT": str(RECEIPT_TIMEOUT),
        "KUBEON_GATEWAY_MAX_CONNECTIONS_PER_SOURCE": str(PER_SOURCE),
    }, name="limited").start()
    try:
        yield proc
    finally:
        proc.stop()


def slow_connection(url: str, source: str = "127.0.0.2") -> socket.socket | None:
    """A connection that starts a request and never finishes its headers."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.settimeout(2)
    try:
        sock.bind((source, 0))
        sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        sock.sendall(b"POST /v1/join HTTP/1.1\r\nHost: gateway\r\n")
    except OSError:
        sock.close()
        return None
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        sock.sendall(b"X-Trickle: 1\r\n")
        sock.settimeout(0.2)
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_slow_connections_do_not_starve_a_join(limited: GatewayProcess, setup: Setup, nodes: list[str]) -> None:  # noqa: F811
    with HttpGatewayClient(limited.url, setup.optimizer_token_file) as optimizer:
        req = ticket_request(nodes)
        ticket = optimizer.issue_ticket(req).ticket
    socks = [s for s in (slow_connection(limited.url) for _ in range(SLOW)) if s is not None]
    try:
        started = time.monotonic()
        # Served at once, not a 503 (the slow ones beyond the per-source cap were refused on arrival)...
        response = join_raw(limited, ticket, req.node_name)
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < RECEIPT_TIMEOUT
        # ...and the ones let in are closed once the receipt deadline passes, although they keep trickling.
        deadline = time.monotonic() + RECEIPT_TIMEOUT + 5
        while time.monotonic() < deadline and not all(closed_by_peer(s) for s in socks):
            time.sleep(0.5)
        assert all(closed_by_peer(s) for s in socks), "slow connections still open after the receipt deadline"
    finally:
        for s in socks:
            s.close()


def test_a_trickled_request_is_cut_at_the_deadline(limited: GatewayProcess) -> None:
    sock = slow_connection(limited.url)
    assert sock is not None
    try:
        started = time.monotonic()
        while time.monotonic() - started < RECEIPT_TIMEOUT + 5 and not closed_by_peer(sock):
            time.sleep(0.3)  # one header line every 0.5 s: uvicorn's keep-alive timer never fires on its own
        assert time.monotonic() - started < RECEIPT_TIMEOUT + 5, "the trickled request was never cut"
    finally:
        sock.close()


def test_bogus_tokens_are_throttled_per_source_without_a_token_review(
        limited: GatewayProcess, setup: Setup, nodes: list[str]) -> None:  # noqa: F811
    bogus = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=10)
    with bogus:
        codes = [bogus.get(f"{limited.url}/v1/capacity",
                           headers={"Authorization": f"Bearer bogus-{uuid.uuid4().hex}"}).status_code
                 for _ in range(15)]
    assert codes[:10] == [401] * 10 and set(codes[10:]) == {429}, codes
    # The optimizer, from another address, is served.
    with HttpGatewayClient(limited.url, setup.optimizer_token_file) as optimizer:
        assert optimizer.capacity().total > 0


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


def proxied(proxy: TcpProxy, source: str) -> tuple[socket.socket, bool]:
    sock = socket.socket()
    sock.settimeout(3)
    sock.bind((source, 0))
    try:
        sock.connect(proxy.address)  # a refused one may be reset before connect() returns, on loopback
        sock.sendall(b"ping")
        return sock, sock.recv(4) == b"ping"
    except OSError:
        return sock, False


def test_the_api_proxy_caps_connections_per_peer_and_in_all(echo: tuple[str, int]) -> None:
    proxy = TcpProxy(("127.0.0.1", 0), echo, max_per_peer=3, max_connections=5).start()
    socks: list[socket.socket] = []
    try:
        for _ in range(3):
            sock, ok = proxied(proxy, "127.0.0.2")
            socks.append(sock)
            assert ok
        sock, ok = proxied(proxy, "127.0.0.2")  # the N+1th from one peer
        socks.append(sock)
        assert not ok
        for _ in range(2):  # another peer is served, up to the total
            sock, ok = proxied(proxy, "127.0.0.3")
            socks.append(sock)
            assert ok
        sock, ok = proxied(proxy, "127.0.0.4")
        socks.append(sock)
        assert not ok
        # A connection that ends frees its place.
        socks.pop(0).close()
        deadline = time.monotonic() + 5
        while True:
            sock, ok = proxied(proxy, "127.0.0.2")
            socks.append(sock)
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ok
    finally:
        for s in socks:
            s.close()
        proxy.stop()
