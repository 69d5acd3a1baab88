"""A proposal's plan in its report (hub/plans.py): what the hub reads of it, and the API refusing a decision for
a plan the cluster no longer proposes."""

from __future__ import annotations

import json

import pytest

from hub.plans import console_url
from hub.plans import parse_plan
from hub.web.yaml_fields import field_lines
from hub.web.yaml_fields import line_of
from hub.web.yaml_fields import syntax_error
from tests.hub.conftest import Hub
from tests.hub.helpers import report


def _plan(plan_id: str, **extra: object) -> str:
    return json.dumps({"plan_id": plan_id, "nodes": [
        {"location": "aws/eu-central-1", "instance_type": "g6.xlarge", "compute_usd_per_hour": 0.8,
         "transfer_usd_per_hour": 0.05, "pods": ["ml/a"]},
        {"location": "gcp/europe-west4", "instance_type": "g2-standard-8", "compute_usd_per_hour": 0.9,
         "transfer_usd_per_hour": 0.1}], **extra})


def test_a_plan_is_read_from_a_json_detail_and_plain_text_is_no_plan() -> None:
    plan = parse_plan(_plan("plan-1", future_field=True))
    assert plan is not None and plan.plan_id == "plan-1" and plan.total == pytest.approx(1.85)
    assert [n.usd_per_hour for n in plan.nodes] == [pytest.approx(0.85), pytest.approx(1.0)]
    assert parse_plan("1 node(s) for 2 pod(s): 1x g6.xlarge in aws/eu-central-1, total $0.85/h") is None
    assert parse_plan('{"plan_id": ""}') is None and parse_plan("{not json") is None
    assert parse_plan('{"plan_id": "p", "nodes": [{"location": 1}]}') is None
    scale = parse_plan(json.dumps({"plan_id": "op-1-r3", "workload": "ml/infer", "replicas": 3,
                                   "idle_evidence": "0% GPU for 30 min"}))
    assert scale is not None and scale.workload == "ml/infer" and scale.nodes == []


def test_only_an_http_console_url_is_linked() -> None:
    assert console_url(_plan("p", console_url="https://t.example/ns/default/workflows/x")) == \
        "https://t.example/ns/default/workflows/x"
    for bad in ("javascript:alert(1)", "data:text/html,x", "https://a b", 5):
        assert console_url(json.dumps({"plan_id": "p", "console_url": bad})) is None
    assert parse_plan(json.dumps({"plan_id": "p", "console_url": "javascript:alert(1)"})) is None


def test_yaml_errors_map_to_the_line_of_their_field_or_its_parent() -> None:
    text = "spec:\n  limits:\n    maxNodes: 0\n  locations:\n    - a\n    - b\n"
    lines = field_lines(text)
    assert line_of("spec.limits.maxNodes", lines) == 3
    assert line_of("spec.locations[1]", lines) == 6
    assert line_of("spec.limits.maxGpuHour", lines) == 2  # missing: reported on its parent
    assert line_of("(document)", lines) is None
    assert syntax_error(text) is None
    bomb = syntax_error("a: &a [x]\nb: [*a, *a]\n")
    assert bomb is not None and bomb.line == 2 and "aliases" in bomb.message


async def test_the_api_refuses_a_decision_for_a_plan_the_cluster_no_longer_proposes(hub: Hub) -> None:
    token = await hub.create_cluster("plans")
    for key, plan_id in (("k1", "plan-old"), ("k2", "plan-new")):
        r = await hub.client.post("/v1/cluster/reports", headers=hub.bearer(token), json=report(
            key, operation="op-plan", action="proposed", detail=_plan(plan_id)))
        assert r.status_code == 201, r.text
    stale = await hub.client.post("/v1/clusters/plans/approvals", headers=hub.admin, json={
        "operation": "op-plan", "decision": "approve", "plan_id": "plan-old"})
    assert stale.status_code == 409 and stale.json()["error"] == "stale_plan", stale.text
    assert "plan-new" in stale.json()["message"]
    current = await hub.client.post("/v1/clusters/plans/approvals", headers=hub.admin, json={
        "operation": "op-plan", "decision": "approve", "plan_id": "plan-new"})
    assert current.status_code == 201, current.text
    # A proposal whose detail names no plan cannot be stale: the plan id is the optimizer's to check.
    r = await hub.client.post("/v1/cluster/reports", headers=hub.bearer(token), json=report(
        "k3", operation="op-text", action="proposed", detail="1 node(s) for 1 pod(s)"))
    assert r.status_code == 201
    assert (await hub.client.post("/v1/clusters/plans/approvals", headers=hub.admin, json={
        "operation": "op-text", "decision": "approve", "plan_id": "plan-any"})).status_code == 201
