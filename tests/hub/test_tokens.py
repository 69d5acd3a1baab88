"""Cluster tokens: shown once and stored as a hash; rotation (R2.2), revocation (R2.3), the audit log (R2.4)."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy import text

from hub.db import ClusterToken
from tests.hub.conftest import Hub


async def test_token_is_returned_once_and_stored_only_as_a_hash(hub: Hub) -> None:
    r = await hub.client.post("/v1/clusters", json={"name": "prod-eu", "description": "EU"}, headers=hub.admin)
    assert r.status_code == 201, r.text
    token = r.json()["token"]["token"]
    assert token.startswith("kgc_") and len(token) > 60
    assert r.json()["cluster"]["status"] == "pending"

    with hub.db.session() as s:
        row = s.scalar(select(ClusterToken))
        assert row is not None
        assert row.digest == hashlib.sha256(token.encode()).hexdigest()
    secret = token.split("_", 2)[2]  # kgc_<id>_<secret>; the secret itself may contain "_"
    assert secret not in repr(hub.snapshot())

    shown = await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)
    assert shown.status_code == 200
    assert secret not in shown.text and shown.json()["tokens"][0]["id"] == r.json()["token"]["token_id"]

    # the token works; the cluster is connected and last_seen is the time of that call
    me = await hub.client.get("/v1/cluster", headers=hub.bearer(token))
    assert me.status_code == 200 and me.json()["cluster"] == "prod-eu"
    shown = (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)).json()
    assert shown["status"] == "connected" and shown["connected"] is True
    assert shown["last_seen"] == hub.clock().isoformat().replace("+00:00", "Z")

    # a token with the right id but a wrong secret does not work
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    r = await hub.client.get("/v1/cluster/policies", headers=hub.bearer(forged))
    assert r.status_code == 401 and r.json()["error"] == "invalid_token"


async def test_rotation_old_token_dies_on_first_use_of_the_new_one(hub: Hub) -> None:
    old = await hub.create_cluster("prod-eu")
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))).status_code == 200

    r = await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)
    assert r.status_code == 201, r.text
    new = r.json()["token"]
    assert new != old
    assert r.json()["previous_tokens_expire_at"] == (hub.clock() + timedelta(hours=24)).isoformat().replace(
        "+00:00", "Z")

    # until the new token is used, both work (the optimizer may not have picked up the new Secret yet)
    hub.clock.advance(timedelta(hours=1))
    for _ in range(2):
        assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))).status_code == 200
    states = {t["id"]: t["state"] for t in (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)
                                             ).json()["tokens"]}
    assert sorted(states.values()) == ["active", "expiring"]

    # first use of the new token: the old one stops at once
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(new))).status_code == 200
    r = await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))
    assert r.status_code == 401
    assert r.json()["error"] == "token_superseded"
    assert "replaced by a rotation" in r.json()["message"]
    assert r.headers["www-authenticate"].startswith("Bearer ")
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(new))).status_code == 200

    superseded = await hub.audit(action="token.superseded")
    assert len(superseded) == 1 and superseded[0]["actor"] == "cluster:prod-eu"


async def test_rotation_old_token_dies_after_24_hours_when_the_new_one_is_never_used(hub: Hub) -> None:
    old = await hub.create_cluster("prod-eu")
    r = await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)
    new = r.json()["token"]

    hub.clock.advance(timedelta(hours=23, minutes=59, seconds=59))
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))).status_code == 200

    hub.clock.advance(timedelta(seconds=1))  # exactly 24 h after the rotation
    r = await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))
    assert r.status_code == 401
    assert r.json()["error"] == "token_expired" and "expired at" in r.json()["message"]

    # the new token was never used and still works
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(new))).status_code == 200
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(old))).status_code == 401
    cluster = (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)).json()
    assert cluster["status"] == "connected"
    assert [t["state"] for t in cluster["tokens"]] == ["superseded", "active"]


async def test_rotating_twice_keeps_every_older_token_until_a_newer_one_is_used(hub: Hub) -> None:
    t1 = await hub.create_cluster("prod-eu")
    t2 = (await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)).json()["token"]
    hub.clock.advance(timedelta(hours=12))
    t3 = (await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)).json()["token"]
    for token in (t1, t2, t3):
        assert (await hub.client.get("/v1/cluster", headers=hub.bearer(token))).status_code == 200
    # t2 and t3 were both used: t3 is newest, so its first use retired t1 and t2
    assert (await hub.client.get("/v1/cluster", headers=hub.bearer(t1))).status_code == 401
    assert (await hub.client.get("/v1/cluster", headers=hub.bearer(t2))).status_code == 401
    assert (await hub.client.get("/v1/cluster", headers=hub.bearer(t3))).status_code == 200


async def test_revoke_stops_the_token_at_once_and_the_cluster_shows_disconnected(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    rotated = (await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)).json()["token"]
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(token))).status_code == 200

    r = await hub.client.post("/v1/clusters/prod-eu/token/revoke", headers=hub.admin)
    assert r.status_code == 200, r.text
    assert r.json()["cluster"]["status"] == "disconnected" and r.json()["cluster"]["connected"] is False
    assert len(r.json()["revoked_tokens"]) == 2

    for t in (token, rotated):  # both the current and the not-yet-used rotated token
        for method, path in (("GET", "/v1/cluster/policies"), ("GET", "/v1/cluster/approvals"),
                             ("GET", "/v1/cluster")):
            res = await hub.client.request(method, path, headers=hub.bearer(t))
            assert res.status_code == 401 and res.json()["error"] == "token_revoked", res.text
            assert "revoked at" in res.json()["message"] and "bootstrap:admin" in res.json()["message"]
    before = hub.snapshot()
    res = await hub.client.post("/v1/cluster/reports", json={"idempotency_key": "k"}, headers=hub.bearer(token))
    assert res.status_code == 401
    assert hub.snapshot() == before

    shown = (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)).json()
    assert shown["status"] == "disconnected" and shown["connected"] is False
    assert shown["last_seen"] is not None
    assert {t["state"] for t in shown["tokens"]} == {"revoked"}

    # a token issued after the revocation reconnects the cluster once used
    fresh = (await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.admin)).json()
    assert fresh["previous_tokens_expire_at"] is None
    assert (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)).json()["status"] == "pending"
    hub.clock.advance(timedelta(seconds=1))
    assert (await hub.client.get("/v1/cluster", headers=hub.bearer(fresh["token"]))).status_code == 200
    assert (await hub.client.get("/v1/clusters/prod-eu", headers=hub.admin)).json()["status"] == "connected"
    assert (await hub.client.get("/v1/cluster", headers=hub.bearer(token))).status_code == 401


async def test_audit_log_records_who_created_rotated_and_revoked_tokens(hub: Hub) -> None:
    alice = await hub.create_user("alice", "admin")
    bob = await hub.create_user("bob", "admin")
    alice_id = alice.split("_")[1]
    bob_id = bob.split("_")[1]

    r = await hub.client.post("/v1/clusters", json={"name": "prod-eu"}, headers=hub.bearer(alice))
    first_id = r.json()["token"]["token_id"]
    hub.clock.advance(timedelta(minutes=5))
    r = await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.bearer(bob))
    second_id = r.json()["token_id"]
    hub.clock.advance(timedelta(minutes=5))
    await hub.client.post("/v1/clusters/prod-eu/token/revoke", headers=hub.bearer(alice))

    events = await hub.audit(cluster="prod-eu")
    by_action = {e["action"]: e for e in events}
    assert [e["action"] for e in events] == ["cluster.created", "token.created", "token.rotated", "token.revoked"]
    # the cluster's chain: one place each, in order, each naming the hash of the one before
    assert [e["chain_seq"] for e in events] == [1, 2, 3, 4]
    assert [e["chain_prev"] for e in events[1:]] == [e["chain_hash"] for e in events[:-1]]
    start = "2025-03-01T12:00:00Z"
    chain_fields = {"chain_seq", "chain_prev", "chain_hash"}
    assert {k: v for k, v in by_action["token.created"].items() if k not in chain_fields} | {
            "id": 0, "detail": {}} == {
        "id": 0, "at": start, "actor": "user:alice", "actor_key_id": alice_id, "action": "token.created",
        "cluster": "prod-eu", "target": "prod-eu", "detail": {},
    }
    assert by_action["token.created"]["detail"]["token_id"] == first_id
    rotated = by_action["token.rotated"]
    assert (rotated["actor"], rotated["actor_key_id"], rotated["at"]) == ("user:bob", bob_id, "2025-03-01T12:05:00Z")
    assert rotated["detail"]["token_id"] == second_id and rotated["detail"]["previous_token_ids"] == [first_id]
    revoked = by_action["token.revoked"]
    assert (revoked["actor"], revoked["at"]) == ("user:alice", "2025-03-01T12:10:00Z")
    assert sorted(revoked["detail"]["token_ids"]) == sorted([first_id, second_id])

    users = await hub.audit(action="user.created")
    assert [(e["actor"], e["target"]) for e in users] == [("bootstrap:admin", "alice"), ("bootstrap:admin", "bob")]


async def test_audit_log_is_append_only(hub: Hub) -> None:
    await hub.create_cluster("prod-eu")
    events = await hub.audit()
    assert events
    for method in ("PUT", "PATCH", "DELETE"):
        r = await hub.client.request(method, "/v1/audit", headers=hub.admin)
        assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
        r = await hub.client.request(method, f"/v1/audit/{events[0]['id']}", headers=hub.admin)
        assert r.status_code == 404

    # and not even the database lets a row change
    before = hub.snapshot()
    for statement in ("UPDATE audit_events SET actor = 'user:mallory'", "DELETE FROM audit_events"):
        with hub.db.engine.connect() as conn:
            try:
                conn.execute(text(statement))
                conn.commit()
            except Exception as exc:
                assert "append-only" in str(exc)
            else:
                raise AssertionError(f"{statement!r} was allowed")
    assert hub.snapshot() == before


async def test_api_keys_roles_and_revocation(hub: Hub) -> None:
    viewer = await hub.create_user("vera", "viewer")
    operator = await hub.create_user("otto", "operator")
    await hub.create_cluster("prod-eu")
    doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "p"},
           "spec": {"kind": "Burst", "workloads": {"tolerate": "gpu.kubeon.io/burst"},
                    "locations": ["aws/eu-central-1"], "limits": {"maxNodes": 1, "maxGpuHour": 2.0}}}

    me = (await hub.client.get("/v1/me", headers=hub.bearer(viewer))).json()
    assert (me["kind"], me["name"], me["role"]) == ("user", "vera", "viewer")
    assert (await hub.client.get("/v1/clusters", headers=hub.bearer(viewer))).status_code == 200
    before = hub.snapshot()
    r = await hub.put_policy("prod-eu", doc, headers=hub.bearer(viewer))
    assert r.status_code == 403 and r.json()["error"] == "insufficient_role"
    assert "user:vera has role viewer" in r.json()["message"] and "needs operator" in r.json()["message"]
    r = await hub.client.post("/v1/clusters/prod-eu/token/rotate", headers=hub.bearer(operator))
    assert r.status_code == 403 and "needs admin" in r.json()["message"]
    assert (await hub.client.get("/v1/audit", headers=hub.bearer(operator))).status_code == 403
    assert hub.snapshot() == before

    r = await hub.put_policy("prod-eu", doc, headers=hub.bearer(operator))
    assert r.status_code == 201 and r.json()["policy"]["created_by"] == "user:otto"

    key_id = operator.split("_")[1]
    r = await hub.client.post(f"/v1/users/otto/keys/{key_id}/revoke", headers=hub.admin)
    assert r.status_code == 200 and r.json()["keys"][0]["active"] is False
    r = await hub.client.get("/v1/clusters", headers=hub.bearer(operator))
    assert r.status_code == 401 and r.json()["error"] == "api_key_revoked"
    assert [e["actor"] for e in await hub.audit(action="api_key.revoked")] == ["bootstrap:admin"]
