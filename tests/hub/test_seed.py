"""The dev seed: the shipped example works, and seeding is idempotent."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func
from sqlalchemy import select

from hub import tokens
from hub.db import AuditEvent
from hub.db import Cluster
from hub.db import ClusterToken
from hub.db import Database
from hub.db import Policy
from hub.seed import SeedError
from hub.seed import seed_file
from tests.hub.conftest import FakeClock

SHIPPED = Path(__file__).resolve().parent.parent.parent / "hub" / "dev-seed.yaml"


def test_shipped_dev_seed_creates_cluster_token_and_policy(tmp_path: Path, database_url: str) -> None:
    (tmp_path / "hub").mkdir()
    seed = tmp_path / "hub" / "dev-seed.yaml"
    shutil.copy(SHIPPED, seed)
    shutil.copytree(SHIPPED.parent.parent / "examples", tmp_path / "examples")  # its policyFiles
    db = Database(database_url)
    try:
        db.create_schema()
        done = seed_file(db, seed, clock=FakeClock())
        assert "cluster dev created" in done
        token = (tmp_path / ".kubeon/hub/dev.token").read_text().strip()
        assert tokens.parse(token) is not None
        with db.session() as s:
            row = s.scalar(select(ClusterToken))
            assert row is not None and tokens.matches(token, row.digest)
            assert [p.name for p in s.scalars(select(Policy))] == ["inference-burst"]
            events = s.scalar(select(func.count()).select_from(AuditEvent))

        assert seed_file(db, seed, clock=FakeClock()) == []  # again: nothing to do
        with db.session() as s:
            assert s.scalar(select(func.count()).select_from(AuditEvent)) == events
            cluster = s.scalar(select(Cluster))
            assert cluster is not None and cluster.policy_revision == 1
    finally:
        db.dispose()


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    """A fresh hub database (SQLite in ``tmp_path``) with its schema; disposed after the test."""
    db = Database(f"sqlite:///{tmp_path / 'hub.db'}")
    try:
        db.create_schema()
        yield db
    finally:
        db.dispose()


def test_seed_refuses_a_token_file_of_another_cluster(tmp_path: Path, sqlite_db: Database) -> None:
    seed = tmp_path / "seed.yaml"
    seed.write_text("clusters:\n  - {name: a, tokenFile: a.token}\n")
    seed_file(sqlite_db, seed)
    seed.write_text("clusters:\n  - {name: b, tokenFile: a.token}\n")
    with pytest.raises(SeedError, match="belongs to another cluster"):
        seed_file(sqlite_db, seed)


def test_seed_refuses_a_control_character_naming_the_field(tmp_path: Path, sqlite_db: Database) -> None:
    seed = tmp_path / "seed.yaml"
    seed.write_text('clusters:\n  - {name: a, description: "bell\\a"}\n')
    with pytest.raises(SeedError, match=r"description.*U\+0007"):
        seed_file(sqlite_db, seed)
