"""On-prem pools in the hub (SQLite and PostgreSQL): rate cards, servers registered by their agents, claims by
clusters whose policies name the location, release back to idle, offline servers, audit, refused input."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest

from models.join import render_user_data
from models.labels import Taint
from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document

RATE_CARD = {"usd_per_gpu_hour": {"NVIDIA-L4": 0.35, "NVIDIA-H100": 2.5}, "transfer_usd_per_gpu_hour": 0}


async def create_pool(hub: Hub, name: str = "dc1", **extra: Any) -> str:
    r = await hub.client.post("/v1/pools", json={"name": name, "rate_card": RATE_CARD, **extra}, headers=hub.admin)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["pool"]["location"] == f"onprem/{name}" and body["join_token"]["token"].startswith("kgp_")
    token: str = body["join_token"]["token"]
    return token


def beat(server: str, *, pool: str = "dc1", phase: str = "idle", operation: str | None = None,
         gpu_product: str = "NVIDIA-L4", gpus: int = 1) -> dict[str, Any]:
    return {"pool": pool, "server": server, "gpu_product": gpu_product, "gpus": gpus, "phase": phase,
            "operation": operation, "labels": {"rack": "r1"}}


def user_data(operation: str, ticket: str = "") -> str:
    return render_user_data(gateway_url="https://gw.example:8443", ticket=ticket or f"ticket-of-{operation}",
                            node_name=f"burst-{operation}", labels={}, taints=[Taint(key="gpu.kubeon.io/burst")])


def claim_body(operation: str, *, policy: str = "inference-burst-eu", gpus: int = 1, ticket: str = ""
               ) -> dict[str, Any]:
    return {"operation": operation, "policy": policy, "gpu_product": "NVIDIA-L4", "gpus": gpus,
            "node_name": f"burst-{operation}", "user_data": user_data(operation, ticket)}


async def heartbeat(hub: Hub, credential: str, body: dict[str, Any]) -> httpx.Response:
    return await hub.client.post("/v1/pool-agent/heartbeat", json=body, headers=hub.bearer(credential))


async def register(hub: Hub, server: str, *, pool: str = "dc1", gpus: int = 1, gpu_product: str = "NVIDIA-L4"
                   ) -> None:
    r = await hub.client.put(f"/v1/pools/{pool}/servers/{server}", headers=hub.admin,
                             json={"gpu_product": gpu_product, "gpus": gpus, "labels": {"rack": "r1"}})
    assert r.status_code in (200, 201), r.text


async def enrol_request(hub: Hub, join_token: str, server: str, *, pool: str = "dc1", gpus: int = 1
                        ) -> httpx.Response:
    return await hub.client.post("/v1/pool-agent/enrol", headers=hub.bearer(join_token),
                                 json={"pool": pool, "server": server, "gpu_product": "NVIDIA-L4", "gpus": gpus})


async def enrol(hub: Hub, join_token: str, server: str, *, pool: str = "dc1", gpus: int = 1) -> str:
    """An operator registers the server; its agent enrols with the pool's enrolment token: its own credential."""
    await register(hub, server, pool=pool, gpus=gpus)
    r = await enrol_request(hub, join_token, server, pool=pool, gpus=gpus)
    assert r.status_code == 201, r.text
    credential: str = r.json()["credential"]
    assert credential.startswith("kgs_") and r.json()["server"] == server
    return credential


async def cluster_with_policy(hub: Hub, name: str) -> dict[str, str]:
    token = await hub.create_cluster(name)
    r = await hub.put_policy(name, policy_document())  # names aws/eu-central-1, gcp/europe-west4, onprem/dc1
    assert r.status_code == 201, r.text
    return hub.bearer(token)


