"""Web UI sign-ins, stored in the hub's database (same metadata as ``hub.db``: ``create_schema`` creates it).

A session cookie is only a pointer: the hub keeps its SHA-256 digest here, so a cookie from another hub (another
database) or one signed out or expired matches nothing. The API key it was opened with is checked again on every
request: revoking the key ends its sessions, and a changed role applies at once.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from sqlalchemy import ForeignKey
from sqlalchemy import Integer
from sqlalchemy import String
from sqlalchemy.orm import Mapped
from sqlalchemy.orm import mapped_column

from hub.db import NAME_LENGTH
from hub.db import Base

ACTOR_KIND_LENGTH: Final = 16


class WebSession(Base):
    __tablename__ = "web_sessions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    session_id: Mapped[str] = mapped_column(String(16), unique=True)  # public part of the cookie, for lookup
    digest: Mapped[str] = mapped_column(String(64))  # SHA-256 of the whole cookie value
    csrf_token: Mapped[str] = mapped_column(String(64))  # every form of this session carries it
    actor_kind: Mapped[str] = mapped_column(String(ACTOR_KIND_LENGTH))  # "user" or "bootstrap"
    actor_name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    # The bootstrap admin key's digest at sign-in: a hub restarted with another key ends the session.
    credential_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
