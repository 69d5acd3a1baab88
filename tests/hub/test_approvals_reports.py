"""Approvals pulled by the cluster; action reports stored once per idempotency key; locations audited."""

from __future__ import annotations

import asyncio

from sqlalchemy import func
from sqlalchemy import select

from hub.db import ActionReport
from tests.hub.conftest import Hub
from tests.hub.helpers import report


async def test_approvals_are_pulled_after_a_cursor_with_conditional_requests(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    alice = await hub.create_user("alice", "operator")
    auth = hub.bearer(token)

    first = await hub.client.get("/v1/cluster/approvals", headers=auth)
    assert first.status_code == 200 and first.json()["approvals"] == [] and first.json()["cursor"] == 0
    etag = first.headers["etag"]
    assert (await hub.client.get("/v1/cluster/approvals", headers=auth | {"If-None-Match": etag})).status_code == 304

    await hub.propose(token, "op-111111111111")
    await hub.propose(token, "op-222222222222")
    first = await hub.client.get("/v1/cluster/approvals", headers=auth)  # reports change no approval's etag
    assert first.headers["etag"] == etag
    r = await hub.client.post(
        "/v1/clusters/prod-eu/approvals",
        json={"operation": "op-111111111111", "decision": "approve", "plan_id": "plan-1", "reason": "cheap"},
        headers=hub.bearer(alice),
    )
    assert r.status_code == 201 and r.json()["created"] is True
    await hub.client.post("/v1/clusters/prod-eu/approvals",
                          json={"operation": "op-222222222222", "decision": "reject"}, headers=hub.bearer(alice))

    r = await hub.client.get("/v1/cluster/approvals", headers=auth | {"If-None-Match": etag})
    assert r.status_code == 200
    page = r.json()
    assert [(a["operation"], a["decision"], a["decided_by"]) for a in page["approvals"]] == [
        ("op-111111111111", "approve", "user:alice"), ("op-222222222222", "reject", "user:alice")]
    assert page["approvals"][0]["plan_id"] == "plan-1" and page["more"] is False

    # the cursor: nothing after the last one; limit pages
    after = await hub.client.get("/v1/cluster/approvals", params={"after": page["cursor"]}, headers=auth)
    assert after.json()["approvals"] == [] and after.json()["cursor"] == page["cursor"]
    etag_after = after.headers["etag"]
    assert (await hub.client.get("/v1/cluster/approvals", params={"after": page["cursor"]},
                                 headers=auth | {"If-None-Match": etag_after})).status_code == 304
    one = (await hub.client.get("/v1/cluster/approvals", params={"limit": 1}, headers=auth)).json()
    assert len(one["approvals"]) == 1 and one["more"] is True

    # decisions are final: the same one again is fine (retry), a different one conflicts
    again = await hub.client.post("/v1/clusters/prod-eu/approvals",
                                  json={"operation": "op-111111111111", "decision": "approve", "plan_id": "plan-1"},
                                  headers=hub.admin)
    assert again.status_code == 200 and again.json()["created"] is False
    before = hub.snapshot()
    flip = await hub.client.post("/v1/clusters/prod-eu/approvals",
                                 json={"operation": "op-111111111111", "decision": "reject"}, headers=hub.admin)
    assert flip.status_code == 409 and flip.json()["error"] == "already_decided"
    assert "approve by user:alice" in flip.json()["message"]
    assert hub.snapshot() == before

    audit = [(e["action"], e["actor"], e["target"]) for e in await hub.audit(cluster="prod-eu")
             if e["action"].startswith("operation.")]
    assert audit == [("operation.approved", "user:alice", "op-111111111111"),
                     ("operation.rejected", "user:alice", "op-222222222222")]


async def test_same_idempotency_key_twice_stores_one_report(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    auth = hub.bearer(token)
    body = report("op-0123456789ab/launched/1", location="aws/eu-central-1", instance="i-0abc", node="burst-1")

    first = await hub.client.post("/v1/cluster/reports", json=body, headers=auth)
    assert first.status_code == 201, first.text
    second = await hub.client.post("/v1/cluster/reports", json=body, headers=auth)
    assert second.status_code == 200
    assert second.json() == first.json()
    with hub.db.session() as s:
        assert s.scalar(select(func.count()).select_from(ActionReport)) == 1

    # the same instant written differently is the same report
    same_instant = body | {"occurred_at": "2025-03-01T13:00:00+01:00"}
    assert (await hub.client.post("/v1/cluster/reports", json=same_instant, headers=auth)).status_code == 200

    # the key reused for a different report: refused, nothing stored
    before = hub.snapshot()
    r = await hub.client.post("/v1/cluster/reports", json=body | {"action": "failed"}, headers=auth)
    assert r.status_code == 409 and r.json()["error"] == "idempotency_key_reused"
    assert r.json()["details"][0]["field"] == "idempotency_key"
    assert hub.snapshot() == before

    # the burst node's location is in the audit log, once, attributed to the cluster
    located = await hub.audit(action="burst_node.location_reported")
    assert len(located) == 1
    event = located[0]
    assert (event["actor"], event["cluster"], event["target"]) == ("cluster:prod-eu", "prod-eu", "burst-1")
    assert event["detail"]["location"] == "aws/eu-central-1" and event["detail"]["instance"] == "i-0abc"
    assert event["actor_key_id"] == token.split("_")[1]

    listed = (await hub.client.get("/v1/clusters/prod-eu/reports", headers=hub.admin)).json()
    assert [r["idempotency_key"] for r in listed["reports"]] == ["op-0123456789ab/launched/1"]


async def test_concurrent_reports_with_one_key_store_one_row(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    body = report("burst-key", location="gcp/europe-west4")
    results = await asyncio.gather(*[
        hub.client.post("/v1/cluster/reports", json=body, headers=hub.bearer(token)) for _ in range(8)
    ])
    assert sorted(r.status_code for r in results) == [200] * 7 + [201]
    assert len({r.json()["id"] for r in results}) == 1
    with hub.db.session() as s:
        assert s.scalar(select(func.count()).select_from(ActionReport)) == 1
    assert len(await hub.audit(action="burst_node.location_reported")) == 1


async def test_every_action_kind_is_accepted(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    actions = ["proposed", "approved", "launched", "joined", "verified", "drained", "removed", "failed"]
    for i, action in enumerate(actions):
        r = await hub.client.post("/v1/cluster/reports", json=report(f"k{i}", action=action),
                                  headers=hub.bearer(token))
        assert r.status_code == 201, r.text
    listed = (await hub.client.get("/v1/clusters/prod-eu/reports", params={"operation": "op-0123456789ab"},
                                   headers=hub.admin)).json()
    assert [r["action"] for r in listed["reports"]] == actions