async def test_claim_join_serve_release_round_trip_is_audited(hub: Hub) -> None:
    join = await create_pool(hub)
    cred = await enrol(hub, join, "gpu-a")
    first = await heartbeat(hub, cred, beat("gpu-a"))
    assert first.status_code == 200, first.text
    assert first.json()["claim"] is None and first.json()["state"] == "idle"
    auth = await cluster_with_policy(hub, "prod-eu")

    offers = await hub.client.get("/v1/cluster/pools/dc1/offerings", headers=auth)
    assert offers.status_code == 200, offers.text
    assert offers.json()["offerings"] == [{"instance_type": "onprem.1xNVIDIA-L4", "gpu_product": "NVIDIA-L4",
                                           "gpus": 1, "usd_per_hour": 0.35, "idle": 1}]

    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"), headers=auth)
    assert r.status_code == 201, r.text
    assert r.json()["claim"]["server"] == "gpu-a" and r.json()["claim"]["state"] == "claimed"
    again = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"), headers=auth)
    assert again.status_code == 200 and again.json()["created"] is False and again.json()["claim"]["server"] == "gpu-a"

    # the agent sees the claim (no ticket yet), takes it up: the user data and the signed claim; joins, serves
    seen = (await heartbeat(hub, cred, beat("gpu-a"))).json()
    assert seen["claim"]["operation"] == "op-1" and seen["claim"]["cluster"] == "prod-eu"
    assert seen["claim"]["user_data"] is None and seen["claim"]["pool_claim"] is None
    taken = (await heartbeat(hub, cred, beat("gpu-a", phase="joining", operation="op-1"))).json()
    assert taken["state"] == "joining" and "ticket-of-op-1" in taken["claim"]["user_data"]
    assert taken["claim"]["pool_claim"].startswith("kpc1.")
    serving = (await heartbeat(hub, cred, beat("gpu-a", phase="serving", operation="op-1"))).json()
    assert serving["state"] == "serving" and serving["claim"]["user_data"] is None  # the ticket is not kept

    listed = (await hub.client.get("/v1/cluster/pools/dc1/claims", params={"operation": "op-1"}, headers=auth)).json()
    assert [(c["server"], c["state"]) for c in listed] == [("gpu-a", "serving")]

    rel = await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                                json={"operation": "op-1", "policy": "inference-burst-eu"}, headers=auth)
    assert rel.status_code == 200 and rel.json() == {"server": "gpu-a", "released": True, "state": "releasing"}
    # the agent is told to leave (no claim), leaves, reports idle
    assert (await heartbeat(hub, cred, beat("gpu-a", phase="serving", operation="op-1"))).json()["claim"] is None
    done = (await heartbeat(hub, cred, beat("gpu-a", phase="idle", operation="op-1"))).json()
    assert done["state"] == "idle" and done["claim"] is None
    retry = await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                                  json={"operation": "op-1", "policy": "inference-burst-eu"}, headers=auth)
    assert retry.status_code == 200 and retry.json()["released"] is False
    pool = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()
    server = pool["servers"][0]
    assert server["state"] == "idle" and server["claim_operation"] is None

    actions = [(e["action"], e["actor"], e["cluster"]) for e in await hub.audit()
               if e["action"].startswith("pool.")]
    assert actions == [
        ("pool.created", "bootstrap:admin", None), ("pool.join_token_created", "bootstrap:admin", None),
        ("pool.server_registered", "bootstrap:admin", None), ("pool.server_enrolled", "agent:gpu-a", None),
        ("pool.server_online", "agent:gpu-a", None), ("pool.server_claimed", "cluster:prod-eu", "prod-eu"),
        ("pool.server_joining", "agent:gpu-a", "prod-eu"), ("pool.server_serving", "agent:gpu-a", "prod-eu"),
        ("pool.server_release_requested", "cluster:prod-eu", "prod-eu"),
        ("pool.server_released", "agent:gpu-a", "prod-eu"),
    ]


async def test_two_clusters_racing_for_the_last_server_exactly_one_wins(hub: Hub) -> None:
    join = await create_pool(hub)
    await heartbeat(hub, await enrol(hub, join, "gpu-a"), beat("gpu-a"))
    a = await cluster_with_policy(hub, "prod-a")
    b = await cluster_with_policy(hub, "prod-b")
    results = await asyncio.gather(*[
        hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body(f"op-{i}"), headers=auth)
        for i, auth in enumerate([a, b, a, b])])
    codes = sorted(r.status_code for r in results)
    assert codes == [201, 409, 409, 409], [r.text for r in results]
    assert all(r.json()["error"] == "no_idle_server" for r in results if r.status_code == 409)
    claimed = [e for e in await hub.audit() if e["action"] == "pool.server_claimed"]
    assert len(claimed) == 1


async def test_an_offline_server_is_never_claimed_until_it_heartbeats(hub: Hub) -> None:
    join = await create_pool(hub, offline_after_seconds=30)
    cred = await enrol(hub, join, "gpu-a")
    await heartbeat(hub, cred, beat("gpu-a"))
    auth = await cluster_with_policy(hub, "prod-eu")
    hub.clock.advance(timedelta(seconds=31))
    pool = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()
    assert pool["servers"][0]["state"] == "offline"
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"), headers=auth)
    assert r.status_code == 409 and r.json()["error"] == "no_idle_server"
    await heartbeat(hub, cred, beat("gpu-a"))
    assert (await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"),
                                  headers=auth)).status_code == 201


