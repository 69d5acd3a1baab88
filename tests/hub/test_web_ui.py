"""The hub's web UI in Debian's headless chromium against the real hub process, on SQLite and PostgreSQL: the
paths of the product documents (Add cluster -> token -> Secret -> install; rotate; revoke; policies; approvals),
each write checked from the optimizer's side with its own hub client, and a screenshot of every page."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
from datetime import timedelta

import httpx
import pytest
import yaml
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import Page

from activities.clients.hub import HubClient
from activities.clients.hub import HubUnauthorized
from models.hub import ActionReport
from models.hub import pack_proposal_detail
from models.hub import sharing_proposal_detail
from tests.hub.conftest import UiHub
from tests.hub.helpers import policy_document
from tests.hub.ui import Dialogs
from tests.hub.ui import create_cluster
from tests.hub.ui import csrf_of
from tests.hub.ui import new_page
from tests.hub.ui import optimizer
from tests.hub.ui import proposal
from tests.hub.ui import shoot
from tests.hub.ui import sign_in
from tests.hub.ui import signed_in
from tests.hub.ui import user_key

pytestmark = pytest.mark.timeout(180)


async def test_add_cluster_shows_the_token_once_and_the_optimizer_pulls_with_it(ui_hub: UiHub, browser) -> None:
    admin_key = user_key(ui_hub, "ada", "admin")
    context = await browser.new_context(viewport={"width": 1280, "height": 900},
                                        permissions=["clipboard-read", "clipboard-write"])
    dialogs = Dialogs()
    page = await sign_in(context, ui_hub, admin_key, dialogs)
    await shoot(page, ui_hub, "clusters-empty")
    await page.get_by_role("link", name="Add cluster").click()
    await page.get_by_label("Cluster name").fill("web-prod")
    await page.get_by_label("Description (optional)").fill("the UI's first cluster")
    await shoot(page, ui_hub, "add-cluster")
    await page.get_by_role("button", name="Add cluster").click()
    token = (await page.locator("#cluster-token").inner_text()).strip()
    assert re.fullmatch(r"kgc_[0-9a-f]{16}_[A-Za-z0-9_-]{43}", token), token
    secret_cmd = await page.locator("#cmd-secret").inner_text()
    helm_cmd = await page.locator("#cmd-helm").inner_text()
    assert "kubectl create namespace kubeon-gpu" in secret_cmd and token in secret_cmd
    assert "--set cluster=web-prod" in helm_cmd and f"--set hub.url={ui_hub.url}" in helm_cmd
    await page.get_by_role("button", name="Copy token").click()
    await page.get_by_text("Copied.").wait_for()
    assert await page.evaluate("() => navigator.clipboard.readText()") == token
    await shoot(page, ui_hub, "token-issued")

    client = optimizer(ui_hub, token, "web-prod")
    try:
        pulled = client.policies()
        assert pulled is not None and pulled.documents == [] and pulled.revision == 0
    finally:
        client.close()

    # Shown once: not after reloading the page that showed it (never cached: a reload posts the form again,
    # and the cluster exists by then), not on the cluster's page.
    with contextlib.suppress(PlaywrightError):  # Chromium may refuse to re-post without asking (ERR_CACHE_MISS)
        await page.reload()
    assert token not in await page.content()
    await page.goto(f"{ui_hub.url}/ui/clusters/web-prod")
    assert token not in await page.content()
    assert await page.locator("#cluster-status").inner_text() == "connected"
    # The optimizer's client names its version in its User-Agent; a newer one's is shown once it calls.
    installed = importlib.metadata.version("kubeon-gpu-optimizer")
    assert (await page.locator("#optimizer-version").inner_text()).startswith(installed)
    async with httpx.AsyncClient(base_url=ui_hub.url, headers={
            "Authorization": f"Bearer {token}", "User-Agent": "kubeon-gpu-optimizer/1.4.2"}) as newer:
        assert (await newer.get("/v1/cluster")).status_code == 200
    await page.reload()
    assert (await page.locator("#optimizer-version").inner_text()).startswith("1.4.2")
    await shoot(page, ui_hub, "cluster")
    await page.goto(f"{ui_hub.url}/ui/clusters")
    row = page.locator("tr[data-cluster='web-prod']")
    assert "connected" in await row.inner_text()
    assert await row.locator("td.version").inner_text() == "1.4.2"
    await shoot(page, ui_hub, "clusters")
    assert dialogs.seen == []
    await context.close()


async def test_rotate_keeps_the_old_token_until_the_new_one_is_used_and_revoke_disconnects(
        ui_hub: UiHub, browser) -> None:
    old_token = create_cluster(ui_hub, "web-rotate")
    context, page = await signed_in(browser, ui_hub, "rosa", "admin")
    await page.goto(f"{ui_hub.url}/ui/clusters/web-rotate")
    await page.get_by_role("link", name="Rotate token").click()
    await shoot(page, ui_hub, "rotate-confirm")
    await page.get_by_role("button", name="Rotate token").click()
    new_token = (await page.locator("#cluster-token").inner_text()).strip()
    assert new_token != old_token and new_token.startswith("kgc_")
    text = await page.locator("main").inner_text()
    assert "keeps working until this one is first used, or for 24 hours" in text
    assert new_token in await page.locator("#cmd-update").inner_text()
    await shoot(page, ui_hub, "token-rotated")

    old, new = optimizer(ui_hub, old_token, "rotate-old"), optimizer(ui_hub, new_token, "rotate-new")
    try:
        assert old.policies() is not None  # still inside the grace: the new token was never used
        assert new.policies() is not None
        with pytest.raises(HubUnauthorized, match=r"superseded|replaced"):
            old.policies()

        await page.goto(f"{ui_hub.url}/ui/clusters/web-rotate")
        await page.get_by_role("link", name="Revoke token").click()
        assert "web-rotate" in await page.locator("h1").inner_text()
        await shoot(page, ui_hub, "revoke-confirm")
        await page.get_by_role("button", name="Revoke every token of web-rotate").click()
        await page.wait_for_url(re.compile(r".*/ui/clusters/web-rotate$"))
        assert await page.locator("#cluster-status").inner_text() == "disconnected"
        with pytest.raises(HubUnauthorized, match="revoked"):
            new.policies()
    finally:
        old.close()
        new.close()
    events = ui_hub.admin.get("/v1/audit", params={"cluster": "web-rotate", "limit": 100}).json()["events"]
    assert [(e["action"], e["actor"]) for e in events if e["actor"] == "user:rosa"] == [
        ("token.rotated", "user:rosa"), ("token.revoked", "user:rosa")]
    await page.goto(f"{ui_hub.url}/ui/audit?actor=user:rosa")
    rows = page.locator("tbody tr")
    assert await rows.count() == 2 and "token.revoked" in await rows.first.inner_text()
    await shoot(page, ui_hub, "audit")
    await context.close()


async def save_refused_then_confirmed(page: Page, client: HubClient, message: str, diff_line: str,
                                     max_nodes_kept: int) -> None:
    """Save policy is refused with ``message`` and a diff to confirm (``diff_line`` in it), the hub's burst-eu still
    at ``max_nodes_kept``; Save again saves it."""
    await page.get_by_role("button", name="Save policy").click()
    assert message in await page.locator("#editor-message").inner_text()
    assert diff_line in await page.locator("pre.diff").inner_text()
    pulled = client.policies()
    assert pulled is not None and pulled.documents[0]["spec"]["limits"]["maxNodes"] == max_nodes_kept
    await page.get_by_role("button", name="Save policy").click()
    await page.wait_for_url(re.compile(r".*\?saved=burst-eu$"))


async def test_policy_editor_shows_errors_at_their_field_saves_nothing_then_saves_a_valid_one(
        ui_hub: UiHub, browser) -> None:
    token = create_cluster(ui_hub, "web-policies")
    context, page = await signed_in(browser, ui_hub, "otto", "operator")
    client = optimizer(ui_hub, token, "web-policies")
    try:
        await page.goto(f"{ui_hub.url}/ui/clusters/web-policies")
        await page.get_by_role("link", name="New policy").click()
        document = policy_document("burst-eu", max_nodes=0)
        await page.locator("#document").fill(yaml.safe_dump(document, sort_keys=False))
        await page.get_by_role("button", name="Review changes").click()
        error = page.locator(".annotated li.error-line .field-error[data-field='spec.limits.maxNodes']")
        assert await error.count() == 1, await page.content()
        line = error.locator("xpath=..")
        assert "maxNodes: 0" in await line.locator("code").first.inner_text()
        assert "greater than or equal to 1" in await error.inner_text()
        assert await page.get_by_role("button", name="Save policy").count() == 0
        assert await page.locator("#editor-message").evaluate("e => e === document.activeElement")
        await shoot(page, ui_hub, "policy-error")
        pulled = client.policies()
        assert pulled is not None and pulled.revision == 0 and pulled.documents == []

        document["spec"]["limits"]["maxNodes"] = 3
        await page.locator("#document").fill(yaml.safe_dump(document, sort_keys=False))
        await page.get_by_role("button", name="Review changes").click()
        assert "+  name: burst-eu" in await page.locator("pre.diff").inner_text()
        await shoot(page, ui_hub, "policy-diff")
        await page.get_by_role("button", name="Save policy").click()
        await page.wait_for_url(re.compile(r".*/ui/clusters/web-policies\?saved=burst-eu$"))
        row = page.locator("tr[data-policy='burst-eu']")
        assert "Approve" in await row.inner_text() and "user:otto" in await row.inner_text()
        pulled = client.policies()
        assert pulled is not None and [d["spec"]["limits"]["maxNodes"] for d in pulled.documents] == [3]

        # An edit typed after the review is not saved unreviewed.
        await page.get_by_role("link", name="burst-eu", exact=True).click()
        await page.locator("#document").fill(yaml.safe_dump(policy_document("burst-eu", max_nodes=2)))
        await page.get_by_role("button", name="Review changes").click()
        diff = await page.locator("pre.diff").inner_text()
        assert "-    maxNodes: 3" in diff and "+    maxNodes: 2" in diff
        await page.locator("#document").fill(yaml.safe_dump(policy_document("burst-eu", max_nodes=1)))
        await save_refused_then_confirmed(page, client, "changed since you reviewed it", "+    maxNodes: 1", 3)

        # Someone changes the policy through the API while the editor is open: Save shows their version first.
        await page.get_by_role("link", name="burst-eu", exact=True).click()
        await page.locator("#document").fill(yaml.safe_dump(policy_document("burst-eu", max_nodes=4)))
        await page.get_by_role("button", name="Review changes").click()
        changed = ui_hub.admin.put("/v1/clusters/web-policies/policies/burst-eu",
                                   json=policy_document("burst-eu", max_nodes=7))
        assert changed.status_code == 200, changed.text
        await save_refused_then_confirmed(page, client, "changed since you opened the editor", "-    maxNodes: 7", 7)
        pulled = client.policies()
        assert pulled is not None and pulled.documents[0]["spec"]["limits"]["maxNodes"] == 4

        # All to Recommend, confirmed first.
        await page.get_by_role("link", name="All to Recommend").click()
        assert "burst-eu" in await page.locator("main p").first.inner_text()
        await shoot(page, ui_hub, "recommend-confirm")
        await page.get_by_role("button", name=re.compile("Set all 1 to Recommend")).click()
        await page.wait_for_url(re.compile(r".*/ui/clusters/web-policies$"))
        assert await page.locator("tr[data-policy='burst-eu'] td.mode").inner_text() == "Recommend"
        pulled = client.policies()
        assert pulled is not None and [(d["spec"]["mode"], d["spec"]["limits"]["maxNodes"])
                                       for d in pulled.documents] == [("Recommend", 4)]

        await page.get_by_role("link", name="Delete burst-eu").click()
        await page.get_by_role("button", name="Delete burst-eu").click()
        await page.wait_for_url(re.compile(r".*/ui/clusters/web-policies$"))
        pulled = client.policies()
        assert pulled is not None and pulled.documents == []
    finally:
        client.close()
    await context.close()


async def test_a_proposal_is_approved_by_its_plan_and_a_tab_with_the_old_plan_is_refused(
        ui_hub: UiHub, browser) -> None:
    token = create_cluster(ui_hub, "web-approvals")
    operator_key = user_key(ui_hub, "paula", "operator")
    client = optimizer(ui_hub, token, "web-approvals")
    console = "http://127.0.0.1:8233/namespaces/default/workflows/provision%2Fburst-eu"
    try:
        assert client.report(proposal("op-batch-1", "plan-aaa111", ui_hub.now(), console_url=console))
        context = await browser.new_context()
        tab_a = await sign_in(context, ui_hub, operator_key)
        tab_b = await new_page(context)
        for tab in (tab_a, tab_b):
            await tab.goto(f"{ui_hub.url}/ui/approvals")
            section = tab.locator("section.proposal[data-operation='op-batch-1']")
            assert await section.locator("code.plan-id").inner_text() == "plan-aaa111"
            cells = await section.locator("table.plan tbody tr").first.locator("td").all_inner_texts()
            # A plan without transfer_basis (an older optimizer's) shows its transfer as the estimate it was.
            assert cells[1:6] == ["aws/eu-central-1", "g6.xlarge (1x NVIDIA-L4)", "$0.80", "$0.05 (est.)", "$0.85"]
            assert "ml/infer-0, ml/infer-1" in cells[6]
            assert await section.locator("td.total").inner_text() == "$0.85/h"
            assert await section.get_by_role("link", name="Open in the cluster's Temporal UI").get_attribute(
                "href") == console
        await shoot(tab_a, ui_hub, "approvals")

        # The optimizer plans the batch again: two nodes now. Tab A reloads and approves the new plan.
        nodes = [{"location": "gcp/europe-west4", "instance_type": "g2-standard-8", "gpus": 1,
                  "gpu_product": "NVIDIA-L4", "compute_usd_per_hour": 0.9, "transfer_usd_per_hour": 0.1,
                  "pods": [f"ml/infer-{i}"]} for i in range(2)]
        ui_hub.advance(timedelta(seconds=5))
        assert client.report(proposal("op-batch-1", "plan-bbb222", ui_hub.now(), nodes=nodes,
                                      summary="2 node(s) for 2 pod(s)"))
        await tab_a.reload()
        section = tab_a.locator("section.proposal[data-operation='op-batch-1']")
        assert await section.locator("td.total").inner_text() == "$2.00/h"
        await section.get_by_label("Reason (optional)").fill("capacity for the launch")
        await section.get_by_role("button", name="Approve plan plan-bbb222").click()
        await tab_a.wait_for_url(re.compile(r".*/ui/approvals$"))
        decided = tab_a.locator("tr[data-operation='op-batch-1']")
        assert "user:paula" in await decided.inner_text() and "plan-bbb222" in await decided.inner_text()

        # Tab B still shows plan-aaa111.
        await tab_b.locator("section.proposal[data-operation='op-batch-1']").get_by_role(
            "button", name="Approve plan plan-aaa111").click()
        problem = tab_b.locator("#decision-problem")
        assert "stale" in await problem.inner_text() and "plan-bbb222" in await problem.inner_text()
        assert await problem.evaluate("e => e === document.activeElement")
        await shoot(tab_b, ui_hub, "approval-stale")

        # A ScaleToZero proposal: the workload and its idle evidence; rejected.
        scale = ActionReport(
            idempotency_key="op-scale-1/proposed", operation="op-scale-1", policy="idle-inference",
            action="proposed", occurred_at=ui_hub.now(), detail=json.dumps({
                "plan_id": "op-scale-1-r3", "workload": "ml/Deployment/infer", "replicas": 3,
                "idle_evidence": "GPU utilisation 0% for 30 min (DCGM)"}))
        assert client.report(scale)
        await tab_a.reload()
        section = tab_a.locator("section.proposal[data-operation='op-scale-1']")
        facts = await section.locator("dl.facts").inner_text()
        assert "ml/Deployment/infer" in facts and "3 → 0" in facts and "0% for 30 min" in facts
        await section.get_by_label("Reason (optional)").fill("serving a demo")
        await section.get_by_role("button", name="Reject").click()
        await tab_a.wait_for_url(re.compile(r".*/ui/approvals$"))
        assert await tab_a.locator("tr[data-operation='op-scale-1'] td.decision-reject").count() == 1
        assert await tab_a.locator("section.proposal").count() == 0
        await shoot(tab_a, ui_hub, "approvals-decided")

        page = client.approvals(0)
        assert [(a.operation, a.decision, a.plan_id, a.decided_by, a.reason) for a in page.approvals] == [
            ("op-batch-1", "approve", "plan-bbb222", "user:paula", "capacity for the launch"),
            ("op-scale-1", "reject", "op-scale-1-r3", "user:paula", "serving a demo")]

        # A Sharing proposal, as the optimizer sends it: the node, the change, its saving and risk; approved by plan.
        share = ActionReport(
            idempotency_key="op-share-1/proposed", operation="op-share-1", policy="share-a100", action="proposed",
            occurred_at=ui_hub.now(), detail=sharing_proposal_detail(
                plan_id="op-share-1-mig", node="gpu-a100-0", gpus=8, change="MIG geometry all-1g.10gb",
                summary="gpu-a100-0: MIG all-1g.10gb", reason="peak memory 9 GiB fits a 1g.10gb slice",
                risk="MIG evicts every GPU pod of the node", saving_usd_per_hour=4.1))
        assert client.report(share)
        await tab_a.reload()
        section = tab_a.locator("section.proposal[data-operation='op-share-1']")
        facts = await section.locator("dl.facts").inner_text()
        assert all(t in facts for t in ("gpu-a100-0 (8 GPUs)", "MIG geometry all-1g.10gb", "$4.10/h",
                                        "fits a 1g.10gb slice", "evicts every GPU pod"))
        await section.get_by_role("button", name="Approve plan op-share-1-mig").click()
        await tab_a.wait_for_url(re.compile(r".*/ui/approvals$"))

        # A Packing round: the nodes it removes, the pods it moves, what it saves.
        pack = ActionReport(
            idempotency_key="op-pack-1/proposed", operation="op-pack-1", policy="pack-l4", action="proposed",
            occurred_at=ui_hub.now(), detail=pack_proposal_detail(
                plan_id="op-pack-1", summary="empty 1 node(s) (gpu-l4-2), moving 2 pod(s): saves $4.60/h",
                remove=["gpu-l4-2"], moves=["ml/infer-4: gpu-l4-2 -> gpu-l4-0", "ml/infer-5: gpu-l4-2 -> gpu-l4-1"],
                saving_usd_per_hour=4.6))
        assert client.report(pack)
        await tab_a.reload()
        section = tab_a.locator("section.proposal[data-operation='op-pack-1']")
        facts = await section.locator("dl.facts").inner_text()
        assert all(t in facts for t in ("gpu-l4-2", "ml/infer-4: gpu-l4-2 -> gpu-l4-0", "$4.60/h"))
        await section.get_by_role("button", name="Approve plan op-pack-1").click()
        await tab_a.wait_for_url(re.compile(r".*/ui/approvals$"))
        assert [(a.operation, a.decision, a.plan_id) for a in client.approvals(0).approvals][-2:] == [
            ("op-share-1", "approve", "op-share-1-mig"), ("op-pack-1", "approve", "op-pack-1")]

        # The activity timeline: filtered by operation, with the link to the cluster's Temporal UI.
        assert client.report(proposal("op-other", "plan-ccc333", ui_hub.now(), policy="other-policy"))
        await tab_a.goto(f"{ui_hub.url}/ui/activity")
        await tab_a.get_by_label("Operation").fill("op-batch-1")
        await tab_a.get_by_role("button", name="Filter").click()
        events = tab_a.locator("li.event")
        assert await events.count() == 2
        assert await tab_a.locator("li.event[data-operation='op-other']").count() == 0
        assert await events.first.get_by_role("link", name="Temporal UI").count() == 1
        await tab_a.goto(f"{ui_hub.url}/ui/activity?policy=other-policy&cluster=web-approvals")
        assert await tab_a.locator("li.event").count() == 1
        await tab_a.goto(f"{ui_hub.url}/ui/activity?location=gcp/europe-west4")
        assert await tab_a.locator("li.event").count() == 0  # reports name the first node's location
        await tab_a.goto(f"{ui_hub.url}/ui/activity?cluster=web-approvals")
        await shoot(tab_a, ui_hub, "activity")
        await context.close()
    finally:
        client.close()


async def test_a_viewer_sees_no_write_control_and_a_forged_post_is_403(ui_hub: UiHub, browser) -> None:
    token = create_cluster(ui_hub, "web-viewer")
    assert ui_hub.admin.put("/v1/clusters/web-viewer/policies/burst-eu",
                            json=policy_document("burst-eu")).status_code == 201
    client = optimizer(ui_hub, token, "web-viewer")
    try:
        assert client.report(proposal("op-viewer", "plan-vvv", ui_hub.now()))
    finally:
        client.close()
    context, page = await signed_in(browser, ui_hub, "vera", "viewer")
    for path in ("/ui/clusters", "/ui/clusters/web-viewer", "/ui/clusters/web-viewer/policies/burst-eu",
                 "/ui/approvals", "/ui/activity", "/ui/pools"):
        await page.goto(f"{ui_hub.url}{path}")
        assert await page.locator("form[method=post]:not([action='/ui/sign-out'])").count() == 0, path
        for name in ("Add cluster", "Rotate token", "Revoke token", "New policy", "All to Recommend", "Approve",
                     "Reject", "Delete"):
            assert await page.get_by_role("link", name=name).count() == 0, (path, name)
            assert await page.get_by_role("button", name=name).count() == 0, (path, name)
    await page.goto(f"{ui_hub.url}/ui/approvals")
    assert await page.locator("section.proposal[data-operation='op-viewer']").count() == 1
    await shoot(page, ui_hub, "approvals-viewer")
    assert (await page.goto(f"{ui_hub.url}/ui/audit")).status == 403

    await page.goto(f"{ui_hub.url}/ui/clusters")
    csrf = await csrf_of(page)
    assert csrf
    before = ui_hub.admin.get("/v1/audit", params={"limit": 1000}).json()["events"]
    forged = {
        "/ui/clusters": {"name": "forged"},
        "/ui/approvals": {"cluster": "web-viewer", "operation": "op-viewer", "decision": "approve",
                          "plan_id": "plan-vvv"},
        "/ui/clusters/web-viewer/rotate": {},
        "/ui/clusters/web-viewer/revoke": {},
        "/ui/clusters/web-viewer/recommend": {},
        "/ui/clusters/web-viewer/policies/burst-eu/delete": {},
        "/ui/clusters/web-viewer/policy-editor": {"step": "save", "original": "burst-eu", "base": "1",
                                                  "document": yaml.safe_dump(policy_document("burst-eu"))},
    }
    for path, fields in forged.items():
        answer = await context.request.post(f"{ui_hub.url}{path}", form={"csrf_token": csrf, **fields},
                                            headers={"Origin": ui_hub.url})
        assert answer.status == 403, (path, answer.status, await answer.text())
        assert "has role viewer" in await answer.text()
    assert ui_hub.admin.get("/v1/audit", params={"limit": 1000}).json()["events"] == before
    await context.close()


async def test_pools_show_rate_cards_and_servers_and_issue_and_revoke_join_tokens(ui_hub: UiHub, browser) -> None:
    created = ui_hub.admin.post("/v1/pools", json={"name": "web-dc1", "rate_card": {
        "usd_per_gpu_hour": {"NVIDIA-L4": 0.45}, "transfer_usd_per_gpu_hour": 0.02}})
    assert created.status_code == 201, created.text
    join_token = created.json()["join_token"]["token"]
    # An operator registers the servers; an agent enrols with the pool's enrolment token, then heartbeats with the
    # server's own credential.
    for server in ("gpu-01", "gpu-02"):
        registered = ui_hub.admin.put(f"/v1/pools/web-dc1/servers/{server}",
                                      json={"gpu_product": "NVIDIA-L4", "gpus": 2})
        assert registered.status_code in (200, 201), registered.text
    enrol = {"pool": "web-dc1", "server": "gpu-01", "gpu_product": "NVIDIA-L4", "gpus": 2}
    enrolled = ui_hub.admin.post("/v1/pool-agent/enrol", headers={"Authorization": f"Bearer {join_token}"},
                                 json=enrol)
    assert enrolled.status_code == 201, enrolled.text
    beat = ui_hub.admin.post("/v1/pool-agent/heartbeat",
                             headers={"Authorization": f"Bearer {enrolled.json()['credential']}"},
                             json={"pool": "web-dc1", "server": "gpu-01", "gpu_product": "NVIDIA-L4", "gpus": 2,
                                   "phase": "idle"})
    assert beat.status_code == 200, beat.text
    context, page = await signed_in(browser, ui_hub, "pia", "admin")
    await page.goto(f"{ui_hub.url}/ui/pools")
    pool = page.locator("section[data-pool='web-dc1']")
    text = await pool.inner_text()
    assert "NVIDIA-L4: $0.45 per GPU-hour" in text and "Transfer: $0.02" in text
    assert "gpu-01" in text and "idle" in text
    await shoot(page, ui_hub, "pools")
    await pool.get_by_role("button", name="Issue a join token for web-dc1").click()
    issued = (await page.locator("#join-token").inner_text()).strip()
    assert issued.startswith("kgp_")
    await shoot(page, ui_hub, "join-token")
    await page.goto(f"{ui_hub.url}/ui/pools")
    assert issued not in await page.content()
    first_id = created.json()["join_token"]["token_id"]
    await page.get_by_role("link", name=f"Revoke join token {first_id}").click()
    await page.get_by_role("button", name=f"Revoke join token {first_id}").click()
    await page.wait_for_url(re.compile(r".*/ui/pools$"))
    refused = ui_hub.admin.post("/v1/pool-agent/enrol", headers={"Authorization": f"Bearer {join_token}"},
                                json={**enrol, "server": "gpu-02"})
    assert refused.status_code == 401, refused.text
    tokens = {t["id"]: t["active"] for t in ui_hub.admin.get("/v1/pools/web-dc1").json()["join_tokens"]}
    assert tokens[first_id] is False and list(tokens.values()).count(True) == 1
    await context.close()


async def test_sign_in_refuses_a_wrong_key_and_sign_out_ends_the_session(ui_hub: UiHub, browser) -> None:
    key = user_key(ui_hub, "sam", "viewer")
    context = await browser.new_context()
    page = await new_page(context)
    await page.goto(f"{ui_hub.url}/ui/sign-in")
    await shoot(page, ui_hub, "sign-in")
    await page.get_by_label("API key").fill(key[:-1] + ("A" if key[-1] != "A" else "B"))
    await page.get_by_role("button", name="Sign in").click()
    assert "invalid API key" in await page.locator("#sign-in-error").inner_text()
    await page.get_by_label("API key").fill(key)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(re.compile(r".*/ui/clusters$"))
    # Keyboard: the first Tab reaches the skip link, which moves the focus past the navigation to the content.
    await page.keyboard.press("Tab")
    assert await page.evaluate("() => document.activeElement.className") == "skip"
    await page.keyboard.press("Enter")
    assert await page.evaluate("() => document.activeElement.id") == "main"
    cookie = next(c for c in await context.cookies() if c["name"] == "kubeon_hub_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert cookie["expires"] > 0  # not a browser-session cookie: it expires with the hub's session
    csrf = await csrf_of(page)
    await page.get_by_role("button", name="Sign out").click()
    await page.wait_for_url(re.compile(r".*/ui/sign-in$"))
    # The old cookie, put back, opens nothing: the hub deleted the session.
    await context.add_cookies([cookie])
    await page.goto(f"{ui_hub.url}/ui/clusters")
    assert "/ui/sign-in" in page.url
    answer = await context.request.post(f"{ui_hub.url}/ui/sign-out", form={"csrf_token": csrf})
    assert answer.status == 401
    await context.close()
