"""The hub's audit hash chains on SQLite and PostgreSQL: a generated day of a cluster's reports verifies, and so does
the worker's file against the hub; one edited, deleted or moved row of ``audit_events`` or ``action_reports`` is
named by ``audit verify --hub``; a report that does not follow its log is flagged; two appenders never fork a
chain; rows from before the chain are sealed by it."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy import select
from sqlalchemy import text

from activities.audit import report_of
from activities.clients.audit_log import AuditLog
from hub import ops
from hub.audit import BOOTSTRAP_ACTOR
from hub.audit import AuditAction
from hub.audit import record
from hub.db import ActionReport
from hub.db import AuditEvent
from hub.db import Cluster
from hub.db import Database
from hub.schemas import ActionReportCreate
from models.audit_chain import GENESIS
from models.audit_chain import canonical
from models.audit_chain import record_hash
from tests.harness.audit_day import DayPlan
from tests.harness.audit_day import write_day
from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document
from worker.audit_verify import Outcome
from worker.audit_verify import fetch_hub
from worker.audit_verify import verify_file
from worker.audit_verify import verify_file_against_hub
from worker.audit_verify import verify_hub


async def _verify(hub: Hub) -> list[Outcome]:
    return verify_hub(await fetch_hub(hub.client, hub.admin))


def _broken(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


def _unprotect(engine: Engine) -> None:
    """What someone with write access to the database can do: take the append-only triggers away."""
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.execute(text("DROP TRIGGER audit_events_no_update"))
            conn.execute(text("DROP TRIGGER audit_events_no_delete"))
        else:
            conn.execute(text("ALTER TABLE audit_events DISABLE TRIGGER USER"))


def _sql(engine: Engine, *statements: str, **params: Any) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement), params)


async def _post_all(hub: Hub, token: str, bodies: list[dict[str, Any]], lanes: int = 4) -> list[dict[str, Any]]:
    """Post from ``lanes`` senders at once, as several activities report: arrival is out of order."""
    answers: list[dict[str, Any]] = []

    async def lane(mine: list[dict[str, Any]]) -> None:
        for body in mine:
            r = await hub.client.post("/v1/cluster/reports", json=body, headers=hub.bearer(token))
            assert r.status_code == 201, r.text
            answers.append(r.json())

    await asyncio.gather(*(lane(bodies[i::lanes]) for i in range(lanes)))
    return answers


async def test_a_day_verifies_and_one_edited_row_of_each_table_is_named(hub: Hub, tmp_path: Path) -> None:
    token = await hub.create_cluster("dev")
    await hub.create_user("alice", "operator")
    assert (await hub.put_policy("dev", policy_document())).status_code == 201
    path = tmp_path / "audit.jsonl"
    stored = write_day(AuditLog(path), threads=4, plan=DayPlan(batches=36, idle_workloads=12))
    answers = await _post_all(hub, token, [report_of(r).model_dump(mode="json") for r in stored])
    assert len(answers) > 400 and not [a for a in answers if a["audit_problem"]]

    data = await fetch_hub(hub.client, hub.admin)
    outcomes = verify_hub(data)
    assert not _broken(outcomes), "\n".join(o.render() for o in outcomes)
    assert {o.what for o in outcomes} >= {
        "hub audit log (audit_events), cluster dev", "hub audit log (audit_events), the hub's own events",
        "hub action reports (action_reports), cluster dev"}
    file_head = AuditLog(path).head()
    assert file_head is not None
    assert [(h["chain"], h["seq"], h["hash"]) for h in data.reported] == [
        (file_head.chain, file_head.seq, file_head.hash)]
    anchored = verify_file_against_hub(path, data)
    assert not _broken(anchored), "\n".join(o.render() for o in anchored)

    # Rewriting the file from one record on, every later record rehashed: the file alone verifies, the hub's copy
    # of its head and records catches it, naming the first record that differs.
    lines = path.read_text().splitlines()
    prev = json.loads(lines[399])["prev"]
    for n in range(400, len(lines) + 1):
        doc = json.loads(lines[n - 1])
        if n == 400:
            doc["location"] = "aws/us-east-1"
        doc["prev"] = prev
        doc["hash"] = prev = record_hash(doc)
        lines[n - 1] = canonical(doc).decode()
    path.write_text("".join(f"{line}\n" for line in lines))
    assert verify_file(path).ok
    rewritten = verify_file_against_hub(path, await fetch_hub(hub.client, hub.admin))[0]
    assert not rewritten.ok
    key = json.loads(lines[399])["key"]
    assert str(rewritten.all_breaks[0]).startswith("line 400 (seq 400): its hash differs from the one the hub "
                                                   "was reported (report id "), rewritten.render()
    assert key in str(rewritten.all_breaks[0])

    # One edited row of each table: each named by its id and place.
    _unprotect(hub.db.engine)
    with hub.db.session() as s:
        report_row = s.scalars(select(ActionReport).where(ActionReport.chain_seq == 300)).one()
        event_row = s.scalars(select(AuditEvent).where(AuditEvent.action == "burst_node.location_reported")
                              .order_by(AuditEvent.id).offset(100).limit(1)).one()
    _sql(hub.db.engine, "UPDATE action_reports SET location = 'aws/us-east-1' WHERE id = :id", id=report_row.id)
    _sql(hub.db.engine, "UPDATE audit_events SET actor = 'cluster:elsewhere' WHERE id = :id", id=event_row.id)
    broken = _broken(await _verify(hub))
    assert [o.what for o in broken] == ["hub audit log (audit_events), cluster dev",
                                        "hub action reports (action_reports), cluster dev"]
    by_what = {o.what: o.all_breaks[0] for o in broken}
    first = by_what["hub action reports (action_reports), cluster dev"]
    assert first.label == f"report id {report_row.id} of cluster dev (seq 300, key {report_row.idempotency_key})"
    assert "content changed after it was written" in first.reason
    first = by_what["hub audit log (audit_events), cluster dev"]
    assert first.label == (f"audit event id {event_row.id} (seq {event_row.chain_seq}, "
                           f"burst_node.location_reported {event_row.target})")
    assert "content changed after it was written" in first.reason


def _delete(engine: Engine, table: str, row_id: int, _: int) -> None:
    _sql(engine, f"DELETE FROM {table} WHERE id = :id", id=row_id)


def _reorder(engine: Engine, table: str, row_id: int, next_id: int) -> None:
    _sql(engine, f"UPDATE {table} SET id = -1 WHERE id = :a", f"UPDATE {table} SET id = :a WHERE id = :b",
         f"UPDATE {table} SET id = :b WHERE id = -1", a=row_id, b=next_id)


def _delete_last(engine: Engine, table: str, _: int, last_id: int) -> None:
    _sql(engine, f"DELETE FROM {table} WHERE id = :id", id=last_id)


@pytest.mark.parametrize("table", ["audit_events", "action_reports"])
@pytest.mark.parametrize(("tamper", "reason"), [
    (_delete, "follows seq 4: record 5 missing (deleted, or moved later)"),
    (_reorder, "follows seq 4: record 5 missing (deleted, or moved later)"),
    (_delete_last, "the head the hub recorded is seq 8"),
], ids=["deleted", "reordered", "last-deleted"])
async def test_a_deleted_or_moved_row_is_named(hub: Hub, table: str, tamper: Callable[[Engine, str, int, int], None],
                                              reason: str) -> None:
    token = await hub.create_cluster("prod-eu")
    for n in range(8 if table == "action_reports" else 6):  # cluster.created and token.created come first
        if table == "action_reports":
            r = await hub.client.post("/v1/cluster/reports", headers=hub.bearer(token), json={
                "idempotency_key": f"op-{n}/launched", "operation": f"op-{n:012x}", "policy": "p",
                "action": "launched", "occurred_at": "2025-03-01T12:00:00Z"})
        else:
            r = await hub.put_policy("prod-eu", policy_document(f"p-{n}"))
        assert r.status_code == 201, r.text
    model: type[ActionReport | AuditEvent] = ActionReport if table == "action_reports" else AuditEvent
    with hub.db.session() as s:
        rows: list[Any] = list(s.scalars(select(model).order_by(model.id)))
    rows = [r for r in rows if table == "action_reports" or r.cluster == "prod-eu"]
    assert [r.chain_seq for r in rows] == list(range(1, 9))
    assert not _broken(await _verify(hub))

    _unprotect(hub.db.engine)
    tamper(hub.db.engine, table, rows[4].id, rows[7].id if tamper is _delete_last else rows[5].id)
    broken = _broken(await _verify(hub))
    assert len(broken) == 1, "\n".join(o.render() for o in broken)
    first = broken[0].all_breaks[0]
    if tamper is _delete_last:
        assert first.label == "the end of the chain (seq 7)"
    else:
        named = rows[5]  # the record now where seq 5 was due
        assert first.label.startswith(f"{'report id' if table == 'action_reports' else 'audit event id'} "
                                      f"{rows[4].id if tamper is _reorder else named.id}")
        assert "(seq 6, " in first.label
    assert reason in first.reason, first.reason


async def test_a_report_that_does_not_follow_its_log_is_flagged_naming_it(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    chain = "a" * 32

    def body(seq: int, hash_: str, prev: str) -> dict[str, Any]:
        return {"idempotency_key": f"op-{seq}/launched", "operation": f"op-{seq:012x}", "policy": "p",
                "action": "launched", "occurred_at": "2025-03-01T12:00:00Z", "audit_chain": chain,
                "audit_seq": seq, "audit_hash": hash_, "audit_prev": prev}

    h1, h2, h3, forged = "1" * 64, "2" * 64, "3" * 64, "f" * 64
    for b in (body(2, h2, h1), body(1, h1, GENESIS)):  # out of order: fine
        r = await hub.client.post("/v1/cluster/reports", json=b, headers=hub.bearer(token))
        assert r.status_code == 201 and r.json()["audit_problem"] is None, r.text
    r = await hub.client.post("/v1/cluster/reports", json=body(3, h3, forged), headers=hub.bearer(token))
    assert r.status_code == 201, r.text  # stored, not refused: the worker would drop it for good
    problem = r.json()["audit_problem"]
    assert problem.startswith(f"audit record seq 3 of cluster 'prod-eu''s audit log {chain} (report 'op-3/launched') "
                              "does not follow the head the cluster reported before (seq 2, hash 2222222222222222")
    again = await hub.client.post("/v1/cluster/reports", json=body(3, h3, forged), headers=hub.bearer(token))
    assert again.status_code == 200 and again.json()["audit_problem"].startswith(  # a retried delivery: said again
        f"audit record seq 3 of cluster 'prod-eu''s audit log {chain} (report 'op-3/launched') does not follow "
        "record seq 2 (report 'op-2/launched', hash 2222222222222222...): its prev is ffffffffffffffff")
    partial = {k: v for k, v in body(4, h3, h3).items() if k != "audit_prev"}
    r = await hub.client.post("/v1/cluster/reports", json=partial, headers=hub.bearer(token))
    assert r.status_code == 422 and "audit_prev missing" in r.text

    flagged = await hub.audit(action="audit.chain_broken")
    assert [(e["cluster"], e["target"], e["detail"]["problem"]) for e in flagged] == [
        ("prod-eu", "op-3/launched", problem)]
    chains = (await hub.client.get("/v1/audit/chains", headers=hub.admin)).json()
    assert [(h["chain"], h["seq"], h["hash"], h["first_seq"], h["reports"], h["problem"])
            for h in chains["reported"]] == [(chain, 3, h3, 1, 4, problem)]
    reported = [o for o in await _verify(hub) if o.what.startswith("worker audit log")]
    assert len(reported) == 1 and not reported[0].ok
    assert [str(b) for b in reported[0].all_breaks] == [
        f"report id {r_id} (op-3/launched, audit record seq 3): does not follow report id {p_id} (seq 2): its prev "
        "is not that record's hash" for r_id, p_id in [_ids(hub, "op-3/launched", "op-2/launched")]
    ] + [f"when it was reported: the hub found: {problem} (at 2025-03-01T12:00:00Z)"]


def _ids(hub: Hub, *keys: str) -> tuple[int, ...]:
    with hub.db.session() as s:
        return tuple(s.scalars(select(ActionReport.id).where(ActionReport.idempotency_key == k)).one() for k in keys)


def test_two_concurrent_appenders_never_fork_a_chain(database_url: str) -> None:
    """Two writers (their own connections, as two hub requests or two hub replicas) append to one cluster's
    chains at once: every place taken once, each row naming the one before (PostgreSQL waits on the head's lock;
    without it the unique (chain, seq) index fails a transaction instead of storing a fork)."""
    from datetime import UTC
    from datetime import datetime

    db = Database(database_url)
    db.create_schema()
    now = datetime(2025, 3, 1, tzinfo=UTC)
    with db.session() as s:
        cluster, _ = ops.create_cluster(s, now, BOOTSTRAP_ACTOR, "prod-eu")
        s.commit()
        cluster_id = cluster.id
    per_writer = 40
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            start.wait()
            for i in range(per_writer):
                with db.session() as s:
                    found = s.get(Cluster, cluster_id)
                    assert found is not None
                    record(s, at=now, actor=BOOTSTRAP_ACTOR, action=AuditAction.POLICY_CHANGED, cluster="prod-eu",
                           target=f"w{n}-{i}")
                    ops.add_report(s, now, BOOTSTRAP_ACTOR, found, ActionReportCreate.model_validate({
                        "idempotency_key": f"w{n}-{i}", "operation": f"op-{n}{i:011x}", "policy": "p",
                        "action": "launched", "location": "sim/eu-west", "occurred_at": "2025-03-01T12:00:00Z"}))
                    s.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    try:
        with db.session() as s:
            models: tuple[type[AuditEvent | ActionReport], ...] = (AuditEvent, ActionReport)
            for model in models:
                rows: list[Any] = list(s.scalars(select(model).order_by(model.id)))
                seqs = [r.chain_seq for r in rows]
                assert seqs == list(range(1, len(rows) + 1)), seqs
                assert all(b.chain_prev == a.chain_hash for a, b in itertools.pairwise(rows))
            targets = [e.target for e in s.scalars(select(AuditEvent).where(
                AuditEvent.action == AuditAction.POLICY_CHANGED.value).order_by(AuditEvent.id))]
            assert len(targets) == 2 * per_writer
            if db.engine.dialect.name == "postgresql":  # the writers' rows interleave: they did run at once
                assert any(a[:2] != b[:2] for a, b in itertools.pairwise(targets)), targets
    finally:
        db.dispose()


async def test_rows_from_before_the_chain_are_sealed_by_its_first_row(hub: Hub) -> None:
    """A database of an earlier hub: create_schema adds the chain columns; the rows already there stay unchained
    and the first new row of their chain seals them (an edit of one is caught from then on)."""
    await hub.create_cluster("prod-eu")
    engine = hub.db.engine
    with engine.begin() as conn:  # back to the shape an earlier hub made, the rows it wrote
        conn.execute(text("DROP INDEX ux_audit_events_chain"))
        for column in ("chain_seq", "chain_prev", "chain_hash"):
            conn.execute(text(f"ALTER TABLE audit_events DROP COLUMN {column}"))
        conn.execute(text("DELETE FROM audit_chain_heads"))
    upgraded = Database(hub.db.url)  # the upgraded hub starts
    upgraded.create_schema()
    upgraded.dispose()
    assert [e["chain_seq"] for e in await hub.audit(cluster="prod-eu")] == [None, None]

    assert (await hub.put_policy("prod-eu", policy_document())).status_code == 201
    events = await hub.audit(cluster="prod-eu")
    assert [e["chain_seq"] for e in events] == [None, None, 1]
    outcome = next(o for o in await _verify(hub) if o.what == "hub audit log (audit_events), cluster prod-eu")
    assert outcome.ok and outcome.check is not None and outcome.check.unchained == 2, outcome.render()
    assert "the chain starts after 2 earlier record(s) written before it existed" in outcome.render()

    _unprotect(engine)
    _sql(engine, "UPDATE audit_events SET actor = 'user:mallory' WHERE id = :id", id=events[0]["id"])
    outcome = next(o for o in await _verify(hub) if o.what == "hub audit log (audit_events), cluster prod-eu")
    assert not outcome.ok and outcome.check is not None
    assert outcome.check.breaks[0].label == f"audit event id {events[2]['id']} (seq 1, policy.created "\
                                            "inference-burst-eu)"
    assert "does not start the chain" in outcome.check.breaks[0].reason


def test_the_cli_verifies_a_worker_file_against_a_real_hub(tmp_path: Path) -> None:
    """`kubeon-gpu audit verify FILE --hub URL` as an operator runs it: a hub process, reports delivered by the
    worker's own hub client, then one record of the file edited."""
    import subprocess
    import sys

    import httpx

    from activities.clients.hub import HubClient
    from tests.hub.conftest import BOOTSTRAP_KEY
    from tests.hub.process import HubProcess

    key_file = tmp_path / "admin.key"
    key_file.write_text(BOOTSTRAP_KEY + "\n")
    hub = HubProcess(["--database-url", f"sqlite:///{tmp_path / 'hub.db'}", "--bootstrap-admin-key-file",
                      str(key_file)], logdir=tmp_path).start()
    try:
        created = httpx.post(f"{hub.url}/v1/clusters", json={"name": "dev"}, timeout=10,
                             headers={"Authorization": f"Bearer {BOOTSTRAP_KEY}"})
        assert created.status_code == 201, created.text
        token_file = tmp_path / "token"
        token_file.write_text(created.json()["token"]["token"])
        path = tmp_path / "audit.jsonl"
        stored = write_day(AuditLog(path), threads=2, plan=DayPlan(batches=4, idle_workloads=2))
        client = HubClient(hub.url, token_file)
        try:
            assert all(client.report(report_of(r)) for r in stored)
        finally:
            client.close()

        def verify() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "worker.cli", "audit", "verify", str(path), "--hub", hub.url,
                                   "--api-key-file", str(key_file)], capture_output=True, text=True, timeout=60)

        ok = verify()
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"{path}: ok: {len(stored)} chained record(s)" in ok.stdout
        assert f"anchored by the hub: head seq {len(stored)} reported by cluster dev" in ok.stdout
        assert "hub action reports (action_reports), cluster dev: ok" in ok.stdout

        lines = path.read_text().splitlines()
        lines[9] = lines[9].replace('"cluster":"dev"', '"cluster":"other"')
        path.write_text("".join(f"{line}\n" for line in lines))
        broken = verify()
        assert broken.returncode == 1, broken.stdout + broken.stderr
        key = json.loads(lines[9])["key"]
        assert f"{path}: BROKEN, first broken record line 10 (seq 10, key {key}): content changed" in broken.stdout
    finally:
        assert hub.stop(), hub.log