async def test_a_claim_the_agent_never_picked_up_is_withdrawn_and_the_server_is_idle(hub: Hub) -> None:
    join = await create_pool(hub, offline_after_seconds=30)
    cred = await enrol(hub, join, "gpu-a")
    await heartbeat(hub, cred, beat("gpu-a"))
    auth = await cluster_with_policy(hub, "prod-eu")
    assert (await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"),
                                  headers=auth)).status_code == 201
    hub.clock.advance(timedelta(seconds=31))  # the server went silent while claimed
    claim = (await hub.client.get("/v1/cluster/pools/dc1/servers/gpu-a", headers=auth)).json()
    assert claim["state"] == "offline"
    rel = await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                                json={"operation": "op-1", "policy": "inference-burst-eu", "withdraw": True},
                                headers=auth)
    assert rel.json()["released"] is True
    server = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()["servers"][0]
    assert server["stored_state"] == "idle" and server["state"] == "offline" and server["claim_operation"] is None
    # back: it is told nothing (the claim is gone), and may be claimed again
    back = (await heartbeat(hub, cred, beat("gpu-a"))).json()
    assert back["claim"] is None
    assert "pool.server_online" in [e["action"] for e in await hub.audit()]


async def test_a_claim_for_a_location_the_clusters_policies_do_not_name_is_refused(hub: Hub) -> None:
    join = await create_pool(hub, name="dc2")
    await heartbeat(hub, await enrol(hub, join, "gpu-a", pool="dc2"), beat("gpu-a", pool="dc2"))
    auth = await cluster_with_policy(hub, "prod-eu")  # its policy names onprem/dc1, not onprem/dc2
    before = hub.snapshot()
    r = await hub.client.post("/v1/cluster/pools/dc2/claims", json=claim_body("op-1"), headers=auth)
    assert r.status_code == 403 and r.json()["error"] == "location_not_in_policies"
    assert r.json()["details"][0]["field"] == "pool" and "onprem/dc2" in r.json()["message"]
    assert (await hub.client.get("/v1/cluster/pools/dc2/offerings", headers=auth)).status_code == 403
    # a policy of the cluster that does not name the location cannot claim either
    await create_pool(hub, name="dc1")
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1", policy="other"), headers=auth)
    assert r.status_code == 403 and r.json()["details"][0]["field"] == "policy"
    assert hub.snapshot()["pool_servers"] == before["pool_servers"]


async def test_wrong_or_revoked_enrolment_tokens_and_servers_of_another_pool_are_refused(hub: Hub) -> None:
    dc1 = await create_pool(hub, name="dc1")
    dc2 = await create_pool(hub, name="dc2")
    await register(hub, "gpu-a")
    before = hub.snapshot()
    wrong = dc1[:-4] + ("AAAA" if not dc1.endswith("AAAA") else "BBBB")
    r = await enrol_request(hub, wrong, "gpu-a")
    assert r.status_code == 401 and "wrong secret" in r.json()["message"]
    r = await enrol_request(hub, "kgc_0123456789abcdef_" + "x" * 43, "gpu-a")
    assert r.status_code == 401 and "enrolment token" in r.json()["message"]
    # dc2's token for a server of dc1's pool: the body names dc1
    r = await enrol_request(hub, dc2, "gpu-a")
    assert r.status_code == 403 and r.json()["details"][0]["field"] == "pool"
    # dc2's token enrolling the dc1 server under dc2
    r = await enrol_request(hub, dc2, "gpu-a", pool="dc2")
    assert r.status_code == 409 and r.json()["error"] == "server_in_another_pool"
    assert r.json()["details"][0]["field"] == "server"
    assert hub.snapshot() == before
    # revoked
    token_id = dc1.split("_")[1]
    r = await hub.client.post(f"/v1/pools/dc1/join-tokens/{token_id}/revoke", headers=hub.admin)
    assert r.status_code == 200 and r.json()["join_tokens"][0]["active"] is False
    r = await enrol_request(hub, dc1, "gpu-a")
    assert r.status_code == 401 and r.json()["error"] == "token_revoked"
    # an enrolment token is no API key or cluster token
    assert (await hub.client.get("/v1/pools", headers=hub.bearer(dc2))).status_code == 401
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(dc2))).status_code == 401


@pytest.mark.parametrize(("price", "message"), [(-0.5, "greater than or equal to 0"), ("0.5", "valid number"),
                                                ("cheap", "valid number"), (1e9, "less than or equal to")])
