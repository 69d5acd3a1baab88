"""Hub fixtures: a fake clock, a PostgreSQL server, and the hub app over SQLite and PostgreSQL alike."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from hub.app import create_app
from hub.auth import HubState
from hub.db import Base, Database
from hub.settings import HubSettings
from tests.hub.postgres import PostgresMissing, PostgresServer

BOOTSTRAP_KEY = "bootstrap-admin-key-for-tests-0123456789"
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


class FakeClock:
    """An injectable clock that only moves when told to."""

    def __init__(self, start: datetime = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta) -> datetime:
        with self._lock:
            self._now += delta
            return self._now


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_database(postgres_server: PostgresServer) -> Iterator[str]:
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database per test: a SQLite file, or a new schema on the session's PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hub.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_schema(request.getfixturevalue("postgres_database"))
    try:
        yield url
    finally:
        server.drop_schema(url)


def snapshot(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every hub table: compare two to prove a request changed nothing."""
    with db.session() as session:
        return {
            table.name: [tuple(row) for row in session.execute(select(table).order_by(*table.primary_key.columns))]
            for table in Base.metadata.sorted_tables
        }


@dataclass
class Hub:
    client: httpx.AsyncClient
    clock: FakeClock
    db: Database

    admin = {"Authorization": f"Bearer {BOOTSTRAP_KEY}"}

    @staticmethod
    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        return snapshot(self.db)

    async def create_cluster(self, name: str) -> str:
        r = await self.client.post("/v1/clusters", json={"name": name}, headers=self.admin)
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]["token"]
        return token

    async def create_user(self, name: str, role: str) -> str:
        r = await self.client.post("/v1/users", json={"name": name, "role": role}, headers=self.admin)
        assert r.status_code == 201, r.text
        r = await self.client.post(f"/v1/users/{name}/keys", json={}, headers=self.admin)
        assert r.status_code == 201, r.text
        key: str = r.json()["key"]
        return key

    async def propose(self, token: str, operation: str) -> None:
        """The cluster reports ``operation`` as proposed, as its optimizer does before waiting for approval."""
        r = await self.client.post("/v1/cluster/reports", headers=self.bearer(token), json={
            "idempotency_key": f"{operation}/proposed", "operation": operation, "policy": "inference-burst-eu",
            "action": "proposed", "detail": "plan: 1 node", "occurred_at": "2025-03-01T12:00:00Z"})
        assert r.status_code in (200, 201), r.text

    async def put_policy(self, cluster: str, document: dict[str, Any], headers: dict[str, str] | None = None
                         ) -> httpx.Response:
        name = document["metadata"]["name"]
        return await self.client.put(f"/v1/clusters/{cluster}/policies/{name}", json=document,
                                     headers=headers or self.admin)

    async def audit(self, **params: Any) -> list[dict[str, Any]]:
        r = await self.client.get("/v1/audit", params={"limit": 1000, **params}, headers=self.admin)
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()["events"]
        return events


@pytest.fixture(scope="session")
def app() -> FastAPI:
    """One app for the session (FastAPI builds its routes on the first request, ~0.1 s); each test gives it a
    fresh database and clock through ``app.state.hub``, exactly what ``create_app`` sets up."""
    return create_app(HubSettings(database_url="sqlite://", bootstrap_admin_key=BOOTSTRAP_KEY))


@pytest.fixture
async def hub(app: FastAPI, database_url: str) -> AsyncIterator[Hub]:
    clock = FakeClock()
    db = Database(database_url)
    db.create_schema()
    settings = HubSettings(database_url=database_url, bootstrap_admin_key=BOOTSTRAP_KEY)
    app.state.hub = HubState(settings=settings, clock=clock, db=db)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://hub.test") as client:
            yield Hub(client=client, clock=clock, db=db)
    finally:
        db.dispose()
