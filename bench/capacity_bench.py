"""Cloud API calls per scale up and per node removal of the managed node group capacity providers
(``eks-nodegroups``, ``gke-nodepools``, ``aks-nodepools``, issue 24), and how long one removal takes, from the
provider's call and from the approval of a packing round, to the instance gone, against the local clouds the
tests use.

Each provider is the product's class with the official SDK inside it (boto3; google-cloud-container and
google-cloud-compute; azure-mgmt-containerservice with azure-identity), built as the worker builds it (its
default poll intervals unless ``--poll-seconds``), on the local control plane (tests/harness/controlplane.py)
where the test harness's cloud controller (tests/harness/clouds/nodes.py) mirrors each instance as a kwok Node.
The clouds: moto in server mode with the harness's auto scaling group behind the node group, every product
request recorded by ``MotoRecorder`` (tests/harness/clouds/eks.py); the local GKE and AKS servers
(tests/harness/clouds/gke.py, aks.py), which record every request themselves. The harness's own calls (its
EKS <-> ASG sync, the servers' control endpoints) are not recorded, so every call counted is the product's.

Per provider, ``--runs`` times a scale up by one node (``scale_up(group, size + 1)``, the bench waiting for the
new Node), then ``--runs`` times the removal of one named node (the first by name) as the packing workflow's
activities do it for a node it emptied (workflows/pack.py): ``freeze``, ``remove_node``, ``node_gone`` until
true, ``unfreeze`` (cordon and evictions are Kubernetes calls, none of them cloud calls; there are no pods here).
Each request is named by the SDK operation that sent it and counted per step. Then ``--rounds`` (default
``--runs``) packing rounds end to end: three nodes, six 1-GPU pods spread over them with a PDB, ``PackWorkflow``
in Approve mode on the Temporal dev server with the product's activities and default ``PackSettings``, approved
as soon as it proposes one node; timed from the approval signal to the removal request received by the cloud,
to the instance gone at the cloud, and to the round Done.

Times: ``scale_up`` and ``remove_node`` to their return; the removal from ``remove_node``'s start to the
instance gone *at the cloud* (EKS: out of the ASG or Terminating, read from moto; GKE: the VM deleted from its
MIG; AKS: the machine deleted from the pool, both from the server's state; polled every 10 ms), and to
``node_gone`` true (the Node deleted by the harness's cloud controller, one pass every ``--reconcile-seconds``:
that part is the emulator's). The emulators' own delays are off: the GKE and AKS servers end operations at once
(``--operation-seconds`` 0; more shows the polls a longer operation costs) and AKS answers ``Retry-After: 0``;
moto answers at once. What remains is the product's calls and its own waits (PackSettings' ``poll_seconds``
2 s between ``node_gone`` checks in a round; the SDKs poll an operation once at once, then every GKE
``poll_seconds`` 1 s / AKS ``polling_interval`` 5 s or Retry-After, which an operation done at once never waits).

    .venv/bin/python -m bench.capacity_bench --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import ExitStack
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field
from functools import partial
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.harness.clouds import local
from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.moto_server import MotoServer
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import aks_listing
from tests.harness.clouds.nodes import gke_listing
from tests.harness.controlplane import ControlPlane
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant

PROVIDERS = ("eks-nodegroups", "gke-nodepools", "aks-nodepools")
STEPS = ("scale_up", "freeze", "remove_node", "node_gone", "unfreeze")
AKS_RG = "ml-prod"

# What each operation is for (the README's table says the same).
PURPOSE = {
    "eks describe_nodegroup": "the node group's scaling config and the name of its auto scaling group",
    "eks update_nodegroup_config": "desired size + 1 (absolute; min/max sent unchanged)",
    "autoscaling describe_auto_scaling_groups": "the instance's lifecycle state, MinSize/desired; the freeze tag",
    "autoscaling terminate_instance_in_auto_scaling_group": "terminate exactly that instance, desired - 1",
    "autoscaling create_or_update_tags": "freeze: the ASG tag kubeon.io/disruption-frozen-by",
    "autoscaling delete_tags": "unfreeze: that tag removed",
    "container get_node_pool": "the pool: its MIG per zone, autoscaling, machine type",
    "container set_node_pool_size": "N per zone (absolute)",
    "container get_operation": "the container operation polled until DONE",
    "compute instance_group_managers.get": "a zone's MIG target size",
    "compute list_managed_instances": "the VM in its MIG (before: still there? after: DELETING)",
    "compute delete_instances": "delete exactly that VM from its MIG (target size - 1)",
    "identity token": "a managed identity token (once per process, cached)",
    "arm agent_pools.get": "the pool's properties and ETag (GET before a PUT; the LRO's final GET)",
    "arm agent_pools.create_or_update": "PUT of the whole properties with If-Match (count + 1; the freeze tag)",
    "arm operation status": "the Azure-AsyncOperation polled until it ends",
    "arm machines.list": "the pool's machines: the one behind the node",
    "arm agent_pools.delete_machines": "delete exactly that machine",
}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def eks_operation(request: dict[str, Any]) -> str:
    """A MotoRecorder entry as boto3's operation name: Query actions by name, EKS REST paths by route."""
    action = str(request["action"])
    if request["service"] != "eks":
        return f"{request['service']} {_snake(action)}"
    method, _, path = action.partition(" ")
    if method == "GET" and re.fullmatch(r"/clusters/[^/]+/node-groups/[^/]+", path):
        return "eks describe_nodegroup"
    if method == "POST" and path.endswith("/update-config"):
        return "eks update_nodegroup_config"
    if method == "GET" and path.endswith("/node-groups"):
        return "eks list_nodegroups"
    return f"eks {action}"


