"""Issue 21, on-prem pools in the hub (SQLite and PostgreSQL): a server's credential is its own, the pool's
enrolment token only enrols, the claim the hub signs names the server, a cluster holds at most its policy's
maxNodes servers, and a claim's ticket reaches only the server that took the claim up."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from gateway.pool_tokens import JoinTokenRefused
from gateway.pool_tokens import check_pool_claim
from models import pool_claim
from models.join import parse_user_data
from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document
from tests.hub.test_pools import beat
from tests.hub.test_pools import claim_body
from tests.hub.test_pools import cluster_with_policy
from tests.hub.test_pools import create_pool
from tests.hub.test_pools import enrol
from tests.hub.test_pools import enrol_request
from tests.hub.test_pools import heartbeat
from tests.hub.test_pools import register


async def _serving_for_b(hub: Hub) -> tuple[str, str, str, dict[str, str]]:
    """Pool dc1 with gpu-a and gpu-b enrolled; cluster B's claim on gpu-a taken up (joining). Returns the pool's
    enrolment token, both credentials and B's auth."""
    join = await create_pool(hub)
    cred_a, cred_b = await enrol(hub, join, "gpu-a"), await enrol(hub, join, "gpu-b")
    for server, cred in (("gpu-a", cred_a), ("gpu-b", cred_b)):
        assert (await heartbeat(hub, cred, beat(server))).status_code == 200
    b = await cluster_with_policy(hub, "cluster-b")
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-b1", ticket="TICKET-OF-B"), headers=b)
    assert r.status_code == 201 and r.json()["claim"]["server"] == "gpu-a", r.text
    taken = (await heartbeat(hub, cred_a, beat("gpu-a", phase="joining", operation="op-b1"))).json()
    assert "TICKET-OF-B" in taken["claim"]["user_data"]
    return join, cred_a, cred_b, b


def _no_ticket(r: Any) -> None:
    assert "TICKET-OF-B" not in r.text and "kpc1." not in r.text, r.text


async def test_h2_impersonation_another_servers_credential_or_the_pool_token_never_gets_its_claim(hub: Hub) -> None:
    join, _, cred_b, _ = await _serving_for_b(hub)
    before = hub.snapshot()
    # gpu-b's own credential, naming gpu-a
    r = await heartbeat(hub, cred_b, beat("gpu-a", phase="joining", operation="op-b1"))
    assert r.status_code == 403 and r.json()["error"] == "wrong_server", r.text
    _no_ticket(r)
    # the pool's token (every server of the pool holds it): enrolment only
    r = await heartbeat(hub, join, beat("gpu-a", phase="joining", operation="op-b1"))
    assert r.status_code == 403 and r.json()["error"] == "enrolment_token_only", r.text
    _no_ticket(r)
    # nor can it enrol gpu-a again and get a credential of its own for it
    r = await enrol_request(hub, join, "gpu-a")
    assert r.status_code == 409 and r.json()["error"] == "server_enrolled", r.text
    assert hub.snapshot()["pool_servers"] == before["pool_servers"]
    # gpu-b's credential, no server named: it is gpu-b, and gpu-b holds no claim
    r = await heartbeat(hub, cred_b, {**beat("gpu-b"), "server": None})
    assert r.status_code == 200 and r.json()["server"] == "gpu-b" and r.json()["claim"] is None
    _no_ticket(r)


