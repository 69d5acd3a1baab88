"""A throwaway PostgreSQL server from Debian's package, on a free loopback port.

initdb and postgres refuse to run as root, and the tests run as root: then both run as the ``postgres`` OS user
(created by the package), with the data directory and the unix socket in a temporary directory that user owns.
Stopping it leaves no process behind. A missing package fails with what to install; it never skips.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import psycopg

from tests.harness.controlplane import free_port
from tests.harness.kube import wait_for

INSTALL_HINT = "install it with `apt-get install postgresql` (Debian's package; the tests start their own server)"
_counter = itertools.count(1)


class PostgresMissing(RuntimeError):
    pass


def find_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with initdb and postgres (override: $KUBEON_PG_BINDIR)."""
    override = os.environ.get("KUBEON_PG_BINDIR")
    candidates = [Path(override)] if override else sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0),
        reverse=True,
    )
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    where = override or "/usr/lib/postgresql/*/bin"
    raise PostgresMissing(f"PostgreSQL server binaries (initdb, postgres) not found in {where}: {INSTALL_HINT}")


@dataclass
class PostgresServer:
    port: int = 0
    bindir: Path = field(default_factory=Path)
    _tmp: Path | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _run_as: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def log_path(self) -> Path:
        assert self._tmp is not None
        return self._tmp / "postgres.log"

    def admin_url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 60.0) -> PostgresServer:
        self.bindir = find_bindir()
        self._tmp = Path(tempfile.mkdtemp(prefix="kubeon-pg-"))
        data, sockets = self._tmp / "data", self._tmp / "sock"
        sockets.mkdir()
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresMissing(f"running as root and there is no `postgres` OS user: {INSTALL_HINT}") from None
            for path in (self._tmp, sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
            self._run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [],
                            "env": {"PATH": "/usr/bin:/bin", "HOME": str(self._tmp), "LC_ALL": "C.UTF-8"}}
        else:
            self._run_as = {"env": {**os.environ, "LC_ALL": "C.UTF-8"}}
        init = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--no-sync", "--no-instructions"],
            capture_output=True, cwd=self._tmp, **self._run_as,
        )
        if init.returncode != 0:
            self.stop()
            raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr.decode(errors='replace')}")
        self.port = free_port()
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self._proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(sockets),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
             "-c", "full_page_writes=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self._tmp,
            start_new_session=True, **self._run_as,
        )
        log.close()
        def accepting() -> bool:
            if self._proc.poll() is not None:
                text = self.log_path.read_text(errors="replace")
                raise RuntimeError(f"postgres exited {self._proc.returncode}: {text}")
            with psycopg.connect(self._dsn("postgres"), connect_timeout=2):
                return True

        try:
            wait_for(accepting, timeout=timeout, interval=0.05, retry_on=(psycopg.OperationalError,),
                     what=f"postgres accepting connections on 127.0.0.1:{self.port}")
        except (AssertionError, RuntimeError):
            self.stop()
            raise
        return self

    def _dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def create_database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"hub_test_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.admin_url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1].split("?", 1)[0]
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def create_schema(self, database_url: str) -> str:
        """A new empty schema in ``database_url``; returns a URL whose connections use only that schema (much
        cheaper than a database per test: CREATE DATABASE forces a checkpoint)."""
        name = f"test_{next(_counter)}"
        database = database_url.rsplit("/", 1)[1]
        with psycopg.connect(self._dsn(database), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{database_url}?options=-csearch_path%3D{name}"

    def drop_schema(self, url: str) -> None:
        database, _, query = url.rsplit("/", 1)[1].partition("?")
        name = query.rsplit("%3D", 1)[1]
        with psycopg.connect(self._dsn(database), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    def stop(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # fast shutdown: ends the backends, then the postmaster
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # any straggler of the session
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def process_group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
