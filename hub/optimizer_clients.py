"""Which optimizer calls as each cluster: its ``User-Agent`` (``kubeon-gpu-optimizer/<version>``), kept so the
web UI can show the version a cluster runs. Written only when it changes, so a poll costs no extra write."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Final

from sqlalchemy import ForeignKey
from sqlalchemy import Integer
from sqlalchemy import String
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped
from sqlalchemy.orm import Session
from sqlalchemy.orm import mapped_column

from hub.db import Base

USER_AGENT_LENGTH: Final = 200
_VERSION_RE: Final = re.compile(r"^kubeon-gpu-optimizer/([0-9A-Za-z][0-9A-Za-z.+_-]{0,63})(?:\s|$)")
_PRINTABLE_RE: Final = re.compile(r"^[\x20-\x7e]*$")


class OptimizerClient(Base):
    __tablename__ = "optimizer_clients"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), unique=True)
    user_agent: Mapped[str] = mapped_column(String(USER_AGENT_LENGTH))
    version: Mapped[str | None] = mapped_column(String(64))  # None: the client names no version
    since: Mapped[datetime]  # first call with this User-Agent


def version_of(user_agent: str) -> str | None:
    match = _VERSION_RE.match(user_agent)
    return match.group(1) if match else None


def note(session: Session, cluster_id: int, user_agent: str | None, now: datetime) -> None:
    """Record the cluster's User-Agent if it is new (printable ASCII only, cut to its column)."""
    agent = (user_agent or "").strip()[:USER_AGENT_LENGTH]
    if not agent or not _PRINTABLE_RE.match(agent):
        return
    row = session.scalar(select(OptimizerClient).where(OptimizerClient.cluster_id == cluster_id))
    if row is not None:
        if row.user_agent != agent:
            row.user_agent, row.version, row.since = agent, version_of(agent), now
        return
    try:
        with session.begin_nested():  # two first polls at once: the other one's row is as good
            session.add(OptimizerClient(cluster_id=cluster_id, user_agent=agent, version=version_of(agent),
                                        since=now))
    except IntegrityError:
        pass


def for_clusters(session: Session) -> dict[int, OptimizerClient]:
    return {row.cluster_id: row for row in session.scalars(select(OptimizerClient))}
