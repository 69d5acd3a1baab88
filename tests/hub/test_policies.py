"""Policies per cluster: validated like the optimizer does, revisioned, pulled with conditional requests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.hub.conftest import Hub
from tests.hub.helpers import INVALID_POLICIES
from tests.hub.helpers import VALID_POLICY
from tests.hub.helpers import apply_case
from tests.hub.helpers import policy_document


async def test_conditional_pull_304_while_unchanged_200_with_a_new_etag_after_a_change(hub: Hub) -> None:
    token = await hub.create_cluster("prod-eu")
    auth = hub.bearer(token)

    empty = await hub.client.get("/v1/cluster/policies", headers=auth)
    assert empty.status_code == 200 and empty.json()["policies"] == [] and empty.json()["revision"] == 0
    etag0 = empty.headers["etag"]
    assert empty.json()["etag"] == etag0

    assert (await hub.put_policy("prod-eu", policy_document("b-policy"))).status_code == 201
    assert (await hub.put_policy("prod-eu", policy_document("a-policy"))).status_code == 201
    r = await hub.client.get("/v1/cluster/policies", headers=auth | {"If-None-Match": etag0})
    assert r.status_code == 200 and r.json()["revision"] == 2
    assert [p["metadata"]["name"] for p in r.json()["policies"]] == ["a-policy", "b-policy"]
    assert r.json()["policies"][0] == policy_document("a-policy")
    etag2 = r.headers["etag"]
    assert etag2 != etag0

    for if_none_match in (etag2, f"W/{etag2}", f'"other", {etag2}', "*"):
        r = await hub.client.get("/v1/cluster/policies", headers=auth | {"If-None-Match": if_none_match})
        assert r.status_code == 304, if_none_match
        assert r.content == b"" and r.headers["etag"] == etag2

    # the same document again is no change: same revision, still 304
    same = await hub.put_policy("prod-eu", policy_document("a-policy"))
    assert same.status_code == 200 and same.json()["changed"] is False and same.json()["revision"] == 2
    assert (await hub.client.get("/v1/cluster/policies", headers=auth | {"If-None-Match": etag2})).status_code == 304

    # a change (R2.7: to Recommend) and a delete each bump the revision and the ETag
    changed = await hub.put_policy("prod-eu", policy_document("a-policy", mode="Recommend"))
    assert changed.status_code == 200 and changed.json()["changed"] is True and changed.json()["revision"] == 3
    r = await hub.client.get("/v1/cluster/policies", headers=auth | {"If-None-Match": etag2})
    assert r.status_code == 200 and r.json()["policies"][0]["spec"]["mode"] == "Recommend"
    etag3 = r.headers["etag"]
    assert etag3 not in (etag0, etag2)

    deleted = await hub.client.delete("/v1/clusters/prod-eu/policies/b-policy", headers=hub.admin)
    assert deleted.status_code == 200 and deleted.json()["revision"] == 4
    r = await hub.client.get("/v1/cluster/policies", headers=auth | {"If-None-Match": etag3})
    assert r.status_code == 200 and [p["metadata"]["name"] for p in r.json()["policies"]] == ["a-policy"]
    assert (await hub.client.get("/v1/clusters/prod-eu/policies/b-policy", headers=hub.admin)).status_code == 404

    actions = [(e["action"], e["target"], e["detail"].get("revision")) for e in await hub.audit(cluster="prod-eu")
               if e["action"].startswith("policy.")]
    assert actions == [("policy.created", "b-policy", 1), ("policy.created", "a-policy", 2),
                       ("policy.changed", "a-policy", 3), ("policy.deleted", "b-policy", 4)]


async def test_stored_document_is_normalized(hub: Hub) -> None:
    await hub.create_cluster("prod-eu")
    doc = policy_document("p")
    doc["metadata"].update({"uid": "abc", "resourceVersion": "7", "labels": {"team": "ml"}})
    doc["status"] = {"conditions": []}
    doc["spec"]["return_home"] = doc["spec"].pop("returnHome")  # the model accepts field names too
    r = await hub.put_policy("prod-eu", doc)
    assert r.status_code == 201, r.text
    stored = r.json()["policy"]["document"]
    assert stored["metadata"] == {"name": "p", "labels": {"team": "ml"}}
    assert "status" not in stored and stored["spec"]["returnHome"] is True


@pytest.mark.parametrize("case", INVALID_POLICIES, ids=[c["name"] for c in INVALID_POLICIES])
async def test_invalid_policy_is_refused_naming_the_field(hub: Hub, case: dict[str, Any]) -> None:
    await hub.create_cluster("prod-eu")
    before = hub.snapshot()
    name = VALID_POLICY["metadata"]["name"]
    r = await hub.client.put(f"/v1/clusters/prod-eu/policies/{name}", json=apply_case(case), headers=hub.admin)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "invalid_policy"
    assert case["field"] in [d["field"] for d in body["details"]]
    assert case["field"] in body["message"]
    assert hub.snapshot() == before


async def test_policy_name_must_match_the_path_and_cluster_must_exist(hub: Hub) -> None:
    await hub.create_cluster("prod-eu")
    before = hub.snapshot()
    r = await hub.client.put("/v1/clusters/prod-eu/policies/other", json=policy_document("p"), headers=hub.admin)
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "metadata.name"
    r = await hub.put_policy("nowhere", policy_document("p"))
    assert r.status_code == 404 and r.json()["error"] == "cluster_not_found" and "'nowhere'" in r.json()["message"]
    r = await hub.client.delete("/v1/clusters/prod-eu/policies/p", headers=hub.admin)
    assert r.status_code == 404 and r.json()["error"] == "policy_not_found"
    assert hub.snapshot() == before
