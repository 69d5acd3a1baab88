"""The optimizer's client of the burst gateway: what its activities may ask of it (``GatewayClient``), and the
HTTPS client of the gateway process.

``HttpGatewayClient`` implements ``GatewayClient`` for the worker in a real cluster, where the gateway is its own
Deployment (``kubeon-gpu gateway``, see ``gateway.app``). It authenticates with the optimizer's
ServiceAccount token, read from its file on every call because projected tokens rotate. A burst node's side of
the join is ``node.join``.

Errors: a 409 on removal (the Node belongs to another operation) raises ``TicketError`` with the gateway's
reason, as ``gateway.service.KubeGateway`` does (tests hand the worker one in their process); a 503
``addresses_exhausted`` on a ticket raises ``AddressesExhausted`` (no free address slot: not worth retrying
soon), as ``KubeGateway`` does; other 5xx
answers, timeouts and connection failures raise ``GatewayUnavailable`` (retryable); any other refusal raises
``GatewayRefused``. Tickets and tokens never appear in a message.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import Final
from typing import Protocol
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from activities.telemetry.tracing import http_call
from models.errors import ADDRESSES_EXHAUSTED
from models.errors import AddressesExhausted
from models.errors import TicketError
from models.join import GatewayCapacity
from models.join import JoinTicketRequest
from models.join import NodeIdentity
from models.join import NodeProbe
from models.join import NodeTransfer
from models.join import TicketGrant
from models.join import gateway_route

IN_CLUSTER_TOKEN_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
DEFAULT_TIMEOUT_SECONDS: Final = 15.0


# A wire model of the gateway's answers.
M = TypeVar("M", bound=BaseModel)

class GatewayClient(Protocol):
    """What the optimizer's activities may ask of the gateway."""

    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant:
        """A ticket with its address slot reserved; ``AddressesExhausted`` when no slot is free."""
        ...

    def capacity(self) -> GatewayCapacity: ...

    def remove_node(self, node_name: str, *, operation: str) -> bool: ...

    def transfer(self, node_name: str, *, operation: str) -> NodeTransfer:
        """Bytes the node moved through its tunnel so far (``rx``: node -> home, its cloud's egress); read it
        before ``remove_node``: the counters go with the node's slot. ``TicketError`` for another operation's
        node, ``GatewayRefused`` (404) for one the gateway holds no slot for."""
        ...

    def identity(self, node_name: str, *, operation: str) -> NodeIdentity:
        """The signed instance identity the node joined with, as the gateway verified it (method ``none``: nothing
        attested). ``TicketError`` for another operation's node, ``GatewayRefused`` (404) for one not joined."""
        ...

    def probe(self, node_name: str, *, operation: str) -> NodeProbe:
        """Whether the node's tunnel carries a full-MTU packet (the burn-in's ``Tunnel`` check); ``tunnel`` false
        for a node without one. ``TicketError`` for another operation's node, ``GatewayRefused`` (404) for one
        the gateway holds no slot for."""
        ...


class GatewayError(Exception):
    """The gateway could not be asked, or it refused; the message names the gateway URL."""


class GatewayUnavailable(GatewayError):
    """Connection failure, timeout or 5xx: worth retrying (a plain exception, so Temporal retries it)."""


class GatewayRefused(GatewayError):
    """A 4xx answer other than a ticket refusal: the request or the caller's credentials are wrong."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def error_message(response: httpx.Response) -> str:
    """The error message of a gateway or hub answer (both ``{"error": ..., "message": ...}``), or the start of
    the body."""
    try:
        doc = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return str(doc["message"])
    return str(doc)[:300]


def _error_code(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return ""
    return str(doc.get("error", "")) if isinstance(doc, dict) else ""


def _verify(ca_file: Path | str | None, ca_bundle: str | None = None) -> ssl.SSLContext | bool:
    """The system's trust store, or only the CA that signed the gateway's certificate: a file, or PEM text (a
    burst node's user data). Host names are checked against the certificate either way."""
    if not ca_file and not (ca_bundle and ca_bundle.strip()):
        return True
    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None,
                                      cadata=ca_bundle if ca_bundle and ca_bundle.strip() else None)


# Builds the client's transport from the TLS verification it settled on (default: ``httpx.HTTPTransport``).
TransportFactory = Callable[[ssl.SSLContext | bool], httpx.BaseTransport]


def _send(client: httpx.Client, what: str, url: str, request: httpx.Request) -> httpx.Response:
    with http_call("gateway", request.method, gateway_route(request.url.path)) as call:
        response = _send_untraced(client, what, url, request)
        call.response(response.status_code)
        return response


def _send_untraced(client: httpx.Client, what: str, url: str, request: httpx.Request) -> httpx.Response:
    try:
        response = client.send(request)
    except httpx.TimeoutException as exc:
        raise GatewayUnavailable(f"burst gateway {url}: {what} timed out ({type(exc).__name__})") from None
    except httpx.TransportError as exc:
        raise GatewayUnavailable(f"burst gateway {url}: {what} failed: cannot connect: {exc}") from None
    if response.status_code == 503 and _error_code(response) == ADDRESSES_EXHAUSTED:
        raise AddressesExhausted(error_message(response))
    if response.status_code >= 500:
        raise GatewayUnavailable(f"burst gateway {url}: {what} failed with HTTP {response.status_code}: "
                                 f"{error_message(response)}")
    return response


def _json(response: httpx.Response, url: str, what: str, key: str) -> Any:
    try:
        doc = response.json()
        return doc[key]
    except (ValueError, KeyError, TypeError):
        raise GatewayUnavailable(f"burst gateway {url}: {what}: answer without {key!r} "
                                 f"(HTTP {response.status_code})") from None


