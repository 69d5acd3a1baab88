"""A cluster token reads only its own cluster's policies and approvals and writes only its own reports (R2.1)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document
from tests.hub.helpers import report


async def _two_clusters(hub: Hub) -> tuple[str, str]:
    token_a = await hub.create_cluster("cluster-a")
    token_b = await hub.create_cluster("cluster-b")
    assert (await hub.put_policy("cluster-a", policy_document("only-a"))).status_code == 201
    assert (await hub.put_policy("cluster-b", policy_document("only-b", max_nodes=2))).status_code == 201
    for cluster, op, token in (("cluster-a", "op-aaaaaaaaaaaa", token_a), ("cluster-b", "op-bbbbbbbbbbbb", token_b)):
        await hub.propose(token, op)
        r = await hub.client.post(f"/v1/clusters/{cluster}/approvals", json={"operation": op, "decision": "approve"},
                                  headers=hub.admin)
        assert r.status_code == 201, r.text
    r = await hub.client.post("/v1/cluster/reports", json=report("b-1"), headers=hub.bearer(token_b))
    assert r.status_code == 201, r.text
    return token_a, token_b


# Everything cluster A's token could try against cluster B (and the people's API in general).
FOREIGN: list[tuple[str, str, Any]] = [
    ("GET", "/v1/clusters/cluster-b", None),
    ("GET", "/v1/clusters", None),
    ("GET", "/v1/clusters/cluster-b/policies", None),
    ("GET", "/v1/clusters/cluster-b/policies/only-b", None),
    ("PUT", "/v1/clusters/cluster-b/policies/only-b", policy_document("only-b", max_nodes=9)),
    ("PUT", "/v1/clusters/cluster-b/policies/sneaky", policy_document("sneaky")),
    ("DELETE", "/v1/clusters/cluster-b/policies/only-b", None),
    ("GET", "/v1/clusters/cluster-b/approvals", None),
    ("POST", "/v1/clusters/cluster-b/approvals", {"operation": "op-cccccccccccc", "decision": "approve"}),
    ("POST", "/v1/clusters/cluster-a/approvals", {"operation": "op-dddddddddddd", "decision": "approve"}),
    ("GET", "/v1/clusters/cluster-b/reports", None),
    ("POST", "/v1/clusters/cluster-b/token/rotate", None),
    ("POST", "/v1/clusters/cluster-b/token/revoke", None),
    ("POST", "/v1/clusters", {"name": "cluster-c"}),
    ("GET", "/v1/audit", None),
    ("GET", "/v1/users", None),
    ("POST", "/v1/users", {"name": "mallory", "role": "admin"}),
    # an unknown cluster looks exactly like a known one: no existence leak
    ("GET", "/v1/clusters/no-such-cluster/policies", None),
]


@pytest.mark.parametrize(("method", "path", "body"), FOREIGN, ids=[f"{m} {p}" for m, p, _ in FOREIGN])
async def test_cluster_token_cannot_touch_another_cluster(hub: Hub, method: str, path: str, body: Any) -> None:
    token_a, _ = await _two_clusters(hub)
    before = hub.snapshot()
    r = await hub.client.request(method, path, json=body, headers=hub.bearer(token_a))
    assert r.status_code == 403, r.text
    assert r.json()["error"] == "cluster_token_not_allowed"
    assert "cluster tokens may only call /v1/cluster/" in r.json()["message"]
    assert hub.snapshot() == before  # not even cluster A's last_seen moved


async def test_cluster_token_sees_and_writes_only_its_own_cluster(hub: Hub) -> None:
    token_a, token_b = await _two_clusters(hub)

    pulled = (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(token_a))).json()
    assert pulled["cluster"] == "cluster-a"
    assert [p["metadata"]["name"] for p in pulled["policies"]] == ["only-a"]
    approvals = (await hub.client.get("/v1/cluster/approvals", headers=hub.bearer(token_a))).json()
    assert [a["operation"] for a in approvals["approvals"]] == ["op-aaaaaaaaaaaa"]

    # the same idempotency key as cluster B's report is cluster A's own, separate report
    r = await hub.client.post("/v1/cluster/reports", json=report("b-1", detail="a"), headers=hub.bearer(token_a))
    assert r.status_code == 201 and r.json()["cluster"] == "cluster-a"
    a_reports = (await hub.client.get("/v1/clusters/cluster-a/reports", headers=hub.admin)).json()["reports"]
    b_reports = (await hub.client.get("/v1/clusters/cluster-b/reports", headers=hub.admin)).json()["reports"]
    assert [(r["action"], r["detail"]) for r in a_reports] == [("proposed", "plan: 1 node"), ("launched", "a")]
    assert [(r["action"], r["detail"]) for r in b_reports] == [("proposed", "plan: 1 node"),
                                                               ("launched", "g5.xlarge launched")]

    # B's ETag means nothing to A
    etag_b = (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(token_b))).headers["etag"]
    r = await hub.client.get("/v1/cluster/policies", headers=hub.bearer(token_a) | {"If-None-Match": etag_b})
    assert r.status_code == 200


async def test_api_key_cannot_use_the_cluster_endpoints(hub: Hub) -> None:
    await _two_clusters(hub)
    before = hub.snapshot()
    for method, path in (("GET", "/v1/cluster/policies"), ("GET", "/v1/cluster/approvals"),
                         ("POST", "/v1/cluster/reports")):
        r = await hub.client.request(method, path, json=report("x") if method == "POST" else None, headers=hub.admin)
        assert r.status_code == 403 and r.json()["error"] == "cluster_token_required", r.text
    assert hub.snapshot() == before
