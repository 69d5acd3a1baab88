"""`make dev` brings everything up, and a newcomer following the README sees a burst waiting for approval."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any
from typing import cast

import httpx
import pytest
import yaml
from kubernetes import client
from temporalio.client import Client

from models.converter import DATA_CONVERTER
from models.node import OperationView
from models.provisioning import ProvisionView
from tests.harness.children import Child
from tests.harness.children import recorded
from tests.harness.controlplane import free_port
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from worker import ops

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
ROOT = Path(__file__).resolve().parents[2]


# a process's output lines, read by one thread per process
_OUTPUT: weakref.WeakKeyDictionary[subprocess.Popen[str], queue.Queue[str | None]] = weakref.WeakKeyDictionary()


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output lines, pumped by a thread (no line lost in a buffer or to two readers); None at EOF."""
    if proc not in _OUTPUT:
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        stdout = proc.stdout

        def pump() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        _OUTPUT[proc] = lines
    return _OUTPUT[proc]


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """Lines of the process's output up to ``marker``."""
    lines = _lines(proc)
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            line = ""
        if line is None or (not line and proc.poll() is not None):
            raise AssertionError(f"make dev exited {proc.wait(timeout=30)}:\n{seen}")
        seen += line
        if line.strip() == marker:
            return seen
    raise AssertionError(f"no {marker!r} within {timeout}s:\n{seen}")


def _rest_of_output(proc: subprocess.Popen[str], timeout: float) -> str:
    """What the process printed after what was read, once it has exited (within ``timeout`` s)."""
    proc.wait(timeout=timeout)
    lines, rest = _lines(proc), ""
    while (line := lines.get(timeout=timeout)) is not None:  # the pump puts None at EOF
        rest += line
    return rest


def interrupt(proc: subprocess.Popen[str], *, twice: bool = False) -> None:
    """Ctrl-C to `make dev` (``twice``: a second one a second later), then its exit within 90 s (else SIGKILL and
    fail)."""
    os.killpg(proc.pid, signal.SIGINT)
    if twice:
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