async def test_h2_forged_release_a_server_cannot_report_another_servers_claim_idle(hub: Hub) -> None:
    join, _, cred_b, _ = await _serving_for_b(hub)
    a = await cluster_with_policy(hub, "cluster-a")
    for cred in (cred_b, join):
        for phase in ("joining", "serving", "idle"):
            r = await heartbeat(hub, cred, beat("gpu-a", phase=phase, operation="op-b1"))
            assert r.status_code == 403, r.text
    server = next(s for s in (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()["servers"]
                  if s["name"] == "gpu-a")
    assert server["stored_state"] == "joining" and server["claim_cluster"] == "cluster-b"
    # gpu-a still serves B: cluster A gets gpu-b (idle), never gpu-a
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-a1"), headers=a)
    assert r.status_code == 201 and r.json()["claim"]["server"] == "gpu-b", r.text
    assert not [e for e in await hub.audit() if e["action"] == "pool.server_released"]


async def test_h2_phantom_servers_and_changed_gpu_counts_are_refused(hub: Hub) -> None:
    join = await create_pool(hub)
    cred = await enrol(hub, join, "gpu-a")
    before = hub.snapshot()
    # a server no operator registered: no credential, not in the pool
    r = await enrol_request(hub, join, "phantom-h100", gpus=8)
    assert r.status_code == 403 and r.json()["error"] == "server_not_registered", r.text
    r = await heartbeat(hub, join, {**beat("phantom-h100", gpu_product="NVIDIA-H100", gpus=8)})
    assert r.status_code == 403, r.text
    # a registered server reporting more GPUs than registered: refused, the registration unchanged
    r = await heartbeat(hub, cred, beat("gpu-a", gpus=8))
    assert r.status_code == 409 and r.json()["error"] == "server_mismatch", r.text
    r = await enrol_request(hub, join, "gpu-a", gpus=8)
    assert r.status_code == 409, r.text
    assert hub.snapshot() == before
    servers = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()["servers"]
    assert [(s["name"], s["gpus"]) for s in servers] == [("gpu-a", 1)]
    assert not [e for e in await hub.audit() if "phantom" in e["target"]]


async def test_h2_a_revoked_server_credential_stops_its_next_join(hub: Hub, tmp_path: Path) -> None:
    join, cred_a, _, b = await _serving_for_b(hub)
    signed = (await heartbeat(hub, cred_a, beat("gpu-a", phase="joining", operation="op-b1"))).json()
    claim = signed["claim"]["pool_claim"]
    keys = pool_claim.load_public_keys((await hub.client.get("/v1/pool-claims/keys")).json()["pem"])
    ticket = str(parse_user_data(signed["claim"]["user_data"])["ticket"])
    keys_file = tmp_path / "claim-keys.pem"
    keys_file.write_text("".join(pool_claim.public_pem(k) for k in keys.values()))

    class Ticket:
        location, node_name, operation = "onprem/dc1", "burst-op-b1", "op-b1"

    now = hub.clock().timestamp()
    assert check_pool_claim(Ticket(), ticket, claim, keys_file, now=now) is not None  # the gateway accepts it
    r = await hub.client.post("/v1/pools/dc1/servers/gpu-a/credential/revoke", headers=hub.admin)
    assert r.status_code == 200 and r.json()["credential_id"] is None
    # its next heartbeat is refused: no new claim is signed for it ...
    r = await heartbeat(hub, cred_a, beat("gpu-a", phase="joining", operation="op-b1"))
    assert r.status_code == 401 and r.json()["error"] == "token_revoked"
    # ... so once the last one expires, the gateway refuses its join
    later = now + pool_claim.CLAIM_SECONDS + 1
    try:
        check_pool_claim(Ticket(), ticket, claim, keys_file, now=later)
        raise AssertionError("an expired claim was accepted")
    except JoinTokenRefused as exc:
        assert "expired" in str(exc)
    # released, it is never claimed again until it enrols again
    await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                          json={"operation": "op-b1", "policy": "inference-burst-eu"}, headers=b)
    pool = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()
    assert next(s for s in pool["servers"] if s["name"] == "gpu-a")["credential_id"] is None
    offers = (await hub.client.get("/v1/cluster/pools/dc1/offerings", headers=b)).json()["offerings"]
    assert [o["idle"] for o in offers] == [1]  # gpu-b only
    again = await enrol_request(hub, join, "gpu-a")
    assert again.status_code == 201 and again.json()["credential"] != cred_a
    assert (await heartbeat(hub, cred_a, beat("gpu-a"))).status_code == 401  # the old one stays revoked
    actions = [e["action"] for e in await hub.audit() if e["target"] == "dc1/gpu-a"]
    assert "pool.server_credential_revoked" in actions and actions.count("pool.server_enrolled") == 2