def gke_operation(request: dict[str, Any]) -> str:
    method, path = request["method"], request["path"]
    if path.startswith("/v1/"):
        if "/operations/" in path:
            return "container get_operation"
        if path.endswith(":setSize"):
            return "container set_node_pool_size"
        if method == "GET" and re.search(r"/nodePools/[^/]+$", path):
            return "container get_node_pool"
        if method == "GET" and path.endswith("/nodePools"):
            return "container list_node_pools"
    if "/instanceGroupManagers/" in path:
        verb = path.rsplit("/", 1)[-1]
        if verb in ("listManagedInstances", "deleteInstances", "resize"):
            return f"compute {_snake(verb)}"
        if method == "GET":
            return "compute instance_group_managers.get"
    return f"{method} {path}"


def aks_operation(request: dict[str, Any]) -> str:
    method, path = request["method"], request["path"]
    if path == "/msi/token":
        return "identity token"
    if "/operations/" in path:
        return "arm operation status"
    if path.endswith("/deleteMachines"):
        return "arm agent_pools.delete_machines"
    if re.search(r"/machines(/[^/]+)?$", path):
        return "arm machines.list" if path.endswith("/machines") else "arm machines.get"
    if re.search(r"/agentPools/[^/]+$", path):
        return {"GET": "arm agent_pools.get", "PUT": "arm agent_pools.create_or_update"}.get(method, f"arm {method}")
    return f"{method} {path}"


@dataclass
class Group:
    """One provider's group on its local cloud, as the common loop drives it."""

    provider: str
    capacity: Any
    name: str
    requests: Callable[[], list[dict[str, Any]]]  # the product's cloud requests so far, in order
    operation: Callable[[dict[str, Any]], str]
    nodes: Callable[[], list[str]]  # the group's Ready Node names
    cloud_gone: Callable[[str], bool]  # a node's instance gone at the cloud
    settings: str
    label: str  # the Node label naming the group
    removal: Callable[[dict[str, Any]], bool]  # the request that removes a node


@dataclass
class Figures:
    provider: str
    runs: int
    settings: str
    calls: dict[str, Counter[str]] = field(default_factory=lambda: {s: Counter() for s in STEPS})
    seconds: dict[str, list[float]] = field(default_factory=lambda: {
        "scale_up": [], "remove_node": [], "instance gone": [], "node_gone": []})


def _step(group: Group, figures: Figures, step: str, call: Callable[[], Any]) -> Any:
    before = len(group.requests())
    out = call()
    figures.calls[step].update(group.operation(r) for r in group.requests()[before:])
    return out


