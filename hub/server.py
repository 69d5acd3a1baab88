"""Run the hub: ``python -m hub.server --listen 127.0.0.1:8600 --database-url sqlite:///hub.db ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from hub.app import create_app
from hub.db import Database
from hub.db import DatabaseError
from hub.seed import SeedError
from hub.seed import seed_file
from hub.settings import BOOTSTRAP_KEY_ENV
from hub.settings import DATABASE_URL_ENV
from hub.settings import DEFAULT_DATABASE_URL
from hub.settings import Clock
from hub.settings import HubSettings
from hub.settings import SettingsError
from hub.settings import read_bootstrap_key
from hub.settings import system_clock

DEFAULT_LISTEN = "127.0.0.1:8600"
log = logging.getLogger("hub")


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"--listen {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def build_parser(prog: str = "kubeon-gpu hub") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run the self-hosted KubeOn GPU hub.")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT to listen on (default {DEFAULT_LISTEN})")
    parser.add_argument(
        "--database-url", default=os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL),
        help=f"sqlite:///PATH or postgresql://USER@HOST:PORT/DB "
        f"(default ${DATABASE_URL_ENV} or {DEFAULT_DATABASE_URL})",
    )
    parser.add_argument(
        "--bootstrap-admin-key-file", metavar="PATH",
        help=f"file holding the bootstrap admin key (default: ${BOOTSTRAP_KEY_ENV}); it creates users and API keys",
    )
    parser.add_argument("--seed-file", metavar="PATH", type=Path,
                        help="YAML with users, clusters (tokens written to files) and policies to create (local dev)")
    parser.add_argument("--tls-cert-file", metavar="PATH", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key-file", metavar="PATH", help="private key of --tls-cert-file (PEM)")
    parser.add_argument("--public-url", metavar="URL",
                        help="the address optimizers reach this hub at, for the web UI's install commands "
                        "(default: the address the browser used)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def serve(argv: Sequence[str] | None = None, *, clock: Clock = system_clock, prog: str = "kubeon-gpu hub") -> int:
    """Parse ``argv``, seed if asked, and serve until SIGINT/SIGTERM. Returns the exit code."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_listen(args.listen)
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            raise SettingsError("--tls-cert-file and --tls-key-file go together")
        settings = HubSettings(
            database_url=args.database_url,
            bootstrap_admin_key=read_bootstrap_key(args.bootstrap_admin_key_file),
            public_url=args.public_url,
        )
        db = Database(settings.database_url)
        db.create_schema()
        if args.seed_file:
            for line in seed_file(db, args.seed_file, clock=clock):
                print(f"seed: {line}", flush=True)
    except (SettingsError, DatabaseError, SeedError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if settings.bootstrap_admin_key is None:
        log.warning("no bootstrap admin key (--bootstrap-admin-key-file or $%s): only existing API keys work",
                    BOOTSTRAP_KEY_ENV)
    if not args.tls_cert_file and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("serving plain HTTP on %s: tokens travel in clear; put TLS in front or use --tls-cert-file", host)
    app = create_app(settings, clock, database=db)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=args.log_level, server_header=False,
        ssl_certfile=args.tls_cert_file, ssl_keyfile=args.tls_key_file, timeout_graceful_shutdown=10,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        db.dispose()
    return 0


def main() -> None:
    sys.exit(serve(prog="python -m hub.server"))


if __name__ == "__main__":
    main()