async def test_h2_an_operator_can_issue_a_servers_credential_without_the_pool_token(hub: Hub) -> None:
    await create_pool(hub)
    await register(hub, "gpu-a")
    operator = hub.bearer(await hub.create_user("olga", "operator"))
    r = await hub.client.post("/v1/pools/dc1/servers/gpu-a/credential", headers=operator)
    assert r.status_code == 201, r.text
    first = r.json()["credential"]
    assert (await heartbeat(hub, first, beat("gpu-a"))).status_code == 200
    second = (await hub.client.post("/v1/pools/dc1/servers/gpu-a/credential", headers=operator)).json()["credential"]
    assert (await heartbeat(hub, first, beat("gpu-a"))).status_code == 401  # re-issued: the previous one revoked
    assert (await heartbeat(hub, second, beat("gpu-a"))).status_code == 200


async def test_h2_the_signed_claim_names_server_cluster_node_operation_and_ticket(hub: Hub) -> None:
    _, cred_a, _, _ = await _serving_for_b(hub)
    signed = (await heartbeat(hub, cred_a, beat("gpu-a", phase="joining", operation="op-b1"))).json()["claim"]
    keys = pool_claim.load_public_keys((await hub.client.get("/v1/pool-claims/keys")).json()["pem"])
    claim = pool_claim.verify(signed["pool_claim"], keys, now=hub.clock().timestamp())
    assert (claim.pool, claim.server, claim.cluster, claim.node, claim.operation) == (
        "dc1", "gpu-a", "cluster-b", "burst-op-b1", "op-b1")
    assert claim.ticket_sha256 == pool_claim.ticket_digest("TICKET-OF-B")


async def test_h3_a_cluster_claims_at_most_its_policys_max_nodes_servers(hub: Hub) -> None:
    join = await create_pool(hub)
    for server in ("gpu-a", "gpu-b", "gpu-c"):
        await heartbeat(hub, await enrol(hub, join, server), beat(server))
    token = await hub.create_cluster("greedy")
    assert (await hub.put_policy("greedy", policy_document(max_nodes=2))).status_code == 201
    auth = hub.bearer(token)
    for op in ("op-1", "op-2"):
        assert (await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body(op),
                                      headers=auth)).status_code == 201
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-3"), headers=auth)
    assert r.status_code == 409 and r.json()["error"] == "max_nodes_reached", r.text
    # a retry of a held claim still answers
    assert (await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"),
                                  headers=auth)).status_code == 200
    servers = (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()["servers"]
    assert sorted(s["claim_operation"] or "" for s in servers) == ["", "op-1", "op-2"]


async def test_h3_user_data_without_a_ticket_for_the_claimed_node_is_refused(hub: Hub) -> None:
    join = await create_pool(hub)
    await heartbeat(hub, await enrol(hub, join, "gpu-a"), beat("gpu-a"))
    auth = await cluster_with_policy(hub, "prod-eu")
    for user_data in ("#!/bin/bash\necho no join document\n", claim_body("op-other")["user_data"]):
        r = await hub.client.post("/v1/cluster/pools/dc1/claims", json={**claim_body("op-1"), "user_data": user_data},
                                  headers=auth)
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "user_data", r.text


async def test_l7_a_claims_ticket_reaches_only_the_server_that_took_it_up(hub: Hub) -> None:
    join = await create_pool(hub, offline_after_seconds=30)
    cred_a, cred_b = await enrol(hub, join, "gpu-a"), await enrol(hub, join, "gpu-b")
    for server, cred in (("gpu-a", cred_a), ("gpu-b", cred_b)):
        await heartbeat(hub, cred, beat(server))
    auth = await cluster_with_policy(hub, "prod-eu")
    body = claim_body("op-1", ticket="THE-ONE-TICKET")
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=body, headers=auth)
    assert r.json()["claim"]["server"] == "gpu-a"
    # gpu-a sees the claim but not its ticket, then goes silent; the launch withdraws it
    seen = await heartbeat(hub, cred_a, beat("gpu-a"))
    assert seen.json()["claim"]["operation"] == "op-1" and "THE-ONE-TICKET" not in seen.text
    hub.clock.advance(timedelta(seconds=31))
    await heartbeat(hub, cred_b, beat("gpu-b"))
    rel = await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                                json={"operation": "op-1", "policy": "inference-burst-eu", "withdraw": True},
                                headers=auth)
    assert rel.json()["released"] is True
    # the same launch claims gpu-b with the same user data; gpu-a, back, taking up the old claim, gets nothing
    r = await hub.client.post("/v1/cluster/pools/dc1/claims", json=body, headers=auth)
    assert r.status_code == 201 and r.json()["claim"]["server"] == "gpu-b", r.text
    late = await heartbeat(hub, cred_a, beat("gpu-a", phase="joining", operation="op-1"))
    assert late.json()["claim"] is None and "THE-ONE-TICKET" not in late.text
    taken = await heartbeat(hub, cred_b, beat("gpu-b", phase="joining", operation="op-1"))
    assert "THE-ONE-TICKET" in taken.json()["claim"]["user_data"]
    # taken up, the claim can no longer be withdrawn: the server has the ticket, so it stays this launch's
    rel = await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-b/release",
                                json={"operation": "op-1", "policy": "inference-burst-eu", "withdraw": True},
                                headers=auth)
    assert rel.json() == {"server": "gpu-b", "released": False, "state": "joining"}


