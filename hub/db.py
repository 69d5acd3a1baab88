"""Storage: SQLAlchemy 2.0 models and engine. SQLite by default, PostgreSQL supported.

Times are stored in UTC and always read back timezone-aware. The audit table is append-only down to the database:
triggers refuse UPDATE and DELETE (and TRUNCATE on PostgreSQL), so not even a bug in the hub can rewrite history.
Someone who can drop the triggers can, so the audit table and the action reports are also hash chains, one per
cluster (``hub/chain.py``): an edited, deleted or moved row is detected by ``kubeon-gpu audit verify --hub``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from datetime import datetime
from typing import Any
from typing import Final

from sqlalchemy import DDL
from sqlalchemy import JSON
from sqlalchemy import DateTime
from sqlalchemy import Dialect
from sqlalchemy import Engine
from sqlalchemy import ForeignKey
from sqlalchemy import Index
from sqlalchemy import Integer
from sqlalchemy import String
from sqlalchemy import Text
from sqlalchemy import TypeDecorator
from sqlalchemy import UniqueConstraint
from sqlalchemy import create_engine
from sqlalchemy import event
from sqlalchemy import func
from sqlalchemy import inspect
from sqlalchemy import literal
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.orm import Mapped
from sqlalchemy.orm import Session
from sqlalchemy.orm import mapped_column
from sqlalchemy.orm import relationship
from sqlalchemy.orm import sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.pool import StaticPool
from sqlalchemy.schema import CreateIndex

NAME_LENGTH: Final = 63
OPERATION_LENGTH: Final = 128
POLICY_NAME_LENGTH: Final = 253
# "user:<name>", "cluster:<name>", "server:<name>": who did something, as the audit log names it.
ACTOR_LENGTH: Final = NAME_LENGTH + 16
HASH_LENGTH: Final = 64


class DatabaseError(RuntimeError):
    """The database URL is unusable or the database cannot be reached; the message says which."""


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, aware UTC datetimes out, on SQLite (which has no time zones) and PostgreSQL alike."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the hub stores aware datetimes only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class StoredSecret:
    """The columns every stored credential has (API keys, cluster tokens, pool join tokens, server credentials):
    only its SHA-256 ``digest`` is kept; who made it and when; its last use; who revoked it and when."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # issue order: a newer secret has a larger id
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    revoked_by: Mapped[str | None] = mapped_column(String(ACTOR_LENGTH))


class Principal(Base):
    """A person or a piece of automation; acts with its API keys and is named in the audit log."""

    __tablename__ = "principals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    keys: Mapped[list[ApiKey]] = relationship(back_populates="principal", order_by="ApiKey.id")


class ApiKey(StoredSecret, Base):
    __tablename__ = "api_keys"
    key_id: Mapped[str] = mapped_column(String(16), unique=True)
    principal_id: Mapped[int] = mapped_column(ForeignKey("principals.id"), index=True)
    description: Mapped[str] = mapped_column(String(200), default="")
    principal: Mapped[Principal] = relationship(back_populates="keys")


class Cluster(Base):
    __tablename__ = "clusters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Random per cluster: ETags built from it never match across clusters or a re-created database.
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    description: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    last_seen_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]  # the last revocation (a token issued later reconnects the cluster)
    policy_revision: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[list[ClusterToken]] = relationship(back_populates="cluster", order_by="ClusterToken.id")


class ClusterToken(StoredSecret, Base):
    __tablename__ = "cluster_tokens"
    token_id: Mapped[str] = mapped_column(String(16), unique=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    first_used_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]  # set on the previous token(s) by a rotation
    revoked_reason: Mapped[str | None] = mapped_column(String(16))  # "revoked" | "superseded"
    cluster: Mapped[Cluster] = relationship(back_populates="tokens")


class Policy(Base):
    __tablename__ = "policies"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    name: Mapped[str] = mapped_column(String(POLICY_NAME_LENGTH))
    document: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    revision: Mapped[int] = mapped_column(Integer)  # the cluster's policy-set revision of the last change


