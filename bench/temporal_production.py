"""A production-shaped Temporal: the 200-at-once scenario with worker replicas, one SIGKILLed mid-run.

    bench/build-temporal-server.sh                      # once: the server and its SQL tool, cached by version
    .venv/bin/python -m bench.temporal_production [--pods 200] [--replicas 3] [--kill-after-seconds 15]

Starts PostgreSQL (Debian's package, ``tests/hub/postgres.py``), sets up the ``temporal`` and
``temporal_visibility`` databases with the server's SQL schema tool and the module's versioned schema, and runs the
Temporal server built from the Go module proxy (all four services in one process, PostgreSQL persistence, SQL
visibility, loopback ports only). The ``default`` namespace is registered and the product's search attributes are
added through the operator service with the worker's own ``register_search_attributes`` (what a worker does at
start against ``temporal.mode=external``). Then the local control plane (as ``bench.burst_bench``), ``--replicas``
``kubeon-gpu worker`` processes on one task queue (each with the gateway in its process, as the burst bench runs
one), and ``--pods`` one-GPU Deployments at once under an Automatic policy over the sim provider. One replica is
SIGKILLed ``--kill-after-seconds`` after the first create (and restarted ``--restart-after-seconds`` later, as its
Deployment would). At the end every Deployment is deleted and every node must go home.

Printed: duplicate instances (a node launched twice), leaks (an instance not terminated at the end), workflow runs
per node and batch, pods bound and the time until all were, and the CPU seconds of each process (every worker
replica, the Temporal server, PostgreSQL with its backends). Exit status 1 when a check fails. Not part of
``make test``: the server build takes long (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client

from bench.burst_bench import BENCH_LABEL
from bench.burst_bench import Bench
from bench.burst_bench import count_actions
from bench.burst_bench import node_cidr_mask
from bench.burst_bench import sim_locations
from bench.burst_bench import tail
from bench.burst_bench import wait_worker_started
from bench.observe import ClusterObserver
from bench.observe import ProcessSampler
from bench.observe import Stopwatch
from bench.observe import children
from bench.observe import cpu_seconds
from bench.observe import machine_cpu
from bench.observe import utc_now
from models import search_attributes as sa
from models.converter import DATA_CONVERTER
from models.ids import operation_id
from models.labels import TAG_OPERATION
from tests.harness.burst import BurstStack
from tests.harness.burst import build_stack
from tests.harness.burst import worker_env
from tests.harness.controlplane import ControlPlane
from tests.harness.controlplane import free_port
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.processes import stop_process
from worker.config import Settings

TEMPORAL_SERVER_VERSION = "v1.32.0"  # as bench/build-temporal-server.sh builds by default
REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "default"


def say(clock: Stopwatch, message: str) -> None:
    print(f"[{clock.elapsed():7.1f}s] {message}", flush=True)


# -- the Temporal server's binaries, schema and configuration -------------------------------------------------------
@dataclass(frozen=True)
class TemporalBinaries:
    server: Path
    sql_tool: Path
    schema: Path  # schema/postgresql/v12 of the server's module: temporal/ and visibility/

    @classmethod
    def find(cls, version: str) -> TemporalBinaries:
        cache = Path(os.environ.get("KUBEON_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME")
                                                                or Path.home() / ".cache") / "kubeon-gpu")
        where = Path(os.environ.get("KUBEON_BIN_DIR") or cache / "bin")
        found = cls(where / f"temporal-server-{version}", where / f"temporal-sql-tool-{version}",
                    where / f"temporal-schema-{version}")
        if not (found.server.exists() and found.sql_tool.exists() and found.schema.is_dir()):
            raise SystemExit(f"the Temporal server {version} is not built in {where}: run "
                             f"TEMPORAL_SERVER_VERSION={version} bench/build-temporal-server.sh")
        return found


def setup_schema(bins: TemporalBinaries, pg_port: int, log: Path) -> None:
    """The two databases, each at the schema's version 0.0 then updated through the module's versioned dirs (as
    Temporal's own auto-setup does)."""
    common = [str(bins.sql_tool), "--ep", "127.0.0.1", "-p", str(pg_port), "-u", "postgres", "--pl", "postgres12"]
    with log.open("ab") as out:
        for db, schema_dir in (("temporal", "temporal"), ("temporal_visibility", "visibility")):
            for command in (["create-database"], ["setup-schema", "-v", "0.0"],
                            ["update-schema", "-d", str(bins.schema / schema_dir / "versioned")]):
                done = subprocess.run([*common, "--db", db, *command], stdout=out, stderr=subprocess.STDOUT,
                                      timeout=300, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"temporal-sql-tool {' '.join(command)} on {db} failed "
                                       f"({done.returncode}):\n{tail(log)}")


def server_config(pg_port: int, ports: dict[str, tuple[int, int]], http_port: int, shards: int) -> str:
    """PostgreSQL persistence and SQL visibility, the four services in one process on loopback ports."""
    def store(db: str, conns: int) -> str:
        return (f"      sql:\n        pluginName: postgres12\n        databaseName: {db}\n"
                f"        connectAddr: 127.0.0.1:{pg_port}\n        connectProtocol: tcp\n        user: postgres\n"
                f"        password: \"\"\n        maxConns: {conns}\n        maxIdleConns: {conns}\n"
                "        maxConnLifetime: 1h\n")

    services = "".join(
        f"  {name}:\n    rpc:\n      grpcPort: {grpc}\n      membershipPort: {member}\n      bindOnLocalHost: true\n"
        + (f"      httpPort: {http_port}\n" if name == "frontend" else "")
        for name, (grpc, member) in ports.items())
    return (
        "log:\n  stdout: true\n  level: warn\n"
        f"persistence:\n  defaultStore: default\n  visibilityStore: visibility\n  numHistoryShards: {shards}\n"
        "  datastores:\n    default:\n" + store("temporal", 20) + "    visibility:\n" + store("temporal_visibility", 10)
        + "global:\n  membership:\n    maxJoinDuration: 30s\n    broadcastAddress: 127.0.0.1\n"
        "services:\n" + services
        + "clusterMetadata:\n  enableGlobalNamespace: false\n  failoverVersionIncrement: 10\n"
        "  masterClusterName: active\n  currentClusterName: active\n  clusterInformation:\n    active:\n"
        f"      enabled: true\n      initialFailoverVersion: 1\n      rpcName: frontend\n"
        f"      rpcAddress: 127.0.0.1:{ports['frontend'][0]}\n"
        "dcRedirectionPolicy:\n  policy: noop\n")


async def connect_when_up(address: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> Client:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the Temporal server exited ({proc.returncode}):\n{tail(log)}")
        try:
            return await Client.connect(address, namespace=NAMESPACE, data_converter=DATA_CONVERTER)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def prepare_namespace(temporal: Client, timeout: float) -> list[str]:
    """Register ``default`` (1 day's retention), add the product's search attributes as a worker does at start
    (``register_search_attributes``, the operator service), and wait until visibility queries accept them. Returns
    the custom search attributes the server lists."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
    from temporalio.service import RPCError

    from worker.runtime import register_search_attributes

    deadline = time.monotonic() + timeout
    request = RegisterNamespaceRequest(namespace=NAMESPACE)
    request.workflow_execution_retention_period.FromTimedelta(timedelta(days=1))
    while True:  # the frontend answers before the namespace handler can write (its membership settling)
        try:
            await temporal.workflow_service.register_namespace(request)
            break
        except RPCError as exc:
            if "already" in str(exc).lower():
                break
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)
    while True:  # the frontend's namespace cache, then the search attributes' aliases in it
        try:
            await register_search_attributes(temporal)
            await temporal.count_workflows(f"{sa.CLUSTER.name} = 'none' AND {sa.USD_PER_HOUR.name} > 0")
            break
        except RPCError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)
    listed = await temporal.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=NAMESPACE))
    return sorted(k for k in listed.custom_attributes if k.startswith("Kubeon"))


def spawn_logged(argv: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[bytes]:
    """``argv`` in a process group of its own, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                env=env, start_new_session=True)


# -- the worker replicas --------------------------------------------------------------------------------------------
@dataclass
class Replica:
    index: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    cpu_before: float = 0.0  # CPU seconds of its earlier processes (a killed one, read just before the kill)
    starts: int = 0

    def cpu(self) -> float:
        now = cpu_seconds(self.proc.pid) if self.proc is not None else None
        return self.cpu_before + (now or 0.0)


@dataclass
class Replicas:
    settings: Settings
    stack: BurstStack
    workdir: Path
    env: dict[str, str]
    members: list[Replica] = field(default_factory=list)

    def spawn(self, replica: Replica) -> subprocess.Popen[bytes]:
        # kubeon-gpu worker with the gateway in its process; the replicas' sim providers share one state file,
        # which the sim locks across processes.
        replica.proc = spawn_logged([sys.executable, "-m", "tests.harness.inproc_worker"], replica.log,
                                    REPO, worker_env(self.settings, {**self.stack.gateway_env(), **self.env}))
        replica.starts += 1
        return replica.proc

    async def start(self, replica: Replica) -> None:
        if replica.log.exists():  # a restart: its own log, so "worker started" is this start's
            replica.log.rename(replica.log.with_suffix(f".before-restart-{replica.starts}.log"))
        await wait_worker_started(self.spawn(replica), replica.log, timeout=180)

    async def start_all(self, count: int) -> None:
        self.members = [Replica(i, self.workdir / f"worker-{i}.log") for i in range(count)]
        await asyncio.gather(*(self.start(r) for r in self.members))

    def kill(self, replica: Replica) -> None:
        assert replica.proc is not None
        replica.cpu_before = replica.cpu()
        os.killpg(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait(timeout=10)
        replica.proc = None

    def stop_all(self) -> None:
        for r in self.members:
            if r.proc is not None and r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGTERM)
        for r in self.members:
            if r.proc is None:
                continue
            try:
                r.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait(timeout=10)


# -- measuring ------------------------------------------------------------------------------------------------------
def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid``, of its children it has reaped and of its live descendants (PostgreSQL's
    postmaster and its backends)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    own = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return own + sum(tree_cpu_seconds(child) for child in children(pid))


@dataclass
class CpuMeter:
    """CPU seconds of each process of the run, read at marks."""

    replicas: Replicas
    temporal_pid: int
    postgres_pid: int
    marks: dict[str, dict[str, float]] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        row = {f"worker {r.index}": r.cpu() for r in self.replicas.members}
        row["Temporal server"] = cpu_seconds(self.temporal_pid) or 0.0
        row["PostgreSQL"] = tree_cpu_seconds(self.postgres_pid)
        row["machine busy"], row["machine all"] = machine_cpu()
        self.marks[name] = row

    def between(self, start: str, end: str) -> dict[str, float]:
        return {k: self.marks[end][k] - self.marks[start].get(k, 0.0) for k in self.marks[end]}


async def node_runs(temporal: Client, cluster: str) -> dict[str, list[str]]:
    """node workflow ID -> its run IDs (one each when every node ran once)."""
    runs: dict[str, list[str]] = {}
    query = f"{sa.CLUSTER.name} = '{cluster}' AND {sa.OPERATION_KIND.name} = 'Burst'"
    async for wf in temporal.list_workflows(query, limit=100_000):
        runs.setdefault(wf.id, []).append(wf.run_id)
    return runs


async def retried(temporal: Client, cluster: str) -> Counter[str]:
    """What the kill cost in the histories: activity attempts after the first, by type and why the one before
    ended (a start-to-close or heartbeat timeout when its worker died), and workflow tasks that timed out."""
    from temporalio.api.enums.v1 import EventType

    out: Counter[str] = Counter()
    async for wf in temporal.list_workflows(f"{sa.CLUSTER.name} = '{cluster}'", limit=100_000):
        events = (await temporal.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()).events
        kinds = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in events}
        for e in events:
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                out["workflow task timed out"] += 1
            started = e.activity_task_started_event_attributes
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and started.attempt > 1:
                out[f"{kinds.get(started.scheduled_event_id)} attempt {started.attempt} after "
                    f"'{started.last_failure.message[:60]}'"] += 1
    return out


