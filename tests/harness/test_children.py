"""`make dev`'s process handling with real processes: bounded stop, children dying with the harness, the reaper,
the instance lock and the port check (the full `make dev` ended each way is in test_dev.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import dev
from tests.harness.children import Child
from tests.harness.children import Children
from tests.harness.children import InstanceLock
from tests.harness.children import busy_ports
from tests.harness.children import port_holder
from tests.harness.children import reap
from tests.harness.children import start_time
from tests.harness.controlplane import free_port

IGNORES_TERM = ("import signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\n"
                "time.sleep(120)\n")


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(start_time(p) is None for p in pids):
            return True
        time.sleep(0.05)
    return False


def _wait_ready(log: Path) -> None:
    deadline = time.monotonic() + 20
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    children = Children(tmp_path)
    proc = children.start("stubborn", [sys.executable, "-c", IGNORES_TERM], log=tmp_path / "stubborn.log")
    polite = children.start("polite", [sys.executable, "-c", "import time; time.sleep(120)"],
                            log=tmp_path / "polite.log")
    _wait_ready(tmp_path / "stubborn.log")
    recorded = json.loads((tmp_path / "children.json").read_text())
    assert [(c["name"], c["pid"]) for c in recorded["children"]] == [("stubborn", proc.pid), ("polite", polite.pid)]
    assert recorded["harness"] == os.getpid()

    t0 = time.monotonic()
    killed = children.stop_all(grace=1.0)
    assert killed == ["stubborn"]
    assert time.monotonic() - t0 < 5
    assert proc.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM


def test_a_second_signal_kills_at_once(tmp_path: Path) -> None:
    children = Children(tmp_path)
    children.start("stubborn", [sys.executable, "-c", IGNORES_TERM], log=tmp_path / "stubborn.log")
    _wait_ready(tmp_path / "stubborn.log")
    children.hurry = True
    t0 = time.monotonic()
    assert children.stop_all(grace=30) == ["stubborn"]
    assert time.monotonic() - t0 < 5


HARNESS = """
import sys, time
from pathlib import Path
from tests.harness.children import Children
children = Children(Path(sys.argv[1]))
argv = [sys.executable, "-c", "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"]
children.start("parent-of-one", argv, log=Path(sys.argv[1]) / "child.log")
print("started", flush=True)
time.sleep(120)
"""


def test_children_die_with_a_killed_harness_and_the_reaper_ends_what_is_left(tmp_path: Path) -> None:
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    try:
        assert harness.stdout is not None and harness.stdout.readline().strip() == "started"
        child = json.loads((tmp_path / "children.json").read_text())["children"][0]
        rec = Child(name=child["name"], pid=child["pid"], start=child["start"])
        deadline = time.monotonic() + 20
        while len(rec.group_members()) < 2:  # the child and its own child (a grandchild of the harness)
            assert time.monotonic() < deadline, rec.group_members()
            time.sleep(0.05)
        grandchild = next(p for p in rec.group_members() if p != rec.pid)
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait()
        # PR_SET_PDEATHSIG: the kernel kills the harness's own child at once...
        assert _gone([rec.pid], timeout=10)
        # ...not its grandchild: that one the next run's reaper finds by the recorded process group.
        assert start_time(grandchild) is not None
        assert reap(tmp_path, grace=2) == ["parent-of-one"]
        assert _gone([grandchild], timeout=5)
        assert reap(tmp_path) == []  # nothing left: nothing to do
    finally:
        if harness.poll() is None:
            harness.kill()
        harness.wait()


def test_reaper_leaves_a_process_that_reused_a_recorded_pid(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        start = start_time(other.pid)
        assert start is not None
        (tmp_path / "children.json").write_text(json.dumps(
            {"children": [{"name": "etcd", "pid": other.pid, "start": start + 1000}]}))
        assert reap(tmp_path, grace=1) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_instance_lock_names_the_running_pid(tmp_path: Path) -> None:
    first, second = InstanceLock(tmp_path / "dev"), InstanceLock(tmp_path / "dev")
    assert first.acquire() is None
    assert second.acquire() == os.getpid()
    first.release()
    assert second.acquire() is None
    second.release()


def test_a_busy_port_is_named_with_the_pid_holding_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_holder(port) == os.getpid()
        [problem] = busy_ports({"Temporal": port, "hub": free_port()})
        assert problem.startswith(f"port {port} (Temporal) is in use by pid {os.getpid()} (")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    workdir = tmp_path / "dev"
    workdir.mkdir()
    (workdir / "kubeconfig").write_text("the running one's")
    return workdir


def test_make_dev_next_to_a_running_one_fails_at_once_and_leaves_its_state(
        state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    running = InstanceLock(state)
    assert running.acquire() is None
    Children(state, ports={"Temporal": 7233, "hub": 8090}).record()
    try:
        t0 = time.monotonic()
        assert dev.main(["--dir", str(state), "--temporal-port", str(free_port()), "--ui-port", str(free_port()),
                         "--hub-port", str(free_port())]) == 1
        assert time.monotonic() - t0 < 5
    finally:
        running.release()
    out = capsys.readouterr().out
    assert f"another `make dev` (pid {os.getpid()}) is running" in out and "ports 7233 (Temporal), 8090 (hub)" in out
    assert (state / "kubeconfig").read_text() == "the running one's"


def test_make_dev_on_a_busy_port_fails_at_once_naming_port_and_pid(
        state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        assert dev.main(["--dir", str(state), "--temporal-port", str(free_port()), "--ui-port", str(free_port()),
                         "--hub-port", str(port)]) == 1
        assert time.monotonic() - t0 < 5
    out = capsys.readouterr().out
    assert f"port {port} (hub) is in use by pid {os.getpid()}" in out
    assert (state / "kubeconfig").read_text() == "the running one's"


def test_a_port_left_in_time_wait_by_a_killed_run_is_free() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn, Temporal, etcd... do
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection lingers in TIME_WAIT
        client.close()
    assert busy_ports({"hub": port}) == []
