"""Every hub endpoint (on-prem pools and their agents' heartbeat included) driven with generated hostile input
(hypothesis), on SQLite and PostgreSQL: integers at and
beyond 2^31 and 2^63, NUL and other control characters, lone surrogates, long strings, wrong types, unicode, extra
and missing fields, in paths, queries and bodies. The hub never answers 5xx, every refusal is a 4xx in the error
shape whose ``details`` name real fields of the endpoint, and a refusal leaves every stored row as it was."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from hub.app import create_app
from hub.db import Database
from hub.schemas import disallowed_character
from hub.settings import HubSettings
from models.join import render_user_data
from tests.hub.conftest import BOOTSTRAP_KEY
from tests.hub.conftest import FakeClock
from tests.hub.conftest import snapshot
from tests.hub.helpers import policy_document

EXAMPLES: Final = 450  # per database (39 endpoints): ~8 s on an idle machine, about a minute on a busy 2-core one
ABSENT: Final = object()
PROPOSED: Final = "op-000000000001"

# ----- hostile values -----

BOUNDARY_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                                 -(2**63) - 1, 2**64, 10**30, -(10**30)])
INTS = BOUNDARY_INTS | st.integers()
CONTROL = st.characters(max_codepoint=0x1F) | st.sampled_from(["\x7f", "\x85", "\x9f", "\ud800", "\udbff",
                                                               "\udfff"])
WITH_CONTROL = st.tuples(st.text(max_size=8), CONTROL, st.text(max_size=8)).map("".join)
LONG = st.integers(min_value=64, max_value=20_000).map(lambda n: "x" * n) | st.text(min_size=200, max_size=400)
UNICODE = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["ünïcødé", "日本語", "🚀💥", "\u202eevil", "a\u200bb", "\ufeff", "Ω" * 63])
SCALAR_WRONG = st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
CONTAINERS = st.lists(INTS, max_size=3) | st.dictionaries(st.text(max_size=4), INTS, max_size=2)
# Texts with a control character weigh as much as all other kinds together: they reach the most code.
HOSTILE = st.one_of(BOUNDARY_INTS, st.integers(), LONG, UNICODE, SCALAR_WRONG, CONTAINERS, *[WITH_CONTROL] * 6)
HOSTILE_TEXT = st.one_of(INTS.map(str), LONG, UNICODE, st.sampled_from(["", " ", "..", "%00", "1e9"]),
                         *[WITH_CONTROL] * 4)
# A fresh valid name or key each time: a used one would be refused as a duplicate before reaching the database.
FRESH = st.from_regex(r"[a-z][a-z0-9]{11}", fullmatch=True)
Valid = list[Any] | st.SearchStrategy[Any]


def _valid(values: Valid) -> st.SearchStrategy[Any]:
    return values if isinstance(values, st.SearchStrategy) else st.sampled_from(values)


def _as_param(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# ----- the endpoints -----


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # FastAPI's template
    auth: str  # admin | cluster | pool (a server's credential) | enrol (the pool's enrolment token) | none
    paths: dict[str, Valid] = field(default_factory=dict)  # valid values per path parameter
    query: dict[str, Valid] = field(default_factory=dict)
    body: dict[str, Valid] | None = None  # valid values per field; None: the endpoint takes no body
    policy: bool = False  # the body is a GpuPolicy document

    @property
    def fields(self) -> set[str]:
        """What a ``details[].field`` may name for this endpoint."""
        names = {f"path.{p}" for p in self.paths} | {f"query.{q}" for q in self.query} | {"body"}
        return names | set(self.body or {})


CLUSTER: dict[str, Valid] = {"cluster": ["prod-eu", "nowhere"]}
# Body fields a valid request may leave out (the others it sends, so that a hostile neighbour is the problem).
OPTIONAL: Final = frozenset({"description", "plan_id", "reason", "location", "instance", "node", "detail"})
PAGE: dict[str, Valid] = {"after": [0, 1, 2**31 - 1], "limit": [1, 100, 1000]}
REPORT: dict[str, Valid] = {
    "idempotency_key": FRESH | st.just("k-1"), "operation": [PROPOSED, "op-0123456789ab"],
    "policy": ["inference-burst-eu"],
    "action": ["launched", "proposed", "failed"], "location": [None, "aws/eu-central-1"], "instance": [None, "i-1"],
    "node": [None, "burst-1"], "detail": ["", "ok"], "occurred_at": ["2025-03-01T12:00:00Z"],
}
POOL: dict[str, Valid] = {"pool": ["dc1", "nowhere"]}
RATE_CARD: Final = {"usd_per_gpu_hour": {"NVIDIA-L4": 0.35}, "transfer_usd_per_gpu_hour": 0.01}
CLAIMED: Final = "op-00000000000c"
CLAIM: dict[str, Valid] = {
    "operation": [CLAIMED, "op-0000000000c2"], "policy": ["inference-burst-eu"], "gpu_product": ["NVIDIA-L4"],
    "gpus": [1], "node_name": ["burst-op-00000000000c"],
    # A join document with a ticket for the claimed node: the hub refuses user data that holds none.
    "user_data": [render_user_data(gateway_url="https://gw.example:8443", ticket="t", node_name="burst-op-00000000000c",
                                   labels={}, taints=[])]}
ENDPOINTS: Final = [
    Endpoint("GET", "/healthz", "none"),
    Endpoint("GET", "/v1/me", "admin"),
    Endpoint("POST", "/v1/users", "admin", body={"name": FRESH | st.just("alice"), "role": ["viewer", "operator"]}),
    Endpoint("GET", "/v1/users", "admin"),
    Endpoint("GET", "/v1/users/{user}", "admin", paths={"user": ["alice", "nobody"]}),
    Endpoint("POST", "/v1/users/{user}/keys", "admin", paths={"user": ["alice"]}, body={"description": ["", "ci"]}),
    Endpoint("POST", "/v1/users/{user}/keys/{key_id}/revoke", "admin",
             paths={"user": ["alice"], "key_id": ["0123456789abcdef"]}),
    Endpoint("POST", "/v1/clusters", "admin", body={"name": FRESH | st.just("prod-eu"), "description": ["", "d"]}),
    Endpoint("GET", "/v1/clusters", "admin"),
    Endpoint("GET", "/v1/clusters/{cluster}", "admin", paths=CLUSTER),
    Endpoint("POST", "/v1/clusters/{cluster}/token/rotate", "admin", paths={"cluster": ["spare", "nowhere"]}),
    Endpoint("POST", "/v1/clusters/{cluster}/token/revoke", "admin", paths={"cluster": ["spare", "nowhere"]}),
    Endpoint("GET", "/v1/clusters/{cluster}/policies", "admin", paths=CLUSTER),
    Endpoint("GET", "/v1/clusters/{cluster}/policies/{policy}", "admin",
             paths={**CLUSTER, "policy": ["inference-burst-eu", "none.here"]}),
    Endpoint("PUT", "/v1/clusters/{cluster}/policies/{policy}", "admin", paths={**CLUSTER, "policy": ["p"]},
             policy=True),
    Endpoint("DELETE", "/v1/clusters/{cluster}/policies/{policy}", "admin", paths={**CLUSTER, "policy": ["gone"]}),
    Endpoint("POST", "/v1/clusters/{cluster}/approvals", "admin", paths=CLUSTER,
             body={"operation": [PROPOSED, "op-000000000000"], "decision": ["approve", "reject"],
                   "plan_id": [None, "plan-1"], "reason": ["", "why"]}),
    Endpoint("GET", "/v1/clusters/{cluster}/approvals", "admin", paths=CLUSTER, query=PAGE),
    Endpoint("GET", "/v1/clusters/{cluster}/reports", "admin", paths=CLUSTER,
             query={**PAGE, "operation": [PROPOSED]}),
    Endpoint("GET", "/v1/audit", "admin", query={**PAGE, "cluster": ["prod-eu"], "action": ["token.rotated"]}),
    Endpoint("GET", "/v1/audit/chains", "admin"),
    Endpoint("GET", "/v1/cluster", "cluster"),
    Endpoint("GET", "/v1/cluster/policies", "cluster"),
    Endpoint("GET", "/v1/cluster/approvals", "cluster", query=PAGE),
    Endpoint("POST", "/v1/cluster/reports", "cluster", body=REPORT),
    # On-prem pools: admins and operators manage them, agents (auth "pool": the pool's join token) heartbeat,
    # clusters whose policies name onprem/dc1 claim and release.
    Endpoint("GET", "/v1/pools", "admin"),
    Endpoint("POST", "/v1/pools", "admin", body={"name": FRESH | st.just("dc1"), "description": ["", "racks"],
                                                 "rate_card": [RATE_CARD], "offline_after_seconds": [5, 60]}),
    Endpoint("GET", "/v1/pools/{pool}", "admin", paths=POOL),
    Endpoint("PUT", "/v1/pools/{pool}/rate-card", "admin", paths={"pool": ["dc1"]},
             body={"usd_per_gpu_hour": [{"NVIDIA-L4": 0.35}, {}], "transfer_usd_per_gpu_hour": [0, 0.01]}),
    Endpoint("POST", "/v1/pools/{pool}/join-tokens", "admin", paths=POOL),
    Endpoint("POST", "/v1/pools/{pool}/join-tokens/{token_id}/revoke", "admin",
             paths={**POOL, "token_id": ["0123456789abcdef"]}),
    Endpoint("PUT", "/v1/pools/{pool}/servers/{server}", "admin", paths={**POOL, "server": ["spare", "gpu-b"]},
             body={"gpu_product": ["NVIDIA-L4", "NVIDIA-H100"], "gpus": [1, 8], "labels": [{}, {"rack": "r1"}],
                   "usd_per_gpu_hour": [None, 0.4]}),
    Endpoint("POST", "/v1/pools/{pool}/servers/{server}/retire", "admin", paths={**POOL, "server": ["spare"]}),
    Endpoint("POST", "/v1/pools/{pool}/servers/{server}/credential", "admin", paths={**POOL, "server": ["spare"]}),
    Endpoint("POST", "/v1/pools/{pool}/servers/{server}/credential/revoke", "admin",
             paths={**POOL, "server": ["spare"]}),
    Endpoint("GET", "/v1/pool-claims/keys", "none"),
    Endpoint("POST", "/v1/pool-agent/enrol", "enrol",
             body={"pool": ["dc1"], "server": ["spare", "gpu-b"], "gpu_product": ["NVIDIA-L4"], "gpus": [1]}),
    Endpoint("POST", "/v1/pool-agent/heartbeat", "pool",
             body={"pool": ["dc1"], "server": ["gpu-a"], "gpu_product": ["NVIDIA-L4"], "gpus": [1],
                   "labels": [{}, {"rack": "r1"}], "phase": ["idle"], "operation": [None]}),
    Endpoint("GET", "/v1/cluster/pools/{pool}/offerings", "cluster", paths=POOL),
    Endpoint("POST", "/v1/cluster/pools/{pool}/claims", "cluster", paths=POOL, body=CLAIM),
    Endpoint("GET", "/v1/cluster/pools/{pool}/claims", "cluster", paths=POOL, query={"operation": [CLAIMED]}),
    Endpoint("GET", "/v1/cluster/pools/{pool}/servers/{server}", "cluster", paths={**POOL, "server": ["gpu-a"]}),
    Endpoint("POST", "/v1/cluster/pools/{pool}/servers/{server}/release", "cluster",
             paths={**POOL, "server": ["gpu-a"]},
             body={"operation": [CLAIMED], "policy": ["inference-burst-eu"], "withdraw": [False, True]}),
]


@dataclass
class Request:
    endpoint: Endpoint
    url: str
    content: bytes | None

    def __repr__(self) -> str:
        return f"{self.endpoint.method} {self.url} {self.content[:300]!r}" if self.content else (
            f"{self.endpoint.method} {self.url}")


def _policy_document() -> st.SearchStrategy[Any]:
    def mutate(doc: dict[str, Any], where: tuple[str, ...], value: Any) -> dict[str, Any]:
        target = doc
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value
        return doc

    paths = st.sampled_from([("metadata", "name"), ("metadata", "labels"), ("metadata", "annotations"),
                             ("spec", "kind"), ("spec", "mode"), ("spec", "locations"),
                             ("spec", "locations", 0), ("spec", "limits", "maxNodes"),
                             ("spec", "limits", "maxGpuHour"), ("spec", "workloads", "tolerate"),
                             ("spec", "returnHome"), ("apiVersion",), ("spec", "extra")])
    labelled = st.dictionaries(HOSTILE_TEXT, HOSTILE_TEXT, min_size=1, max_size=2)
    documents = st.builds(mutate, st.builds(lambda: policy_document("p")), paths, HOSTILE | labelled)
    return documents | documents | documents | HOSTILE


@st.composite
def requests(draw: st.DrawFn, endpoint: Endpoint | None = None) -> Request:
    """A valid request of one endpoint with one or two of its parts (a path or query parameter, a body field, an
    unknown body field, the whole body) replaced by a hostile value: the valid rest makes that value the one the
    hub has to deal with."""
    ep = endpoint or draw(st.sampled_from(ENDPOINTS))
    paths = {name: draw(_valid(valid)) for name, valid in ep.paths.items()}
    query: dict[str, Any] = {name: draw(st.just(ABSENT) | _valid(valid)) for name, valid in ep.query.items()}
    body: Any = None
    if ep.body is not None:
        body = {name: draw(st.just(ABSENT) | _valid(valid)) if name in OPTIONAL else draw(_valid(valid))
                for name, valid in ep.body.items()}
    parts = [f"path.{p}" for p in paths] + [f"query.{q}" for q in query]
    if ep.body is not None:
        parts += [f"body.{b}" for b in ep.body] + ["body.(unknown)", "body"]
    if ep.policy:
        parts.append("policy")
    chosen = draw(st.lists(st.sampled_from(parts), min_size=1, max_size=2, unique=True)) if parts else []
    for part in sorted(chosen, key=lambda p: p in ("body", "policy")):  # a whole-body replacement last
        kind, _, name = part.partition(".")
        if kind == "path":
            paths[name] = draw(HOSTILE_TEXT)
        elif kind == "query":
            query[name] = draw(HOSTILE)
        elif kind == "body" and name == "(unknown)":
            body[draw(HOSTILE_TEXT)] = draw(HOSTILE)
        elif kind == "body" and name:
            body[name] = draw(HOSTILE)
        elif kind == "body":
            body = draw(HOSTILE)
        else:
            body = draw(_policy_document())
    if ep.policy and body is None:
        body = policy_document(paths.get("policy", "p"))
    url = ep.path
    for name, value in paths.items():
        url = url.replace("{" + name + "}", quote(value.encode("utf-8", "surrogatepass"), safe=""))
    params = [f"{name}={quote(_as_param(v).encode('utf-8', 'surrogatepass'), safe='')}"
              for name, v in query.items() if v is not ABSENT]
    if params:
        url += "?" + "&".join(params)
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not ABSENT}
    # ensure_ascii: a lone surrogate travels as a \udxxx escape, as a hostile client would send it
    content = None if body is None else json.dumps(body).encode()
    return Request(ep, url, content)


# ----- the hub under attack -----


@dataclass
class Target:
    """The hub app over a fresh database, called in process on a loop of its own (hypothesis drives a plain
    function)."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    db: Database
    headers: dict[str, dict[str, str]] = field(default_factory=dict)

    def call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.loop.run_until_complete(self.client.request(method, url, **kwargs))


