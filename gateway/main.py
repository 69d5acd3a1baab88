"""`kubeon-gpu gateway`: the burst gateway process (``worker.cli`` dispatches here). Its settings, its own
Kubernetes credentials and ticket key, the tunnel when configured, the reconciler, and the HTTPS API
(``gateway.app``) with its health listener, until SIGTERM."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import urllib3
import uvicorn
from kubernetes import client
from kubernetes import config

from common.kube import kube_api
from gateway.app import HealthState
from gateway.app import TokenReviewer
from gateway.app import _QuietProbes
from gateway.app import create_app
from gateway.app import create_health_app
from gateway.attestation import verifier_from
from gateway.limits import guarded_h11
from gateway.service import KubeGateway
from gateway.settings import ConfigError
from gateway.settings import GatewayServerConfig
from gateway.settings import GatewaySettings
from gateway.settings import check_tls_files
from gateway.settings import load_settings
from gateway.tunnel_end import build_tunnel
from gateway.tunnel_end import start_tunnel
from tunnel import link

log = logging.getLogger("kubeon.gateway")

# Connections kept to the API server: one per thread that may call it at once, or a busy gateway opens (and
# discards) a TLS connection per request: the HTTP app's sync routes (anyio's 40 worker threads), the reconciler
# and its node watch.
API_POOL_SIZE = 40 + 2

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class _JsonLines(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the exception)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """``KUBEON_LOG_FORMAT``: ``text`` (the default) or ``json``, as for the worker."""
    environ = os.environ if environ is None else environ
    value = environ.get("KUBEON_LOG_FORMAT", "").strip().lower() or "text"
    if value not in ("text", "json"):
        raise ConfigError(f"KUBEON_LOG_FORMAT={value!r}: use text (the default) or json")
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonLines() if value == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.INFO)


def serve(settings: GatewaySettings) -> int:
    """Run the gateway until SIGTERM/SIGINT. Returns the exit code (2: configuration error)."""
    try:
        cfg = GatewayServerConfig.from_settings(settings)
        key = cfg.ticket_key_file.read_bytes().strip()
        if len(key) < 16:
            raise ConfigError(f"{cfg.ticket_key_file}: the join ticket key must be at least 16 bytes")
        check_tls_files(cfg)
        try:
            api = kube_api(cfg.kubeconfig, pool_size=API_POOL_SIZE)
        except config.ConfigException as exc:
            raise ConfigError(f"no Kubernetes credentials: KUBEON_GATEWAY_KUBECONFIG is not set and this is not a "
                              f"pod with a ServiceAccount ({exc})") from None
        tunnel = build_tunnel(cfg)
        gateway = KubeGateway(api, key, public_url=cfg.public_url, service=cfg.service, namespace=cfg.namespace,
                              plan=cfg.plan, tunnel=tunnel, cert_seconds=cfg.cert_seconds,
                              transfer_seconds=cfg.transfer_seconds,
                              attestation=verifier_from(cfg.attestation_roots, cfg.attestation_accounts,
                                                        cfg.attestation_audience))
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        return 2
    try:
        links = start_tunnel(cfg, tunnel, api, gateway.reconcile) if tunnel is not None else None
    except (link.LinkError, OSError) as exc:
        print(f"kubeon-gpu gateway: the tunnel cannot start: {exc}", file=sys.stderr)
        return 1
    gateway.start_reconciler()
    reviewer = TokenReviewer(api, cfg.token_audiences)
    state = HealthState()
    try:
        state.identity = reviewer.whoami()
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:  # not fatal: the API server
        # may come up after the gateway
        log.warning("cannot tell the gateway's own identity (SelfSubjectReview): %s", type(exc).__name__)
    same_port = cfg.health_port in (0, cfg.port)
    app = create_app(gateway, reviewer, cfg.allowed_clients, max_body_bytes=cfg.max_body_bytes,
                     health=state if same_port else None, hub_claim_keys=settings.hub_claim_keys_file,
                     auth_failures_per_minute=cfg.auth_failures_per_minute)
    if not cfg.tls and cfg.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("serving plain HTTP on %s: set KUBEON_GATEWAY_TLS_CERT_FILE and KUBEON_GATEWAY_TLS_KEY_FILE",
                    cfg.host)
    health_server: uvicorn.Server | None = None
    if not same_port:
        # Configured before the main server: uvicorn's logging set-up is process-wide, and the main server's
        # (access log on, level info) must be the one that stays.
        health_server = uvicorn.Server(uvicorn.Config(
            create_health_app(state), host=cfg.host, port=cfg.health_port, log_level="warning",
            access_log=False, server_header=False))
    main_server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level="info", server_header=False, proxy_headers=False,
        ssl_certfile=str(cfg.tls_cert_file) if cfg.tls_cert_file else None,
        ssl_keyfile=str(cfg.tls_key_file) if cfg.tls_key_file else None,
        limit_concurrency=cfg.max_connections, timeout_keep_alive=5, timeout_graceful_shutdown=10,
        # A deadline for receiving each request and a cap per source address (issue 21, finding 9).
        http=guarded_h11(receipt_timeout=cfg.request_timeout, per_source=cfg.max_connections_per_source),
    ))
    state.ready = lambda: bool(main_server.started) and not main_server.should_exit
    logging.getLogger("uvicorn.access").addFilter(_QuietProbes())
    if health_server is not None:
        # Its own thread and loop: uvicorn only handles signals in the main thread, where the main server runs.
        threading.Thread(target=health_server.run, name="health", daemon=True).start()
    scheme = "https" if cfg.tls else "http"
    if cfg.public_url:
        where = f"burst nodes join at {cfg.public_url}"
    elif cfg.service is not None:
        where = (f"burst nodes join at the LoadBalancer address of Service {cfg.service.namespace}/"
                 f"{cfg.service.name}, verified as {cfg.service.dns_name}")
    else:
        where = "burst nodes join at the worker's configured URL"
    log.info("burst gateway on %s://%s:%d (health on port %d), acting as %s; optimizer clients: %s%s; %s", scheme,
             cfg.host, cfg.port, cfg.port if same_port else cfg.health_port, state.identity,
             ", ".join(sorted(cfg.allowed_clients)),
             f"; token audiences: {', '.join(cfg.token_audiences)}" if cfg.token_audiences else "", where)
    # uvicorn re-raises the signal it stopped on once it has shut down; with the default SIGTERM handler that
    # would end the process before the tunnel (wireguard-go, the proxy) is stopped below.
    signal.signal(signal.SIGTERM, lambda *_: setattr(main_server, "should_exit", True))
    try:
        main_server.run()
    finally:
        if health_server is not None:
            health_server.should_exit = True
        gateway.stop()
        if links is not None:
            links.stop()
    return 0


def main() -> None:
    try:
        configure_logging()
    except ConfigError as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(settings))


if __name__ == "__main__":
    main()


__all__ = ["configure_logging", "main", "serve"]
