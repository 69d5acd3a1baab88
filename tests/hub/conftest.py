"""Hub fixtures: a fake clock, a PostgreSQL server, and the hub app over SQLite and PostgreSQL alike."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from hub.app import create_app
from hub.auth import HubState
from hub.db import Base
from hub.db import Database
from hub.settings import HubSettings
from tests.hub.postgres import PostgresMissing
from tests.hub.postgres import PostgresServer

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


# ----- the web UI: a real hub process and Debian's chromium, shared by the tests of a module -----


@dataclass
class UiHub:
    """A hub process (``tests.hub.clocked_server``: its clock is a file the test can move) for the web UI tests,
    with an admin API client. ``backend`` is ``sqlite`` or ``postgresql``."""

    process: Any
    backend: str
    clock_file: Path
    workdir: Path
    admin: httpx.Client

    @property
    def url(self) -> str:
        return str(self.process.url)

    def now(self) -> datetime:
        return datetime.fromisoformat(self.clock_file.read_text().strip())

    def advance(self, delta: timedelta) -> None:
        from tests.hub.clocked_server import FileClock

        FileClock.set(self.clock_file, self.now() + delta)


def start_ui_hub(workdir: Path, database_url: str, backend: str) -> UiHub:
    from tests.hub.clocked_server import FileClock
    from tests.hub.process import HubProcess

    key_file = workdir / "bootstrap.key"
    key_file.write_text(BOOTSTRAP_KEY + "\n")
    clock_file = workdir / "clock"
    FileClock.set(clock_file, datetime.now(UTC).replace(microsecond=0))
    process = HubProcess(["--database-url", database_url, "--bootstrap-admin-key-file", str(key_file)],
                         logdir=workdir,
                         module=["tests.hub.clocked_server", str(clock_file)]).start()
    admin = httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {BOOTSTRAP_KEY}"}, timeout=10)
    return UiHub(process=process, backend=backend, clock_file=clock_file, workdir=workdir, admin=admin)


@pytest.fixture(scope="module", params=BACKENDS)
def ui_hub(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiHub]:
    """One hub per module and backend: the module's tests use clusters of their own names, so they cannot
    disturb each other."""
    workdir = tmp_path_factory.mktemp(f"ui-hub-{request.param}")
    server: PostgresServer | None = None
    if request.param == "sqlite":
        url = f"sqlite:///{workdir / 'hub.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        url = server.create_database()
    hub = start_ui_hub(workdir, url, request.param)
    try:
        yield hub
    finally:
        hub.admin.close()
        stopped = hub.process.stop()
        if server is not None:
            server.drop_database(url)
        assert stopped, hub.process.log


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """Debian's chromium, headless, one per module (each test opens contexts of its own: separate cookies)."""
    from tests.harness.browser import chromium

    async with chromium() as launched:
        yield launched