def batch_of(workflow_id: str) -> str:
    """The batch of a node workflow ID (``burst/<cluster>/<policy>/<batch>-<index>``)."""
    return workflow_id.rsplit("/", 1)[1].rsplit("-", 1)[0]


def workdir_logs(replica: Replica) -> list[Path]:
    """The logs of a replica's processes: its own and those of its starts before a kill."""
    return sorted(replica.log.parent.glob(replica.log.stem + ".*log"))


def sim_instances(settings: Settings) -> dict[str, dict[str, Any]]:
    import json

    path = settings.state_dir / "sim-instances.json"
    data: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    return data


# -- the scenario ---------------------------------------------------------------------------------------------------
async def kill_and_restart(b: Bench, replicas: Replicas, args: argparse.Namespace, bound: Any,
                           events: list[str]) -> None:
    await asyncio.sleep(args.kill_after_seconds)
    victim = replicas.members[-1]
    replicas.kill(victim)
    events.append(f"SIGKILL worker {victim.index} at {args.kill_after_seconds:.0f}s after the first create "
                  f"({bound()} of {args.pods} bound then)")
    b.say(events[-1])
    if args.restart_after_seconds < 0:
        return
    await asyncio.sleep(args.restart_after_seconds)
    t = time.monotonic()
    await replicas.start(victim)
    events.append(f"worker {victim.index} restarted {args.restart_after_seconds:.0f}s after its kill, serving "
                  f"{time.monotonic() - t:.1f}s later")
    b.say(events[-1])