def _until(check: Callable[[], bool], what: str, timeout: float, interval: float = 0.01) -> float:
    """Poll ``check`` (bounded); the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)
    return time.monotonic()


def measure(group: Group, runs: int, timeout: float) -> Figures:
    figures = Figures(group.provider, runs, group.settings)
    cap, name = group.capacity, group.name

    def nodes_are(count: int) -> Callable[[], bool]:
        return lambda: len(group.nodes()) == count

    for _ in range(runs):
        size = len(group.nodes())
        start = time.monotonic()
        _step(group, figures, "scale_up", partial(cap.scale_up, name, size + 1))
        figures.seconds["scale_up"].append(time.monotonic() - start)
        _until(nodes_are(size + 1), f"{group.provider}: node {size + 1} Ready", timeout, interval=0.05)
    for _ in range(runs):
        victim = sorted(group.nodes())[0]
        operation = f"pack-bench-{uuid.uuid4().hex[:6]}"
        _step(group, figures, "freeze", partial(cap.freeze, name, operation))
        start = time.monotonic()
        _step(group, figures, "remove_node", partial(cap.remove_node, name, victim))
        figures.seconds["remove_node"].append(time.monotonic() - start)
        gone = _until(partial(group.cloud_gone, victim), f"{group.provider}: {victim}'s instance gone", timeout)
        figures.seconds["instance gone"].append(gone - start)
        before = len(group.requests())
        _until(partial(cap.node_gone, name, victim), f"{group.provider}: Node {victim} gone", timeout,
               interval=0.05)
        figures.seconds["node_gone"].append(time.monotonic() - start)
        figures.calls["node_gone"].update(group.operation(r) for r in group.requests()[before:])
        _step(group, figures, "unfreeze", partial(cap.unfreeze, name, operation))
    return figures


def _ready(nodes: NodeReconciler, label: str, group: str) -> Callable[[], list[str]]:
    return lambda: [str(n.metadata.name) for n in nodes.ready(label, group)]


# -- the three providers on their local clouds ---------------------------------------------------------------
@contextmanager
def eks_group(cluster: Cluster, optimizer: Kube, workdir: Path, runs: int, reconcile: float) -> Iterator[Group]:
    from activities.capacity.eks import GONE_STATES
    from activities.capacity.eks import EksNodeGroupsCapacity
    from activities.capacity.eks import instance_of
    from models.eks import NODEGROUP_LABEL

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.pop("AWS_PROFILE", None)
    moto = MotoServer(workdir).start()
    try:
        groups = EksNodeGroups(moto.endpoint)
        eks_cluster, ng = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
        asg_name = groups.create(eks_cluster, ng, instance_type="g6.12xlarge", min_size=1, max_size=max(runs + 1, 3),
                                 desired=1, taints=[{"key": "nvidia.com/gpu", "value": "true",
                                                     "effect": "NO_SCHEDULE"}])
        autoscaling = groups.client("autoscaling")
        with MotoRecorder(moto.endpoint) as recorder, \
                NodeReconciler(cluster.admin, f"eks-{uuid.uuid4().hex[:6]}", groups.listing,
                               interval=reconcile) as nodes:
            wait_for(lambda: len(nodes.ready(NODEGROUP_LABEL, ng)) == 1, timeout=60, what="the first node Ready")
            provider_ids: dict[str, str] = {}

            def ready() -> list[str]:
                found = nodes.ready(NODEGROUP_LABEL, ng)
                provider_ids.update({str(n.metadata.name): str(n.spec.provider_id) for n in found})
                return [str(n.metadata.name) for n in found]

            def gone(node: str) -> bool:
                instance = instance_of(provider_ids[node])
                asg = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])
                member = next((i for i in asg["AutoScalingGroups"][0]["Instances"] if i["InstanceId"] == instance),
                              None)
                return member is None or member["LifecycleState"] in GONE_STATES

            capacity = EksNodeGroupsCapacity(optimizer.api, cluster=eks_cluster, region=groups.region,
                                             endpoint_url=recorder.url)
            try:
                yield Group("eks-nodegroups", capacity, ng, recorder.requests, eks_operation, ready, gone,
                            "boto3 standard retries (3 attempts), terminate sent once", NODEGROUP_LABEL,
                            lambda r: r["action"] == "TerminateInstanceInAutoScalingGroup")
            finally:
                groups.delete(eks_cluster, ng)
    finally:
        moto.stop()


@contextmanager
def gke_group(cluster: Cluster, optimizer: Kube, workdir: Path, poll: float | None, reconcile: float,
              operation_seconds: float) -> Iterator[Group]:
    from activities.capacity.gke import GkeNodePoolsCapacity
    from models.gke import NODEPOOL_LABEL

    with local.start_gcp(workdir) as server:
        gke_cluster, pool = local.seed_gke_gpu_pool(server, machine_type="a2-highgpu-8g", nodes=1,
                                                     operation_seconds=operation_seconds)
        with NodeReconciler(cluster.admin, f"gke-{uuid.uuid4().hex[:6]}", gke_listing(server),
                            interval=reconcile) as nodes:
            wait_for(lambda: len(nodes.ready(NODEPOOL_LABEL, pool)) == 1, timeout=60, what="the first node Ready")

            def gone(node: str) -> bool:
                return any(d["instance"] == node and d["via"] == "deleteInstances" for d in server.state()["deleted"])

            kwargs: dict[str, Any] = {"poll_seconds": poll} if poll is not None else {}
            capacity = GkeNodePoolsCapacity(optimizer.api, project=local.GKE_PROJECT, location=local.GKE_LOCATION,
                                            cluster=gke_cluster, endpoint_url=server.url, **kwargs)
            yield Group("gke-nodepools", capacity, pool, server.requests, gke_operation,
                        _ready(nodes, NODEPOOL_LABEL, pool), gone,
                        f"poll_seconds {capacity._poll:g}", NODEPOOL_LABEL,
                        lambda r: str(r["path"]).endswith("/deleteInstances"))
            server.reset()  # the pool's VMs go, and with them their Nodes (deleted on the reconciler's exit)


@contextmanager
def aks_group(cluster: Cluster, optimizer: Kube, workdir: Path, poll: float | None, reconcile: float,
              operation_seconds: float) -> Iterator[Group]:
    from activities.capacity.aks import AksNodePoolsCapacity
    from models.aks import AGENTPOOL_LABEL

    with local.start_azure(workdir) as server:
        os.environ.update(local.azure_identity_env(server))
        server.fault(operation_seconds=operation_seconds, retry_after=0)
        aks_cluster, pool = f"train-{uuid.uuid4().hex[:6]}", "gpu"
        server.seed(aks={"subscription": local.AZURE_SUBSCRIPTION, "resourceGroup": AKS_RG, "cluster": aks_cluster,
                         "location": "westeurope", "agentPools": [
                             {"name": pool, "vmSize": "Standard_NC64as_T4_v3", "count": 1, "mode": "User",
                              "nodeTaints": ["nvidia.com/gpu=true:NoSchedule"]},
                             {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})
        with NodeReconciler(cluster.admin, f"aks-{uuid.uuid4().hex[:6]}", aks_listing(server),
                            interval=reconcile) as nodes:
            wait_for(lambda: len(nodes.ready(AGENTPOOL_LABEL, pool)) == 1, timeout=60, what="the first node Ready")

            def gone(node: str) -> bool:
                return any(d["machine"] == node and d["via"] == "deleteMachines"
                           for d in server.state()["machineDeleted"])

            kwargs: dict[str, Any] = {"polling_interval": poll} if poll is not None else {}
            capacity = AksNodePoolsCapacity(optimizer.api, subscription=local.AZURE_SUBSCRIPTION,
                                            resource_group=AKS_RG, cluster=aks_cluster, endpoint_url=server.url,
                                            ca_file=str(server.ca_file), client_id=local.AZURE_CLIENT_ID, **kwargs)
            yield Group("aks-nodepools", capacity, pool, server.requests, aks_operation,
                        _ready(nodes, AGENTPOOL_LABEL, pool), gone,
                        f"polling_interval {capacity.polling_interval:g}, Retry-After 0", AGENTPOOL_LABEL,
                        lambda r: str(r["path"]).endswith("/deleteMachines"))
            server.reset()


# -- a packing round end to end: approve -> the planned node's instance gone --------------------------------
@dataclass
class Round:
    provider: str
    node: str
    to_sent: float  # approve -> the removal request received by the cloud
    to_gone: float  # approve -> the instance gone at the cloud
    to_done: float  # approve -> the round Done (Node gone, group unfrozen)
    planning: Counter[str]  # cloud calls from the round's start to its proposal
    approved: Counter[str]  # cloud calls from the approval to Done
    moved: int


async def _until_async(check: Callable[[], bool], what: str, timeout: float, interval: float = 0.01) -> float:
    """``check`` (run in a thread: it does I/O) until it holds, bounded; the wall-clock time it first held."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        await asyncio.sleep(interval)
    return time.time()


