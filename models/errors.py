"""Errors with a code that crosses a process boundary: the gateway answers with them over HTTP and its clients raise
them again, so the optimizer branches on the same types in-process and over the wire."""

from __future__ import annotations

from typing import Final


class TicketError(Exception):
    """A join ticket is forged, expired, replayed or bound to another node; the message says which, ``code``
    names it for the HTTP answer."""

    def __init__(self, message: str, *, code: str = "ticket_refused") -> None:
        super().__init__(message)
        self.code = code


class JoinRefused(Exception):
    """A join request is refused; ``code`` and ``status`` for the HTTP answer, the message names the cause."""

    def __init__(self, code: str, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status

ADDRESSES_EXHAUSTED: Final = "addresses_exhausted"


class AddressesExhausted(JoinRefused):
    """Every address slot is held: no ticket (and so no instance) until a node goes or a reservation expires."""

    def __init__(self, message: str) -> None:
        super().__init__(ADDRESSES_EXHAUSTED, message, status=503)


# Error types of the burst and drain activities (``ApplicationError.type``): the workflows branch on them.
INSUFFICIENT_CAPACITY: Final = "InsufficientCapacity"
LOCATION_NOT_ALLOWED: Final = "LocationNotAllowed"
JOIN_TIMEOUT: Final = "JoinTimeout"
VERIFICATION_FAILED: Final = "VerificationFailed"
POLICY_GONE: Final = "PolicyGone"
NOT_OWNED: Final = "NotOwned"
PROVIDER_REJECTED: Final = "ProviderRejected"
HELD: Final = "Held"
# The gateway has no free address slot for the node: no ticket, so nothing launched.
ADDRESSES_EXHAUSTED_TYPE: Final = "AddressesExhausted"