@pytest.fixture
def target(database_url: str) -> Iterator[Target]:
    db = Database(database_url)
    app = create_app(HubSettings(database_url=database_url, bootstrap_admin_key=BOOTSTRAP_KEY), FakeClock(),
                     database=db)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                               base_url="http://hub.test")
    t = Target(loop=loop, client=client, db=db)
    admin = {"Authorization": f"Bearer {BOOTSTRAP_KEY}"}
    try:
        created = t.call("POST", "/v1/clusters", json={"name": "prod-eu"}, headers=admin)
        assert created.status_code == 201, created.text
        cluster = {"Authorization": f"Bearer {created.json()['token']['token']}"}
        assert t.call("POST", "/v1/clusters", json={"name": "spare"}, headers=admin).status_code == 201
        assert t.call("POST", "/v1/users", json={"name": "alice", "role": "operator"},
                      headers=admin).status_code == 201
        for name in ("inference-burst-eu", "gone"):
            put = t.call("PUT", f"/v1/clusters/prod-eu/policies/{name}", json=policy_document(name), headers=admin)
            assert put.status_code == 201, put.text
        proposed = t.call("POST", "/v1/cluster/reports", headers=cluster, json={
            "idempotency_key": "proposal", "operation": PROPOSED, "policy": "inference-burst-eu",
            "action": "proposed", "occurred_at": "2025-03-01T12:00:00Z"})
        assert proposed.status_code == 201, proposed.text
        pool = t.call("POST", "/v1/pools", json={"name": "dc1", "rate_card": RATE_CARD}, headers=admin)
        assert pool.status_code == 201, pool.text
        enrolment = {"Authorization": f"Bearer {pool.json()['join_token']['token']}"}
        agents = {}
        for server in ("gpu-a", "gpu-c"):  # two idle servers: a claim can succeed, and be refused once both are
            registered = t.call("PUT", f"/v1/pools/dc1/servers/{server}", headers=admin,
                                json={"gpu_product": "NVIDIA-L4", "gpus": 1})
            assert registered.status_code in (200, 201), registered.text
            enrolled = t.call("POST", "/v1/pool-agent/enrol", headers=enrolment, json={
                "pool": "dc1", "server": server, "gpu_product": "NVIDIA-L4", "gpus": 1})
            assert enrolled.status_code == 201, enrolled.text
            agents[server] = {"Authorization": f"Bearer {enrolled.json()['credential']}"}
            beat = t.call("POST", "/v1/pool-agent/heartbeat", headers=agents[server], json={
                "pool": "dc1", "server": server, "gpu_product": "NVIDIA-L4", "gpus": 1, "phase": "idle"})
            assert beat.status_code == 200, beat.text
        agent = agents["gpu-a"]
        spare = t.call("PUT", "/v1/pools/dc1/servers/spare", headers=admin,
                       json={"gpu_product": "NVIDIA-L4", "gpus": 1})
        assert spare.status_code in (200, 201), spare.text
        claimed = t.call("POST", "/v1/cluster/pools/dc1/claims", headers=cluster, json={
            k: v[0] for k, v in CLAIM.items() if isinstance(v, list)})
        assert claimed.status_code == 201, claimed.text
        t.headers = {"admin": admin, "cluster": cluster, "pool": agent, "enrol": enrolment, "none": {}}
        yield t
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        db.dispose()