class Approval(Base):
    __tablename__ = "approvals"
    __table_args__ = (UniqueConstraint("cluster_id", "operation"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # the pull cursor
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    operation: Mapped[str] = mapped_column(String(OPERATION_LENGTH))
    decision: Mapped[str] = mapped_column(String(8))
    plan_id: Mapped[str | None] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text, default="")
    decided_by: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    decided_at: Mapped[datetime]


class ActionReport(Base):
    __tablename__ = "action_reports"
    __table_args__ = (
        UniqueConstraint("cluster_id", "idempotency_key"),
        Index("ux_action_reports_chain", "cluster_id", "chain_seq", unique=True),  # one row per place: no fork
        Index("ix_action_reports_audit", "cluster_id", "audit_chain", "audit_seq"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    idempotency_key: Mapped[str] = mapped_column(String(200))
    operation: Mapped[str] = mapped_column(String(OPERATION_LENGTH))
    policy: Mapped[str] = mapped_column(String(POLICY_NAME_LENGTH))
    action: Mapped[str] = mapped_column(String(16))
    location: Mapped[str | None] = mapped_column(String(80))
    instance: Mapped[str | None] = mapped_column(String(253))
    node: Mapped[str | None] = mapped_column(String(253))
    detail: Mapped[str] = mapped_column(Text, default="")
    occurred_at: Mapped[datetime]
    received_at: Mapped[datetime]
    # The hub's chain of the cluster's reports (hub/chain.py); None on rows written before it existed.
    chain_seq: Mapped[int | None] = mapped_column(Integer)
    chain_prev: Mapped[str | None] = mapped_column(String(HASH_LENGTH))
    chain_hash: Mapped[str | None] = mapped_column(String(HASH_LENGTH))
    # The worker's audit record this report is: its place in the worker's audit log chain, as reported.
    audit_chain: Mapped[str | None] = mapped_column(String(32))
    audit_seq: Mapped[int | None] = mapped_column(Integer)
    audit_hash: Mapped[str | None] = mapped_column(String(HASH_LENGTH))
    audit_prev: Mapped[str | None] = mapped_column(String(HASH_LENGTH))


class AuditEvent(Base):
    """Append-only: the API has no way to change or delete a row, and database triggers refuse it too."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_cluster", "cluster"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(ACTOR_LENGTH))  # e.g. "user:alice", "cluster:prod-eu"
    actor_key_id: Mapped[str | None] = mapped_column(String(16))  # the API key or cluster token used
    action: Mapped[str] = mapped_column(String(64))
    cluster: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    target: Mapped[str | None] = mapped_column(String(POLICY_NAME_LENGTH))
    detail: Mapped[dict[str, Any]]
    # The cluster's chain (the hub's own for events of no cluster), hub/chain.py; None before it existed.
    chain_seq: Mapped[int | None] = mapped_column(Integer)
    chain_prev: Mapped[str | None] = mapped_column(String(HASH_LENGTH))
    chain_hash: Mapped[str | None] = mapped_column(String(HASH_LENGTH))


# One row per place in a chain (the hub's own chain is the rows of no cluster): a bug cannot fork one.
Index("ux_audit_events_chain", func.coalesce(AuditEvent.cluster, literal("", String)), AuditEvent.chain_seq,
      unique=True)


class AuditChainHead(Base):
    """The last record of each of the hub's chains, updated in the transaction that appends (its row is locked
    first, so appends to one chain are serial on PostgreSQL as on SQLite). ``log``: ``audit`` (audit_events) or
    ``reports`` (action_reports); ``chain``: the cluster's name, "" for the hub's own audit events."""

    __tablename__ = "audit_chain_heads"
    __table_args__ = (UniqueConstraint("log", "chain"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    log: Mapped[str] = mapped_column(String(16))
    chain: Mapped[str] = mapped_column(String(NAME_LENGTH))
    seq: Mapped[int] = mapped_column(Integer)
    hash: Mapped[str] = mapped_column(String(HASH_LENGTH))
    updated_at: Mapped[datetime]


class ReportedAuditHead(Base):
    """The head of a worker's audit log chain as its cluster reported it (one per chain: a worker replica's log,
    a log started afresh), with the first break the hub saw in it."""

    __tablename__ = "audit_reported_heads"
    __table_args__ = (UniqueConstraint("cluster_id", "chain"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    chain: Mapped[str] = mapped_column(String(32))
    seq: Mapped[int] = mapped_column(Integer)
    hash: Mapped[str] = mapped_column(String(HASH_LENGTH))
    first_seq: Mapped[int] = mapped_column(Integer)
    reports: Mapped[int] = mapped_column(Integer)
    first_reported_at: Mapped[datetime]
    reported_at: Mapped[datetime]
    problem: Mapped[str | None] = mapped_column(Text)
    problem_at: Mapped[datetime | None]


# Columns added since a table was first created: ``create_schema`` adds them to an existing database (the hub has
# no migration tool; these are nullable, so rows written before read as "not chained").
ADDED_COLUMNS: Final = {
    "audit_events": ("chain_seq", "chain_prev", "chain_hash"),
    "action_reports": ("chain_seq", "chain_prev", "chain_hash", "audit_chain", "audit_seq", "audit_hash",
                       "audit_prev"),
}


APPEND_ONLY_MESSAGE: Final = "audit_events is append-only"

for _op in ("UPDATE", "DELETE"):
    event.listen(
        AuditEvent.__table__,
        "after_create",
        DDL(
            f"CREATE TRIGGER audit_events_no_{_op.lower()} BEFORE {_op} ON audit_events "
            f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY_MESSAGE}'); END"
        ).execute_if(dialect="sqlite"),
    )
event.listen(
    AuditEvent.__table__,
    "after_create",
    DDL(
        "CREATE OR REPLACE FUNCTION audit_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN RAISE EXCEPTION '{APPEND_ONLY_MESSAGE}'; END $$"
    ).execute_if(dialect="postgresql"),
)
event.listen(
    AuditEvent.__table__,
    "after_create",
    DDL(
        "CREATE TRIGGER audit_events_append_only BEFORE UPDATE OR DELETE ON audit_events "
        "FOR EACH ROW EXECUTE FUNCTION audit_events_append_only()"
    ).execute_if(dialect="postgresql"),
)
event.listen(
    AuditEvent.__table__,
    "after_create",
    DDL(
        "CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events "
        "FOR EACH STATEMENT EXECUTE FUNCTION audit_events_append_only()"
    ).execute_if(dialect="postgresql"),
)


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 (the driver the hub ships with)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str) -> Engine:
    try:
        parsed = make_url(normalize_url(url))
    except ArgumentError as exc:
        raise DatabaseError(f"invalid database URL {url!r}: {exc}") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        memory = parsed.database in (None, "", ":memory:")
        engine = create_engine(
            parsed,
            connect_args={"check_same_thread": False, "timeout": 30},
            poolclass=StaticPool if memory else None,
        )
        _sqlite_transactions(engine, wal=not memory)
        return engine
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise DatabaseError(f"PostgreSQL URL {url!r}: use postgresql:// or postgresql+psycopg:// (psycopg 3)")
        return create_engine(parsed, pool_pre_ping=True)
    raise DatabaseError(f"unsupported database {backend!r} in {url!r}: use sqlite:///PATH or postgresql://...")


def _sqlite_transactions(engine: Engine, *, wal: bool) -> None:
    """Foreign keys on, WAL, and BEGIN IMMEDIATE: a transaction that reads then writes cannot fail halfway on a
    concurrent writer (SQLite would raise "database is locked" instead of waiting)."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's "begin" event emit BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        if wal:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """Engine plus session factory; ``create_schema`` creates missing tables (the hub has no migrations yet)."""

    def __init__(self, url: str) -> None:
        from hub import chain  # the hash chains: every audit event and report gets its place as it is flushed

        self.url = url
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        chain.install(self.sessions)

    def create_schema(self) -> None:
        try:
            Base.metadata.create_all(self.engine)
            self._add_columns()
        except Exception as exc:
            raise DatabaseError(f"cannot create the hub schema in {self.engine.url!r}: {exc}") from exc

    def _add_columns(self) -> None:
        """Bring a database made by an earlier hub up to date: the columns of ``ADDED_COLUMNS`` and the indexes
        over them (``create_all`` makes missing tables only)."""
        with self.engine.begin() as conn:
            for table_name, columns in ADDED_COLUMNS.items():
                table = Base.metadata.tables[table_name]
                present = {c["name"] for c in inspect(conn).get_columns(table_name)}
                for name in columns:
                    if name not in present:
                        column = table.c[name]
                        conn.execute(text(f"ALTER TABLE {table_name} ADD COLUMN {name} "
                                          f"{column.type.compile(dialect=conn.dialect)}"))
                for index in table.indexes:
                    conn.execute(CreateIndex(index, if_not_exists=True))

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