async def pack_round(group: Group, cluster: Cluster, optimizer: Kube, temporal: Any, timeout: float) -> Round:
    """Three nodes of the group (scaled up by the provider, not counted), six 1-GPU pods spread over them by the
    scheduler with a PDB (maxUnavailable 1) over them; a PackWorkflow in Approve mode with the product's default
    settings (PackSettings()) over the group, one node at most; approved at once when it proposes."""
    from models.decisions import Approval
    from models.packing import PackSettings
    from tests.harness import packing
    from tests.harness.workloads import node_group_pods
    from tests.harness.workloads import running_pods

    if len(group.nodes()) < 3:
        group.capacity.scale_up(group.name, 3)
    await _until_async(lambda: len(group.nodes()) == 3, f"{group.provider}: 3 nodes Ready", timeout, 0.05)
    namespace = cluster.create_namespace("pack-bench")
    admin = cluster.admin
    try:
        admin.apps.create_namespaced_deployment(namespace, node_group_pods("serve", group.label, group.name, 6))
        await asyncio.to_thread(running_pods, admin.core, namespace, "serve", 6)
        admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"), spec=client.V1PodDisruptionBudgetSpec(
                max_unavailable=1, selector=client.V1LabelSelector(match_labels={"app": "serve"}))))
        queue = f"pack-bench-{uuid.uuid4().hex[:6]}"
        async with packing.pack_worker(temporal, queue, optimizer.api, group.capacity):
            start = len(await asyncio.to_thread(group.requests))
            handle, proposal = await packing.proposed_round(temporal, queue, [group.name], max_nodes=1,
                                                            settings=PackSettings())
            assert proposal.plan is not None and len(proposal.plan.empty) == 1, proposal
            [planned] = proposal.plan.empty
            mark = len(await asyncio.to_thread(group.requests))
            approved = time.time()
            await handle.signal("approve", Approval(approver="bench"))
            done = asyncio.ensure_future(handle.result())
            gone = await _until_async(partial(group.cloud_gone, planned), f"{group.provider}: {planned} gone",
                                      timeout)
            view = await asyncio.wait_for(done, timeout)
            finished = time.time()
            assert view.phase == "Done" and view.removed == [planned], view
        requests = await asyncio.to_thread(group.requests)
        sent = [r for r in requests[mark:] if group.removal(r)]
        assert len(sent) == 1, sent
        return Round(group.provider, planned, float(sent[0]["time"]) - approved, gone - approved,
                     finished - approved, Counter(group.operation(r) for r in requests[start:mark]),
                     Counter(group.operation(r) for r in requests[mark:]), len(view.moved))
    finally:
        admin.core.delete_namespace(namespace)
        await _until_async(lambda: not running_on(admin, group), f"{group.provider}: the round's pods gone",
                           timeout, 0.1)


