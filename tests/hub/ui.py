"""Helpers of the web UI tests: sign in through the page, screenshots at both widths with the layout and
accessibility checks every page must pass, and the optimizer's side (its hub client with a token file)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from dataclasses import field
from datetime import datetime
from pathlib import Path
from typing import Any

from playwright.async_api import Browser
from playwright.async_api import BrowserContext
from playwright.async_api import Page
from playwright.async_api import ViewportSize

from activities.clients.hub import HubClient
from models.hub import ActionReport
from tests.harness.browser import artifacts_dir
from tests.hub.conftest import UiHub

ROOT = Path(__file__).resolve().parent.parent.parent
WIDE: ViewportSize = {"width": 1280, "height": 900}
NARROW: ViewportSize = {"width": 390, "height": 844}


def artifacts(hub: UiHub) -> Path:
    out = artifacts_dir(ROOT / ".artifacts" / "hub-ui") / hub.backend
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass
class Dialogs:
    """Every alert/confirm a page opened: a hostile value that ran as script would open one."""

    seen: list[str] = field(default_factory=list)

    def watch(self, page: Page) -> Page:
        async def on_dialog(dialog: Any) -> None:
            self.seen.append(dialog.message)
            await dialog.dismiss()

        page.on("dialog", on_dialog)
        return page


async def new_page(context: BrowserContext, dialogs: Dialogs | None = None) -> Page:
    page = await context.new_page()
    page.set_default_timeout(10_000)
    if dialogs is not None:
        dialogs.watch(page)
    return page


async def sign_in(context: BrowserContext, hub: UiHub, key: str, dialogs: Dialogs | None = None) -> Page:
    """With the keyboard only, as a screen-reader user would: the field is found by its label."""
    page = await new_page(context, dialogs)
    await page.goto(f"{hub.url}/ui/clusters")
    assert "/ui/sign-in" in page.url, page.url
    field = page.get_by_label("API key")
    await field.focus()
    await page.keyboard.type(key)
    await page.keyboard.press("Enter")
    await page.wait_for_url(re.compile(r".*/ui/clusters$"))
    return page


async def csrf_of(page: Page) -> str:
    return await page.locator("form[action='/ui/sign-out'] input[name=csrf_token]").get_attribute("value") or ""


async def check_page(page: Page) -> None:
    """What every page must have: one h1, a label for each control, a skip link to main, no horizontal scrolling
    of the page itself at 390 px (wide tables scroll inside their own region)."""
    assert await page.locator("h1").count() == 1, await page.content()
    unlabelled = await page.evaluate("""() => [...document.querySelectorAll(
        'input:not([type=hidden]), select, textarea')].filter(e => !(e.labels && e.labels.length)
        && !e.getAttribute('aria-label')).map(e => e.name || e.id)""")
    assert unlabelled == [], f"controls without a label on {page.url}: {unlabelled}"
    assert await page.locator("a.skip[href='#main']").count() == 1
    overflow = await page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{page.url} scrolls sideways by {overflow}px at width {page.viewport_size}"


async def shoot(page: Page, hub: UiHub, name: str) -> None:
    """Screenshots at 1280 and 390 px into the artifacts dir, each width passing ``check_page``."""
    out = artifacts(hub)
    for label, size in (("1280", WIDE), ("390", NARROW)):
        await page.set_viewport_size(size)
        await check_page(page)
        await page.screenshot(path=str(out / f"{name}-{label}.png"), full_page=True)
    await page.set_viewport_size(WIDE)


def optimizer(hub: UiHub, token: str, name: str) -> HubClient:
    """The optimizer's own hub client, reading its token from a file as it reads the mounted Secret."""
    token_file = hub.workdir / f"{name}.token"
    token_file.write_text(token)
    return HubClient(hub.url, token_file, timeout=10)


def user_key(hub: UiHub, name: str, role: str) -> str:
    created = hub.admin.post("/v1/users", json={"name": name, "role": role})
    assert created.status_code == 201, created.text
    issued = hub.admin.post(f"/v1/users/{name}/keys", json={"description": "web UI test"})
    assert issued.status_code == 201, issued.text
    key: str = issued.json()["key"]
    return key


async def signed_in(browser: Browser, hub: UiHub, name: str, role: str,
                    dialogs: Dialogs | None = None) -> tuple[BrowserContext, Page]:
    """A new user ``name`` of ``role``, signed in with its key in a fresh browser context: the context and the page."""
    context = await browser.new_context()
    return context, await sign_in(context, hub, user_key(hub, name, role), dialogs)


def create_cluster(hub: UiHub, name: str) -> str:
    created = hub.admin.post("/v1/clusters", json={"name": name})
    assert created.status_code == 201, created.text
    token: str = created.json()["token"]["token"]
    return token


def plan_detail(plan_id: str, *, nodes: list[dict[str, Any]] | None = None, summary: str = "",
                console_url: str | None = None) -> str:
    body: dict[str, Any] = {"plan_id": plan_id, "summary": summary, "nodes": nodes or [
        {"location": "aws/eu-central-1", "instance_type": "g6.xlarge", "gpus": 1, "gpu_product": "NVIDIA-L4",
         "compute_usd_per_hour": 0.80, "transfer_usd_per_hour": 0.05, "pods": ["ml/infer-0", "ml/infer-1"]},
    ]}
    if console_url:
        body["console_url"] = console_url
    return json.dumps(body)


def proposal(operation: str, plan_id: str, at: datetime, *, key: str | None = None, policy: str = "burst-eu",
             **plan: Any) -> ActionReport:
    return ActionReport(idempotency_key=key or f"{operation}/proposed/{plan_id}", operation=operation,
                        policy=policy, action="proposed", location="aws/eu-central-1",
                        detail=plan_detail(plan_id, **plan), occurred_at=at)