def cpu_lines(meter: CpuMeter, end: str) -> list[str]:
    cpu = meter.between("start", end)
    return [*[f"    {k:<18} {v:7.1f}" for k, v in cpu.items() if not k.startswith("machine")],
            f"    {'machine busy':<18} {cpu['machine busy']:7.1f} of {cpu['machine all']:.1f} available "
            f"({os.cpu_count()} CPUs)"]


async def scenario(b: Bench, replicas: Replicas, meter: CpuMeter, args: argparse.Namespace) -> bool:
    """The figures go to ``b.lines`` as they are known: a run stopped early prints what it had."""
    n, policy = args.pods, f"bench-{b.run}"
    b.create_policy(policy)
    ns = b.cluster.create_namespace("bench-prod")
    names = [f"load-{i}" for i in range(n)]
    loop = asyncio.get_running_loop()
    b.lines.append(f"{n} one-GPU Deployments at once, {len(replicas.members)} worker replicas, Temporal "
                   f"{args.temporal_version} on PostgreSQL ({args.history_shards} history shards, SQL visibility)")

    def bound() -> int:
        return sum(1 for p in b.observer.pods_snapshot()
                   if p.namespace == ns and p.scheduled_seen is not None and not p.deleted)

    def left() -> int:
        return sum(1 for v in b.observer.nodes_snapshot().values() if v.deleted_seen is None)

    shown = [0.0]

    def progress(done: bool, text: Callable[[], str]) -> bool:
        if done or time.monotonic() - shown[0] > 5:
            shown[0] = time.monotonic()
            b.say(f"  {text()}")
        return done

    meter.mark("start")
    started, t0, events = utc_now(), time.monotonic(), list[str]()
    killer = asyncio.create_task(kill_and_restart(b, replicas, args, bound, events))
    await asyncio.gather(*(loop.run_in_executor(b.pool, b.create, ns, name) for name in names))
    b.say(f"{n} Deployments created in {time.monotonic() - t0:.1f}s")
    ok_bound = await b.until(lambda: progress(bound() >= n, lambda: f"bound {bound()}/{n}, burst nodes {left()}"),
                             args.deadline, f"all {n} bound")
    to_bound = time.monotonic() - t0
    meter.mark("bound")
    pods = [p for p in b.observer.pods_snapshot() if p.namespace == ns]
    all_bound_pods = len([p for p in pods if p.scheduled_seen is not None])
    b.lines += [f"  all bound                      {'yes' if ok_bound else 'NO'}: {all_bound_pods}/{n} after "
                f"{to_bound:.1f}s (from the first create)", "  CPU seconds, first create -> all bound:",
                *cpu_lines(meter, "bound")]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(killer, timeout=max(0.0, args.kill_after_seconds + args.restart_after_seconds
                                                   + 200 - (time.monotonic() - t0)))
    b.lines[1:1] = [f"  {e}" for e in events]
    view = await b.state(policy)
    nodes = b.observer.nodes_snapshot()
    spare = [k for k in nodes if k not in {p.node_name for p in pods if p.node_name}]
    t1 = time.monotonic()
    await asyncio.gather(*(loop.run_in_executor(b.pool, b.cluster.admin.apps.delete_namespaced_deployment, name, ns)
                           for name in names))
    ok_home = await b.until(lambda: progress(left() == 0, lambda: f"deleted; burst nodes left {left()}"),
                            args.deadline, "every node home")
    home = time.monotonic() - t1
    await b.nodes_closed(min(120.0, args.deadline))
    meter.mark("end")
    b.lines += [f"  nodes launched                 {len(nodes)} ({len(spare)} spare: no pod ever bound); all home "
                f"{'yes' if ok_home else 'NO'} {home:.1f}s after the deletion",
                "  CPU seconds, first create -> all home and their workflows closed:", *cpu_lines(meter, "end")]

    # Checks: instances against node workflow runs, runs per workflow, batches.
    instances = sim_instances(b.settings)
    by_operation = Counter(str(r["tags"].get(TAG_OPERATION)) for r in instances.values())
    by_node = Counter(str(r.get("node_name")) for r in instances.values())
    duplicates = sum(c - 1 for c in by_operation.values() if c > 1) + sum(c - 1 for c in by_node.values() if c > 1)
    leaks = [iid for iid, r in instances.items() if r["state"] != "terminated"]
    never_joined = [iid for iid, r in instances.items() if r.get("node_name") not in nodes]
    runs = await node_runs(b.temporal, b.settings.cluster)
    rerun = {wid: ids for wid, ids in runs.items() if len(ids) > 1}
    operations = {operation_id(wid, rid) for wid, ids in runs.items() for rid in ids}
    orphans = [op for op in by_operation if op not in operations]
    no_instance = [op for op in operations if op not in by_operation]
    batches = Counter(batch_of(wid) for wid in runs)
    # A batch planned once (one record a batch); each of its planned nodes started at most once (a planned node
    # whose pods went before the launch is left out), by that batch alone, and no node workflow of a batch that
    # the batch did not start. The view keeps the provisioning's last 20 batches.
    planned = Counter(bt.batch for bt in view.batches)
    started_in = Counter(wid for bt in view.batches for wid in bt.nodes)
    batch_faults = ([f"{k} planned {c} times" for k, c in planned.items() if c > 1]
                    + [f"{bt.batch}: {len(bt.nodes)} node starts for {len(bt.plan.new_nodes)} planned nodes"
                       for bt in view.batches if len(bt.nodes) > min(len(set(bt.nodes)), len(bt.plan.new_nodes))]
                    + [f"{wid} started by {c} batches" for wid, c in started_in.items() if c > 1]
                    + [f"{wid} not started by its batch" for wid in runs
                       if batch_of(wid) in planned and wid not in started_in])
    not_started = sum(len(bt.plan.new_nodes) - len(set(bt.nodes)) for bt in view.batches)
    actions = await count_actions(b, started)
    again = await retried(b.temporal, b.settings.cluster)
    verified = {r.index: sum(f.read_text(errors="replace").count(": verified")
                             for f in workdir_logs(r)) for r in replicas.members}
    ok = (ok_bound and ok_home and not duplicates and not leaks and not rerun and not orphans
          and not batch_faults and all_bound_pods == n)
    b.lines += [
        f"  sim instances                  {len(instances)}; duplicates {duplicates} (same operation or node "
        f"launched twice); leaks {len(leaks)} (not terminated at the end)"
        + (f": {', '.join(leaks[:5])}" if leaks else "") + f"; never joined {len(never_joined)}",
        f"  node workflows                 {len(runs)} in {len(batches)} batches; workflows run more than once "
        f"{len(rerun)}; instances of no node workflow run {len(orphans)}; runs that launched nothing "
        f"{len(no_instance)}",
        f"  batches                        {len(planned)} in the provisioning's view, {len(batches)} with node "
        f"workflows; faults {len(batch_faults)}" + (f": {'; '.join(batch_faults[:3])}" if batch_faults else "")
        + f" (a batch planned twice, a node started twice or outside its batch); planned nodes not started "
        f"{not_started} (their pods bound or gone before the launch)",
        f"  nodes verified by each replica {', '.join(f'worker {k}: {v}' for k, v in verified.items())} (its logs)",
        f"  Temporal                       {actions.runs} workflow runs, {actions.workflow_tasks} workflow tasks, "
        f"{actions.actions} actions ({actions.actions / n:.1f} per pod), {actions.events} history events",
        "  after the kill                 "
        + ("; ".join(f"{k}: {v}" for k, v in again.most_common(6)) or "nothing retried"),
        f"  checks                         {'PASS' if ok else 'FAIL'}",
    ]
    return ok


