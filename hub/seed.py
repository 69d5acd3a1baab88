"""Seed users, clusters, tokens and policies from a YAML file, for local development (``make dev``).

Idempotent: run it on every start. Existing users and clusters are kept; a key or token file that exists is
re-used (imported if the database is new), one that is missing is written (mode 0600) with a new secret; policies
are created or replaced (an unchanged one keeps the revision). Nothing is deleted. Example::

    users:
      - name: dev
        role: admin
        keyFile: .kubeon/hub/dev.key          # relative to this file
    clusters:
      - name: dev
        description: local cluster
        tokenFile: .kubeon/hub/dev.token      # the optimizer's Secret `kubeon-gpu-optimizer-token`, key `token`
        policies:                             # GpuPolicy documents inline ...
          - apiVersion: gpu.kubeon.io/v1
            kind: GpuPolicy
            metadata: {name: dev-burst}
            spec: {...}
        policyFiles: [policies.yaml]          # ... and/or files (several YAML documents each)
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Annotated
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import StrictStr
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from hub import ops
from hub import tokens
from hub.audit import SEED_ACTOR
from hub.audit import Role
from hub.db import ApiKey
from hub.db import Cluster
from hub.db import ClusterToken
from hub.db import Database
from hub.db import Principal
from hub.errors import HubError
from hub.pool_db import Pool
from hub.pool_db import PoolServer
from hub.pool_schemas import GpuProduct
from hub.pool_schemas import Gpus
from hub.pool_schemas import PoolCreate
from hub.pool_schemas import RateCard
from hub.pools import add_pool
from hub.pools import register_inventory
from hub.schemas import Line
from hub.schemas import Name
from hub.settings import ROTATION_GRACE
from hub.settings import Clock
from hub.settings import system_clock
from hub.tokens import IssuedToken
from hub.tokens import TokenKind


class SeedError(ValueError):
    """The seed file is unreadable or invalid; the message names the file and field."""


class _Seed(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SeedUser(_Seed):
    name: Name
    role: Role = Role.ADMIN
    key_file: StrictStr | None = Field(default=None, alias="keyFile")


class SeedCluster(_Seed):
    name: Name
    description: Annotated[Line, Field(max_length=200)] = ""
    token_file: StrictStr | None = Field(default=None, alias="tokenFile")
    policies: list[dict[str, Any]] = Field(default_factory=list)
    policy_files: list[StrictStr] = Field(default_factory=list, alias="policyFiles")


class SeedServer(_Seed):
    """A server of the pool, registered as its operator would (its agent then enrols with the pool's token)."""

    name: Name
    gpu_product: GpuProduct = Field(alias="gpuProduct")
    gpus: Gpus
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)


class SeedPool(_Seed):
    """An on-prem pool (hub/pools.py): its rate card, the file holding its enrolment token, its servers."""

    name: Name
    description: Annotated[StrictStr, Field(max_length=200)] = ""
    rate_card: RateCard = Field(alias="rateCard")
    offline_after_seconds: Annotated[int, Field(strict=True, ge=5, le=86_400)] = Field(
        default=60, alias="offlineAfterSeconds")
    join_token_file: StrictStr | None = Field(default=None, alias="joinTokenFile")
    servers: list[SeedServer] = Field(default_factory=list)


class SeedSpec(_Seed):
    users: list[SeedUser] = Field(default_factory=list)
    clusters: list[SeedCluster] = Field(default_factory=list)
    pools: list[SeedPool] = Field(default_factory=list)


