"""The hub's web UI end to end with a real optimizer (issue 25's acceptance): a cluster added in the browser, its
token mounted into the test harness's worker, which syncs the policy written in the UI's editor into the cluster's
GpuPolicy; the worker's batch proposal shows under Approvals with its plan; Approve in the browser, and the node
launches, joins and takes the pod. SQLite only: the web UI tests prove both databases page by page."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from models.policy import API_GROUP
from models.policy import PLURAL
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import in_process_worker
from tests.harness.burst import provision_state
from tests.harness.burst import unique
from tests.harness.crd import read_gpupolicy
from tests.harness.kube import until
from tests.hub.conftest import UiHub
from tests.hub.ui import shoot
from tests.hub.ui import sign_in
from tests.hub.ui import user_key

pytestmark = [pytest.mark.cluster, pytest.mark.temporal, pytest.mark.timeout(300)]


def burst_node_ready(stack: BurstStack, policy: str) -> str | None:
    for node in stack.cluster.admin.core.list_node(label_selector=f"gpu.kubeon.io/policy={policy}").items:
        if any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or [])):
            return str(node.metadata.name)
    return None


@pytest.mark.parametrize("ui_hub", ["sqlite"], indirect=True)
async def test_a_cluster_added_in_the_ui_syncs_its_policy_and_launches_what_the_ui_approves(
        ui_hub: UiHub, browser: Any, stack: BurstStack, temporal_dev_server: WorkflowEnvironment,
        namespace: str) -> None:
    cluster, policy = unique("ui"), unique("uiburst")
    context = await browser.new_context()
    page = await sign_in(context, ui_hub, user_key(ui_hub, "una", "admin"))

    # Add cluster -> its token, shown once: the Secret the optimizer mounts.
    await page.get_by_role("link", name="Add cluster").click()
    await page.get_by_label("Cluster name").fill(cluster)
    await page.get_by_role("button", name="Add cluster").click()
    token_file = ui_hub.workdir / f"{cluster}.token"
    token_file.write_text((await page.locator("#cluster-token").inner_text()).strip())

    # The policy, written in the editor.
    document = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": policy},
                "spec": {"kind": "Burst", "mode": "Approve", "workloads": {"tolerate": BURST_TAINT_KEY},
                         "locations": ["sim/eu-west"], "limits": {"maxNodes": 2, "maxGpuHour": 4.5},
                         "returnHome": True}}
    await page.goto(f"{ui_hub.url}/ui/clusters/{cluster}")
    await page.get_by_role("link", name="New policy").click()
    await page.locator("#document").fill(yaml.safe_dump(document, sort_keys=False))
    await page.get_by_role("button", name="Review changes").click()
    await page.get_by_role("button", name="Save policy").click()
    await page.wait_for_url(re.compile(rf".*\?saved={policy}$"))

    deploy = unique("infer")
    try:
        async with in_process_worker(stack, temporal_dev_server, SIM_LOCATIONS, cluster_name=cluster,
                                     hub_url=ui_hub.url, hub_token_file=token_file,
                                     hub_poll_interval=1) as (temporal, _settings, _runtime):
            # Synced into the cluster's GpuPolicy (what `kubectl get gpupolicies` lists).
            synced = await until(lambda: read_gpupolicy(stack.cluster, policy), timeout=60,
                                 what=f"{policy} synced from the hub")
            assert synced["spec"]["limits"]["maxNodes"] == 2 and synced["spec"]["mode"] == "Approve"
            listed = stack.cluster.admin.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL)
            assert policy in [p["metadata"]["name"] for p in listed["items"]]

            # A pod home cannot fit: the optimizer's proposal, under Approvals with its plan.
            stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
            view = await provision_state(temporal, cluster, policy, lambda v: v.proposal is not None, timeout=90)
            assert view.proposal is not None
            plan = view.proposal.plan
            section = page.locator(f"section.proposal[data-operation='{view.proposal.batch}']")
            deadline = time.monotonic() + 60
            while not await section.count():  # the proposal reaches the hub with the optimizer's next poll
                assert time.monotonic() < deadline, "the proposal never showed under Approvals"
                await asyncio.sleep(1)
                await page.goto(f"{ui_hub.url}/ui/approvals")
            assert await section.locator("code.plan-id").inner_text() == plan.plan_id
            cells = await section.locator("table.plan tbody tr").first.locator("td").all_inner_texts()
            assert cells[1] == plan.new_nodes[0].offering.location and plan.new_nodes[0].pods[0] in cells[6]
            await shoot(page, ui_hub, "approvals-real-optimizer")

            # Approve in the browser: the optimizer pulls the decision and launches; the node joins.
            await section.get_by_role("button", name=f"Approve plan {plan.plan_id}").click()
            await page.wait_for_url(re.compile(r".*/ui/approvals$"))
            node = await until(lambda: burst_node_ready(stack, policy), timeout=120, what="the burst node Ready")
            pods = stack.cluster.admin.core.list_namespaced_pod(namespace).items
            await until(lambda: [p for p in stack.cluster.admin.core.list_namespaced_pod(namespace).items
                                 if p.spec.node_name == node], timeout=60, what=f"the pod bound to {node}")
            assert pods, "the workload has its pod"
            after = await provision_state(temporal, cluster, policy)
            assert after.batches[-1].approver == "hub:user:una", after.batches[-1]
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            await until(lambda: burst_node_ready(stack, policy) is None, timeout=120, what="the node gone home")
    finally:
        await context.close()
        stack.delete_policy(policy)
