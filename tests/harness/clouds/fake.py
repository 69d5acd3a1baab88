"""What the local Google Cloud and Azure servers share: the request log, fault injection, the process that runs
them (so a SIGKILLed worker never takes its cloud down) and the control client tests use.

Control endpoints (never called by the product's cloud code) live under ``/_fake/``: ``GET requests`` (every request the
cloud API received, in order), ``POST faults`` (a JSON object merged into the faults), ``POST reset``,
``GET state`` (the instances, with their user data), ``POST seed`` (resources a test starts from that the product
never creates: GKE clusters and node pools, AKS managed clusters and agent pools), ``GET identity-ca`` (the
trust root and signer certificate of the instance identities this cloud signs: ``{"root", "signer"}``, PEM) and
``GET metadata/<instance id>/<metadata path>``: that instance's metadata service (its signed identity, issue 27),
the ``metadataUrl`` a local instance's node joins with.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.controlplane import free_port
from tests.harness.identity import IdentityCA
from tests.harness.processes import stop_process


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(json.dumps(body))
        self.status, self.body, self.headers = status, body, headers or {}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status=status, headers=headers or {}, content_type="application/json")


class FakeCloud:
    """Base of both fakes: the WSGI entry point, the request log and the faults every cloud has.

    Faults: ``fail_nth`` ({"n": N, "status": 500}: the Nth cloud API request from now on fails, once),
    ``slow_create_seconds`` (a create is done at once but its answer comes this much later: the window in which a
    worker is killed), ``slow_remove_seconds`` (the same for removing one node of a managed group: GKE
    deleteInstances, AKS deleteMachines), ``operation_seconds`` (how long a create or delete operation runs),
    per-cloud others.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._identity_ca: IdentityCA | None = None
        self.reset()

    @property
    def identity_ca(self) -> IdentityCA:
        """The CA this cloud signs its instances' identities with (made at first use, kept across resets)."""
        if self._identity_ca is None:
            self._identity_ca = IdentityCA(name=f"{type(self).__name__} test identity CA")
        return self._identity_ca

    def reset(self) -> None:
        with self.lock:
            self.requests: list[dict[str, Any]] = []
            self.faults: dict[str, Any] = {"operation_seconds": 0.5}
            self._counted = 0

    # -- to implement --------------------------------------------------------------------------------------
    def route(self, request: Request, body: Any) -> Response:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def server_error(self, status: int) -> ApiError:
        raise NotImplementedError

    def seed(self, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiError(404, {"error": "this cloud has nothing to seed"})

    def metadata(self, instance: str, path: str, request: Request) -> Response:
        """What the metadata service answers ``instance`` at ``path`` (its signed identity)."""
        raise ApiError(404, {"error": "this cloud has no metadata service"})

    # -- shared --------------------------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        response = self.handle(request)
        return response(environ, start_response)

    def handle(self, request: Request) -> Response:
        raw = request.get_data()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return json_response({"error": {"code": 400, "message": "body is not JSON"}}, 400)
        if request.path.startswith("/_fake/"):
            return self.control(request, body)
        with self.lock:
            self.requests.append({"method": request.method, "path": request.path,
                                  "query": dict(request.args.items()), "body": body,
                                  "authorization": request.headers.get("Authorization", ""), "time": time.time()})
            self._counted += 1
            nth = self.faults.get("fail_nth")
            if nth and self._counted >= int(nth["n"]):
                self.faults.pop("fail_nth")
                err = self.server_error(int(nth.get("status", 500)))
                return json_response(err.body, err.status, err.headers)
        try:
            return self.route(request, body)
        except ApiError as err:
            return json_response(err.body, err.status, err.headers)

    def control(self, request: Request, body: Any) -> Response:
        with self.lock:
            if request.path == "/_fake/requests":
                return json_response(self.requests)
            if request.path == "/_fake/faults" and request.method == "POST":
                self.faults.update(body or {})
                self.faults = {k: v for k, v in self.faults.items() if v is not None}
                self._counted = 0
                return json_response(self.faults)
            if request.path == "/_fake/reset" and request.method == "POST":
                self.reset()
                return json_response({})
            if request.path == "/_fake/state":
                return json_response(self.state())
            if request.path == "/_fake/identity-ca":
                return json_response({"root": self.identity_ca.root_pem, "signer": self.identity_ca.signer_pem})
            if request.path.startswith("/_fake/metadata/"):
                instance, _, path = request.path.removeprefix("/_fake/metadata/").partition("/")
                try:
                    return self.metadata(instance, f"/{path}", request)
                except ApiError as err:
                    return json_response(err.body, err.status)
            if request.path == "/_fake/seed" and request.method == "POST":
                try:
                    return json_response(self.seed(body or {}))
                except ApiError as err:
                    return json_response(err.body, err.status)
        return json_response({"error": "no such control endpoint"}, 404)

    def slow_create(self) -> None:
        """The create is done; its answer waits (outside the lock), so a caller can die before hearing it."""
        delay = float(self.faults.get("slow_create_seconds", 0))
        if delay:
            time.sleep(delay)

    def slow_answer(self, fault: str) -> None:
        """Like ``slow_create`` for another fault (``slow_remove_seconds``: a node group removal has started; its
        answer waits). Called holding the lock once: it releases it while waiting."""
        delay = float(self.faults.get(fault, 0))
        if delay:
            self.lock.release()
            try:
                time.sleep(delay)
            finally:
                self.lock.acquire()


@dataclass
class FakeServer:
    """A fake cloud in its own process on a loopback port: ``python -m <module> --port P [--tls-dir D]``."""

    module: str
    logdir: Path
    tls_dir: Path | None = None
    # An identity endpoint (plain HTTP on a port of its own): the Azure fake's managed identity.
    with_identity: bool = False
    url: str = ""
    identity_url: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # How the process is started: `make dev` passes its registry's (children die with it, leftovers are reaped).
    popen: Callable[..., subprocess.Popen[bytes]] = field(default=subprocess.Popen, repr=False)

    def start(self, *, port: int = 0, timeout: float = 30.0) -> FakeServer:
        port = port or free_port()
        scheme = "https" if self.tls_dir else "http"
        self.url = f"{scheme}://127.0.0.1:{port}"
        name = self.module.rsplit(".", 1)[-1]
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        argv = [sys.executable, "-m", self.module, "--port", str(port)]
        if self.tls_dir:
            argv += ["--tls-dir", str(self.tls_dir)]
        if self.with_identity:
            identity_port = free_port()
            self.identity_url = f"http://127.0.0.1:{identity_port}/msi/token"
            argv += ["--identity-port", str(identity_port)]
        self._proc = self.popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, cwd=Path(__file__).resolve().parents[3])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited {self._proc.returncode}: "
                                   f"{(self.logdir / f'{name}.log').read_text()}")
            with contextlib.suppress(OSError):
                self._control("GET", "requests")
                return self
            time.sleep(0.1)
        raise RuntimeError(f"{self.module} did not answer on {self.url} within {timeout}s")

    @property
    def ca_file(self) -> Path | None:
        return self.tls_dir / "ca.pem" if self.tls_dir else None

    def _control(self, method: str, what: str, body: Any = None) -> Any:
        import ssl

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}/_fake/{what}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        ctx = ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else None
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read())

    def requests(self) -> list[dict[str, Any]]:
        return list(self._control("GET", "requests"))

    def fault(self, **faults: Any) -> None:
        self._control("POST", "faults", faults)

    def reset(self) -> None:
        self._control("POST", "reset", {})

    def state(self) -> dict[str, Any]:
        return dict(self._control("GET", "state"))

    def seed(self, **body: Any) -> dict[str, Any]:
        return dict(self._control("POST", "seed", body))

    def identity_ca(self) -> dict[str, str]:
        """The trust root and signer certificate (PEM) of the instance identities this cloud signs."""
        return dict(self._control("GET", "identity-ca"))

    def stop(self) -> None:
        if self._proc:
            stop_process(self._proc, 10)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(app: FakeCloud, argv: list[str] | None = None) -> None:
    """Run a fake on 127.0.0.1 (threaded, so a slow answer never holds up the others)."""
    import argparse

    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-dir", type=Path, help="serve HTTPS with a certificate made here (ca.pem: its CA)")
    args = parser.parse_args(argv)
    ssl_context: Any = None
    if args.tls_dir:
        ssl_context = make_tls(args.tls_dir)
    run_simple("127.0.0.1", args.port, app, threaded=True, ssl_context=ssl_context)


def make_tls(folder: Path) -> Any:
    """A CA and a certificate for 127.0.0.1 / localhost minted with trustme; ca.pem is what clients trust."""
    import ssl

    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    cert.private_key_and_cert_chain_pem.write_to_path(str(folder / "server.pem"))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(folder / "server.pem"))
    return ctx
