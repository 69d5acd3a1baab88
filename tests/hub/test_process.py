"""The hub as a real process: `python -m hub.server` with a seed file, spoken to over HTTP on loopback."""

from __future__ import annotations

import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from hub.db import Cluster
from hub.db import Database
from hub.server import serve
from tests.hub.clocked_server import FileClock
from tests.hub.conftest import BOOTSTRAP_KEY
from tests.hub.helpers import policy_document
from tests.hub.helpers import report
from tests.hub.process import HubProcess


def _write_seed(tmp_path: Path) -> Path:
    seed = {
        "users": [{"name": "dev", "role": "admin", "keyFile": "secrets/dev.key"}],
        "clusters": [
            {"name": "dev", "description": "local", "tokenFile": "secrets/dev.token",
             "policies": [policy_document("dev-burst")]},
            {"name": "other", "tokenFile": "secrets/other.token", "policyFiles": ["other-policies.yaml"]},
        ],
    }
    (tmp_path / "other-policies.yaml").write_text(yaml.safe_dump_all([policy_document("other-1"),
                                                                      policy_document("other-2")]))
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(seed))
    return path


def _hub_args(tmp_path: Path, database_url: str, *extra: str) -> list[str]:
    key_file = tmp_path / "bootstrap.key"
    key_file.write_text(BOOTSTRAP_KEY + "\n")
    return ["--database-url", database_url, "--bootstrap-admin-key-file", str(key_file), *extra]


def _client(hub: HubProcess, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=hub.url, headers=headers, timeout=10)


@contextmanager
def _started(hub: HubProcess) -> Iterator[HubProcess]:
    hub.start()
    try:
        yield hub
    finally:
        assert hub.stop(), hub.log


