"""`make dev` brings everything up, and a newcomer following the README sees a burst waiting for approval."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.harness.controlplane import free_port
from tests.harness.kube import Kube
from worker import ops

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
ROOT = Path(__file__).resolve().parents[2]


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """Lines of the process's output up to ``marker`` (read in a thread: no line is lost in a buffer)."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                raise AssertionError(f"make dev exited {proc.returncode}:\n{seen}") from None
            continue
        seen += line
        if line.strip() == marker:
            return seen
    raise AssertionError(f"no {marker!r} within {timeout}s:\n{seen}")


async def test_dev_environment_shows_a_burst_awaiting_approval(tmp_path: Path) -> None:
    port, ui, hub_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.dev", "--dir", str(tmp_path / "dev"), "--temporal-port", str(port),
         "--ui-port", str(ui), "--hub-port", str(hub_port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = _read_until(proc, "ready", timeout=240)
        assert f"http://127.0.0.1:{ui}" in banner
        assert "kubectl --kubeconfig" in banner and "examples/burst-workload.yaml" in banner
        assert f"http://127.0.0.1:{hub_port}" in banner and "policies synced from the hub: inference-burst" in banner
        # R1.5; the policies show in the cluster as they are applied, the worker logs the line once all are.
        examples = len(list((ROOT / "examples" / "policies").glob("*.yaml")))
        log_deadline = time.monotonic() + 30
        while f"policies synced: {examples} created" not in (tmp_path / "dev" / "worker.log").read_text():
            assert time.monotonic() < log_deadline, (tmp_path / "dev" / "worker.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
        admin = Kube.from_kubeconfig(tmp_path / "dev" / "kubeconfig")
        workload = yaml.safe_load((ROOT / "examples" / "burst-workload.yaml").read_text())
        admin.apps.create_namespaced_deployment("default", workload)

        temporal = await Client.connect(f"127.0.0.1:{port}", data_converter=pydantic_data_converter)
        deadline = time.monotonic() + 120
        while True:
            rows = await ops.list_operations(temporal)
            waiting = [r for r in rows if r.phase == "AwaitingApproval"]
            if waiting:
                break
            assert time.monotonic() < deadline, f"no operation awaiting approval: {rows}"
            await asyncio.sleep(1)
        view = await ops.show(temporal, waiting[0].operation)
        assert view.policy == "inference-burst"
        assert view.plan is not None and view.plan.best is not None
        assert view.plan.best.location == "sim/eu-west"  # the cheaper of the two sim locations
        # Approved in the hub (the seeded admin key), the operation goes on to launch in the cluster.
        key = (tmp_path / "dev" / "hub" / "dev.key").read_text().strip()
        async with httpx.AsyncClient(timeout=10) as http:
            approved = await http.post(f"http://127.0.0.1:{hub_port}/v1/clusters/dev/approvals",
                                       headers={"Authorization": f"Bearer {key}"},
                                       json={"operation": view.operation, "decision": "approve"})
        assert approved.status_code == 201, approved.text
        while (view := await ops.show(temporal, view.operation)).phase in ("AwaitingApproval", "WaitingForCapacity"):
            assert time.monotonic() < deadline + 60, view.history
            await asyncio.sleep(1)
        assert view.approver == "hub:user:dev", view.history
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0
    # Ctrl-C leaves nothing running: no process of the dev environment survives.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "dev")], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
