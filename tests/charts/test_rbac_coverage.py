"""Every Kubernetes call in the worker's and the gateway's code is granted by the chart's rules for the
ServiceAccount it runs as: a new call without a rule fails here, before it fails with 403 in a cluster."""

from __future__ import annotations

import textwrap

import pytest

from tests.charts.helm import BURST_VALUES
from tests.charts.helm import REPO
from tests.charts.helm import Rendered
from tests.charts.helm import bound_rules
from tests.charts.helm import template
from tests.charts.kubecalls import Call
from tests.charts.kubecalls import allowed
from tests.charts.kubecalls import endpoints
from tests.charts.kubecalls import scan
from tests.charts.kubecalls import scan_source

OPTIMIZER = "kubeon-gpu-optimizer"
GATEWAY = "kubeon-gpu-optimizer-gateway"
# Code that runs in the in-cluster processes. hub/ runs outside the cluster and calls no Kubernetes API.
SCANNED = ("worker", "activities", "gateway")
# (file, class) whose calls run with the gateway's ServiceAccount; everything else runs as the optimizer's.
# If a module that belongs to the gateway is reported below, add it here: never widen the optimizer's rules.
GATEWAY_CODE = {("gateway/service.py", "KubeGateway"), ("gateway/slots.py", "RecordStore"),
                ("gateway/admission.py", "Admission"), ("gateway/reconciler.py", "Reconciler"),
                ("gateway/app.py", "TokenReviewer"), ("gateway/tunnel_end.py", "TunnelFilter")}


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return template(values=[BURST_VALUES])


def runs_as(call: Call) -> str:
    return GATEWAY if (call.file, call.scope) in GATEWAY_CODE else OPTIMIZER


def test_every_kubernetes_call_is_granted(rendered: Rendered) -> None:
    calls, problems = scan(REPO, SCANNED)
    assert not problems, "calls whose resource cannot be told statically (use a string or module constant):\n" + \
        "\n".join(f"{f}:{line} {m}: {why}" for f, line, m, why in problems)
    assert calls, "no Kubernetes call found in worker/, activities/ or gateway/: the scanner is broken"
    rules = {OPTIMIZER: bound_rules(rendered, OPTIMIZER), GATEWAY: bound_rules(rendered, GATEWAY)}
    denied = [f"{c.where()}: {c.verb} {c.resource} (group {c.group!r}) as {runs_as(c)}"
              for c in calls if not allowed(c, rules[runs_as(c)])]
    assert not denied, "Kubernetes calls the chart does not grant:\n" + "\n".join(denied)


def test_gateway_code_is_where_the_table_says() -> None:
    for file, cls in GATEWAY_CODE:
        assert f"class {cls}" in (REPO / file).read_text(), f"{file} has no class {cls}: update GATEWAY_CODE"


SAMPLE = textwrap.dedent('''
    from kubernetes import client, watch
    from models.policy import API_GROUP, PLURAL

    GROUP = "karpenter.sh"

    class Ops:
        def run(self, core, apps, custom, name, ns):
            core.list_node()
            core.patch_node(name, {})
            core.create_namespaced_pod_eviction(name, ns, body=None)
            for _ in watch.Watch().stream(core.list_pod_for_all_namespaces, field_selector="x"):
                pass
            apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": 0}})
            custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, name, {})
            custom.list_cluster_custom_object(group=GROUP, version="v1", plural="nodeclaims")
            core.read_namespaced_secret(name, ns)
            core.delete_namespaced_pod(name, ns)

    class Gate:
        def label(self, core, node):
            core.patch_node(node, {})
            core.delete_node("n")

    def unknown(custom, group):
        custom.get_cluster_custom_object(group, "v1", "things", "x")
''')


def test_scanner_reads_calls_as_rbac_sees_them(rendered: Rendered) -> None:
    found = list(scan_source(SAMPLE, "sample.py"))
    calls = [c for c in found if isinstance(c, Call)]
    got: dict[tuple[str, str, str], set[str]] = {}
    for c in calls:
        got.setdefault((c.scope, c.group, c.resource), set()).add(c.verb)
    assert got == {  # (class, API group, resource): verbs
        ("Ops", "", "nodes"): {"list", "patch"},
        ("Ops", "", "pods/eviction"): {"create"},
        ("Ops", "", "pods"): {"watch", "list", "delete"},
        ("Ops", "apps", "deployments/scale"): {"patch"},
        ("Ops", "gpu.kubeon.io", "gpupolicies"): {"patch"},
        ("Ops", "karpenter.sh", "nodeclaims"): {"list"},
        ("Ops", "", "secrets"): {"get"},
        ("Gate", "", "nodes"): {"patch", "delete"},
    }
    problems = [p for p in found if not isinstance(p, Call)]
    assert [(p[2], p[3].split(" from ")[0]) for p in problems] == [
        ("get_cluster_custom_object", "cannot tell the group")]

    optimizer, gateway = bound_rules(rendered, OPTIMIZER), bound_rules(rendered, GATEWAY)
    refused = {(c.resource, c.verb) for c in calls if not allowed(c, optimizer)}
    assert refused == {("secrets", "get"), ("pods", "delete"), ("nodes", "delete")}
    # the scale Roles exist only in scaleToZero.namespaces, so a namespaced scale call is granted
    assert all(allowed(c, gateway) for c in calls if c.scope == "Gate")
    assert not any(allowed(c, gateway) for c in calls if c.resource in ("secrets", "pods/eviction"))


def test_the_client_table_is_complete() -> None:
    table = endpoints()
    for method in ("list_node", "patch_node", "create_namespaced_pod_eviction", "patch_cluster_custom_object",
                   "patch_namespaced_deployment_scale", "create_node", "delete_node"):
        assert method in table, method