async def test_dev_environment_shows_a_burst_awaiting_approval(tmp_path: Path) -> None:
    port, ui, hub_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.dev", "--dir", str(tmp_path / "dev"), "--temporal-port", str(port),
         "--ui-port", str(ui), "--hub-port", str(hub_port), "--console-port", str(free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = _read_until(proc, "ready", timeout=240)
        assert f"http://127.0.0.1:{ui}" in banner
        assert "kubectl --kubeconfig" in banner and "examples/burst-workload.yaml" in banner
        assert f"http://127.0.0.1:{hub_port}" in banner
        synced = next(line for line in banner.splitlines() if "policies synced from the hub: " in line)
        assert {"cloud-burst", "inference-burst"} <= set(synced.split(": ", 1)[1].split(", "))
        # R1.5; the policies show in the cluster as they are applied, the worker logs the line once all are.
        examples = len(list((ROOT / "examples" / "policies").glob("*.yaml")))
        log_deadline = time.monotonic() + 30
        while f"policies synced: {examples} created" not in (tmp_path / "dev" / "worker.log").read_text():
            assert time.monotonic() < log_deadline, (tmp_path / "dev" / "worker.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
        endpoints = json.loads((tmp_path / "dev" / "endpoints.json").read_text())
        assert set(endpoints) == {"aws", "gcp", "azure"} and endpoints["azure"]["ca"].endswith(".pem")
        assert endpoints["gcp"]["url"] in banner and endpoints["azure"]["resourceGroup"] in banner
        admin = Kube.from_kubeconfig(tmp_path / "dev" / "kubeconfig")
        workload = yaml.safe_load((ROOT / "examples" / "burst-workload.yaml").read_text())
        admin.apps.create_namespaced_deployment("default", workload)

        temporal = await Client.connect(f"127.0.0.1:{port}", data_converter=DATA_CONVERTER)
        deadline = time.monotonic() + 120
        while True:
            rows = await ops.list_operations(temporal)
            waiting = [r for r in rows if r.phase == "AwaitingApproval"]
            if waiting:
                break
            assert time.monotonic() < deadline, f"no operation awaiting approval: {rows}"
            await asyncio.sleep(1)
        batch = waiting[0].operation  # the policy's provisioning row names its batch awaiting approval
        prov = await ops.show(temporal, batch)
        assert isinstance(prov, ProvisionView) and prov.policy == "inference-burst" and prov.proposal is not None
        (planned,) = prov.proposal.plan.new_nodes
        assert planned.offering.location == "onprem/dc1"  # the pool's rate card is the cheapest
        # Approved in the hub (the seeded admin key), the batch goes on to launch its node. The hub takes the
        # decision once the cluster's `proposed` report has arrived (within a poll, 5 s).
        key = (tmp_path / "dev" / "hub" / "dev.key").read_text().strip()
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                approved = await http.post(f"http://127.0.0.1:{hub_port}/v1/clusters/dev/approvals",
                                           headers={"Authorization": f"Bearer {key}"},
                                           json={"operation": batch, "decision": "approve"})
                if approved.status_code != 404 or time.monotonic() > deadline:
                    break
                assert approved.json()["error"] == "operation_not_proposed", approved.text
                await asyncio.sleep(1)
        assert approved.status_code == 201, approved.text
        while not (prov := await ops.show(temporal, prov.workflow_id)).batches or not prov.batches[-1].nodes:
            assert isinstance(prov, ProvisionView)
            assert time.monotonic() < deadline + 60, prov.history
            await asyncio.sleep(1)
        assert isinstance(prov, ProvisionView) and prov.batches[-1].approver == "hub:user:dev", prov.history
        # One of the pool's two local servers was claimed and joins through the gateway like a burst node.
        node_wf = prov.batches[-1].nodes[0]
        while (view := await ops.show(temporal, node_wf)).phase != "Serving":
            assert isinstance(view, OperationView)
            assert time.monotonic() < deadline + 120, view.history
            await asyncio.sleep(1)
        assert isinstance(view, OperationView)
        assert view.instance is not None and view.instance.location == "onprem/dc1"
        assert view.instance.instance_id in ("gpu-1", "gpu-2")
        # It redeemed its ticket at the gateway process (with the pool's join token) and registered itself with
        # its own certificate.
        assert f"node {view.node_name} joined" in (tmp_path / "dev" / "gateway.log").read_text()
        csrs = client.CertificatesV1Api(admin.api).list_certificate_signing_request().items
        assert any(c.status.certificate and str(view.node_name) in (c.status.conditions[0].message or "")
                   for c in csrs)
        # make dev's Prometheus scrapes the worker's and the gateway's /metrics: both up, with the product's series
        # of what just happened (the approval counted by the worker, the join admitted by the gateway).
        found = re.search(r"Prometheus +(http://127\.0\.0\.1:\d+)", banner)
        assert found, banner
        await product_series_in_prometheus(found.group(1), deadline + 180)
    finally:
        children = recorded_children(tmp_path / "dev")
        # Ctrl-C twice (an impatient user): the second kills what has not exited yet.
        interrupt(proc, twice=True)
    assert proc.returncode == 0
    names = {c.name.rsplit("-v", 1)[0] for c in children}  # binaries are named <component>-<version>
    assert {"etcd", "kube-apiserver", "kube-scheduler", "kwok", "temporal", "hub", "worker"} <= names, names
    assert_all_gone(children, "Ctrl-C twice")
    # Ctrl-C leaves nothing running: no process of the dev environment survives.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "dev")], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""


async def product_series_in_prometheus(url: str, deadline: float) -> None:
    wanted = {'up{job="kubeon-worker"}': 1.0, 'up{job="kubeon-gateway"}': 1.0,
              'sum(kubeon_operation_actions_total{job="kubeon-worker",action="approved"})': 1.0,
              'sum(kubeon_gateway_joins_total{job="kubeon-gateway",outcome="admitted"})': 1.0}
    got: dict[str, float | None] = {}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while True:
            for query in wanted:
                answer = (await http.get("/api/v1/query", params={"query": query})).json()
                assert answer["status"] == "success", answer
                got[query] = float(answer["data"]["result"][0]["value"][1]) if answer["data"]["result"] else None
            if all(got[q] is not None and got[q] >= v for q, v in wanted.items()):
                return
            assert time.monotonic() < deadline, f"Prometheus at {url} has {got}"
            await asyncio.sleep(1)


def recorded_children(state: Path) -> list[Child]:
    doc = recorded(state)
    return [Child(name=c["name"], pid=int(c["pid"]), start=int(c["start"])) for c in doc.get("children", [])]


def assert_all_gone(children: list[Child], how: str, timeout: float = 30) -> None:
    """None of the children (nor anything left in their process groups) is alive ``timeout`` s after ``how``."""
    assert children, f"no children recorded before {how}"
    deadline = time.monotonic() + timeout
    while True:
        left = {c.name: c.pid for c in children if c.running() or c.group_members()}
        if not left:
            return
        assert time.monotonic() < deadline, f"alive {timeout:.0f}s after {how}: {left}"
        time.sleep(0.2)


def start_dev(state: Path, ports: tuple[int, int, int], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.harness.dev", "--dir", str(state), "--temporal-port", str(ports[0]),
         "--ui-port", str(ports[1]), "--hub-port", str(ports[2]), "--console-port", str(free_port()), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_make_dev_killed_terminated_or_hung_up_leaves_no_child_and_a_second_one_keeps_off(tmp_path: Path) -> None:
    state, ports = tmp_path / "dev", (free_port(), free_port(), free_port())
    running: list[subprocess.Popen[str]] = []
    try:
        first = start_dev(state, ports)
        running.append(first)
        _read_until(first, "ready", timeout=240)
        kubeconfig = (state / "kubeconfig").read_text()
        children = recorded_children(state)

        # A second one while the first runs: fails at once naming the first's pid and ports, touches nothing.
        second = start_dev(state, ports)
        out, _ = second.communicate(timeout=30)
        assert second.returncode == 1, out
        assert f"another `make dev` (pid {first.pid})" in out and f"{ports[2]} (hub)" in out, out
        assert (state / "kubeconfig").read_text() == kubeconfig
        assert all(c.running() for c in children), "the second make dev touched the first's processes"

        # SIGKILL of the harness: the kernel ends its children (PR_SET_PDEATHSIG).
        first.kill()
        first.wait()
        assert_all_gone(children, "SIGKILL of the harness")

        # Then a new one starts cleanly on the same directory and ports; SIGTERM ends it and its children.
        third = start_dev(state, ports)
        running.append(third)
        _read_until(third, "ready", timeout=240)
        children = recorded_children(state)
        os.kill(third.pid, signal.SIGTERM)
        out = _rest_of_output(third, timeout=90)
        assert third.returncode == 0 and "stopping" in out, out
        # The control plane stops by itself, etcd after the apiserver (an apiserver without its etcd had to be killed).
        assert "killed after 10s" not in out, out
        assert_all_gone(children, "SIGTERM")

        # The terminal closing (SIGHUP to its process group) while it is still starting.
        fourth = start_dev(state, ports)
        running.append(fourth)
        deadline = time.monotonic() + 120
        # its own record (not the previous run's), once etcd, kube-apiserver, ... are up
        while recorded(state).get("harness") != fourth.pid or len(recorded_children(state)) < 3:
            assert time.monotonic() < deadline and fourth.poll() is None, "make dev did not start its children"
            time.sleep(0.2)
        children = recorded_children(state)
        os.killpg(fourth.pid, signal.SIGHUP)
        out, _ = fourth.communicate(timeout=90)
        assert fourth.returncode == 1 and "SIGHUP while starting: stopping" in out, out
        assert_all_gone(children, "SIGHUP")
    finally:
        for proc in running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# karpenter and one managed node group provider: each starts a whole make dev (the other two, gke-nodepools and
# aks-nodepools, go through the same DevCapacity code, their servers and providers tested in their own modules).
DOCTOR_CHECK = {"karpenter": "Karpenter", "eks-nodegroups": "EKS node groups"}


@pytest.mark.parametrize("provider", sorted(DOCTOR_CHECK))
def test_make_dev_with_home_capacity_lists_its_group_and_proposes_packing(provider: str, tmp_path: Path) -> None:
    """`make dev ARGS=--capacity X`: the home group gpu-home (two 4-GPU nodes) behind capacity.provider X, named in
    endpoints.json with what the SDK and doctor need, found by `kubeon-gpu doctor` run as the README says, and the
    README's packing walk-through: the example workload -> packing-home (Recommend) proposes emptying one node;
    the policy set to Approve in the hub -> a round awaiting approval; `ops approve` -> exactly that node removed
    through the provider, both pods on the kept one."""
    state = tmp_path / "dev"
    started = time.monotonic()
    ports = (free_port(), free_port(), free_port())
    proc = start_dev(state, ports, "--capacity", provider)
    try:
        banner = _read_until(proc, "ready", timeout=300)
        print(f"make dev --capacity {provider}: ready after {time.monotonic() - started:.0f} s")
        assert "examples/packing-workload.yaml" in banner and "gpupolicy packing-home" in banner
        endpoints = json.loads((state / "endpoints.json").read_text())
        entry = endpoints["capacity"]
        assert entry["provider"] == provider and entry["group"] == "gpu-home" and len(entry["nodes"]) == 2, entry
        assert entry["env"]["KUBEON_CAPACITY_PROVIDER"] == provider
        if provider == "eks-nodegroups":
            assert entry["url"] == endpoints["aws"]["url"] == entry["env"]["KUBEON_AWS_ENDPOINT_URL"]
            assert entry["eksCluster"] == entry["env"]["KUBEON_CAPACITY_CLUSTER_NAME"]
            assert entry["env"]["AWS_ACCESS_KEY_ID"] and entry["env"]["AWS_SECRET_ACCESS_KEY"]
        synced = next(line for line in banner.splitlines() if "policies synced from the hub: " in line)
        assert "packing-home" in synced.split(": ", 1)[1].split(", "), synced
        # doctor as the banner and the README run it: with endpoints.json's capacity env.
        doctor = subprocess.run(
            [sys.executable, "-m", "worker.cli", "doctor", "--kubeconfig", str(state / "kubeconfig"), "--json"],
            env={**os.environ, "PYTHONPATH": str(ROOT), **entry["env"]}, cwd=ROOT, capture_output=True, text=True,
            timeout=120)
        assert doctor.returncode == 0, doctor.stderr
        found = {r["name"]: r for r in json.loads(doctor.stdout)}[DOCTOR_CHECK[provider]]
        assert found["status"] == "found" and "gpu-home" in found["detail"], found
        # The walk-through: two 1-GPU pods, one per node -> a proposal to empty one of the group's nodes.
        admin = Kube.from_kubeconfig(state / "kubeconfig")
        admin.apps.create_namespaced_deployment(
            "default", yaml.safe_load((ROOT / "examples" / "packing-workload.yaml").read_text()))
        def proposed() -> dict[str, Any] | None:
            policy = cast(dict[str, Any], admin.custom.get_cluster_custom_object(
                "gpu.kubeon.io", "v1", "gpupolicies", "packing-home"))
            packing = (policy.get("status") or {}).get("packing") or {}
            return packing if packing.get("proposal") else None

        packing = wait_for(proposed, timeout=120, interval=1, what="the packing proposal")
        proposal = packing["proposal"]
        assert packing["enforcedMode"] == "Recommend" and len(proposal["nodes"]) == 1, packing
        assert set(proposal["nodes"]) <= set(entry["nodes"]) and proposal["usdPerHourSaved"] > 1.0, packing
        assert {p.spec.node_name for p in admin.core.list_namespaced_pod("default", label_selector="app=serve").items
                } <= set(entry["nodes"])  # Recommend: nothing moved off the group
        # Approve, as the README does it: the policy put back to the hub in mode Approve, then `ops approve`.
        doc = yaml.safe_load((ROOT / "examples" / "dev" / "packing-home.yaml").read_text())
        doc["spec"]["mode"] = "Approve"
        key = (state / "hub" / "dev.key").read_text().strip()
        put = httpx.put(f"http://127.0.0.1:{ports[2]}/v1/clusters/dev/policies/packing-home", json=doc, timeout=10,
                        headers={"Authorization": f"Bearer {key}"})
        assert put.status_code == 200 and put.json()["changed"], put.text
        cli_env = {**os.environ, "PYTHONPATH": str(ROOT), "KUBEON_TEMPORAL_ADDRESS": f"127.0.0.1:{ports[0]}"}

        def cli(*argv: str) -> str:
            done = subprocess.run([sys.executable, "-m", "worker.cli", "ops", *argv], env=cli_env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return done.stdout

        round_id = "packing/dev/packing-home"
        wait_for(lambda: any("Pack" in line and "AwaitingApproval" in line for line in cli("list").splitlines()),
                 timeout=120, interval=1, what="the packing round awaiting approval in ops list")
        [planned] = json.loads(cli("show", round_id, "--json"))["plan"]["empty"]
        assert planned in entry["nodes"]
        cli("approve", round_id)

        def done() -> dict[str, Any] | None:
            view: dict[str, Any] = json.loads(cli("show", round_id, "--json"))
            assert view["phase"] != "Failed", cli("show", round_id)
            return view if view["phase"] == "Done" else None

        view = wait_for(done, timeout=180, interval=1, what="the packing round Done")
        assert view["removed"] == [planned], view
        kept = set(entry["nodes"]) - {planned}

        def group_nodes() -> set[str]:
            return {str(n.metadata.name) for n in admin.core.list_node(
                label_selector="example.com/gpu-group=gpu-home").items}

        # The node goes once its instance (NodeClaim) has.
        wait_for(lambda: group_nodes() == kept, timeout=120, interval=1, what=f"only {sorted(kept)} left in gpu-home")
        pods = admin.core.list_namespaced_pod("default", label_selector="app=serve").items
        assert len(pods) == 2 and {p.spec.node_name for p in pods} == kept, [(p.metadata.name, p.spec.node_name)
                                                                              for p in pods]
    finally:
        children = recorded_children(state)
        interrupt(proc)
    assert proc.returncode == 0
    if provider == "karpenter":
        assert any(c.name.startswith("karpenter") for c in children), children
    assert_all_gone(children, "Ctrl-C")