def running_on(admin: Kube, group: Group) -> bool:
    """Whether pods are still bound to the group's nodes."""
    nodes = set(group.nodes())
    return any(p.spec is not None and str(p.spec.node_name) in nodes
               for p in admin.core.list_pod_for_all_namespaces().items)


# -- printing -----------------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(results: list[Figures]) -> None:
    print(f"\n{'provider':<16} {'calls/scale up':>14} {'calls/removal':>14} {'scale_up s':>11} {'remove_node s':>14} "
          f"{'-> instance gone s':>19} {'-> node_gone s':>15}   settings")
    for f in results:
        up = sum(f.calls["scale_up"].values()) / f.runs
        removal = sum(sum(f.calls[s].values()) for s in ("freeze", "remove_node", "node_gone", "unfreeze")) / f.runs
        s = f.seconds
        print(f"{f.provider:<16} {up:>14.1f} {removal:>14.1f} {statistics.median(s['scale_up']):>11.2f} "
              f"{statistics.median(s['remove_node']):>14.2f} {statistics.median(s['instance gone']):>19.2f} "
              f"{statistics.median(s['node_gone']):>15.2f}   {f.settings}")
    print("(times: median of the runs; max in the breakdown below)")
    for f in results:
        print(f"\n{f.provider}: API calls per step, average of {f.runs} runs "
              f"(scale up {max(f.seconds['scale_up']):.2f} s max, removal -> instance gone "
              f"{max(f.seconds['instance gone']):.2f} s max, p95 {_pct(f.seconds['instance gone'], .95):.2f} s)")
        for step in STEPS:
            calls = f.calls[step]
            print(f"  {step:<12} {sum(calls.values()) / f.runs:5.1f}")
            for op, count in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"      {count / f.runs:5.1f}  {op:<54} {PURPOSE.get(op, '')}")