# -- set-up and tear-down -------------------------------------------------------------------------------------------
async def start_temporal(stack: contextlib.AsyncExitStack, bins: TemporalBinaries, workdir: Path, pg_port: int,
                         args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], Client]:
    names = ("frontend", "history", "matching", "worker")
    ports = {name: (free_port(), free_port()) for name in names}
    config = workdir / "temporal.yaml"
    config.write_text(server_config(pg_port, ports, free_port(), args.history_shards))
    log = workdir / "temporal.log"
    proc = spawn_logged([str(bins.server), "--config-file", str(config), "--allow-no-auth", "start",
                         *[a for name in names for a in ("--service", name)]], log, workdir)
    stack.callback(stop_process, proc, 30.0, group=True)
    temporal = await connect_when_up(f"127.0.0.1:{ports['frontend'][0]}", proc, log, timeout=120)
    return proc, temporal


async def main_async(args: argparse.Namespace) -> int:
    from tests.hub.postgres import PostgresServer

    bins = TemporalBinaries.find(args.temporal_version)
    clock, run, lines, ok = Stopwatch(), uuid.uuid4().hex[:6], list[str](), False
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-prod-temporal-"))
    say(clock, f"work directory {workdir}{' (kept)' if args.keep else ''}")
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, workdir, True)
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench")
        stack.callback(pool.shutdown, wait=False, cancel_futures=True)

        postgres = PostgresServer()
        stack.callback(postgres.stop)
        await loop.run_in_executor(pool, postgres.start)
        postmaster = next(pid for pid, name in children().items() if name == "postgres")
        await loop.run_in_executor(pool, setup_schema, bins, postgres.port, workdir / "schema.log")
        say(clock, f"PostgreSQL on 127.0.0.1:{postgres.port}, schema set up")
        server, temporal = await start_temporal(stack, bins, workdir, postgres.port, args)
        registered = await prepare_namespace(temporal, timeout=120)
        say(clock, f"Temporal {args.temporal_version} up; search attributes {', '.join(registered)}")

        plane = ControlPlane(workdir / "controlplane")
        stack.callback(plane.stop)
        await loop.run_in_executor(pool, plane.start)
        say(clock, f"control plane up in {plane.started_seconds:.1f}s")
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        cluster.create_kwok_node("home-cpu", gpus=0)  # the scheduler then wakes pending pods on node events
        burst = await loop.run_in_executor(pool, build_stack, cluster, workdir / "burst")
        queue = f"bench-{run}"
        settings = burst.settings(temporal_address=temporal.service_client.config.target_host, task_queue=queue,
                                  locations=sim_locations(args.capacity, args.boot_seconds), cluster_name=queue,
                                  serve_check_seconds=args.serve_check_seconds,
                                  join_timeout_seconds=args.join_timeout_seconds)
        observer = ClusterObserver(Kube.from_kubeconfig(plane.admin_kubeconfig).api,
                                   pod_selector=f"{BENCH_LABEL}={run}", node_selector="gpu.kubeon.io/operation")
        stack.callback(observer.start().stop)
        replicas = Replicas(settings, burst, workdir, {"KUBEON_GATEWAY_NODE_CIDR_MASK": str(node_cidr_mask(args.pods))})
        stack.callback(replicas.stop_all)
        await replicas.start_all(args.replicas)
        say(clock, f"{args.replicas} worker replicas serving task queue {queue}")
        first = replicas.members[0]
        assert first.proc is not None
        sampler = ProcessSampler(first.proc.pid)  # Bench's interface; the replicas' CPU is read by the meter
        b = Bench(args=args, clock=clock, run=run, cluster=cluster, temporal=temporal, settings=settings,
                  worker=first.proc, sampler=sampler, observer=observer, pool=pool, lines=lines)
        meter = CpuMeter(replicas, server.pid, postmaster)
        try:
            ok = await scenario(b, replicas, meter, args)
        finally:
            print("=" * 100)
            print(f"KubeOn on a production-shaped Temporal, sim boot {args.boot_seconds}s, {os.cpu_count()} CPU(s)")
            print("\n".join(lines) or "(no figures: the run stopped early; see above)")
            print("=" * 100, flush=True)
    for pid in children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.temporal_production", description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=200, help="one-GPU Deployments created at once")
    p.add_argument("--replicas", type=int, default=3, help="`kubeon-gpu worker` processes on the task queue")
    p.add_argument("--kill-after-seconds", type=float, default=15.0,
                   help="SIGKILL the last replica this long after the first create")
    p.add_argument("--restart-after-seconds", type=float, default=5.0,
                   help="start it again this long after the kill, as its Deployment would (negative: never)")
    p.add_argument("--join-timeout-seconds", type=int, default=120,
                   help="the worker's join_timeout_seconds (900 by default): a sim node boots and joins inside the "
                        "replica that launched it, so one killed mid-join never joins and goes home after this")
    p.add_argument("--temporal-version", default=TEMPORAL_SERVER_VERSION,
                   help="the server built by bench/build-temporal-server.sh")
    p.add_argument("--history-shards", type=int, default=4, help="the server's numHistoryShards")
    p.add_argument("--serve-check-seconds", type=int, default=1, help="the worker's serve_check_seconds")
    p.add_argument("--capacity", type=int, default=1000, help="simulated capacity of each sim location")
    p.add_argument("--boot-seconds", type=float, default=0.0, help="simulated boot delay of an instance")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds any one wait may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, the server's config)")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.pods < 1:
        p.error("--replicas and --pods must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