async def test_l7_a_withdrawal_racing_the_take_up_either_withdraws_or_leaves_the_claim_standing(hub: Hub) -> None:
    join = await create_pool(hub)
    cred = await enrol(hub, join, "gpu-a")
    await heartbeat(hub, cred, beat("gpu-a"))
    auth = await cluster_with_policy(hub, "prod-eu")
    for i in range(6):
        op = f"op-{i}"
        assert (await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body(op), headers=auth)
                ).status_code == 201
        withdraw, taken = await asyncio.gather(
            hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                            json={"operation": op, "policy": "inference-burst-eu", "withdraw": True}, headers=auth),
            heartbeat(hub, cred, beat("gpu-a", phase="joining", operation=op)))
        got_ticket = f"ticket-of-{op}" in taken.text
        assert withdraw.json()["released"] is not got_ticket, (withdraw.text, taken.text)
        server = next(s for s in (await hub.client.get("/v1/pools/dc1", headers=hub.admin)).json()["servers"])
        assert server["stored_state"] == ("joining" if got_ticket else "idle"), server
        if got_ticket:  # release it for the next round
            await hub.client.post("/v1/cluster/pools/dc1/servers/gpu-a/release",
                                  json={"operation": op, "policy": "inference-burst-eu"}, headers=auth)
            await heartbeat(hub, cred, beat("gpu-a", phase="idle", operation=op))


async def test_an_agent_may_decline_a_claim_it_is_not_configured_for(hub: Hub) -> None:
    join = await create_pool(hub)
    cred = await enrol(hub, join, "gpu-a")
    await heartbeat(hub, cred, beat("gpu-a"))
    auth = await cluster_with_policy(hub, "prod-eu")
    await hub.client.post("/v1/cluster/pools/dc1/claims", json=claim_body("op-1"), headers=auth)
    r = await heartbeat(hub, cred, beat("gpu-a", phase="idle", operation="op-1"))
    assert r.json()["claim"] is None and r.json()["state"] == "idle"
    assert "pool.claim_declined" in [e["action"] for e in await hub.audit()]
    claim = await hub.client.get("/v1/cluster/pools/dc1/servers/gpu-a", headers=auth)
    assert claim.status_code == 404
