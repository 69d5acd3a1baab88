"""Storage of on-prem burst pools: pools (with their rate card), their join tokens and their servers.

Same metadata as ``hub.db`` (``create_schema`` creates these tables too). A server's ``state`` is what the hub
knows of it: ``idle``, ``claimed`` (by a cluster's operation, the agent has not picked the claim up yet),
``joining``, ``serving``, ``releasing``. ``offline`` is not stored: a server whose last heartbeat is older than
its pool's ``offline_after_seconds`` is shown offline and never claimed while it is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from typing import Final

from sqlalchemy import Float
from sqlalchemy import ForeignKey
from sqlalchemy import Integer
from sqlalchemy import String
from sqlalchemy import Text
from sqlalchemy import UniqueConstraint
from sqlalchemy.orm import Mapped
from sqlalchemy.orm import mapped_column
from sqlalchemy.orm import relationship

from hub.db import ACTOR_LENGTH
from hub.db import NAME_LENGTH
from hub.db import OPERATION_LENGTH
from hub.db import POLICY_NAME_LENGTH
from hub.db import Base
from hub.db import StoredSecret

PRODUCT_LENGTH: Final = 63


class Pool(Base):
    __tablename__ = "pools"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)  # the location is onprem/<name>
    description: Mapped[str] = mapped_column(String(200), default="")
    # USD per GPU-hour per GPU product, e.g. {"NVIDIA-L4": 0.35}
    rate_card: Mapped[dict[str, Any]]
    transfer_usd_per_gpu_hour: Mapped[float] = mapped_column(Float, default=0.0)
    offline_after_seconds: Mapped[int] = mapped_column(Integer, default=60)
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    tokens: Mapped[list[PoolJoinToken]] = relationship(back_populates="pool", order_by="PoolJoinToken.id")
    servers: Mapped[list[PoolServer]] = relationship(back_populates="pool", order_by="PoolServer.name")


class PoolJoinToken(StoredSecret, Base):
    """The pool's enrolment token: an operator-registered server of the pool that has no credential yet
    exchanges it, once, for its own server credential. Never handed to clusters. Stored as a SHA-256 hash."""

    __tablename__ = "pool_join_tokens"
    token_id: Mapped[str] = mapped_column(String(16), unique=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id"), index=True)
    pool: Mapped[Pool] = relationship(back_populates="tokens")


class PoolServer(Base):
    __tablename__ = "pool_servers"
    # One server per operation of a cluster: a retried claim finds the server it already holds.
    __table_args__ = (UniqueConstraint("claim_cluster_id", "claim_operation"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)  # unique across pools
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id"), index=True)
    gpu_product: Mapped[str] = mapped_column(String(PRODUCT_LENGTH))
    gpus: Mapped[int] = mapped_column(Integer)
    labels: Mapped[dict[str, Any]]
    usd_per_gpu_hour: Mapped[float | None] = mapped_column(Float)  # overrides the rate card
    state: Mapped[str] = mapped_column(String(16), default="idle")
    registered_at: Mapped[datetime]
    registered_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    last_heartbeat_at: Mapped[datetime | None]
    retired_at: Mapped[datetime | None]
    retired_by: Mapped[str | None] = mapped_column(String(ACTOR_LENGTH))
    claim_cluster_id: Mapped[int | None] = mapped_column(ForeignKey("clusters.id"))
    claim_operation: Mapped[str | None] = mapped_column(String(OPERATION_LENGTH))
    claim_policy: Mapped[str | None] = mapped_column(String(POLICY_NAME_LENGTH))
    claim_node_name: Mapped[str | None] = mapped_column(String(253))
    claim_user_data: Mapped[str | None] = mapped_column(Text)  # the gateway ticket, handed to the agent once
    claimed_at: Mapped[datetime | None]
    release_requested_at: Mapped[datetime | None]
    pool: Mapped[Pool] = relationship(back_populates="servers")


class PoolServerCredential(StoredSecret, Base):
    """A server's own credential (``kgs_<id>_<secret>``): its agent heartbeats with it, and the hub takes the
    server's name from it, never from the request. At most one active per server; revoked by an operator (the
    server is then never claimed, and gets no claim signed, until it enrols again). Stored as a SHA-256 hash."""

    __tablename__ = "pool_server_credentials"
    token_id: Mapped[str] = mapped_column(String(16), unique=True)
    server_id: Mapped[int] = mapped_column(ForeignKey("pool_servers.id"), index=True)
    via_join_token: Mapped[str | None] = mapped_column(String(16))  # the enrolment token's id (None: an operator)
    server: Mapped[PoolServer] = relationship()


class HubSigningKey(Base):
    """The hub's Ed25519 key that signs pool claims (``models.pool_claim``); gateways hold the public half."""

    __tablename__ = "hub_signing_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kid: Mapped[str] = mapped_column(String(16), unique=True)
    private_pem: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
