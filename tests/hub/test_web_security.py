"""The web UI's defences against the real hub process (SQLite and PostgreSQL): CSRF on every form, sessions that
another hub instance, a sign-out, an expiry or a revoked key end, and hostile form inputs that are refused or
escaped, never put raw into a page (checked in the HTML and, for stored values, in chromium: no script runs)."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import trustme
import yaml

from models.hub import ActionReport
from models.hub import pack_proposal_detail
from models.hub import sharing_proposal_detail
from tests.harness.controlplane import free_port
from tests.hub.conftest import BOOTSTRAP_KEY
from tests.hub.conftest import UiHub
from tests.hub.conftest import start_ui_hub
from tests.hub.helpers import policy_document
from tests.hub.helpers import wait_until
from tests.hub.process import ROOT
from tests.hub.ui import Dialogs
from tests.hub.ui import create_cluster
from tests.hub.ui import optimizer
from tests.hub.ui import proposal
from tests.hub.ui import sign_in
from tests.hub.ui import signed_in
from tests.hub.ui import user_key

pytestmark = pytest.mark.timeout(180)
CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')
SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
SVG = "<svg/onload=alert(1)>"


class WebClient:
    """The UI over plain HTTP with a signed-in session: how a script (or an attacker's page) would post."""

    def __init__(self, hub: UiHub, key: str | None) -> None:
        self.hub = hub
        self.http = httpx.Client(base_url=hub.url, headers={"Origin": hub.url}, timeout=10)
        self.csrf = ""
        if key is not None:
            signed_in = self.sign_in(key)
            assert signed_in.status_code == 303, signed_in.text
            self.csrf = CSRF_RE.findall(self.http.get("/ui/clusters").text)[0]

    def sign_in(self, key: str, next_path: str = "/ui/clusters") -> httpx.Response:
        form = self.http.get("/ui/sign-in")
        return self.http.post("/ui/sign-in", data={"csrf_token": CSRF_RE.findall(form.text)[0], "api_key": key,
                                                    "next": next_path})

    def post(self, path: str, **fields: str) -> httpx.Response:
        return self.http.post(path, data={"csrf_token": self.csrf, **fields})

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def admin_web(ui_hub: UiHub) -> Iterator[WebClient]:
    client = WebClient(ui_hub, user_key(ui_hub, "hana", "admin"))
    create_cluster(ui_hub, "sec-main")
    yield client
    client.close()


def clusters(hub: UiHub) -> list[str]:
    return [c["name"] for c in hub.admin.get("/v1/clusters").json()]


# ----- CSRF and the session cookie -----


async def test_a_post_without_the_sessions_csrf_token_or_from_another_origin_is_refused(
        ui_hub: UiHub, admin_web: WebClient) -> None:
    other = WebClient(ui_hub, user_key(ui_hub, "otis", "admin"))
    try:
        attempts = {
            "no token": admin_web.http.post("/ui/clusters", data={"name": "csrf-a"}),
            "empty token": admin_web.http.post("/ui/clusters", data={"name": "csrf-b", "csrf_token": ""}),
            "another session's token": admin_web.http.post("/ui/clusters", data={"name": "csrf-c",
                                                                                 "csrf_token": other.csrf}),
            "another origin": admin_web.http.post("/ui/clusters", data={"name": "csrf-d", "csrf_token":
                                                  admin_web.csrf}, headers={"Origin": "https://evil.example"}),
            "opaque origin": admin_web.http.post("/ui/clusters", data={"name": "csrf-e", "csrf_token":
                                                 admin_web.csrf}, headers={"Origin": "null"}),
        }
        for what, answer in attempts.items():
            assert answer.status_code == 403, (what, answer.status_code, answer.text)
            assert "csrf" in answer.text.lower() or "cross-site" in answer.text, what
        assert not any(name.startswith("csrf-") for name in clusters(ui_hub))
        assert admin_web.post("/ui/clusters", name="csrf-ok").status_code == 201  # the same form, with it
        # The sign-in form too: without its double-submit token no session opens.
        fresh = WebClient(ui_hub, None)
        fresh.http.get("/ui/sign-in")
        answer = fresh.http.post("/ui/sign-in", data={"api_key": "x" * 30, "csrf_token": "forged"})
        assert answer.status_code == 403 and "kubeon_hub_session" not in answer.headers.get("set-cookie", "")
        fresh.close()
    finally:
        other.close()


async def test_a_session_cookie_from_another_hub_instance_is_refused_and_sessions_expire(
        ui_hub: UiHub, browser, tmp_path: Path) -> None:
    other_hub = start_ui_hub(tmp_path, f"sqlite:///{tmp_path / 'other.db'}", "sqlite")
    try:
        key_there = user_key(other_hub, "ida", "admin")
        context = await browser.new_context()
        page = await sign_in(context, other_hub, key_there)
        cookie = next(c for c in await context.cookies() if c["name"] == "kubeon_hub_session")
        # Same host, another port: the browser sends the other hub's cookie here, and this hub refuses it.
        await page.goto(f"{ui_hub.url}/ui/clusters")
        assert "/ui/sign-in" in page.url
        # Posted with the other hub's own CSRF token, as a page of that hub would: still refused.
        await page.goto(f"{other_hub.url}/ui/clusters")
        csrf = CSRF_RE.findall(await page.content())[0]
        async with httpx.AsyncClient(base_url=ui_hub.url, cookies={"kubeon_hub_session": cookie["value"]},
                                     headers={"Origin": ui_hub.url}) as forged:
            answer = await forged.post("/ui/clusters", data={"csrf_token": csrf, "name": "from-elsewhere"})
            assert answer.status_code == 401, answer.text
        assert "from-elsewhere" not in clusters(ui_hub)

        # The session lasts 8 hours on the other hub's clock, then it is gone.
        other_hub.advance(timedelta(hours=7, minutes=59))
        await page.goto(f"{other_hub.url}/ui/clusters")
        assert page.url.endswith("/ui/clusters")
        other_hub.advance(timedelta(minutes=2))
        await page.goto(f"{other_hub.url}/ui/clusters")
        assert "/ui/sign-in" in page.url
        await context.close()
    finally:
        other_hub.admin.close()
        assert other_hub.process.stop(), other_hub.process.log


async def test_revoking_the_api_key_ends_its_sessions(ui_hub: UiHub) -> None:
    key = user_key(ui_hub, "kim", "operator")
    web = WebClient(ui_hub, key)
    try:
        assert web.http.get("/ui/approvals").status_code == 200
        key_id = key.split("_")[1]
        assert ui_hub.admin.post(f"/v1/users/kim/keys/{key_id}/revoke").status_code == 200
        answer = web.http.get("/ui/approvals")
        assert answer.status_code == 303 and answer.headers["location"].startswith("/ui/sign-in")
        assert web.post("/ui/approvals", cluster="sec-main", operation="op-x", decision="approve"
                        ).status_code == 401
    finally:
        web.close()


# ----- hostile inputs: refused or escaped, never raw -----


@dataclass(frozen=True)
class Hostile:
    name: str
    send: Callable[[WebClient], httpx.Response]
    statuses: tuple[int, ...]
    raw: tuple[str, ...] = ()  # must not appear in the answer as sent


def _policy_yaml(**changes: object) -> str:
    doc = policy_document("hostile-policy")
    doc["metadata"].update(changes)
    return yaml.safe_dump(doc)


def _editor(web: WebClient, text: str, step: str = "preview") -> httpx.Response:
    return web.post("/ui/clusters/sec-main/policy-editor", document=text, original="", base="0", step=step)


HOSTILE = [
    Hostile("cluster name with a script", lambda w: w.post("/ui/clusters", name=SCRIPT), (422,), (SCRIPT,)),
    Hostile("cluster name breaking out of the attribute", lambda w: w.post("/ui/clusters", name=IMG), (422,),
            (IMG, "<img")),
    Hostile("cluster name of 5000 characters", lambda w: w.post("/ui/clusters", name="a" * 5000), (422,)),
    Hostile("cluster name with NUL", lambda w: w.post("/ui/clusters", name="ab\x00cd"), (422,)),
    Hostile("cluster name with a newline", lambda w: w.post("/ui/clusters", name="ab\ncd"), (422,)),
    Hostile("cluster description with a script (stored, escaped)",
            lambda w: w.post("/ui/clusters", name="hostile-desc", description=SCRIPT), (201,), (SCRIPT,)),
    Hostile("cluster description with BEL", lambda w: w.post("/ui/clusters", name="bel", description="a\x07b"),
            (422,)),
    Hostile("cluster description of 300 characters",
            lambda w: w.post("/ui/clusters", name="long-desc", description="d" * 300), (422,)),
    Hostile("API key with a script", lambda w: WebClient(w.hub, None).sign_in(SCRIPT), (401,), (SCRIPT,)),
    Hostile("API key of 100 000 characters", lambda w: WebClient(w.hub, None).sign_in("k" * 100_000), (401,)),
    Hostile("sign-in redirect to another site", lambda w: WebClient(w.hub, None).sign_in(
        "k" * 30, "//evil.example/x"), (401,), ("evil.example",)),
    Hostile("policy annotation with a script (stored, escaped)", lambda w: _editor(
        w, _policy_yaml(annotations={"note": SCRIPT + IMG}), "preview"), (200,), (SCRIPT, "<img")),
    Hostile("policy name with markup", lambda w: _editor(w, _policy_yaml(name="<b>bold</b>")), (422,),
            ("<b>bold",)),
    Hostile("policy YAML with a Python tag", lambda w: _editor(w, '!!python/object/apply:os.system ["id"]\n'),
            (422,)),
    Hostile("policy YAML alias bomb", lambda w: _editor(
        w, "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(12))), (422,)),
    Hostile("policy YAML of 300 KB", lambda w: _editor(w, "# " + "x" * 300_000 + "\n"), (422,)),
    Hostile("policy YAML with ESC", lambda w: _editor(w, _policy_yaml(labels={"a": "b"}).replace("b\n",
                                                                                                "b\x1b\n")),
            (422,)),
    Hostile("approval of an operation named with a script", lambda w: w.post(
        "/ui/approvals", cluster="sec-main", operation=SCRIPT, decision="approve"), (422,), (SCRIPT,)),
    Hostile("approval for a cluster named with markup", lambda w: w.post(
        "/ui/approvals", cluster=SVG, operation="op-1", decision="approve"), (422,), (SVG,)),
    Hostile("approval reason with NUL", lambda w: w.post(
        "/ui/approvals", cluster="sec-main", operation="op-1", decision="approve", reason="a\x00b"), (422,)),
    Hostile("activity filter with a script (reflected, escaped)", lambda w: w.http.get(
        "/ui/activity", params={"policy": SCRIPT + IMG}), (200,), (SCRIPT, "<img")),
    Hostile("activity filter with NUL", lambda w: w.http.get("/ui/activity", params={"operation": "a\x00"}),
            (422,)),
    Hostile("audit filter with a script", lambda w: w.http.get("/ui/audit", params={"actor": SCRIPT}), (422,),
            (SCRIPT,)),
    Hostile("form that is not UTF-8", lambda w: w.http.post(
        "/ui/clusters", content=b"csrf_token=" + w.csrf.encode() + b"&name=%ff%fe",
        headers={"Content-Type": "application/x-www-form-urlencoded"}), (400,)),
    Hostile("form with 60 fields", lambda w: w.http.post("/ui/clusters", data={
        "csrf_token": w.csrf, **{f"f{i}": "x" for i in range(60)}}), (400,)),
    Hostile("JSON instead of a form", lambda w: w.http.post("/ui/clusters", json={"name": "json"}), (415,)),
    Hostile("body over 1 MiB", lambda w: w.post("/ui/clusters", name="big", description="d" * 1_100_000),
            (413,)),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[h.name for h in HOSTILE])
async def test_hostile_input_is_refused_or_escaped(ui_hub: UiHub, admin_web: WebClient, case: Hostile) -> None:
    before = clusters(ui_hub)
    answer = case.send(admin_web)
    assert answer.status_code in case.statuses, (answer.status_code, answer.text[:2000])
    for raw in case.raw:
        assert raw not in answer.text, f"{raw!r} rendered raw"
    assert "evil.example" not in answer.headers.get("location", "")
    if answer.headers.get("content-type", "").startswith("text/html"):
        assert "script-src 'self'" in answer.headers["content-security-policy"]
    after = clusters(ui_hub)
    assert set(after) - set(before) <= ({"hostile-desc"} if case.statuses == (201,) else set())


async def test_stored_hostile_values_run_no_script_in_the_browser(ui_hub: UiHub, admin_web: WebClient,
                                                                  browser) -> None:
    """Hostile values that are valid (a description, an annotation, a report's detail) are stored; every page
    that shows them escapes them: chromium opens no dialog and finds no element they would have made."""
    assert admin_web.post("/ui/clusters", name="stored-xss", description=SCRIPT + IMG).status_code == 201
    saved = _editor(admin_web, _policy_yaml(annotations={"note": SCRIPT + IMG}), "preview")
    reviewed = re.findall(r'name="reviewed" value="([0-9a-f]+)"', saved.text)[0]
    stored = admin_web.post("/ui/clusters/sec-main/policy-editor", document=_policy_yaml(
        annotations={"note": SCRIPT + IMG}), original="", base="0", step="save", reviewed=reviewed)
    assert stored.status_code == 303, stored.text
    token = create_cluster(ui_hub, "stored-reports")
    client = optimizer(ui_hub, token, "stored-reports")
    try:
        assert client.report(proposal("op-xss-1", "plan-xss", ui_hub.now(), summary=SCRIPT + IMG,
                                      nodes=[{"location": "aws/eu-central-1", "instance_type": SVG,
                                              "pods": [IMG]}]))
        bad_link = proposal("op-xss-2", "plan-js", ui_hub.now()).model_copy(update={
            "idempotency_key": "op-xss-2/proposed",
            "detail": '{"plan_id": "plan-js", "console_url": "javascript:alert(1)", "summary": "' + IMG + '"}'})
        assert client.report(bad_link)
        # The Sharing and Packing plans' texts (node, change, reason, risk, nodes removed, pods moved) are the
        # cluster's words too: shown as text, never markup.
        assert client.report(ActionReport(
            idempotency_key="op-xss-3/proposed", operation="op-xss-3", policy="p", action="proposed",
            occurred_at=ui_hub.now(), detail=sharing_proposal_detail(
                plan_id="plan-share-xss", node=SVG, gpus=8, change=IMG, summary=SCRIPT, reason=SCRIPT + IMG,
                risk=SVG, saving_usd_per_hour=1.0)))
        assert client.report(ActionReport(
            idempotency_key="op-xss-4/proposed", operation="op-xss-4", policy="p", action="proposed",
            occurred_at=ui_hub.now(), detail=pack_proposal_detail(
                plan_id="plan-pack-xss", summary=SCRIPT, remove=[SVG], moves=[IMG + ": a -> b"],
                saving_usd_per_hour=1.0)))
    finally:
        client.close()
    dialogs = Dialogs()
    context, page = await signed_in(browser, ui_hub, "xena", "admin", dialogs)
    # Each page, and where it shows the hostile text as text (None: the page does not show it).
    pages = {"/ui/clusters": "main", "/ui/clusters/stored-xss": "main", "/ui/clusters/sec-main": None,
             "/ui/clusters/sec-main/policies/hostile-policy": "#document", "/ui/approvals": "main",
             "/ui/activity": "main", "/ui/audit": "main", f"/ui/activity?policy={SCRIPT}": "#f-policy"}
    for path, where in pages.items():
        await page.goto(f"{ui_hub.url}{path}")
        made = await page.evaluate("""() => document.querySelectorAll(
            'script:not([src]), img, svg, [onerror], [onload], a[href^="javascript:"]').length""")
        assert made == 0, (path, await page.content())
        if where == "main":
            assert SCRIPT in await page.locator("main").inner_text(), path
        elif where is not None:
            assert SCRIPT in await page.locator(where).input_value(), path
    assert dialogs.seen == []
    await context.close()


def test_over_https_the_session_cookie_is_secure(tmp_path: Path) -> None:
    """The hub serving TLS itself (``--tls-cert-file``): its cookies carry ``Secure``, so a browser never sends
    them over plain HTTP. With ``--public-url`` the install commands name that address."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    (tmp_path / "bootstrap.key").write_text(BOOTSTRAP_KEY)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    with open(tmp_path / "hub.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hub.server", "--listen", f"127.0.0.1:{port}", "--database-url",
             f"sqlite:///{tmp_path / 'hub.db'}", "--bootstrap-admin-key-file", str(tmp_path / "bootstrap.key"),
             "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file),
             "--public-url", "https://hub.example.test"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        trust = ssl.create_default_context(cafile=str(ca_file))
        with httpx.Client(base_url=url, verify=trust, headers={"Origin": url}, timeout=10) as web:
            wait_until(lambda: web.get("/healthz").status_code == 200 or None, timeout=30,
                       what="the TLS hub to answer")
            form = web.get("/ui/sign-in")
            assert "; secure" in form.headers["set-cookie"].lower(), form.headers["set-cookie"]
            signed_in = web.post("/ui/sign-in", data={"csrf_token": CSRF_RE.findall(form.text)[0],
                                                      "api_key": BOOTSTRAP_KEY})
            assert signed_in.status_code == 303, signed_in.text
            session_cookie = next(v for k, v in signed_in.headers.multi_items()
                                  if k == "set-cookie" and v.startswith("kubeon_hub_session="))
            flags = {part.strip().lower() for part in session_cookie.split(";")[1:]}
            assert {"secure", "httponly", "samesite=strict", "path=/ui"} <= flags, session_cookie
            assert any(f.startswith("max-age=") for f in flags), session_cookie
            # --public-url: the address optimizers use, in the install commands (not the one the browser used).
            csrf = CSRF_RE.findall(web.get("/ui/clusters").text)[0]
            added = web.post("/ui/clusters", data={"csrf_token": csrf, "name": "behind-proxy"})
            assert added.status_code == 201, added.text
            assert "--set hub.url=https://hub.example.test" in added.text and url not in added.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