def load_seed_file(path: Path) -> SeedSpec:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SeedError(f"cannot read seed file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise SeedError(f"seed file {path} is not valid YAML: {exc}") from exc
    try:
        return SeedSpec.model_validate(data or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(document)'}: {err['msg']}" for err in exc.errors()
        )
        raise SeedError(f"seed file {path}: {problems}") from None


def seed_file(db: Database, path: Path, *, clock: Clock = system_clock) -> list[str]:
    return seed(db, load_seed_file(path), base_dir=path.parent, clock=clock)


def seed(db: Database, spec: SeedSpec, *, base_dir: Path, clock: Clock = system_clock) -> list[str]:
    """Apply ``spec`` in one transaction; return what was done, one line each (secrets only when no file)."""
    now = clock()
    done: list[str] = []
    with db.session() as session:
        try:
            for user in spec.users:
                done += _seed_user(session, now, user, base_dir)
            for cluster in spec.clusters:
                done += _seed_cluster(session, now, cluster, base_dir)
            for pool in spec.pools:
                done += _seed_pool(session, now, pool, base_dir)
        except HubError as exc:
            raise SeedError(f"seed: {exc.message}") from None
        session.commit()
    return done


def _secret_from_file(path: Path, kind: TokenKind) -> IssuedToken | None:
    if not path.exists():
        return None
    try:
        return tokens.from_existing(path.read_text().strip(), kind)
    except OSError as exc:
        raise SeedError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise SeedError(f"{path}: {exc}") from None


def _write_secret(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")


def _seed_user(session: Session, now: datetime, spec: SeedUser, base_dir: Path) -> list[str]:
    done: list[str] = []
    user = session.scalar(select(Principal).where(Principal.name == spec.name))
    if user is None:
        user = ops.create_user(session, now, SEED_ACTOR, spec.name, spec.role)
        done.append(f"user {spec.name} created ({spec.role.value})")
    key_path = base_dir / spec.key_file if spec.key_file else None
    existing = _secret_from_file(key_path, TokenKind.API_KEY) if key_path else None
    if existing is not None:
        row = session.scalar(select(ApiKey).where(ApiKey.key_id == existing.token_id))
        if row is not None and row.principal_id == user.id and row.digest == existing.digest and not row.revoked_at:
            return done
        if row is None:
            ops.issue_api_key(session, now, SEED_ACTOR, user, "seed", existing=existing)
            done.append(f"user {spec.name}: API key from {key_path} imported")
            return done
    if key_path is None and user.keys:
        return done
    issued = ops.issue_api_key(session, now, SEED_ACTOR, user, "seed")
    if key_path is not None:
        _write_secret(key_path, issued.secret)
        done.append(f"user {spec.name}: API key {issued.token_id} written to {key_path}")
    else:
        done.append(f"user {spec.name}: API key {issued.secret} (shown once)")
    return done


def _seed_cluster(session: Session, now: datetime, spec: SeedCluster, base_dir: Path) -> list[str]:
    done: list[str] = []
    token_path = base_dir / spec.token_file if spec.token_file else None
    from_file = _secret_from_file(token_path, TokenKind.CLUSTER) if token_path else None
    cluster = session.scalar(select(Cluster).where(Cluster.name == spec.name).with_for_update())
    reuse: IssuedToken | None = None
    if from_file is not None:
        row = session.scalar(select(ClusterToken).where(ClusterToken.token_id == from_file.token_id))
        if row is None:
            reuse, need_token = from_file, True  # a new database: import the token the cluster already has
        elif row.digest != from_file.digest or cluster is None or row.cluster_id != cluster.id:
            raise SeedError(f"{token_path}: token {from_file.token_id} belongs to another cluster")
        else:
            need_token = ops.token_state(row, now) not in ops.VALID_TOKEN_STATES  # revoked/expired: a new one
    else:
        need_token = token_path is not None or cluster is None
    if cluster is None:
        cluster, issued = ops.create_cluster(session, now, SEED_ACTOR, spec.name, spec.description, reuse)
        done.append(f"cluster {spec.name} created")
        _report_token(done, spec.name, issued, reuse, token_path)
    elif need_token:
        issued, _ = ops.rotate_token(session, now, SEED_ACTOR, cluster, ROTATION_GRACE, reuse)
        _report_token(done, spec.name, issued, reuse, token_path)
    documents = list(spec.policies)
    for name in spec.policy_files:
        path = base_dir / name
        try:
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as exc:
            raise SeedError(f"cluster {spec.name}: cannot read policy file {path}: {exc}") from exc
    for document in documents:
        metadata = document.get("metadata") if isinstance(document, dict) else None
        name = str(metadata.get("name", "")) if isinstance(metadata, dict) else ""
        try:
            written = ops.put_policy(session, now, SEED_ACTOR, cluster, name, document)
        except HubError as exc:
            raise SeedError(f"cluster {spec.name}: policy {name or '(unnamed)'}: {exc.message}") from None
        if written.changed:
            done.append(f"cluster {spec.name}: policy {name} {'created' if written.created else 'updated'} "
                        f"(revision {cluster.policy_revision})")
    return done


def _seed_pool(session: Session, now: datetime, spec: SeedPool, base_dir: Path) -> list[str]:
    """Create the pool once (an existing pool is kept as it is); its join token from the file, or written there;
    its servers registered (once each)."""
    found = session.scalar(select(Pool).where(Pool.name == spec.name))
    if found is not None:
        return _seed_servers(session, now, found, spec)
    done = _seed_new_pool(session, now, spec, base_dir)
    pool = session.scalar(select(Pool).where(Pool.name == spec.name))
    assert pool is not None
    return done + _seed_servers(session, now, pool, spec)


def _seed_servers(session: Session, now: datetime, pool: Pool, spec: SeedPool) -> list[str]:
    done = []
    for server in spec.servers:
        if session.scalar(select(PoolServer.id).where(PoolServer.name == server.name)) is None:
            register_inventory(session, now, SEED_ACTOR.label, None, pool, server.name, server.gpu_product,
                                 server.gpus, dict(server.labels))
            done.append(f"pool {pool.name}: server {server.name} registered ({server.gpus} x {server.gpu_product})")
    return done


def _seed_new_pool(session: Session, now: datetime, spec: SeedPool, base_dir: Path) -> list[str]:
    path = base_dir / spec.join_token_file if spec.join_token_file else None
    existing = path.read_text().strip() if path is not None and path.exists() else None
    body = PoolCreate(name=spec.name, description=spec.description, rate_card=spec.rate_card,
                      offline_after_seconds=spec.offline_after_seconds)
    try:
        _, issued = add_pool(session, now, SEED_ACTOR, body, existing)
    except ValueError as exc:
        raise SeedError(f"pool {spec.name}: {path}: {exc}") from None
    if existing is not None:
        return [f"pool {spec.name} created, join token from {path} imported"]
    if path is not None:
        _write_secret(path, issued.token)
        return [f"pool {spec.name} created, join token {issued.token_id} written to {path}"]
    return [f"pool {spec.name} created, join token {issued.token} (shown once)"]


def _report_token(
    done: list[str], cluster: str, issued: IssuedToken, existing: IssuedToken | None, path: Path | None
) -> None:
    if existing is not None:
        done.append(f"cluster {cluster}: token from {path} imported")
    elif path is not None:
        _write_secret(path, issued.secret)
        done.append(f"cluster {cluster}: token {issued.token_id} written to {path}")
    else:
        done.append(f"cluster {cluster}: token {issued.secret} (shown once)")