def report_rounds(rounds: list[Round]) -> None:
    if not rounds:
        return
    print(f"\nPackWorkflow end to end (Approve mode, PackSettings() defaults; 6 pods over 3 nodes, PDB "
          f"maxUnavailable 1, one node planned): median (max) over {len(rounds) // len({r.provider for r in rounds})} "
          "round(s)")
    print(f"{'provider':<16} {'approve -> removal sent s':>26} {'approve -> instance gone s':>27} "
          f"{'approve -> Done s':>18} {'pods moved':>11} {'calls: plan':>12} {'calls: approved':>16}")
    for provider in dict.fromkeys(r.provider for r in rounds):
        mine = [r for r in rounds if r.provider == provider]

        def col(values: list[float], width: int) -> str:
            return f"{statistics.median(values):.2f} ({max(values):.2f})".rjust(width)

        print(f"{provider:<16} {col([r.to_sent for r in mine], 26)} {col([r.to_gone for r in mine], 27)} "
              f"{col([r.to_done for r in mine], 18)} {statistics.median([r.moved for r in mine]):>11.0f} "
              f"{sum(sum(r.planning.values()) for r in mine) / len(mine):>12.1f} "
              f"{sum(sum(r.approved.values()) for r in mine) / len(mine):>16.1f}")
    for provider in dict.fromkeys(r.provider for r in rounds):
        mine = [r for r in rounds if r.provider == provider]
        for what in ("planning", "approved"):
            calls: Counter[str] = sum((getattr(r, what) for r in mine), Counter())
            print(f"  {provider} {what}: " + ", ".join(f"{op} {n / len(mine):.1f}" for op, n in
                                                       sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))))


async def run(args: argparse.Namespace) -> tuple[list[Figures], list[Round]]:
    from temporalio.testing import WorkflowEnvironment

    from tests.harness.temporal import start_dev_server

    results: list[Figures] = []
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="kubeon-capacity-bench-") as tmp:
        workdir = Path(tmp)
        plane = ControlPlane(workdir / "controlplane")
        temporal: WorkflowEnvironment | None = None
        try:
            plane.start()
            cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
            optimizer = grant(cluster, "kubeon-capacity-bench", OPTIMIZER_RULES)
            if args.rounds:
                temporal = await start_dev_server()
            for provider in args.providers:
                folder = workdir / provider
                folder.mkdir()
                with ExitStack() as stack:
                    if provider == "eks-nodegroups":
                        group = stack.enter_context(eks_group(cluster, optimizer, folder, args.runs,
                                                              args.reconcile_seconds))
                    elif provider == "gke-nodepools":
                        group = stack.enter_context(gke_group(cluster, optimizer, folder, args.poll_seconds,
                                                              args.reconcile_seconds, args.operation_seconds))
                    else:
                        group = stack.enter_context(aks_group(cluster, optimizer, folder, args.poll_seconds,
                                                              args.reconcile_seconds, args.operation_seconds))
                    results.append(measure(group, args.runs, args.timeout))
                    for _ in range(args.rounds):
                        assert temporal is not None
                        rounds.append(await pack_round(group, cluster, optimizer, temporal.client, args.timeout))
        finally:
            if temporal is not None:
                await temporal.shutdown()
            plane.stop()
    return results, rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.capacity_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="scale ups and removals per provider (5)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="packing rounds end to end per provider (default: --runs; 0: none)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--poll-seconds", type=float, default=None,
                        help="GKE poll_seconds and AKS polling_interval (default: the worker's, 1 s and 5 s)")
    parser.add_argument("--reconcile-seconds", type=float, default=0.1,
                        help="the harness cloud controller's pass interval (Nodes made and deleted)")
    parser.add_argument("--operation-seconds", type=float, default=0.0,
                        help="how long the GKE/AKS servers run an operation (0: done at once; more shows the polls)")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound of every wait (s)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.rounds is None:
        args.rounds = args.runs
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # MotoRecorder's access log
    results, rounds = asyncio.run(run(args))
    report(results)
    report_rounds(rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

