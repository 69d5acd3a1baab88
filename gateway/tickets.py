"""Join tickets: what the gateway signs for one node of one operation (HMAC-SHA256 with the gateway's key, which
nothing else holds), and their check at redemption (signature, shape, expiry)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable

from pydantic import Field

from models.errors import JoinRefused
from models.errors import TicketError
from models.join import JoinTicketRequest
from models.join import TicketSubject
from models.join import burst_node_name_problem


class JoinTicket(TicketSubject):
    expires_at: float
    gpus: int = 0
    # Issued with an address slot reservation: redeemed on that reservation only, never on a fresh slot (once it is
    # released, the ticket is dead).
    reserved: bool = False
    nonce: str = Field(default_factory=lambda: secrets.token_hex(8))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TicketSigner:
    """Signs and verifies tickets with the gateway's key; ``clock`` sets their expiry (``ttl_seconds`` from now)."""

    def __init__(self, key: bytes, clock: Callable[[], float]) -> None:
        if len(key) < 16:
            raise ValueError("gateway ticket signing key must be at least 16 bytes")
        self._key = key
        self._clock = clock

    def new(self, request: JoinTicketRequest, *, reserved: bool = False) -> JoinTicket:
        problem = burst_node_name_problem(request.node_name, request.operation)
        if problem:
            raise JoinRefused("node_name_refused", problem, status=400)
        return JoinTicket(
            operation=request.operation, policy=request.policy, location=request.location,
            node_name=request.node_name, labels=request.labels, taints=request.taints,
            expires_at=self._clock() + request.ttl_seconds, gpus=request.gpus, reserved=reserved,
        )

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def encode(self, ticket: JoinTicket) -> str:
        body = _b64(ticket.model_dump_json().encode())
        return f"{body}.{self._mac(body)}"

    def verify(self, token: str) -> JoinTicket:
        body, _, sig = token.partition(".")
        if not sig or not hmac.compare_digest(sig, self._mac(body)):
            raise TicketError("join ticket signature is invalid", code="ticket_invalid")
        try:
            ticket = JoinTicket.model_validate_json(_unb64(body))
        except ValueError as exc:
            raise TicketError(f"join ticket is malformed: {exc}", code="ticket_invalid") from None
        if ticket.expires_at < self._clock():
            raise TicketError(f"join ticket for {ticket.node_name} expired", code="ticket_expired")
        problem = burst_node_name_problem(ticket.node_name, ticket.operation)
        if problem:  # signed before names were checked at issue
            raise TicketError(problem, code="ticket_invalid")
        return ticket
