"""Headless Chromium from Debian's package, driven by Playwright's Python client (no browser download).

The flags keep Chromium off the network this machine does not have (background services, component updates)
and let it run as root. Screenshots go to ``KUBEON_ARTIFACTS_DIR`` (default: the test's temporary directory)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from playwright.async_api import Browser
from playwright.async_api import Page
from playwright.async_api import async_playwright

CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise RuntimeError("chromium not found: `make system-deps` installs Debian's chromium package")
    return path


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            await browser.close()


def artifacts_dir(fallback: Path) -> Path:
    out = Path(os.environ.get("KUBEON_ARTIFACTS_DIR") or fallback)
    out.mkdir(parents=True, exist_ok=True)
    return out


async def screenshot(page: Page, out: Path, name: str) -> Path:
    path = out / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    return path


async def current_details_text(page: Page, marker: str = "Phase", timeout: float = 30.0) -> str:
    """The rendered current details on the workflow page's User Metadata tab. The UI draws summary, details and
    current details each in an iframe of its markdown renderer (``/render?content=...``): the one holding
    ``marker``."""
    import asyncio
    import time

    await page.get_by_text("User Metadata", exact=True).first.click()
    deadline = time.monotonic() + timeout
    while True:
        for frame in page.frames:
            if "/render" not in frame.url:
                continue
            try:
                text = await frame.locator("body").inner_text(timeout=2_000)
            except Exception:
                continue
            if marker in text:
                return text
        if time.monotonic() > deadline:
            raise AssertionError(f"no rendered details holding {marker!r} on {page.url}")
        await asyncio.sleep(0.5)
