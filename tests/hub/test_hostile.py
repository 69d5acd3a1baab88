"""The cases of issue 14, each a named regression test on SQLite and PostgreSQL: cursors beyond what the databases
store, NUL and other control characters in texts and filters, and approvals nothing could act on. Each is refused
with a 4xx naming the field (never a 500, never a database error) and changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hub.schemas import MAX_ID
from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document
from tests.hub.helpers import report

CURSOR_PATHS = ["/v1/cluster/approvals", "/v1/clusters/prod-eu/approvals", "/v1/clusters/prod-eu/reports",
                "/v1/audit"]


@pytest.fixture
async def auth(hub: Hub) -> dict[str, dict[str, str]]:
    token = await hub.create_cluster("prod-eu")
    return {"cluster": hub.bearer(token), "admin": hub.admin}


def _headers(path: str, auth: dict[str, dict[str, str]]) -> dict[str, str]:
    return auth["cluster"] if path.startswith("/v1/cluster/") else auth["admin"]


def _refused(r: Any, status: int, field: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body: dict[str, Any] = r.json()
    assert field in [d["field"] for d in body["details"]], body
    return body


@pytest.mark.parametrize("value", [2**31, 2**63 - 1, 2**63, 2**64, 10**30], ids=lambda v: f"after={v}")
@pytest.mark.parametrize("path", CURSOR_PATHS)
async def test_cursor_beyond_what_the_databases_store_is_a_422_naming_after(
        hub: Hub, auth: dict[str, dict[str, str]], path: str, value: int) -> None:
    before = hub.snapshot()
    r = await hub.client.get(path, params={"after": value}, headers=_headers(path, auth))
    body = _refused(r, 422, "query.after")
    assert "less than or equal to 2147483647" in body["message"]
    assert hub.snapshot() == before


@pytest.mark.parametrize("path", CURSOR_PATHS)
async def test_the_largest_cursor_is_answered(hub: Hub, auth: dict[str, dict[str, str]], path: str) -> None:
    r = await hub.client.get(path, params={"after": MAX_ID}, headers=_headers(path, auth))
    assert r.status_code == 200, r.text
    assert r.json()["cursor"] == MAX_ID


NUL = "before\x00after"


async def test_nul_in_a_cluster_description_is_refused_naming_it(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    before = hub.snapshot()
    r = await hub.client.post("/v1/clusters", json={"name": "nul-desc", "description": NUL}, headers=hub.admin)
    body = _refused(r, 422, "description")
    assert "U+0000" in body["message"] and "position 6" in body["message"]
    assert hub.snapshot() == before


async def test_nul_in_an_api_key_description_is_refused_naming_it(hub: Hub) -> None:
    assert (await hub.client.post("/v1/users", json={"name": "alice", "role": "viewer"},
                                  headers=hub.admin)).status_code == 201
    before = hub.snapshot()
    r = await hub.client.post("/v1/users/alice/keys", json={"description": NUL}, headers=hub.admin)
    _refused(r, 422, "description")
    assert hub.snapshot() == before


async def test_nul_in_an_approval_reason_is_refused_naming_it(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    token = auth["cluster"]["Authorization"].removeprefix("Bearer ")
    await hub.propose(token, "op-0123456789ab")
    before = hub.snapshot()
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-0123456789ab", "decision": "approve", "reason": NUL})
    _refused(r, 422, "reason")
    assert hub.snapshot() == before


@pytest.mark.parametrize("field", ["detail", "instance", "node"])
async def test_nul_in_a_report_is_refused_naming_the_field(
        hub: Hub, auth: dict[str, dict[str, str]], field: str) -> None:
    before = hub.snapshot()
    r = await hub.client.post("/v1/cluster/reports", json=report("k-nul", **{field: NUL}), headers=auth["cluster"])
    _refused(r, 422, field)
    assert hub.snapshot() == before


@pytest.mark.parametrize("char", ["\x01", "\x1b", "\x7f", "\x85", "\ud800"], ids=["SOH", "ESC", "DEL", "NEL",
                                                                                   "lone-surrogate"])
async def test_other_control_characters_in_a_report_detail_are_refused(
        hub: Hub, auth: dict[str, dict[str, str]], char: str) -> None:
    before = hub.snapshot()
    # ensure_ascii JSON carries a lone surrogate as the escape \ud800, as a hostile client would send it
    r = await hub.client.post("/v1/cluster/reports", content=json.dumps(report("k-ctl", detail=f"a{char}b")),
                              headers=auth["cluster"] | {"Content-Type": "application/json"})
    body = _refused(r, 422, "detail")
    assert f"U+{ord(char):04X}" in body["message"]
    assert hub.snapshot() == before


async def test_tabs_and_newlines_in_a_report_detail_are_kept(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    r = await hub.client.post("/v1/cluster/reports", json=report("k-lines", detail="line 1\n\tline 2\r\n"),
                              headers=auth["cluster"])
    assert r.status_code == 201, r.text
    assert r.json()["detail"] == "line 1\n\tline 2\r\n"


@pytest.mark.parametrize(("path", "param", "field"), [
    ("/v1/audit", "action", "query.action"),
    ("/v1/clusters/prod-eu/reports", "operation", "query.operation"),
])
async def test_nul_in_a_filter_is_refused_naming_it(
        hub: Hub, auth: dict[str, dict[str, str]], path: str, param: str, field: str) -> None:
    before = hub.snapshot()
    r = await hub.client.get(path, params={param: NUL}, headers=hub.admin)
    _refused(r, 422, field)
    assert hub.snapshot() == before


async def test_nul_in_a_policy_annotation_is_refused_naming_it(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    doc = policy_document("p")
    doc["metadata"]["annotations"] = {"note": NUL}
    before = hub.snapshot()
    r = await hub.put_policy("prod-eu", doc)
    body = _refused(r, 422, "metadata.annotations.note")
    assert body["error"] == "invalid_policy"
    doc["metadata"]["annotations"] = {"bad\x00key": "x"}
    r = await hub.put_policy("prod-eu", doc)
    assert r.status_code == 422 and "U+0000" in r.json()["message"], r.text
    assert hub.snapshot() == before


async def test_approval_of_an_operation_the_cluster_never_proposed_is_a_404_naming_it(
        hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    before = hub.snapshot()
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-000000000000", "decision": "approve"})
    body = _refused(r, 404, "operation")
    assert body["error"] == "operation_not_proposed"
    assert "'op-000000000000'" in body["message"] and "has not proposed" in body["message"]
    assert hub.snapshot() == before
    # a report of another action of it is not a proposal either
    r = await hub.client.post("/v1/cluster/reports", json=report("k-l", operation="op-000000000000"),
                              headers=auth["cluster"])
    assert r.status_code == 201
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-000000000000", "decision": "reject"})
    assert r.status_code == 404 and r.json()["error"] == "operation_not_proposed", r.text


async def test_approval_of_another_clusters_proposal_is_refused(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    other = await hub.create_cluster("other")
    await hub.propose(other, "op-0123456789ab")
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-0123456789ab", "decision": "approve"})
    assert r.status_code == 404 and r.json()["error"] == "operation_not_proposed", r.text


async def test_approval_of_an_operation_that_ended_is_a_409_naming_how(
        hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    token = auth["cluster"]["Authorization"].removeprefix("Bearer ")
    await hub.propose(token, "op-0123456789ab")
    r = await hub.client.post("/v1/cluster/reports", headers=auth["cluster"],
                              json=report("k-exp", operation="op-0123456789ab", action="expired",
                                          occurred_at="2025-03-01T13:00:00Z"))
    assert r.status_code == 201
    before = hub.snapshot()
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-0123456789ab", "decision": "approve"})
    body = _refused(r, 409, "operation")
    assert body["error"] == "operation_ended" and "expired at 2025-03-01T13:00:00" in body["message"]
    assert hub.snapshot() == before


async def test_approval_of_a_proposed_operation_is_recorded_and_pulled(
        hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    token = auth["cluster"]["Authorization"].removeprefix("Bearer ")
    await hub.propose(token, "op-0123456789ab")
    r = await hub.client.post("/v1/clusters/prod-eu/approvals", headers=hub.admin,
                              json={"operation": "op-0123456789ab", "decision": "approve"})
    assert r.status_code == 201, r.text
    pulled = (await hub.client.get("/v1/cluster/approvals", headers=auth["cluster"])).json()
    assert [a["operation"] for a in pulled["approvals"]] == ["op-0123456789ab"]


async def test_an_empty_unknown_key_in_a_policy_is_named(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    r = await hub.client.put("/v1/clusters/prod-eu/policies/p", json={"": 0}, headers=hub.admin)
    _refused(r, 422, "(document)")


async def test_the_optimizers_report_details_are_always_accepted(hub: Hub, auth: dict[str, dict[str, str]]) -> None:
    """The worker puts error text into details: report_detail makes any of it storable (and within the limit)."""
    from models.hub import report_detail

    raw = "exit\x00 \x1b[31mred\x1b[0m\nnext\tline \ud800" + "x" * 9000
    r = await hub.client.post("/v1/cluster/reports", headers=auth["cluster"] | {"Content-Type": "application/json"},
                              content=json.dumps(report("k-detail", detail=report_detail(raw))))
    assert r.status_code == 201, r.text
    assert r.json()["detail"].startswith("exit\ufffd \ufffd[31mred\ufffd[0m\nnext\tline \ufffd")
