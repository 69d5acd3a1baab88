"""Cluster tokens and API keys: generated with high entropy, shown once, stored only as a SHA-256 hash.

Format: ``<prefix>_<id>_<secret>`` where ``prefix`` is ``kgc`` (cluster token) or ``kgk`` (API key of a person or
automation), ``id`` is 16 hex digits (public: it names the token in listings and the audit log) and ``secret`` is
43 URL-safe characters (256 bits). The hub looks a token up by its id and compares the hash in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class TokenKind(StrEnum):
    CLUSTER = "kgc"
    API_KEY = "kgk"


_TOKEN_RE: Final = re.compile(r"^(kgc|kgk)_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class IssuedToken:
    kind: TokenKind
    token_id: str
    secret: str  # the whole token, shown to the caller once
    digest: str  # what is stored


@dataclass(frozen=True)
class ParsedToken:
    kind: TokenKind
    token_id: str
    token: str


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(kind: TokenKind) -> IssuedToken:
    token_id = secrets.token_hex(8)
    token = f"{kind.value}_{token_id}_{secrets.token_urlsafe(32)}"
    return IssuedToken(kind=kind, token_id=token_id, secret=token, digest=digest(token))


def parse(token: str) -> ParsedToken | None:
    """The kind and id of a well-formed token; None for anything else (e.g. the bootstrap admin key)."""
    match = _TOKEN_RE.match(token)
    if match is None:
        return None
    return ParsedToken(kind=TokenKind(match.group(1)), token_id=match.group(2), token=token)


def matches(token: str, stored_digest: str) -> bool:
    """Constant-time comparison of a presented token with a stored digest."""
    return hmac.compare_digest(digest(token).encode(), stored_digest.encode())


def from_existing(token: str, kind: TokenKind) -> IssuedToken:
    """Adopt a token generated elsewhere (the dev seed re-uses the one in its token file). Raises ValueError."""
    parsed = parse(token)
    if parsed is None or parsed.kind != kind:
        raise ValueError(
            f"not a {'cluster token' if kind is TokenKind.CLUSTER else 'API key'}: expected "
            f"{kind.value}_<16 hex digits>_<43 URL-safe characters>"
        )
    return IssuedToken(kind=kind, token_id=parsed.token_id, secret=token, digest=digest(token))
