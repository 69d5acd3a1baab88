"""The hub's hash chains (``models.audit_chain``): ``audit_events`` and ``action_reports``, one chain per cluster
(and one for the hub's own events of no cluster: users, API keys), and the heads of the workers' audit logs as
their clusters report them.

**Appends are serial per chain.** Every new ``AuditEvent`` and ``ActionReport`` gets its ``chain_seq``,
``chain_prev`` and ``chain_hash`` as it is flushed (a ``before_flush`` hook: no code path can store one without),
in the transaction that stores it: the cluster's row is locked (``SELECT ... FOR UPDATE``), then the chain's head row
in ``audit_chain_heads`` (made if missing with an insert that ignores a concurrent one), the row takes the next
place and the head moves, committed together. On PostgreSQL a second appender waits on the lock and then sees the
new head; SQLite's ``BEGIN IMMEDIATE`` serializes writers anyway. Locking the cluster first, always, keeps two
transactions from taking one cluster's heads in opposite orders. A unique index on each table's (chain, seq) turns
any fork a bug could make into a failed transaction, never a stored one.

**Rows from before the chain** (chain fields empty) are sealed by the first chained row of their chain: its
``chain_prev`` is the hash of their canonical forms, in id order.

**The worker's chain, as reported.** A report carries its audit record's place in the worker's audit log
(``audit_chain``, ``audit_seq``, ``audit_hash``, ``audit_prev``). ``observe_report`` checks it against what the hub
already has of that log: the head the cluster reported before (the next record must name it as ``prev``), the
stored reports just before and after it (out of order delivery is normal: several activities report at once), and
any other report claiming the same place (a fork). A mismatch is not refused (the worker would drop the report for
good): it is stored, the first one is kept on the head (``audit_reported_heads.problem``), written to the audit log
as ``audit.chain_broken`` naming the record, and said in the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from typing import cast

from sqlalchemy import Insert
from sqlalchemy import event
from sqlalchemy import inspect
from sqlalchemy import select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import InstanceState
from sqlalchemy.orm import Session
from sqlalchemy.orm import UOWTransaction
from sqlalchemy.orm import sessionmaker

from hub.db import ActionReport
from hub.db import AuditChainHead
from hub.db import AuditEvent
from hub.db import Cluster
from hub.db import ReportedAuditHead
from models.audit_chain import GENESIS
from models.audit_chain import HUB_AUDIT_LOG
from models.audit_chain import HUB_REPORTS_LOG
from models.audit_chain import canonical
from models.audit_chain import hub_event_doc
from models.audit_chain import hub_report_doc
from models.audit_chain import record_hash
from models.audit_chain import seal

HUB_CHAIN = ""  # the chain of audit events of no cluster


def install(sessions: sessionmaker[Session]) -> None:
    event.listen(sessions, "before_flush", _before_flush)


def event_doc(row: AuditEvent, chain: str) -> dict[str, Any]:
    return hub_event_doc(chain=chain, seq=row.chain_seq, prev=row.chain_prev, at=row.at, actor=row.actor,
                         actor_key_id=row.actor_key_id, action=row.action, cluster=row.cluster, target=row.target,
                         detail=row.detail)


def report_doc(row: ActionReport, chain: str) -> dict[str, Any]:
    return hub_report_doc(
        chain=chain, seq=row.chain_seq, prev=row.chain_prev, idempotency_key=row.idempotency_key,
        operation=row.operation, policy=row.policy, action=row.action, location=row.location, instance=row.instance,
        node=row.node, detail=row.detail if row.detail is not None else "", occurred_at=row.occurred_at,
        received_at=row.received_at, audit_chain=row.audit_chain, audit_seq=row.audit_seq,
        audit_hash=row.audit_hash, audit_prev=row.audit_prev)


def _before_flush(session: Session, _: UOWTransaction, __: Any) -> None:
    new = [o for o in session.new if isinstance(o, AuditEvent | ActionReport) and o.chain_hash is None]
    if not new:
        return
    heads: dict[tuple[str, str], AuditChainHead] = {}  # locked in this flush (their changes are not flushed yet)
    # In the order they are inserted, so ids ascend with seq.
    for row in sorted(new, key=lambda o: cast(InstanceState[Any], inspect(o)).insert_order or 0):
        if isinstance(row, AuditEvent):
            _append(session, heads, HUB_AUDIT_LOG, row.cluster or HUB_CHAIN, row, row.at, event_doc,
                    _legacy_events)
        else:
            cluster = session.get(Cluster, row.cluster_id)
            assert cluster is not None
            _append(session, heads, HUB_REPORTS_LOG, cluster.name, row, row.received_at, report_doc,
                    _legacy_reports)


def _append(session: Session, heads: dict[tuple[str, str], AuditChainHead], log: str, chain: str, row: Any,
            at: datetime, doc: Callable[[Any, str], dict[str, Any]],
            legacy: Callable[[Session, str], list[dict[str, Any]]]) -> None:
    head = heads.get((log, chain))
    if head is None:
        head = heads[(log, chain)] = lock_head(session, log, chain, at)
    row.chain_seq = head.seq + 1
    row.chain_prev = head.hash if head.seq else seal(canonical(d) for d in legacy(session, chain))
    row.chain_hash = record_hash(doc(row, chain))
    head.seq, head.hash, head.updated_at = row.chain_seq, row.chain_hash, at


def lock_cluster(session: Session, name: str) -> None:
    """Lock the cluster's row until the transaction ends: the first lock of every append to its chains."""
    if name != HUB_CHAIN:
        session.execute(select(Cluster.id).where(Cluster.name == name).with_for_update())