async def test_a_rate_card_with_a_negative_or_non_numeric_price_is_refused(hub: Hub, price: Any, message: str) -> None:
    await create_pool(hub)
    before = hub.snapshot()
    r = await hub.client.put("/v1/pools/dc1/rate-card", json={"usd_per_gpu_hour": {"NVIDIA-L4": price}},
                             headers=hub.admin)
    assert r.status_code == 422, r.text
    detail = r.json()["details"][0]
    assert detail["field"] == "usd_per_gpu_hour.NVIDIA-L4" and message in detail["message"]
    r = await hub.client.post("/v1/pools", json={"name": "dc9", "rate_card": {"usd_per_gpu_hour": {"L4": price}}},
                              headers=hub.admin)
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "rate_card.usd_per_gpu_hour.L4"
    assert hub.snapshot() == before


async def test_bad_text_and_numbers_are_refused_naming_the_field(hub: Hub) -> None:
    join = await create_pool(hub)
    cred = await enrol(hub, join, "gpu-a")
    before = hub.snapshot()
    cases: list[tuple[dict[str, Any], str]] = [
        ({**beat("gpu-a"), "gpus": 0}, "gpus"), ({**beat("gpu-a"), "gpus": "1"}, "gpus"),
        ({**beat("gpu-a"), "gpus": 2**40}, "gpus"), ({**beat("Gpu_A")}, "server"),
        ({**beat("gpu-a"), "gpu_product": "L4\x00"}, "gpu_product"), ({**beat("gpu-a"), "phase": "lost"}, "phase"),
        ({**beat("gpu-a"), "labels": {"rack": "a\nb"}}, "labels.rack"), ({**beat("gpu-a"), "extra": 1}, "extra"),
    ]
    for body, field in cases:
        r = await heartbeat(hub, cred, body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["details"][0]["field"] == field, (body, r.json())
    r = await hub.client.post("/v1/pools", json={"name": "dc2", "description": "a\x07b", "rate_card": RATE_CARD},
                              headers=hub.admin)
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "description"
    assert hub.snapshot() == before


async def test_operators_register_and_retire_servers_viewers_only_read(hub: Hub) -> None:
    await create_pool(hub)
    viewer = hub.bearer(await hub.create_user("vic", "viewer"))
    operator = hub.bearer(await hub.create_user("olga", "operator"))
    body = {"gpu_product": "NVIDIA-H100", "gpus": 8, "usd_per_gpu_hour": 1.9}
    assert (await hub.client.put("/v1/pools/dc1/servers/big-1", json=body, headers=viewer)).status_code == 403
    r = await hub.client.put("/v1/pools/dc1/servers/big-1", json=body, headers=operator)
    assert r.status_code == 201 and r.json()["usd_per_gpu_hour"] == 1.9 and r.json()["state"] == "offline"
    assert (await hub.client.post("/v1/pools", json={"name": "x", "rate_card": RATE_CARD},
                                  headers=operator)).status_code == 403
    r = await hub.client.post("/v1/pools/dc1/servers/big-1/retire", headers=operator)
    assert r.status_code == 200 and r.json()["state"] == "retired"
    assert (await hub.client.get("/v1/pools", headers=viewer)).status_code == 200
    events = [(e["action"], e["actor"]) for e in await hub.audit() if e["action"].startswith("pool.server")]
    assert events == [("pool.server_registered", "user:olga"), ("pool.server_retired", "user:olga")]


def test_the_dev_seed_creates_the_pool_once_and_reuses_its_join_token_file(tmp_path: Any, database_url: str) -> None:
    import shutil
    from pathlib import Path

    from sqlalchemy import select

    from hub.db import Database
    from hub.pool_db import Pool
    from hub.seed import seed_file
    from tests.hub.conftest import FakeClock

    shipped = Path(__file__).resolve().parent.parent.parent / "hub" / "dev-seed.yaml"
    (tmp_path / "hub").mkdir()
    seed = tmp_path / "hub" / "dev-seed.yaml"
    shutil.copy(shipped, seed)
    shutil.copytree(shipped.parent.parent / "examples", tmp_path / "examples")
    token_file = tmp_path / ".kubeon/hub/dc1.join-token"
    for fresh in (True, False):  # a new database imports the token file the servers already hold
        db = Database(database_url if fresh else f"sqlite:///{tmp_path / 'other.db'}")
        try:
            db.create_schema()
            done = seed_file(db, seed, clock=FakeClock())
            assert any(line.startswith("pool dc1 created") for line in done), done
            assert ("written to" in " ".join(done)) is fresh and ("imported" in " ".join(done)) is not fresh
            assert seed_file(db, seed, clock=FakeClock()) == []  # again: nothing to do
            with db.session() as s:
                pool = s.scalar(select(Pool))
                assert pool is not None and pool.rate_card["usd_per_gpu_hour"] == {"NVIDIA-L4": 0.45}
                assert [t.token_id for t in pool.tokens] == [token_file.read_text().split("_")[1]]
        finally:
            db.dispose()
