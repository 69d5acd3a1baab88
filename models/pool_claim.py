"""The claim the hub signs for an on-prem server, which the gateway checks when that server joins.

A cluster claims a server of pool P in the hub; the hub hands the server's agent (and only it: the agent
authenticates with its own server credential) the node's user data and a *pool claim*: an Ed25519 signature by
the hub over ``(pool, server, cluster, operation, node, sha256(ticket), expiry)``. The agent presents it with the
ticket in the ``X-Kubeon-Pool-Claim`` header; the gateway verifies it with the hub's public key (no secret: what
a cluster holds cannot enrol, impersonate or claim anything) and requires it to name exactly the ticket's
location, node and operation, and the ticket itself. So a ticket of an ``onprem/<pool>`` location joins only from
the server the hub handed it to, and only while the hub keeps re-signing (a revoked server gets no new claim).

Format: ``kpc1.<base64url(JSON body)>.<base64url(signature over "kpc1.<base64url(JSON body)>")>``.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import ValidationError

PREFIX: Final = "kpc1"
POOL_CLAIM_HEADER: Final = "X-Kubeon-Pool-Claim"
# How long a signed claim is good for: the agent gets a fresh one with every heartbeat while it joins.
CLAIM_SECONDS: Final = 600
MAX_CLAIM_CHARS: Final = 4096


class PoolClaimRefused(Exception):
    """The pool claim is missing, forged, expired or names something else; the message says which."""


class PoolClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kid: str
    pool: str
    server: str
    cluster: str
    operation: str
    node: str
    ticket_sha256: str
    iat: int
    exp: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def ticket_digest(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def sign(private: Ed25519PrivateKey, claim: PoolClaim) -> str:
    signed = f"{PREFIX}.{_b64(claim.model_dump_json().encode())}"
    return f"{signed}.{_b64(private.sign(signed.encode()))}"


def load_public_keys(pem_text: str) -> dict[str, Ed25519PublicKey]:
    """Every Ed25519 public key in a PEM bundle (several during a rotation), by key id."""
    out: dict[str, Ed25519PublicKey] = {}
    marker = "-----END PUBLIC KEY-----"
    for block in pem_text.split(marker)[:-1]:
        key = serialization.load_pem_public_key((block.strip() + "\n" + marker + "\n").encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the hub's claim keys must be Ed25519 public keys")
        out[key_id(key)] = key
    return out


def verify(token: str | None, keys: dict[str, Ed25519PublicKey], *, now: float) -> PoolClaim:
    """The claim, if ``token`` is signed by one of ``keys`` and not expired; else ``PoolClaimRefused``."""
    if not token:
        raise PoolClaimRefused(f"a server of an on-prem pool must present the claim the hub signed for it "
                               f"({POOL_CLAIM_HEADER})")
    if len(token) > MAX_CLAIM_CHARS:
        raise PoolClaimRefused("the pool claim is too long")
    prefix, _, rest = token.strip().partition(".")
    body, _, sig = rest.partition(".")
    if prefix != PREFIX or not body or not sig:
        raise PoolClaimRefused("the pool claim is malformed")
    try:
        claim = PoolClaim.model_validate_json(_unb64(body))
        signature = _unb64(sig)
    except (ValueError, ValidationError):
        raise PoolClaimRefused("the pool claim is malformed") from None
    key = keys.get(claim.kid)
    if key is None:
        raise PoolClaimRefused(f"the pool claim is signed with key {claim.kid!r}, which is not one of the hub's "
                               f"keys this gateway trusts")
    try:
        key.verify(signature, f"{prefix}.{body}".encode())
    except InvalidSignature:
        raise PoolClaimRefused("the pool claim's signature is invalid") from None
    if claim.exp < now:
        raise PoolClaimRefused(f"the pool claim for server {claim.server} expired")
    return claim