def lock_head(session: Session, log: str, chain: str, at: datetime) -> AuditChainHead:
    lock_cluster(session, chain)
    query = (select(AuditChainHead).where(AuditChainHead.log == log, AuditChainHead.chain == chain)
             .with_for_update().execution_options(populate_existing=True))
    head = session.scalars(query).first()
    if head is None:
        session.execute(_insert_ignoring_conflict(session, {"log": log, "chain": chain, "seq": 0, "hash": GENESIS,
                                                           "updated_at": at}))
        head = session.scalars(query).one()
    return head


def _insert_ignoring_conflict(session: Session, values: dict[str, Any]) -> Insert:
    """INSERT ... ON CONFLICT DO NOTHING: two first appends to a chain both make its head, one row results."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return insert(AuditChainHead).values(**values).on_conflict_do_nothing(index_elements=["log", "chain"])


def _legacy_events(session: Session, chain: str) -> list[dict[str, Any]]:
    where = AuditEvent.cluster.is_(None) if chain == HUB_CHAIN else AuditEvent.cluster == chain
    rows = session.scalars(select(AuditEvent).where(where, AuditEvent.chain_hash.is_(None)).order_by(AuditEvent.id))
    return [event_doc(r, chain) for r in rows]


def _legacy_reports(session: Session, chain: str) -> list[dict[str, Any]]:
    rows = session.scalars(select(ActionReport).join(Cluster, Cluster.id == ActionReport.cluster_id)
                           .where(Cluster.name == chain, ActionReport.chain_hash.is_(None))
                           .order_by(ActionReport.id))
    return [report_doc(r, chain) for r in rows]


# ----- the worker's chain, as its cluster reports it -----


def _short(value: str | None) -> str:
    return f"{value[:16]}..." if value else "none"


def observe_report(session: Session, now: datetime, cluster: Cluster, key: str, chain: str, seq: int,
                   hash_: str, prev: str) -> str | None:
    """Check a reported audit record's place against what the hub has of its log and move the reported head.
    Returns the problem (naming the record), or None. The caller holds the cluster's lock."""
    head = session.scalar(select(ReportedAuditHead).where(ReportedAuditHead.cluster_id == cluster.id,
                                                          ReportedAuditHead.chain == chain)
                          .with_for_update().execution_options(populate_existing=True))
    what = f"audit record seq {seq} of cluster {cluster.name!r}'s audit log {chain} (report {key!r})"

    def stored(at_seq: int) -> list[ActionReport]:
        return list(session.scalars(select(ActionReport).where(
            ActionReport.cluster_id == cluster.id, ActionReport.audit_chain == chain, ActionReport.audit_seq == at_seq,
            ActionReport.idempotency_key != key).order_by(ActionReport.id)))

    problem = None
    twin = next((r for r in stored(seq) if r.audit_hash != hash_), None)
    before = next((r for r in stored(seq - 1) if r.audit_hash != prev), None)
    after = next((r for r in stored(seq + 1) if r.audit_prev != hash_), None)
    if twin is not None:
        problem = (f"{what} has hash {_short(hash_)} but report {twin.idempotency_key!r} (id {twin.id}) gave that "
                   f"place hash {_short(twin.audit_hash)}: the log forked or was rewritten")
    elif head is not None and seq == head.seq + 1 and prev != head.hash:
        problem = (f"{what} does not follow the head the cluster reported before (seq {head.seq}, hash "
                   f"{_short(head.hash)}): its prev is {_short(prev)}; the log was rewritten or forked")
    elif before is not None:
        problem = (f"{what} does not follow record seq {seq - 1} (report {before.idempotency_key!r}, hash "
                   f"{_short(before.audit_hash)}): its prev is {_short(prev)}")
    elif after is not None:
        problem = (f"record seq {seq + 1} (report {after.idempotency_key!r}) does not follow {what}: its prev is "
                   f"{_short(after.audit_prev)}, this record's hash {_short(hash_)}")
    if head is None:
        head = ReportedAuditHead(cluster_id=cluster.id, chain=chain, seq=seq, hash=hash_, first_seq=seq, reports=0,
                                 first_reported_at=now, reported_at=now)
        session.add(head)
    elif seq > head.seq:
        head.seq, head.hash = seq, hash_
    head.first_seq = min(head.first_seq, seq)
    head.reports += 1
    head.reported_at = now
    if problem is not None and head.problem is None:
        head.problem, head.problem_at = problem, now
    return problem
