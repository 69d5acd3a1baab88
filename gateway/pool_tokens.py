"""The gateway's check of an on-prem server's join (R4.5): the claim the hub signed for that very server.

A node of an ``onprem/<pool>`` location presents, besides its one-time ticket, the pool claim the hub signed for
it (``X-Kubeon-Pool-Claim``, ``models.pool_claim``). The gateway verifies it with the hub's public claim keys
(a PEM bundle, mounted read-only from the chart's ``hub.claimPublicKeys``: nothing secret), and requires it to
name the ticket's pool, node and operation, and the ticket itself (its SHA-256). Nodes of other locations are not
asked for one.

The gateway holds no pool secret: the pool's enrolment token stays with the operator and the servers, so nothing
a cluster holds lets anyone enrol a server, heartbeat as one, or pass this check with another server's ticket.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final
from typing import Protocol

from models.pool_claim import POOL_CLAIM_HEADER
from models.pool_claim import PoolClaim
from models.pool_claim import PoolClaimRefused
from models.pool_claim import load_public_keys
from models.pool_claim import ticket_digest
from models.pool_claim import verify

DEFAULT_CLAIM_KEYS_FILE: Final = Path("/var/run/kubeon/hub-claim-keys/keys.pem")

__all__ = ["DEFAULT_CLAIM_KEYS_FILE", "POOL_CLAIM_HEADER", "JoinTokenRefused", "check_pool_claim"]


class JoinTokenRefused(PoolClaimRefused):
    """The pool claim is missing, forged, expired, for another join, or the gateway has no hub keys."""


class _Ticket(Protocol):
    location: str
    node_name: str
    operation: str


def check_pool_claim(ticket: _Ticket, ticket_text: str, presented: str | None, keys_file: Path | None,
                     *, now: float | None = None) -> PoolClaim | None:
    """Raise ``JoinTokenRefused`` unless ``presented`` is a hub-signed claim for exactly this join (onprem only).
    Returns the claim (None for other locations). The keys file is read on every join: a rotation needs no
    restart."""
    location = ticket.location
    if not location.startswith("onprem/"):
        return None
    pool = location.partition("/")[2]
    if keys_file is None:
        raise JoinTokenRefused(f"{location}: the gateway has no hub claim keys (hub.claimPublicKeys): it cannot "
                               "check the pool's servers")
    try:
        keys = load_public_keys(keys_file.read_text())
    except (OSError, ValueError) as exc:
        raise JoinTokenRefused(f"{location}: the hub claim keys {keys_file} cannot be read: {exc}") from None
    if not keys:
        raise JoinTokenRefused(f"{location}: the hub claim keys file {keys_file} holds no key")
    try:
        claim = verify(presented, keys, now=time.time() if now is None else now)
    except PoolClaimRefused as exc:
        raise JoinTokenRefused(f"{location}: {exc}") from None
    named = {"pool": (claim.pool, pool), "node": (claim.node, ticket.node_name),
             "operation": (claim.operation, ticket.operation),
             "ticket": (claim.ticket_sha256, ticket_digest(ticket_text))}
    wrong = [what for what, (got, want) in named.items() if got != want]
    if wrong:
        raise JoinTokenRefused(f"{location}: the pool claim (server {claim.server}) is for another join: its "
                               f"{', '.join(wrong)} differ from the ticket's")
    return claim
