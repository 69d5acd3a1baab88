"""`kubeon-gpu console`: the real Temporal UI (the dev server's) through the console, in headless Chromium."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from temporalio.common import SearchAttributePair
from temporalio.common import TypedSearchAttributes
from temporalio.testing import WorkflowEnvironment

from models import search_attributes as sa
from tests.harness.browser import artifacts_dir
from tests.harness.browser import chromium
from tests.harness.browser import screenshot
from worker.console import COLUMNS_KEY
from worker.console import column_script
from worker.console import inject
from worker.console import workflows_url

PAGE = ('<!doctype html><html><head><meta charset="utf-8" />'
        '<meta http-equiv="content-security-policy" content="script-src \'strict-dynamic\' \'sha256-abc=\'">'
        '</head><body></body></html>')


def test_the_script_goes_first_in_the_head_and_its_hash_is_allowed() -> None:
    script = column_script("default")
    page = inject(PAGE, script)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'strict-dynamic' 'sha256-abc=' 'sha256-{digest}'" in page
    assert page.index(f"<script>{script}</script>") == page.index("<head>") + len("<head>")


def test_a_page_without_a_head_is_left_alone() -> None:
    assert inject("<p>plain</p>", column_script("default")) == "<p>plain</p>"


def test_the_link_filters_on_awaiting_approval() -> None:
    assert workflows_url("http://ui:8233/", "prod ns") == (
        "http://ui:8233/namespaces/prod%20ns/workflows?query=KubeonPhase%3D%22AwaitingApproval%22")


async def _operation(env: WorkflowEnvironment, wf_id: str, phase: str, usd: float) -> None:
    # No worker needed: visibility lists a started workflow with its start-time search attributes.
    await env.client.start_workflow(
        "BatchWorkflow", id=wf_id, task_queue="nobody-polls",
        search_attributes=TypedSearchAttributes([
            SearchAttributePair(sa.PHASE, phase), SearchAttributePair(sa.POLICY, "inference-burst-eu"),
            SearchAttributePair(sa.LOCATION, "aws/eu-central-1"), SearchAttributePair(sa.USD_PER_HOUR, usd),
            SearchAttributePair(sa.OPERATION_KIND, "Burst")]))


@pytest.mark.temporal
async def test_the_console_opens_on_what_awaits_approval_with_policy_location_and_cost(
        ui: tuple[WorkflowEnvironment, str], console: str, tmp_path: Path) -> None:
    env, _ = ui
    await _operation(env, "burst/c/inference-burst-eu/waiting", "AwaitingApproval", 3.8)
    await _operation(env, "burst/c/inference-burst-eu/serving", "Serving", 0.95)
    out = artifacts_dir(tmp_path)
    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1600, "height": 900})
        csp_errors: list[str] = []
        page.on("console", lambda m: csp_errors.append(m.text) if "Content Security Policy" in m.text else None)
        await page.goto(console + "/")
        assert "query=KubeonPhase" in page.url
        row = page.locator("tr", has_text="burst/c/inference-burst-eu/waiting")
        await row.wait_for(timeout=30_000)
        headers = await page.locator("th").all_inner_texts()
        assert {"KubeonPolicy", "KubeonLocation", "KubeonUsdPerHour", "KubeonPhase"} <= {h.strip() for h in headers}
        cells = await row.inner_text()
        assert "inference-burst-eu" in cells and "aws/eu-central-1" in cells and "3.8" in cells
        assert await page.locator("tr", has_text="burst/c/inference-burst-eu/serving").count() == 0
        await screenshot(page, out, "console-awaiting-approval")
        assert csp_errors == []


        # A choice the operator made in the UI stays theirs.
        mine = {"default": [{"label": "Status"}, {"label": "Workflow ID"}]}
        await page.evaluate(f"localStorage.setItem({json.dumps(COLUMNS_KEY)}, {json.dumps(json.dumps(mine))})")
        await page.reload()
        await page.locator("tr", has_text="burst/c/inference-burst-eu/waiting").wait_for(timeout=30_000)
        chosen = {h.strip() for h in await page.locator("th").all_inner_texts()}
        assert "KubeonPolicy" not in chosen and "Workflow ID" in chosen
        stored = await page.evaluate(f"localStorage.getItem({json.dumps(COLUMNS_KEY)})")
        assert json.loads(stored)["default"] == mine["default"]
        assert re.search(r"/namespaces/default/workflows", page.url)

        # A workflow ID holds `/`: its page (the UI sends it as %2F) must not turn into other path segments.
        wf_page = quote("burst/c/inference-burst-eu/waiting", safe="")
        await page.goto(f"{console}/namespaces/default/workflows/{wf_page}")
        await page.get_by_text("User Metadata", exact=True).first.wait_for(timeout=30_000)
        assert await page.get_by_text("Not Found").count() == 0