def test_the_endpoint_table_covers_every_route() -> None:
    """A new route must be added to the property test's table."""
    app = create_app(HubSettings(database_url="sqlite://", bootstrap_admin_key=BOOTSTRAP_KEY))
    routes = {(method.upper(), path) for path, methods in app.openapi()["paths"].items() for method in methods}
    assert routes == {(e.method, e.path) for e in ENDPOINTS}


def _field_named(field_name: str, req: Request) -> bool:
    """Whether a refusal's ``details[].field`` names something of this request: a parameter or body field of the
    endpoint, a GpuPolicy path (``spec.limits.maxNodes``), or an unknown body key as it was sent."""
    endpoint = req.endpoint
    sent = json.loads(req.content) if req.content else None
    sent_keys = set(sent) if isinstance(sent, dict) else set()
    if field_name in endpoint.fields or field_name in sent_keys:
        return True
    known = sent_keys | set(endpoint.body or {})
    if endpoint.policy:
        known |= {"(document)", "apiVersion", "kind", "metadata", "spec", "status"}
    root = re.split(r"[.\[ ]", field_name, maxsplit=1)[0]
    return root in known


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def test_hostile_input_never_breaks_the_hub_and_refusals_change_nothing(target: Target) -> None:
    seen: dict[int, int] = {}
    attacked: set[tuple[str, str]] = set()

    def attack(req: Request) -> None:
        attacked.add((req.endpoint.method, req.endpoint.path))
        headers = dict(target.headers[req.endpoint.auth])
        if req.content is not None:
            headers["Content-Type"] = "application/json"
        before = snapshot(target.db)
        r = target.call(req.endpoint.method, req.url, content=req.content, headers=headers)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{req!r} -> {r.status_code} {r.text}"
        if r.status_code < 400:
            # What either database accepted, both do: nothing stored holds a character one of them refuses.
            bad = [v for v in _texts(snapshot(target.db)) if disallowed_character(v)]
            assert not bad, f"{req!r} -> {r.status_code} stored {bad[:3]!r}"
            return
        body = r.json()
        assert set(body) == {"error", "message", "details"} and body["message"], body
        if r.status_code == 422:
            assert body["details"], body
            for detail in body["details"]:
                assert _field_named(detail["field"], req), f"{req!r}: {detail} names no field"
        assert snapshot(target.db) == before, f"{req!r} -> {r.status_code} changed the stored state"

    # Every endpoint gets its share of the examples: drawn from all of them at once, hypothesis favours the first
    # few, and whether a late one is drawn at all varied from run to run.
    per_endpoint = max(4, EXAMPLES // len(ENDPOINTS))
    for endpoint in ENDPOINTS:
        settings(max_examples=per_endpoint, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(
            given(requests(endpoint))(attack))()
    assert attacked == {(e.method, e.path) for e in ENDPOINTS}, "some endpoints were never attacked"
    assert seen.get(422, 0) > EXAMPLES // 3, seen  # mostly refused, as generated
    assert sum(n for status, n in seen.items() if status < 300) > 0, seen  # and some valid neighbours pass
