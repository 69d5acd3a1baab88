"""The hub's ASGI application: ``create_app(settings, clock=...)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Annotated

from fastapi import Depends
from fastapi import FastAPI
from pydantic import TypeAdapter

from common.asgi import BodySizeLimit
from hub.auth import HubState
from hub.auth import hub_state
from hub.db import Database
from hub.http import install_error_handlers
from hub.http import install_openapi
from hub.http import refusal
from hub.pools import BODY_MODELS as POOL_BODY_MODELS
from hub.pools import ROUTERS as POOL_ROUTERS
from hub.routes import clusters_api
from hub.routes import people
from hub.schemas import ActionReportCreate
from hub.schemas import ApiKeyCreate
from hub.schemas import ApprovalCreate
from hub.schemas import ClusterCreate
from hub.schemas import Health
from hub.schemas import UserCreate
from hub.settings import Clock
from hub.settings import HubSettings
from hub.settings import system_clock
from hub.web import install as install_web_ui
from models.policy import GpuPolicy

DESCRIPTION = """\
The self-hosted hub of the KubeOn GPU optimizer. The optimizer pulls its policies and approvals from here and
reports its actions; the hub never connects to the optimizer.

* People and automation: `Authorization: Bearer <API key>` on `/v1/users`, `/v1/clusters/...`, `/v1/audit`.
* An optimizer: `Authorization: Bearer <cluster token>` on `/v1/cluster/...`; it sees only its own cluster.
* An on-prem server's agent: `Authorization: Bearer <pool join token>` on `/v1/pool-agent/heartbeat`.

Errors are `{"error": code, "message": text, "details": [{"field", "message"}]}`. Request bodies are JSON
(`Content-Type: application/json`), at most 1 MiB.
"""


def _version() -> str:
    try:
        return metadata.version("kubeon-gpu-optimizer")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def create_app(settings: HubSettings, clock: Clock = system_clock, *, database: Database | None = None) -> FastAPI:
    """Build the hub. Creates missing tables. ``clock`` must return aware datetimes; tests inject a fake one.
    A ``database`` passed in is left open at shutdown; one created here is disposed."""
    owned = database is None
    db = database or Database(settings.database_url)
    db.create_schema()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            db.dispose()

    app = FastAPI(title="KubeOn GPU hub", version=_version(), description=DESCRIPTION, lifespan=lifespan)
    app.state.hub = HubState(settings=settings, clock=clock, db=db)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, refusal=refusal)
    app.include_router(people)
    app.include_router(clusters_api)
    for router in POOL_ROUTERS:  # on-prem burst pools (hub/pools.py)
        app.include_router(router)

    install_web_ui(app)  # the pages under /ui (hub/web): same database, roles and write functions

    @app.get("/healthz", tags=["health"], summary="Liveness and database reachability (no auth)")
    def healthz(state: Annotated[HubState, Depends(hub_state)]) -> Health:
        state.db.ping()
        return Health(status="ok")

    install_openapi(
        app,
        [UserCreate, ApiKeyCreate, ClusterCreate, ApprovalCreate, ActionReportCreate, *POOL_BODY_MODELS],
        {"GpuPolicy": TypeAdapter(GpuPolicy)},
    )
    return app
