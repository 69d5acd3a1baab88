"""Malformed requests each get a clear 4xx naming the cause, and change nothing (not even last-seen times)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.hub.conftest import Hub
from tests.hub.helpers import policy_document
from tests.hub.helpers import report

MIB = 1024 * 1024
NO_AUTH = "none"


@dataclass
class Case:
    id: str
    method: str
    path: str
    status: int
    error: str
    says: str  # the message names the cause
    auth: str = "cluster"  # cluster | revoked | admin | none | a literal Authorization header value
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    field: str | None = None  # the field `details` must name
    chunked: int = 0  # send this many bytes as a chunked body (no Content-Length)


JSON = {"Content-Type": "application/json"}
CASES = [
    # bodies that are not JSON, or not the JSON asked for
    Case("bad-json", "POST", "/v1/clusters", 400, "invalid_json", "not valid JSON", auth="admin",
         content=b'{"name": "x",}', headers=JSON),
    Case("truncated-json", "POST", "/v1/cluster/reports", 400, "invalid_json", "not valid JSON",
         content=b'{"idempotency_key": "k", "operation": ', headers=JSON),
    Case("empty-body", "POST", "/v1/cluster/reports", 400, "empty_body", "body is empty", content=b"", headers=JSON),
    Case("nan", "POST", "/v1/cluster/reports", 400, "invalid_json", "NaN", content=b'{"detail": NaN}', headers=JSON),
    Case("not-utf8", "POST", "/v1/clusters", 400, "invalid_json", "UTF-8", auth="admin",
         content=b'{"name": "\xff\xfe"}', headers=JSON),
    Case("nested-too-deep", "POST", "/v1/cluster/reports", 400, "invalid_json", "nested too deeply",
         content=b"[" * 100_000, headers=JSON),
    Case("array-not-object", "POST", "/v1/clusters", 422, "invalid_request", "valid dictionary", auth="admin",
         json=["prod"], field="body"),
    Case("name-wrong-type", "POST", "/v1/clusters", 422, "invalid_request", "valid string", auth="admin",
         json={"name": 5}, field="name"),
    Case("name-not-dns-label", "POST", "/v1/clusters", 422, "invalid_request", "pattern", auth="admin",
         json={"name": "Prod_EU"}, field="name"),
    Case("occurred-at-garbage", "POST", "/v1/cluster/reports", 422, "invalid_request", "occurred_at",
         json=report("k") | {"occurred_at": "yesterday"}, field="occurred_at"),
    Case("occurred-at-naive", "POST", "/v1/cluster/reports", 422, "invalid_request", "timezone",
         json=report("k") | {"occurred_at": "2025-03-01T12:00:00"}, field="occurred_at"),
    Case("unknown-action", "POST", "/v1/cluster/reports", 422, "invalid_request", "action",
         json=report("k", action="exploded"), field="action"),
    Case("missing-idempotency-key", "POST", "/v1/cluster/reports", 422, "invalid_request", "Field required",
         json={k: v for k, v in report("k").items() if k != "idempotency_key"}, field="idempotency_key"),
    Case("extra-field", "POST", "/v1/cluster/reports", 422, "invalid_request", "Extra inputs",
         json=report("k") | {"cluster": "cluster-b"}, field="cluster"),
    Case("bad-location", "POST", "/v1/cluster/reports", 422, "invalid_request", "unknown provider 'mars'",
         json=report("k", location="mars/base-1"), field="location"),
    Case("decision-unknown", "POST", "/v1/clusters/prod-eu/approvals", 422, "invalid_request", "decision",
         auth="admin", json={"operation": "op-1", "decision": "maybe"}, field="decision"),
    Case("policy-not-a-mapping", "PUT", "/v1/clusters/prod-eu/policies/p", 422, "invalid_policy", "mapping",
         auth="admin", json=["not", "a", "policy"], field="(document)"),
    Case("policy-wrong-type", "PUT", "/v1/clusters/prod-eu/policies/p", 422, "invalid_policy",
         "spec.limits.maxNodes", auth="admin",
         json=policy_document("p") | {"spec": policy_document("p")["spec"] | {"limits": {"maxNodes": "4",
                                                                                          "maxGpuHour": 1.0}}},
         field="spec.limits.maxNodes"),
    # size and content type
    Case("huge-body", "POST", "/v1/cluster/reports", 413, "body_too_large", "limit is 1048576 bytes",
         content=b'{"detail": "' + b"x" * (2 * MIB) + b'"}', headers=JSON),
    Case("huge-policy", "PUT", "/v1/clusters/prod-eu/policies/p", 413, "body_too_large", "too large", auth="admin",
         content=b" " * (MIB + 1), headers=JSON),
    Case("huge-chunked", "POST", "/v1/cluster/reports", 413, "body_too_large", "more than 1048576 bytes",
         chunked=2 * MIB, headers=JSON),
    Case("text-plain", "POST", "/v1/cluster/reports", 415, "unsupported_media_type", "'text/plain'",
         content=b'{"idempotency_key": "k"}', headers={"Content-Type": "text/plain"}),
    Case("no-content-type", "POST", "/v1/clusters", 415, "unsupported_media_type", "Content-Type header missing",
         auth="admin", content=b'{"name": "x"}'),
    Case("form-encoded", "POST", "/v1/clusters", 415, "unsupported_media_type", "application/x-www-form-urlencoded",
         auth="admin", content=b"name=x", headers={"Content-Type": "application/x-www-form-urlencoded"}),
    # credentials
    Case("no-token", "GET", "/v1/cluster/policies", 401, "missing_token", "Authorization header missing",
         auth=NO_AUTH),
    Case("basic-auth", "GET", "/v1/cluster/policies", 401, "malformed_authorization", "expected 'Bearer <token>'",
         auth="Basic dXNlcjpwYXNz"),
    Case("bearer-empty", "GET", "/v1/cluster/policies", 401, "malformed_authorization", "token is empty",
         auth="Bearer "),
    Case("garbage-token", "GET", "/v1/cluster/policies", 401, "invalid_token", "not a hub cluster token",
         auth="Bearer hunter2"),
    Case("unknown-cluster-token", "POST", "/v1/cluster/reports", 401, "invalid_token", "unknown or wrong secret",
         auth="Bearer kgc_0123456789abcdef_" + "A" * 43, json=report("k")),
    Case("unknown-api-key", "POST", "/v1/clusters", 401, "invalid_token", "invalid API key",
         auth="Bearer kgk_0123456789abcdef_" + "A" * 43, json={"name": "x"}),
    Case("revoked-token", "POST", "/v1/cluster/reports", 401, "token_revoked", "revoked at", auth="revoked",
         json=report("k")),
    Case("bad-token-before-bad-body", "POST", "/v1/cluster/reports", 401, "invalid_token", "not a hub",
         auth="Bearer nope", content=b"{bad", headers=JSON),
    # paths and queries
    Case("unknown-cluster", "POST", "/v1/clusters/atlantis/token/rotate", 404, "cluster_not_found", "'atlantis'",
         auth="admin"),
    Case("unknown-cluster-approval", "POST", "/v1/clusters/atlantis/approvals", 404, "cluster_not_found",
         "'atlantis'", auth="admin", json={"operation": "op-1", "decision": "approve"}),
    Case("cluster-name-invalid", "GET", "/v1/clusters/Prod_EU", 422, "invalid_request", "pattern", auth="admin",
         field="path.cluster"),
    Case("negative-cursor", "GET", "/v1/cluster/approvals?after=-1", 422, "invalid_request", "greater than",
         field="query.after"),
    Case("limit-not-a-number", "GET", "/v1/cluster/approvals?limit=ten", 422, "invalid_request", "integer",
         field="query.limit"),
    Case("limit-too-large", "GET", "/v1/audit?limit=100000", 422, "invalid_request", "less than", auth="admin",
         field="query.limit"),
    Case("unknown-endpoint", "GET", "/v1/clusterz", 404, "not_found", "no such endpoint: GET /v1/clusterz"),
    Case("wrong-method", "DELETE", "/v1/clusters", 405, "method_not_allowed", "(allowed: GET, POST)", auth="admin"),
    # conflicts
    Case("cluster-exists", "POST", "/v1/clusters", 409, "cluster_exists", "already exists", auth="admin",
         json={"name": "prod-eu"}),
]


@pytest.fixture
async def setup(hub: Hub) -> dict[str, str]:
    token = await hub.create_cluster("prod-eu")
    revoked = await hub.create_cluster("gone")
    await hub.client.post("/v1/clusters/gone/token/revoke", headers=hub.admin)
    assert (await hub.put_policy("prod-eu", policy_document("p"))).status_code == 201
    assert (await hub.client.get("/v1/cluster/policies", headers=hub.bearer(token))).status_code == 200
    return {"cluster": f"Bearer {token}", "revoked": f"Bearer {revoked}", "admin": hub.admin["Authorization"]}


def test_there_are_at_least_20_malformed_cases() -> None:
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


async def _chunks(size: int) -> AsyncIterator[bytes]:
    yield b'{"detail": "'
    sent = 0
    while sent < size:
        yield b"x" * 65536
        sent += 65536
    yield b'"}'


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_malformed_request_gets_a_clear_4xx_and_changes_nothing(
    hub: Hub, setup: dict[str, str], case: Case
) -> None:
    headers = dict(case.headers)
    if case.auth != NO_AUTH:
        headers["Authorization"] = setup.get(case.auth, case.auth)
    before = hub.snapshot()
    content: Any = _chunks(case.chunked) if case.chunked else case.content
    r = await hub.client.request(case.method, case.path, json=case.json, content=content, headers=headers)
    assert r.status_code == case.status, r.text
    body = r.json()
    assert set(body) == {"error", "message", "details"}
    assert body["error"] == case.error, body
    assert case.says in body["message"], body
    if case.field is not None:
        assert case.field in [d["field"] for d in body["details"]], body
    if case.status == 401:
        assert r.headers["www-authenticate"].startswith('Bearer realm="kubeon-hub"')
    assert hub.snapshot() == before


async def test_unreachable_database_is_a_clear_503(app: FastAPI) -> None:
    from hub.auth import HubState
    from hub.db import Database
    from hub.settings import HubSettings
    from tests.harness.controlplane import free_port
    from tests.hub.conftest import BOOTSTRAP_KEY
    from tests.hub.conftest import FakeClock

    url = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing-listens-here"
    db = Database(url)
    app.state.hub = HubState(settings=HubSettings(database_url=url, bootstrap_admin_key=BOOTSTRAP_KEY),
                             clock=FakeClock(), db=db)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hub.test") as client:
            for path in ("/healthz", "/v1/cluster/policies"):
                r = await client.get(path, headers={"Authorization": "Bearer kgc_0123456789abcdef_" + "A" * 43})
                assert r.status_code == 503, r.text
                assert r.json()["error"] == "database_unavailable" and "retry later" in r.json()["message"]
    finally:
        db.dispose()