class HttpGatewayClient:
    """``GatewayClient`` over HTTPS with the optimizer's ServiceAccount token (verified by TokenReview)."""

    def __init__(self, base_url: str, token_file: Path | str = IN_CLUSTER_TOKEN_FILE,
                 ca_file: Path | str | None = None, timeout: float = DEFAULT_TIMEOUT_SECONDS, *,
                 transport: TransportFactory | None = None) -> None:
        if not base_url.startswith(("https://", "http://")):
            raise ValueError(f"gateway URL {base_url!r} must start with https:// (http:// only on loopback)")
        self.base_url = base_url.rstrip("/")
        self._token_file = Path(token_file)
        verify = _verify(ca_file)
        self._client = httpx.Client(base_url=self.base_url, verify=verify, timeout=timeout,
                                    transport=transport(verify) if transport is not None else None,
                                    follow_redirects=False, headers={"User-Agent": "kubeon-gpu-optimizer"})

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpGatewayClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _token(self) -> str:
        # Re-read every call: the kubelet rotates projected ServiceAccount tokens in place.
        try:
            token = self._token_file.read_text().strip()
        except OSError as exc:
            raise GatewayError(f"burst gateway {self.base_url}: cannot read the ServiceAccount token "
                               f"{self._token_file}: {exc.strerror or exc}") from None
        if not token:
            raise GatewayError(f"burst gateway {self.base_url}: the ServiceAccount token file "
                               f"{self._token_file} is empty")
        return token

    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        request = self._client.build_request(method, path, headers={"Authorization": f"Bearer {self._token()}"},
                                             **kwargs)
        return _send(self._client, what, self.base_url, request)

    def _refused(self, response: httpx.Response, what: str) -> GatewayRefused:
        return GatewayRefused(f"burst gateway {self.base_url} refused {what} (HTTP {response.status_code}): "
                              f"{error_message(response)}", status=response.status_code)

    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant:
        """The ticket, and where the node joins: the gateway's endpoint and TLS server name (empty from a gateway
        that names none: the worker's configured URL stands)."""
        what = f"a join ticket for {request.node_name} ({request.operation})"
        response = self._request("POST", "/v1/tickets", what, json=request.model_dump(mode="json"))
        if response.status_code != 200:
            raise self._refused(response, what)
        ticket = str(_json(response, self.base_url, what, "ticket"))
        doc = response.json()
        endpoint, server_name = doc.get("endpoint") or "", doc.get("serverName") or ""
        if not isinstance(endpoint, str) or not isinstance(server_name, str) or (
                endpoint and not endpoint.startswith(("https://", "http://"))):
            raise GatewayUnavailable(f"burst gateway {self.base_url}: {what}: the answer's endpoint "
                                     f"{str(endpoint)[:100]!r} is not an https URL")
        attestation = doc.get("attestation") or {}
        if not isinstance(attestation, dict) or not all(isinstance(v, str) for v in attestation.values()):
            raise GatewayUnavailable(f"burst gateway {self.base_url}: {what}: the answer's attestation "
                                     f"{str(attestation)[:100]!r} is not an object of strings")
        return TicketGrant(ticket=ticket, endpoint=endpoint, server_name=server_name, attestation=attestation)

    def capacity(self) -> GatewayCapacity:
        what = "its address slots"
        response = self._request("GET", "/v1/capacity", what)
        if response.status_code != 200:
            raise self._refused(response, what)
        try:
            return GatewayCapacity.model_validate(response.json())
        except ValueError:
            raise GatewayUnavailable(f"burst gateway {self.base_url}: {what}: the answer is not "
                                     "{total, nodes}") from None

    def _node_call(self, method: str, node_name: str, operation: str, tail: str, what: str) -> httpx.Response:
        """A call about one node of ``operation``: 409 (another operation's node) is ``TicketError``, any other
        answer but 200 ``GatewayRefused``."""
        path = f"/v1/nodes/{quote(node_name, safe='')}" + (f"/{tail}" if tail else "")
        response = self._request(method, path, what, params={"operation": operation})
        if response.status_code == 409:
            raise TicketError(error_message(response))
        if response.status_code != 200:
            raise self._refused(response, what)
        return response

    def _answer(self, model: type[M], response: httpx.Response, what: str, shape: str) -> M:
        try:
            return model.model_validate(response.json())
        except ValueError:
            raise GatewayUnavailable(f"burst gateway {self.base_url}: {what}: the answer is not {shape}") from None

    def remove_node(self, node_name: str, *, operation: str) -> bool:
        what = f"removing node {node_name} ({operation})"
        response = self._node_call("DELETE", node_name, operation, "", what)
        return bool(_json(response, self.base_url, what, "removed"))

    def probe(self, node_name: str, *, operation: str) -> NodeProbe:
        what = f"the tunnel probe of node {node_name} ({operation})"
        return self._answer(NodeProbe, self._node_call("POST", node_name, operation, "probe", what), what,
                            "{tunnel, mtu, answered, rttMs, detail}")

    def identity(self, node_name: str, *, operation: str) -> NodeIdentity:
        what = f"the attested identity of node {node_name} ({operation})"
        return self._answer(NodeIdentity, self._node_call("GET", node_name, operation, "identity", what), what,
                            "{method, verified, region, zone, instanceId, instanceName, account}")

    def transfer(self, node_name: str, *, operation: str) -> NodeTransfer:
        what = f"the transfer of node {node_name} ({operation})"
        return self._answer(NodeTransfer, self._node_call("GET", node_name, operation, "transfer", what), what,
                            "{rxBytes, txBytes, measuredAt}")
