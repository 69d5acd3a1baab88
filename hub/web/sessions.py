"""Sign-in with an API key, the session cookie, and CSRF protection.

The cookie (``kubeon_hub_session``) is ``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the hub is reached over
HTTPS, scoped to ``/ui`` and expires with the session. Every form carries the session's CSRF token (the sign-in
form, before there is a session, a double-submit token in a cookie of its own); a POST without a matching one is
refused, and so is one whose ``Origin`` names another site.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from datetime import timedelta
from typing import Final

from fastapi import Request
from fastapi import Response
from sqlalchemy import delete
from sqlalchemy import select
from sqlalchemy.orm import Session

from hub.audit import BOOTSTRAP_ACTOR
from hub.audit import Actor
from hub.audit import ActorKind
from hub.audit import Role
from hub.auth import authenticate_credential
from hub.db import ApiKey
from hub.errors import Forbidden
from hub.errors import Unauthorized
from hub.settings import HubSettings
from hub.web.session_db import WebSession

COOKIE: Final = "kubeon_hub_session"
SIGN_IN_CSRF_COOKIE: Final = "kubeon_hub_signin"
COOKIE_PATH: Final = "/ui"
SESSION_TTL: Final = timedelta(hours=8)
_COOKIE_RE_PREFIX: Final = "kgs_"


@dataclass(frozen=True)
class SignedIn:
    """The person behind a request: the same ``Actor`` the API would see for their key."""

    actor: Actor
    csrf_token: str
    expires_at: datetime
    row_id: int

    @property
    def role(self) -> Role:
        assert self.actor.role is not None
        return self.actor.role

    def can(self, role: Role | str) -> bool:
        return self.role.allows(Role(role))


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def sign_in(session: Session, now: datetime, settings: HubSettings, key: str, response: Response,
            request: Request) -> Actor:
    """Check ``key`` as the API does, open a session and set its cookie. Raises ``Unauthorized``/``Forbidden``."""
    actor = authenticate_credential(key, session, now, settings)
    if actor.kind is ActorKind.CLUSTER:
        raise Forbidden("a cluster token cannot sign in: use a person's API key (kgk_...)",
                        code="cluster_token_not_allowed")
    api_key_id: int | None = None
    credential: str | None = None
    if actor.kind is ActorKind.BOOTSTRAP:
        credential = _digest(key)
    else:
        api_key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_id == actor.key_id))
    session.execute(delete(WebSession).where(WebSession.expires_at <= now))  # expired sessions of anyone
    session_id = secrets.token_hex(8)
    value = f"{_COOKIE_RE_PREFIX}{session_id}_{secrets.token_urlsafe(32)}"
    expires = now + SESSION_TTL
    session.add(WebSession(session_id=session_id, digest=_digest(value), csrf_token=secrets.token_urlsafe(32),
                           actor_kind=actor.kind.value, actor_name=actor.name, api_key_id=api_key_id,
                           credential_digest=credential, created_at=now, expires_at=expires))
    session.flush()
    response.set_cookie(COOKIE, value, max_age=int(SESSION_TTL.total_seconds()), path=COOKIE_PATH,
                        httponly=True, secure=_secure(request), samesite="strict")
    response.delete_cookie(SIGN_IN_CSRF_COOKIE, path=COOKIE_PATH, httponly=True, secure=_secure(request),
                           samesite="strict")
    return actor


def current(request: Request, session: Session, now: datetime, settings: HubSettings) -> SignedIn | None:
    """The signed-in person, or None (no cookie, unknown, from another hub, expired, key revoked)."""
    value = request.cookies.get(COOKIE)
    if not value or not value.startswith(_COOKIE_RE_PREFIX) or len(value) > 100:
        return None
    session_id = value[len(_COOKIE_RE_PREFIX):].partition("_")[0]
    row = session.scalar(select(WebSession).where(WebSession.session_id == session_id))
    if row is None or not hmac.compare_digest(row.digest, _digest(value)) or row.expires_at <= now:
        return None
    actor = _actor(session, row, settings, now)
    if actor is None:
        return None
    return SignedIn(actor=actor, csrf_token=row.csrf_token, expires_at=row.expires_at, row_id=row.id)


def _actor(session: Session, row: WebSession, settings: HubSettings, now: datetime) -> Actor | None:
    if row.actor_kind == ActorKind.BOOTSTRAP.value:
        key = settings.bootstrap_admin_key
        if key is None or row.credential_digest is None or not hmac.compare_digest(_digest(key),
                                                                                    row.credential_digest):
            return None
        return BOOTSTRAP_ACTOR
    key_row = session.get(ApiKey, row.api_key_id) if row.api_key_id is not None else None
    if key_row is None or key_row.revoked_at is not None:
        return None
    key_row.last_used_at = now
    return Actor(kind=ActorKind.USER, name=key_row.principal.name, key_id=key_row.key_id,
                 role=Role(key_row.principal.role))


def sign_out(session: Session, signed_in: SignedIn, request: Request, response: Response) -> None:
    session.execute(delete(WebSession).where(WebSession.id == signed_in.row_id))
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, secure=_secure(request), samesite="strict")


def sign_in_csrf(request: Request, response: Response) -> str:
    """The double-submit token of the sign-in form: the cookie's, or a new one set on ``response``."""
    token = request.cookies.get(SIGN_IN_CSRF_COOKIE)
    if not token or len(token) != 43:
        token = secrets.token_urlsafe(32)
        response.set_cookie(SIGN_IN_CSRF_COOKIE, token, max_age=3600, path=COOKIE_PATH, httponly=True,
                            secure=_secure(request), samesite="strict")
    return token


def check_origin(request: Request) -> None:
    """Refuse a POST whose Origin (or, without one, Referer) names another site than the hub's own."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return  # old browsers and curl send neither; the CSRF token still has to match
    own = f"{request.url.scheme}://{request.url.netloc}"
    if origin != own and not origin.startswith(own + "/"):
        raise Forbidden(f"cross-site request refused: Origin {origin[:100]!r} is not {own}", code="csrf_origin")


def check_csrf(request: Request, presented: str | None, expected: str) -> None:
    check_origin(request)
    if not presented or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Forbidden("the form's CSRF token is missing or does not match this session: reload the page and "
                        "try again", code="csrf_failed")


def require_signed_in(signed_in: SignedIn | None) -> SignedIn:
    if signed_in is None:
        raise Unauthorized("sign in first: no session, or it expired or was signed out", code="not_signed_in")
    return signed_in


def require(signed_in: SignedIn, role: Role, what: str) -> None:
    """The API's rule for the same write (hub.auth.require_role): the role must include ``role``."""
    if not signed_in.can(role):
        raise Forbidden(f"{signed_in.actor.label} has role {signed_in.role.value}; {what} needs {role.value}",
                        code="insufficient_role")

