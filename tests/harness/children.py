"""The processes `make dev` starts, so that no way of ending it leaves one behind.

- Every child goes through ``Children.start`` (or ``Children.popen``, for helpers such as ``ControlPlane`` that
  spawn their own): a process group of its own (a terminal's Ctrl-C reaches only the harness, which stops the
  children in order), ``PR_SET_PDEATHSIG`` so that the kernel kills it with SIGKILL when the harness dies however it
  dies (SIGKILL included), and its pid, process group and start time recorded in ``<state>/children.json``.
- ``stop_all`` ends them in reverse start order: SIGTERM to each group, then SIGKILL to what is left after a
  bounded grace (at once when ``hurry`` is set: a second Ctrl-C).
- ``reap`` ends what an earlier run recorded and left running (its harness was SIGKILLed before PDEATHSIG could
  reach a grandchild, say): only processes whose start time proves they are the ones recorded.
- ``InstanceLock`` (``flock`` on ``<state>.lock``, released by the kernel when the harness dies) keeps a second
  `make dev` away from a running one's state directory; ``port_holder`` names the process on a port.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import IO
from typing import Any
from typing import Final

PR_SET_PDEATHSIG: Final = 1
STATE_FILE: Final = "children.json"
GRACE_SECONDS: Final = 15.0  # SIGTERM to SIGKILL (kube-apiserver can take 20 s and more to exit on SIGTERM)

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGKILL when the parent (the harness) dies."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone or a
    zombie (a zombie holds no port and no file: it is dead for every purpose here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def alive(pid: int) -> bool:
    return start_time(pid) is not None


def wait_answering(proc: subprocess.Popen[Any], url: str, *, name: str, log: Callable[[], str],
                   timeout: float, interval: float = 0.1) -> None:
    """Until a GET of ``url`` answers; a RuntimeError with ``log()`` when ``proc`` (``name``) exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {log()}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).close()
            return
        time.sleep(interval)
    raise RuntimeError(f"{name} did not answer on {url} within {timeout}s: {log()}")


@dataclass
class Child:
    name: str
    pid: int
    start: int  # start time in clock ticks: a recycled pid has another one

    def running(self) -> bool:
        return start_time(self.pid) == self.start

    def group_members(self) -> list[int]:
        """Live processes of this child's group (its pid is the group id) that started no earlier than it: what
        it left behind, never an unrelated group that took the number after the whole group was gone."""
        return [p for p in process_group(self.pid) if (start_time(p) or 0) >= self.start]


def _signal_group(child: Child, signum: int) -> None:
    if child.running() or child.group_members():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signum)


def end(children: list[Child], *, grace: float = GRACE_SECONDS, hurry: Callable[[], bool] = lambda: False,
        reap: Callable[[], None] = lambda: None) -> list[str]:
    """SIGTERM every child's group, SIGKILL what is left after ``grace`` (or as soon as ``hurry()``); returns the
    names of those that had to be killed. ``reap`` collects exited children of this process meanwhile."""
    for child in reversed(children):
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        reap()
        if not any(c.running() or c.group_members() for c in children):
            return []
        time.sleep(0.1)
    killed = [c.name for c in children if c.running() or c.group_members()]
    for child in children:
        _signal_group(child, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(c.running() or c.group_members() for c in children):
        reap()
        time.sleep(0.05)
    return killed


@dataclass
class Children:
    """The registry of one `make dev` run, written to ``<state>/children.json`` at every start."""

    state: Path
    ports: dict[str, int] = field(default_factory=dict)
    hurry: bool = False  # a second Ctrl-C: kill at once
    _procs: list[tuple[Child, subprocess.Popen[Any]]] = field(default_factory=list)

    @property
    def file(self) -> Path:
        return self.state / STATE_FILE

    def start(self, name: str, argv: list[str], *, log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start a service of `make dev` with its output in ``log``: the one way every service is started."""
        with open(log, "ab") as out:
            return self.popen(argv, name=name, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def popen(self, argv: list[str], *, name: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` for helpers that spawn their own processes (``ControlPlane(popen=...)``)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs["start_new_session"] = True
        kwargs["preexec_fn"] = _die_with_parent
        proc = subprocess.Popen(argv, **kwargs)
        started = start_time(proc.pid)
        child = Child(name=name or Path(argv[0]).name, pid=proc.pid, start=started or 0)
        self._procs.append((child, proc))
        self.record()
        return proc

    @property
    def children(self) -> list[Child]:
        return [c for c, _ in self._procs]

    def record(self) -> None:
        doc = {"harness": os.getpid(), "harness_start": start_time(os.getpid()), "ports": self.ports,
               "children": [{"name": c.name, "pid": c.pid, "start": c.start} for c in self.children]}
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.file)

    def stop_all(self, grace: float = GRACE_SECONDS, *, keep: Collection[int] = ()) -> list[str]:
        """End every child (reverse start order) but those whose pid is in ``keep`` (stopped by their owner in the
        order they need, e.g. the control plane's), bounded; returns the names that needed SIGKILL."""
        procs = [(c, p) for c, p in self._procs if c.pid not in keep]

        def reap() -> None:
            for _, proc in procs:
                proc.poll()

        killed = end([c for c, _ in procs], grace=grace, hurry=lambda: self.hurry, reap=reap)
        for _, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        return killed


def recorded(state: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads((state / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc


def reap(state: Path, grace: float = 10.0) -> list[str]:
    """End the children an earlier run recorded in ``state`` and left running; returns their names."""
    doc = recorded(state)
    children = [Child(name=c["name"], pid=int(c["pid"]), start=int(c["start"])) for c in doc.get("children", [])]
    left = [c for c in children if c.running() or c.group_members()]
    if left:
        end(left, grace=grace)
    return [c.name for c in left]


class InstanceLock:
    """An exclusive ``flock`` on ``<state>.lock`` holding the owner's pid: one `make dev` per state directory."""

    def __init__(self, state: Path) -> None:
        self.path = state.parent / f"{state.name}.lock"
        self._file: IO[str] | None = None

    def acquire(self) -> int | None:
        """Take the lock; None on success, else the pid of the holder (0 when it cannot be read)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held for the life of the harness
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            handle.seek(0)
            text = handle.read().strip()
            handle.close()
            return int(text) if text.isdigit() else 0
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._file = handle
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                local, state, inode = parts[1], parts[3], parts[9]
                if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":  # LISTEN
                    inodes.add(inode)
    return inodes


def _socket_owners(inodes: set[str]) -> Iterator[int]:
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in targets:
                        yield int(entry.name)
                        break


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could not listen on the port. SO_REUSEADDR as the servers set it: connections of a killed
    run lingering in TIME_WAIT do not hold the port, a listening socket does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_holder(port: int) -> int | None:
    """The pid of a process listening on TCP ``port`` (the lowest, when several share it), or None."""
    owners = sorted(set(_socket_owners(_listening_inodes(port))))
    return owners[0] if owners else None


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def busy_ports(ports: dict[str, int]) -> list[str]:
    """A sentence per port of ``ports`` (what -> port) that something holds, naming the process."""
    problems = []
    for what, port in ports.items():
        if port_in_use(port):
            pid = port_holder(port)
            who = f"pid {pid} ({process_name(pid)})" if pid else "a process this user cannot see"
            problems.append(f"port {port} ({what}) is in use by {who}")
    return problems
