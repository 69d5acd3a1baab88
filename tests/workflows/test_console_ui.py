"""The Temporal UI as the operator's console, driven in headless Chromium like an operator would (issue 15):
the real dev server's UI behind `kubeon-gpu console`, the real control plane, a sim burst awaiting approval.
Screenshots are saved (KUBEON_ARTIFACTS_DIR, else the test's temporary directory)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from models import search_attributes as sa
from models.ids import provision_workflow_id
from models.node import NodePhase
from tests.harness.browser import artifacts_dir
from tests.harness.browser import chromium
from tests.harness.browser import current_details_text
from tests.harness.browser import screenshot
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import in_process_worker
from tests.harness.burst import node_for
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]


@pytest.fixture
async def worker(stack: BurstStack, ui: tuple[WorkflowEnvironment, str]) -> AsyncIterator[tuple[Client, str]]:
    """The worker on the UI's own dev server."""
    async with in_process_worker(stack, ui[0], SIM_LOCATIONS) as (temporal, settings, _runtime):
        yield temporal, settings.cluster


async def test_an_operator_finds_reads_approves_and_follows_a_burst_home_in_the_ui(
        stack: BurstStack, worker: tuple[Client, str], console: str, namespace: str, policy: str,
        tmp_path: Path) -> None:
    temporal, cluster_name = worker
    out = artifacts_dir(tmp_path)
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west"], max_nodes=2)
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
    view = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
    assert view.proposal is not None
    plan = view.proposal.plan
    (node,) = plan.new_nodes
    wf_id = provision_workflow_id(cluster_name, policy)

    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1600, "height": 1000})
        # 1. The console opens on what awaits approval, with policy, location and $/h: nothing configured by hand.
        await page.goto(console + "/")
        row = page.locator("tr", has_text=wf_id)
        await row.wait_for(timeout=60_000)
        cells = await row.inner_text()
        assert policy in cells and "sim/eu-west" in cells, cells
        assert str(round(plan.total_usd_per_hour, 4)) in cells, (cells, plan.total_usd_per_hour)
        await screenshot(page, out, "1-awaiting-approval")

        # 2. The details show the prices literally (no math rendering of `$...$`) and the plan as a list.
        await page.goto(f"{console}/namespaces/default/workflows/{quote(wf_id, safe='')}")
        await page.get_by_text("User Metadata", exact=True).first.wait_for(timeout=30_000)
        await screenshot(page, out, "2-workflow")
        details = await current_details_text(page)
        assert f"${plan.total_usd_per_hour:,.2f}/h" in details, details
        assert f"${node.offering.usd_per_hour:.2f}/h (compute ${node.offering.instance_usd_per_hour:.2f}" in details
        assert "\\(" not in details and "\\)" not in details and "**" not in details, details
        assert "sim.l4.1" in details and deploy in details
        await screenshot(page, out, "2-details")

        # 3. Approve through the UI's "Send a Signal" dialog, input left empty.
        await page.get_by_role("button", name="More Actions").click()
        await page.get_by_role("menuitem", name="Send a Signal").click()
        dialog = page.get_by_role("dialog")
        await dialog.get_by_text("Signal name").first.wait_for(timeout=30_000)
        await dialog.get_by_test_id("signal-select-button").click()
        listed = await dialog.get_by_role("option", include_hidden=True).all()
        texts = [" ".join((await o.text_content() or "").split()) for o in listed]
        options = {t.split(" ", 1)[0]: t for t in texts if t}
        assert "approve" in options, texts
        # Every signal is described; the plumbing between the product's own workflows says it is internal.
        assert "Approve the batch" in options["approve"] and "Reject the batch" in options["reject"], options
        assert all("Internal" in options[s] for s in ("pods_waiting", "pods_gone", "node_finished")), options
        await screenshot(page, out, "3-signal-dialog")
        await dialog.get_by_role("option").filter(has_text=re.compile(r"^\s*approve\b")).click()
        await page.get_by_role("button", name="Submit").click()
        handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
        serving = await wait_phase(handle, NodePhase.SERVING)
        after = await provision_state(temporal, cluster_name, policy, lambda v: bool(v.batches))
        assert after.batches[-1].approver is not None  # the UI's signal carries no input: the default approver
        await screenshot(page, out, "3-approved")

        # 4. The workload goes; filtering by the operation finds the node and its drain, both Completed.
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        done = await result(handle)
        assert done.phase == NodePhase.COMPLETED, done.message
        query = f'{sa.OPERATION.name}="{serving.operation}"'
        await page.goto(f"{console}/namespaces/default/workflows?query={quote(query, safe='')}")
        await page.locator("tr", has_text="drain/").wait_for(timeout=60_000)
        rows = [await r.inner_text() for r in await page.locator("tbody tr").all()]
        kinds = {("drain" if "drain/" in r else "node"): r for r in rows}
        assert set(kinds) == {"drain", "node"}, rows
        assert all("Completed" in r or "COMPLETED" in r for r in rows), rows
        assert all("sim/eu-west" in r for r in rows), rows
        await screenshot(page, out, "4-home")