def test_hub_process_seeded_for_local_dev(tmp_path: Path, database_url: str) -> None:
    seed = _write_seed(tmp_path)
    hub = HubProcess(_hub_args(tmp_path, database_url, "--seed-file", str(seed)), logdir=tmp_path).start()
    try:
        token_file, key_file = tmp_path / "secrets/dev.token", tmp_path / "secrets/dev.key"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        token, dev_key = token_file.read_text().strip(), key_file.read_text().strip()
        assert "seed: cluster dev created" in hub.log and token not in hub.log

        with _client(hub, token) as dev:
            r = dev.get("/v1/cluster/policies")
            assert r.status_code == 200, r.text
            assert r.json()["policies"] == [policy_document("dev-burst")] and r.json()["revision"] == 1
            assert dev.get("/v1/cluster/policies", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
        with _client(hub, (tmp_path / "secrets/other.token").read_text().strip()) as other:
            names = [p["metadata"]["name"] for p in other.get("/v1/cluster/policies").json()["policies"]]
            assert names == ["other-1", "other-2"]
        with _client(hub, dev_key) as person:
            assert person.get("/v1/me").json() == {"kind": "user", "name": "dev", "role": "admin",
                                                   "key_id": dev_key.split("_")[1], "cluster": None}
            audit = person.get("/v1/audit", params={"action": "token.created"}).json()["events"]
            assert {e["actor"] for e in audit} == {"seed:seed-file"}
            doc = person.get("/openapi.json").json()
            for path in ("/v1/cluster/policies", "/v1/cluster/approvals", "/v1/cluster/reports",
                         "/v1/clusters/{cluster}/token/rotate", "/v1/clusters/{cluster}/policies/{policy}"):
                assert path in doc["paths"], path
            assert "GpuPolicy" in doc["components"]["schemas"]
            assert set(doc["components"]["securitySchemes"]) == {"ApiKey", "ClusterToken"}
    finally:
        assert hub.stop(), hub.log


def test_seed_is_idempotent_across_restarts_and_imports_tokens_into_a_new_database(
    tmp_path: Path, database_url: str
) -> None:
    seed = _write_seed(tmp_path)
    args = _hub_args(tmp_path, database_url, "--seed-file", str(seed))
    with _started(HubProcess(args, logdir=tmp_path)):
        token = (tmp_path / "secrets/dev.token").read_text()
    with _started(HubProcess(args, logdir=tmp_path)) as hub:  # same database, same seed: nothing new
        assert (tmp_path / "secrets/dev.token").read_text() == token
        assert "seed:" not in hub.log
        with _client(hub, BOOTSTRAP_KEY) as admin:
            assert len(admin.get("/v1/audit", params={"action": "cluster.created"}).json()["events"]) == 2
            assert admin.get("/v1/clusters/dev").json()["policy_revision"] == 1
    # a fresh database with the token files of an earlier one: the clusters keep their tokens
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    with _started(HubProcess(_hub_args(tmp_path, fresh, "--seed-file", str(seed)), logdir=tmp_path)) as hub:
        assert "token from" in hub.log and "imported" in hub.log
        with _client(hub, token.strip()) as dev:
            assert dev.get("/v1/cluster").json()["cluster"] == "dev"


def test_hub_process_rotation_revocation_isolation_and_limits(tmp_path: Path, database_url: str) -> None:
    hub = HubProcess(_hub_args(tmp_path, database_url), logdir=tmp_path).start()
    try:
        with _client(hub, BOOTSTRAP_KEY) as admin:
            tokens: dict[str, str] = {}
            for name in ("cluster-a", "cluster-b"):
                r = admin.post("/v1/clusters", json={"name": name})
                assert r.status_code == 201, r.text
                tokens[name] = r.json()["token"]["token"]
                assert admin.put(f"/v1/clusters/{name}/policies/p", json=policy_document("p")).status_code == 201

            # isolation: A's token on B's things
            with _client(hub, tokens["cluster-a"]) as a:
                for method, path, body in (
                    ("GET", "/v1/clusters/cluster-b/policies", None),
                    ("PUT", "/v1/clusters/cluster-b/policies/p", policy_document("p", max_nodes=9)),
                    ("POST", "/v1/clusters/cluster-b/token/revoke", None),
                ):
                    assert a.request(method, path, json=body).status_code == 403
                assert a.post("/v1/cluster/reports", json=report("k1")).status_code == 201
                assert a.post("/v1/cluster/reports", json=report("k1")).status_code == 200
            b_policy = admin.get("/v1/clusters/cluster-b/policies/p").json()
            assert b_policy["document"]["spec"]["limits"]["maxNodes"] == 4 and b_policy["revision"] == 1
            assert admin.get("/v1/clusters/cluster-b/reports").json()["reports"] == []

            # rotation: the old token works until the new one is used
            old = tokens["cluster-a"]
            new = admin.post("/v1/clusters/cluster-a/token/rotate").json()["token"]
            with _client(hub, old) as a_old, _client(hub, new) as a_new:
                assert a_old.get("/v1/cluster/policies").status_code == 200
                assert a_new.get("/v1/cluster/policies").status_code == 200
                r = a_old.get("/v1/cluster/policies")
                assert r.status_code == 401 and r.json()["error"] == "token_superseded"

                # revoke: stops at once, disconnected
                assert admin.post("/v1/clusters/cluster-a/token/revoke").status_code == 200
                r = a_new.get("/v1/cluster/policies")
                assert r.status_code == 401 and r.json()["error"] == "token_revoked"
                cluster = admin.get("/v1/clusters/cluster-a").json()
                assert (cluster["status"], cluster["connected"]) == ("disconnected", False)
            events = [(e["action"], e["actor"]) for e in
                      admin.get("/v1/audit", params={"cluster": "cluster-a"}).json()["events"]]
            assert ("token.rotated", "bootstrap:admin") in events and ("token.revoked", "bootstrap:admin") in events
            assert ("token.superseded", "cluster:cluster-a") in events

            # over real HTTP: oversized bodies, by Content-Length and chunked; a bad Content-Length
            before = admin.get("/v1/audit").json()
            with _client(hub, tokens["cluster-b"]) as b:
                r = b.post("/v1/cluster/reports", content=b"x" * (1024 * 1024 + 1),
                           headers={"Content-Type": "application/json"})
                assert r.status_code == 413 and r.json()["error"] == "body_too_large"
                r = b.post("/v1/cluster/reports", content=iter([b"[" + b"0," * 400_000] * 2),
                           headers={"Content-Type": "application/json"})
                assert r.status_code == 413 and "more than 1048576 bytes" in r.json()["message"]
            status, raw = _raw_request(hub, b"POST /v1/cluster/reports HTTP/1.1\r\nHost: x\r\n"
                                             b"Content-Length: 12abc\r\n\r\n")
            assert status >= 400, raw  # refused by uvicorn or the hub, never accepted
            assert admin.get("/v1/audit").json() == before
            assert admin.get("/v1/clusters/cluster-b/reports").json()["reports"] == []
    finally:
        assert hub.stop(), hub.log


def _raw_request(hub: HubProcess, data: bytes) -> tuple[int, bytes]:
    host, port = hub.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        response = b""
        while b"\r\n" not in response:
            chunk = sock.recv(4096)
            if not chunk:
                break
            response += chunk
    return int(response.split(b" ", 2)[1]), response


def test_hub_process_old_token_expires_24_hours_after_rotation(tmp_path: Path, database_url: str) -> None:
    clock_file = tmp_path / "clock"
    start = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
    FileClock.set(clock_file, start)
    hub = HubProcess(_hub_args(tmp_path, database_url), logdir=tmp_path,
                     module=["tests.hub.clocked_server", str(clock_file)]).start()
    try:
        with _client(hub, BOOTSTRAP_KEY) as admin:
            old = admin.post("/v1/clusters", json={"name": "prod-eu"}).json()["token"]["token"]
            rotated = admin.post("/v1/clusters/prod-eu/token/rotate").json()
            assert rotated["previous_tokens_expire_at"] == "2025-03-02T12:00:00Z"
            with _client(hub, old) as a_old, _client(hub, rotated["token"]) as a_new:
                FileClock.set(clock_file, start + timedelta(hours=23, minutes=59))
                assert a_old.get("/v1/cluster/policies").status_code == 200
                FileClock.set(clock_file, start + timedelta(hours=24))
                r = a_old.get("/v1/cluster/policies")
                assert r.status_code == 401 and r.json()["error"] == "token_expired", r.text
                assert a_new.get("/v1/cluster/policies").status_code == 200
            audit: list[dict[str, Any]] = admin.get("/v1/audit", params={"action": "token.rotated"}).json()["events"]
            assert [(e["actor"], e["at"]) for e in audit] == [("bootstrap:admin", "2025-03-01T12:00:00Z")]
    finally:
        assert hub.stop(), hub.log


def test_hub_refuses_to_start_with_bad_settings_naming_the_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short_key = tmp_path / "short.key"
    short_key.write_text("short")
    bad_seed = tmp_path / "bad-seed.yaml"
    bad_seed.write_text(yaml.safe_dump({"clusters": [{"name": "Bad_Name"}]}))
    bad_policy_seed = tmp_path / "bad-policy-seed.yaml"
    bad_policy_seed.write_text(yaml.safe_dump({"clusters": [
        {"name": "dev", "policies": [policy_document("p") | {"spec": {"kind": "Burst"}}]}]}))
    db = f"sqlite:///{tmp_path / 'hub.db'}"
    cases = [
        (["--database-url", "mysql://x/y"], "unsupported database 'mysql'"),
        (["--database-url", db, "--bootstrap-admin-key-file", str(tmp_path / "missing")], "cannot read bootstrap"),
        (["--database-url", db, "--bootstrap-admin-key-file", str(short_key)], "at least 24 characters"),
        (["--database-url", db, "--listen", "nowhere"], "expected HOST:PORT"),
        (["--database-url", db, "--tls-cert-file", "cert.pem"], "go together"),
        (["--database-url", db, "--seed-file", str(bad_seed)], "clusters.0.name"),
        (["--database-url", db, "--seed-file", str(bad_policy_seed)], "spec.workloads"),
    ]
    for args, says in cases:
        assert serve(args) == 2, args  # refused before anything listens
        err = capsys.readouterr().err
        assert says in err, (args, err)
    # the refused seed left nothing behind
    assert "dev" not in [c.name for c in _clusters(db)]


def _clusters(url: str) -> list[Cluster]:
    db = Database(url)
    try:
        with db.session() as session:
            return list(session.scalars(select(Cluster)))
    finally:
        db.dispose()
