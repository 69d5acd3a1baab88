"""Burst benchmark: the sim provider on the local control plane, the worker as its own process.

    .venv/bin/python -m bench.burst_bench [--ops 200] [--latency-samples 20]

Starts a real control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok) and a Temporal dev
server in a temporary directory, runs ``kubeon-gpu worker`` as a subprocess, and measures

1. pod Unschedulable -> its BurstWorkflow started,
2. burst Node Ready -> the operation's ``verified`` step,
3. N concurrent operations: wall time until all are Serving (and all Completed after their workloads are
   deleted) and the worker's peak memory.

Everything it starts is stopped at the end; see bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from bench.observe import (
    AuditView,
    ClusterObserver,
    NodeSeen,
    PodSeen,
    ProcessSampler,
    Stopwatch,
    children,
    cpu_seconds,
    percentile,
    read_audit,
    seconds_between,
    utc_now,
)
from models import search_attributes as sa
from models.converter import DATA_CONVERTER
from models.operation import (
    TERMINAL_PHASES,
    BurstResult,
    OperationView,
    Phase,
    burst_workflow_id,
    ledger_workflow_id,
)
from tests.harness.burst import SIM_LOCATIONS, BurstStack, build_stack, gpu_deployment, worker_process
from tests.harness.controlplane import ControlPlane, free_port
from tests.harness.kube import Cluster, Kube
from tests.harness.otlp import OtlpReceiver
from tests.harness.temporal import dev_server_path
from worker.config import Settings

T = TypeVar("T")
BENCH_LABEL = "kubeon-bench/run"
POLICY_LOCATIONS = ["sim/eu-west", "sim/us-west"]
PHASES_SHOWN = [Phase.PLANNING, Phase.WAITING_FOR_CAPACITY, Phase.LAUNCHING, Phase.JOINING, Phase.VERIFYING,
                Phase.SERVING, Phase.DRAINING, Phase.COMPLETED, Phase.FAILED]


def log(clock: Stopwatch, message: str) -> None:
    print(f"[{clock.elapsed():7.1f}s] {message}", flush=True)


# -- per-operation timings -------------------------------------------------------------------------------------------
@dataclass
class OpTimes:
    namespace: str
    deployment: str
    workflow_id: str
    operation: str = ""  # the latest run's (a pod left without a node gets a new run of the same workflow ID)
    operations: set[str] = field(default_factory=set)  # every run's
    runs: int = 0
    node_name: str = ""
    unschedulable_seen: datetime | None = None  # the benchmark's pod watch saw PodScheduled=False/Unschedulable
    unschedulable_cond: datetime | None = None  # that condition's lastTransitionTime (1 s resolution)
    workflow_start: datetime | None = None  # Temporal's start time of the BurstWorkflow (its first run)
    ready_seen: datetime | None = None  # the benchmark's node watch saw Ready=True
    ready_cond: datetime | None = None  # Ready's lastTransitionTime (kwok sets the node's creation time)
    scheduled_seen: datetime | None = None  # the benchmark's pod watch saw the pod bound to a node
    joined: datetime | None = None  # audit "joined"
    verified: datetime | None = None  # audit "verified" (the workflow turns Serving right after)
    closed: datetime | None = None
    final: str = ""

    def fill(self, pods: dict[tuple[str, str], PodSeen], nodes: dict[str, NodeSeen], audit: AuditView) -> None:
        pod = pods.get((self.namespace, self.deployment))
        if pod is not None:
            self.unschedulable_seen, self.unschedulable_cond = pod.unschedulable_seen, pod.unschedulable_cond
            self.scheduled_seen = pod.scheduled_seen
        if self.operation:
            self.node_name = self.node_name or f"burst-{self.operation}"
            self.joined = audit.get(self.operation, "joined")
            self.verified = audit.get(self.operation, "verified")
        node = nodes.get(self.node_name)
        if node is not None:
            self.ready_seen, self.ready_cond = node.ready_seen, node.ready_cond


def pods_by_app(pods: Iterable[PodSeen]) -> dict[tuple[str, str], PodSeen]:
    """The first pod of each deployment (one replica each) that was seen Unschedulable."""
    out: dict[tuple[str, str], PodSeen] = {}
    for p in pods:
        key = (p.namespace, p.app)
        best = out.get(key)
        if best is None or (p.unschedulable_seen and (best.unschedulable_seen is None
                                                       or p.unschedulable_seen < best.unschedulable_seen)):
            out[key] = p
    return out


@dataclass
class Series:
    label: str
    values: list[float]

    def row(self) -> str:
        p50, p95 = percentile(self.values, 50), percentile(self.values, 95)
        return (f"  {self.label:<66} {len(self.values):>4}  {fmt_s(p50):>9}  {fmt_s(p95):>9}  "
                f"{fmt_s(max(self.values) if self.values else math.nan):>9}")


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.3f}s"


def series(label: str, ops: list[OpTimes], start: Callable[[OpTimes], datetime | None],
           end: Callable[[OpTimes], datetime | None]) -> Series:
    vals = [d for o in ops if (d := seconds_between(start(o), end(o))) is not None]
    return Series(label, vals)


def latency_series(ops: list[OpTimes], tag: str) -> tuple[list[Series], list[Series]]:
    first = [
        series(f"{tag}: bench watch saw Unschedulable -> workflow start", ops,
               lambda o: o.unschedulable_seen, lambda o: o.workflow_start),
        series(f"{tag}: condition lastTransitionTime -> workflow start", ops,
               lambda o: o.unschedulable_cond, lambda o: o.workflow_start),
    ]
    second = [
        series(f"{tag}: bench watch saw Ready -> audit verified", ops, lambda o: o.ready_seen, lambda o: o.verified),
        series(f"{tag}: Ready lastTransitionTime -> audit verified", ops, lambda o: o.ready_cond,
               lambda o: o.verified),
        series(f"{tag}:   of which bench watch saw Ready -> audit joined", ops, lambda o: o.ready_seen,
               lambda o: o.joined),
        series(f"{tag}:   of which audit joined -> audit verified", ops, lambda o: o.joined, lambda o: o.verified),
        series(f"{tag}:   (bench watch saw Ready -> saw the pod bound to a node)", ops, lambda o: o.ready_seen,
               lambda o: o.scheduled_seen),
    ]
    return first, second


# -- the benchmark ---------------------------------------------------------------------------------------------------
@dataclass
class ScaleOutcome:
    ops: int
    created_s: float = math.nan
    reached_serving: int = 0
    withdrawn: int = 0
    failed: int = 0
    serving_wall_s: float | None = None  # creation of the first workload -> the last operation verified
    settled_wall_s: float | None = None  # ... -> the last operation verified, withdrawn or failed
    placement: Placement | None = None
    milestones: dict[int, float] = field(default_factory=dict)  # percent of ops -> seconds
    serving_note: str = ""
    completed: int = 0
    closed: int = 0
    completed_wall_s: float | None = None  # deletion of the workloads -> the last workflow closed
    completion_note: str = ""
    runs: int = 0  # workflow runs (a workflow ID started again for a pod its earlier run left without a node)
    stranded: list[str] = field(default_factory=list)  # why the pods left pending are pending
    diagnosis: list[str] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    records: list[OpTimes] = field(default_factory=list)


@dataclass
class Bench:
    args: argparse.Namespace
    clock: Stopwatch
    workdir: Path
    run: str
    cluster: Cluster
    stack: BurstStack
    temporal: Client
    settings: Settings
    worker: subprocess.Popen[bytes]
    worker_log: Path
    temporal_log: Path
    sampler: ProcessSampler
    observer: ClusterObserver
    pool: ThreadPoolExecutor
    audit_file: Path
    idle_rss_kib: int = 0
    latency_records: list[OpTimes] = field(default_factory=list)
    latency_note: str = ""
    latency_completion: list[float] = field(default_factory=list)
    scale: ScaleOutcome | None = None
    telemetry: Telemetry | None = None

    def say(self, message: str) -> None:
        log(self.clock, message)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_worker(self) -> None:
        if self.worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {self.worker.returncode}:\n{tail(self.worker_log)}")

    # -- kubernetes helpers --------------------------------------------------------------------------------------
    def create_namespace(self, prefix: str) -> str:
        return self.cluster.create_namespace(prefix)

    def create_deployment(self, namespace: str, name: str) -> None:
        dep = gpu_deployment(name)
        assert dep.spec is not None and dep.spec.template.metadata is not None
        dep.spec.template.metadata.labels = {**(dep.spec.template.metadata.labels or {}), BENCH_LABEL: self.run}
        self.cluster.admin.apps.create_namespaced_deployment(namespace, dep)

    def delete_deployment(self, namespace: str, name: str) -> None:
        try:
            self.cluster.admin.apps.delete_namespaced_deployment(name, namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    # -- temporal helpers ----------------------------------------------------------------------------------------
    def query(self, policy: str, extra: str = "") -> str:
        q = f"WorkflowType = 'BurstWorkflow' AND {sa.POLICY.name} = '{policy}'"
        return q + (f" AND {extra}" if extra else "")

    async def count(self, policy: str, extra: str = "") -> int:
        return (await self.temporal.count_workflows(self.query(policy, extra))).count

    async def last_close(self, policy: str) -> datetime | None:
        """When the last of the policy's workflows closed (every run, also the further nodes' derived IDs)."""
        last = None
        async for wf in self.temporal.list_workflows(self.query(policy, "ExecutionStatus != 'Running'")):
            if wf.close_time is not None and (last is None or wf.close_time > last):
                last = wf.close_time
        return last

    async def phase_counts(self, policy: str) -> dict[Phase, int]:
        counts = await asyncio.gather(*(self.count(policy, f"{sa.PHASE.name} = '{p.value}' AND "
                                                           "ExecutionStatus = 'Running'"
                                                   if p not in TERMINAL_PHASES else f"{sa.PHASE.name} = '{p.value}'")
                                        for p in PHASES_SHOWN))
        return dict(zip(PHASES_SHOWN, counts, strict=True))


@dataclass
class Telemetry:
    """--telemetry on: spans exported over OTLP/HTTP to a receiver on loopback, JSON logs, and /metrics scraped
    every 15 s as Prometheus would. Off: no exporter, text logs, no scrape (the worker still counts its metrics)."""

    receiver: Any
    metrics_url: str
    scrapes: int = 0
    failed: int = 0
    scrape_bytes: int = 0
    scrape_seconds: list[float] = field(default_factory=list)

    async def scrape_loop(self, loop: asyncio.AbstractEventLoop, pool: ThreadPoolExecutor) -> None:
        import httpx

        while True:
            started = time.monotonic()
            try:
                response = await loop.run_in_executor(pool, lambda: httpx.get(self.metrics_url, timeout=30))
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                self.scrapes += 1
                self.scrape_bytes = len(response.content)
                self.scrape_seconds.append(time.monotonic() - started)
            else:
                self.failed += 1
            await asyncio.sleep(15)

    def line(self) -> str:
        spans = len(self.receiver.snapshot())
        took = (f", p50 {percentile(self.scrape_seconds, 50):.2f}s max {max(self.scrape_seconds):.2f}s"
                if self.scrape_seconds else "")
        return (f"on: {spans} spans received in {self.receiver.requests} OTLP/HTTP requests; /metrics scraped "
                f"{self.scrapes} times, {self.failed} failed ({self.scrape_bytes / 1024:.0f} KiB{took}); JSON logs")


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


def sim_locations(capacity: int, boot_seconds: float) -> list[dict[str, Any]]:
    locations = copy.deepcopy(SIM_LOCATIONS)
    for loc in locations:
        loc["sim"] = {"capacity": capacity, "bootSeconds": boot_seconds}
    return locations


async def wait_view(temporal: Client, workflow_id: str, want: set[Phase], deadline: float) -> OperationView | None:
    handle = temporal.get_workflow_handle(workflow_id)
    last: OperationView | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # not started yet
            last = await handle.query("state", result_type=OperationView)
        if last is not None and (last.phase in want or last.phase in TERMINAL_PHASES):
            return last
        await asyncio.sleep(0.1)
    return last


# -- scenario 1+2: latency of single operations on an otherwise idle system ------------------------------------------
async def latency_scenario(b: Bench, samples: int) -> None:
    if samples <= 0:
        return
    policy = f"bench-lat-{b.run}"
    b.stack.create_policy(policy, mode="Automatic", locations=POLICY_LOCATIONS, max_nodes=1000, max_gpu_hour=100.0)
    ns = await b.blocking(b.create_namespace, "lat")
    phase_deadline = time.monotonic() + b.args.latency_budget
    b.say(f"latency: {samples} operations one after another (policy {policy}, namespace {ns})")
    try:
        for i in range(samples):
            if time.monotonic() > phase_deadline:
                b.latency_note = (f"stopped after {i} of {samples} samples: the latency budget of "
                                  f"{b.args.latency_budget:.0f}s was used up")
                b.say(b.latency_note)
                break
            b.check_worker()
            name = f"lat-{i:03d}"
            rec = OpTimes(namespace=ns, deployment=name,
                          workflow_id=burst_workflow_id(b.settings.cluster, policy, f"{ns}/Deployment/{name}"))
            await b.blocking(b.create_deployment, ns, name)
            view = await wait_view(b.temporal, rec.workflow_id, {Phase.SERVING},
                                   min(phase_deadline + 60, time.monotonic() + b.args.sample_timeout))
            if view is None or view.phase != Phase.SERVING:
                b.say(f"  sample {i}: did not reach Serving within {b.args.sample_timeout:.0f}s "
                      f"(last: {view.phase.value if view else 'not started'}; {view.history[-3:] if view else ''})")
                rec.final = view.phase.value if view else "not started"
                await b.blocking(b.delete_deployment, ns, name)
                b.latency_records.append(rec)
                continue
            handle = b.temporal.get_workflow_handle(rec.workflow_id, result_type=BurstResult)
            desc = await handle.describe()
            rec.workflow_start, rec.operation, rec.node_name = desc.start_time, view.operation, view.node_name or ""
            deleted = utc_now()
            await b.blocking(b.delete_deployment, ns, name)
            try:
                res = await asyncio.wait_for(handle.result(), b.args.sample_timeout)
                rec.final = res.phase.value
                rec.closed = (await handle.describe()).close_time
                if (d := seconds_between(deleted, rec.closed)) is not None:
                    b.latency_completion.append(d)
            except TimeoutError:
                rec.final = "still running"
            await asyncio.sleep(0.3)  # let the node deletion events arrive before the next sample
            rec.fill(pods_by_app(b.observer.pods_snapshot()), b.observer.nodes_snapshot(), read_audit(b.audit_file))
            b.latency_records.append(rec)
            b.say(f"  sample {i + 1}/{samples}: Unschedulable->start "
                  f"{fmt_s(seconds_between(rec.unschedulable_seen, rec.workflow_start))}, Ready->verified "
                  f"{fmt_s(seconds_between(rec.ready_seen, rec.verified))}, {rec.final}")
    finally:
        b.stack.delete_policy(policy)
    b.sampler.sample()
    b.say(f"latency: done; worker RSS {b.sampler.mib(b.sampler.last_rss_kib):.0f} MiB")


# -- scenario 3: N concurrent operations -----------------------------------------------------------------------------
Check = Callable[[], Awaitable[tuple[bool, str, tuple[int, ...]]]]


HUNG = "the worker used no CPU"


async def progress_loop(b: Bench, what: str, done: Check, deadline_s: float, stall_s: float) -> str:
    """Print a line every --progress seconds until ``done`` says so; "" when done, else why it stopped."""
    start = time.monotonic()
    last_change, last_key = time.monotonic(), None
    cpu0, t0 = cpu_seconds(b.worker.pid) or 0.0, time.monotonic()
    idle_since: float | None = None
    while True:
        b.check_worker()
        finished, line, key = await done()
        cpu1, t1 = cpu_seconds(b.worker.pid) or cpu0, time.monotonic()
        b.sampler.sample()
        cpu_pct = 100 * (cpu1 - cpu0) / max(t1 - t0, 1e-3)
        cpu0, t0 = cpu1, t1
        b.say(f"{what}: {line} | worker RSS {b.sampler.mib(b.sampler.last_rss_kib):.0f} MiB, CPU {cpu_pct:.0f}%")
        if finished:
            return ""
        idle_since = (idle_since or t1) if cpu_pct < 0.5 else None
        if key != last_key:
            last_key, last_change = key, time.monotonic()
        if time.monotonic() - start > deadline_s:
            return f"deadline of {deadline_s:.0f}s reached"
        if idle_since is not None and t1 - idle_since >= b.args.hung_seconds:
            # Serving operations check their node every serve_check_seconds: a live worker is never idle this long.
            return f"{HUNG} for {t1 - idle_since:.0f}s while operations are open: it is hung"
        if time.monotonic() - last_change > stall_s:
            return f"no progress for {stall_s:.0f}s"
        await asyncio.sleep(b.args.progress)


def dump_stacks(b: Bench) -> list[str]:
    """The hung worker's Python stacks (py-spy, if installed), summarised by each thread's innermost frame."""
    spy = b.args.py_spy or shutil.which("py-spy")
    if not spy:
        return ["(install py-spy, or pass --py-spy, to have the hung worker's stacks dumped)"]
    out_file = b.workdir / "worker-stacks.txt"
    proc = subprocess.run([spy, "dump", "--pid", str(b.worker.pid)], capture_output=True, text=True, timeout=60)
    out_file.write_text(proc.stdout + proc.stderr)
    tops: Counter[str] = Counter()
    lines = proc.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Thread ") and i + 1 < len(lines) and lines[i + 1].startswith("    "):
            tops[lines[i + 1].strip()] += 1
    threads = sum(tops.values())
    summary = [f"py-spy dump of the worker ({threads} Python threads, {out_file}), innermost frames:"]
    summary += [f"  {n:>4} x {frame}" for frame, n in tops.most_common(4)]
    return summary


def log_silence(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return math.nan


async def diagnose(b: Bench, policy: str) -> list[str]:
    """Why running operations are not Serving: their phases and pending activities, aggregated."""
    reasons: Counter[str] = Counter()
    oldest: dict[str, float] = {}
    now = utc_now()
    async for wf in b.temporal.list_workflows(
            b.query(policy, f"ExecutionStatus = 'Running' AND {sa.PHASE.name} != '{Phase.SERVING.value}'")):
        desc = await b.temporal.get_workflow_handle(wf.id).describe()
        phase = desc.typed_search_attributes.get(sa.PHASE) or "?"
        pending = list(desc.raw_description.pending_activities)
        if not pending:
            reasons[f"{phase}: no activity pending (timer, update or workflow task)"] += 1
        for pa in pending:
            state = PendingActivityState.Name(pa.state).removeprefix("PENDING_ACTIVITY_STATE_")
            key = f"{phase}: activity {pa.activity_type.name} {state}, attempt {pa.attempt}"
            if pa.last_failure.message:
                key += f", last failure: {pa.last_failure.message[:80]}"
            reasons[key] += 1
            waited = (now - pa.scheduled_time.ToDatetime(tzinfo=UTC)).total_seconds()
            oldest[key] = max(oldest.get(key, 0.0), waited)
    lines = [f"{n:>4} x {k} (oldest scheduled {oldest.get(k, 0):.0f}s ago)" for k, n in reasons.most_common(8)]
    serving = await b.count(policy, f"{sa.PHASE.name} = '{Phase.SERVING.value}' AND ExecutionStatus = 'Running'")
    lines.append(f"{serving} operation(s) Serving: each holds one activity slot (serve_until_done) while it serves; "
                 f"the worker runs at most max_concurrent_activities={b.settings.max_concurrent_activities} "
                 "activities at once")
    ledger = await b.temporal.get_workflow_handle(ledger_workflow_id(b.settings.cluster, policy)).describe()
    task = ledger.raw_description.pending_workflow_task
    lines.append(f"ledger workflow {ledger.id}: {ledger.status.name if ledger.status else '?'}, history length "
                 f"{ledger.history_length}, pending workflow task attempt {task.attempt if task else 0}")
    server = tail(b.temporal_log, 50_000_000)
    lines.append(f"Temporal server log: {server.count('in-flight updates has been reached')} update(s) refused for the "
                 f"per-workflow limit on in-flight updates, {server.count('workflow update was aborted')} aborted")
    worker_log = tail(b.worker_log, 50_000_000)
    lines.append(f"worker log: last written {log_silence(b.worker_log):.0f}s ago; "
                 f"{worker_log.count('Traceback')} traceback(s); "
                 f"{worker_log.count('Connection pool is full')} x 'Connection pool is full, discarding connection' "
                 f"(urllib3); {worker_log.count('pod watch interrupted')} x 'pod watch interrupted'")
    return lines


SETTLED = ("verified", "withdrawn", "failed", "expired", "cancelled")


@dataclass
class Placement:
    own: int = 0  # pods running on the node their own operation launched
    other: int = 0  # pods running on a node another operation launched
    pending: int = 0  # pods not (yet) on a node

    def line(self) -> str:
        return f"pods on own op's node {self.own}, on another op's node {self.other}, pending {self.pending}"


def latest_pods(pods: list[PodSeen], prefix: str) -> dict[tuple[str, str], PodSeen]:
    latest: dict[tuple[str, str], PodSeen] = {}
    for p in pods:
        if p.app.startswith(prefix) and not p.deleted:
            latest[(p.namespace, p.app)] = p
    return latest


def placement(pods: list[PodSeen], nodes: dict[str, NodeSeen], ops_of_deployment: dict[tuple[str, str], set[str]],
              prefix: str) -> Placement:
    out = Placement()
    for key, p in latest_pods(pods, prefix).items():
        if not p.node_name:
            out.pending += 1
            continue
        node = nodes.get(p.node_name)
        if node is not None and node.operation and node.operation in ops_of_deployment.get(key, set()):
            out.own += 1
        else:
            out.other += 1
    return out


async def scale_scenario(b: Bench, n: int) -> ScaleOutcome:
    out = ScaleOutcome(ops=n)
    b.scale = out
    if n <= 0:
        return out
    policy = f"bench-scale-{b.run}"
    b.stack.create_policy(policy, mode="Automatic", locations=POLICY_LOCATIONS, max_nodes=1000, max_gpu_hour=100.0)
    namespaces = [await b.blocking(b.create_namespace, "scale") for _ in range(max(1, b.args.namespaces))]
    names = [(namespaces[i % len(namespaces)], f"s-{i:04d}") for i in range(n)]
    out.records = [OpTimes(namespace=ns, deployment=name, workflow_id=burst_workflow_id(
        b.settings.cluster, policy, f"{ns}/Deployment/{name}")) for ns, name in names]
    by_id = {r.workflow_id: r for r in out.records}
    cpu_before = {pid: (comm, cpu_seconds(pid) or 0.0) for pid, comm in children().items()}
    bench_cpu0 = cpu_seconds(os.getpid()) or 0.0
    b.say(f"scale: creating {n} pending GPU deployments in {len(namespaces)} namespace(s), policy {policy} "
          "(Automatic)")
    t0 = utc_now()
    await asyncio.gather(*(b.blocking(b.create_deployment, ns, name) for ns, name in names))
    out.created_s = (utc_now() - t0).total_seconds()
    b.say(f"scale: {n} deployments created in {out.created_s:.1f}s")

    async def refresh() -> tuple[int, dict[tuple[str, str], set[str]]]:
        """Visibility -> records (operations, first start, latest run's status); returns (workflow runs,
        deployment -> its runs' operations). A workflow ID has more than one run when the watcher started it again
        for a pod an earlier run left without a node."""
        seen = 0
        latest: dict[str, datetime] = {}
        for r in out.records:
            r.runs, r.operations = 0, set()
        async for wf in b.temporal.list_workflows(b.query(policy)):
            rec = by_id.get(wf.id)
            if rec is None:
                continue
            seen += 1
            rec.runs += 1
            op = wf.typed_search_attributes.get(sa.OPERATION)
            if op:
                rec.operations.add(op)
            if rec.workflow_start is None or wf.start_time < rec.workflow_start:
                rec.workflow_start = wf.start_time
            if wf.id not in latest or wf.start_time >= latest[wf.id]:
                latest[wf.id] = wf.start_time
                rec.operation = op or rec.operation
                rec.final = wf.status.name if wf.status else ""
                rec.closed = wf.close_time if wf.status != WorkflowExecutionStatus.RUNNING else None
        out.runs = seen
        return seen, {(r.namespace, r.deployment): r.operations for r in out.records if r.operations}

    def ops_of(audit: AuditView) -> set[str]:
        return {op for op, p in audit.policy.items() if p == policy}

    async def serving_done() -> tuple[bool, str, tuple[int, ...]]:
        audit = read_audit(b.audit_file)
        ops = ops_of(audit)
        verified = audit.count("verified", ops)
        settled = len({op for (op, act) in audit.at if op in ops and act in SETTLED})
        withdrawn = audit.count("withdrawn", ops)
        started, op_of = await refresh()
        phases = await b.phase_counts(policy)
        pods, nodes = b.observer.pods_snapshot(), b.observer.nodes_snapshot()
        unsched = len({(p.namespace, p.app) for p in pods if p.app.startswith("s-") and p.unschedulable_seen})
        ready = sum(1 for nd in nodes.values() if nd.operation in ops and nd.ready_seen)
        where = placement(pods, nodes, op_of, "s-")
        shown = " ".join(f"{p.value} {c}" for p, c in phases.items() if c)
        ids = sum(1 for r in out.records if r.runs)
        line = (f"Unschedulable {unsched}/{n} | workflows {ids} ({started} runs) [{shown}] | nodes Ready {ready} | "
                f"verified {verified}, withdrawn {withdrawn} | {where.line()}")
        # Settled: every deployment's pod is on a burst node (some never get a workflow of their own: they land on
        # another operation's node first) and every run verified, withdrew or failed. A run that ended leaving its
        # pod pending is followed by a new run, and a pod left waiting while its operation serves by one more node
        # (the watcher's resync), so wait for the pods.
        done = where.pending == 0 and where.own + where.other >= n and settled >= started
        return done, line, (verified, settled, ready, started, where.own, where.other, *phases.values())

    why = await progress_loop(b, "scale", serving_done, b.args.serve_deadline, b.args.stall_seconds)
    audit = read_audit(b.audit_file)
    ops = ops_of(audit)
    verified_at = sorted(at for (op, act), at in audit.at.items() if act == "verified" and op in ops)
    settled_at = sorted(min(at for (o, act), at in audit.at.items() if o == op and act in SETTLED)
                        for op in ops if any((op, act) in audit.at for act in SETTLED))
    out.reached_serving = len(verified_at)
    out.withdrawn = audit.count("withdrawn", ops)
    out.failed = audit.count("failed", ops)
    for pct in (50, 90, 95, 100):
        k = math.ceil(n * pct / 100)
        if len(verified_at) >= k:
            out.milestones[pct] = (verified_at[k - 1] - t0).total_seconds()
    if len(verified_at) >= n:
        out.serving_wall_s = (verified_at[-1] - t0).total_seconds()
    if len(settled_at) >= n:
        out.settled_wall_s = (settled_at[-1] - t0).total_seconds()
    _, op_of = await refresh()
    out.placement = placement(b.observer.pods_snapshot(), b.observer.nodes_snapshot(), op_of, "s-")
    out.stranded = await stranded(b, out.records, latest_pods(b.observer.pods_snapshot(), "s-"))
    for line in out.stranded:
        b.say(f"  pending: {line}")
    if why or out.reached_serving < n:
        out.serving_note = f"{out.reached_serving} of {n} reached Serving" + (f" ({why})" if why else "")
        b.say(f"scale: {out.serving_note}; diagnosing")
        out.diagnosis = await diagnose(b, policy)
        if why.startswith(HUNG):
            out.diagnosis += await b.blocking(dump_stacks, b)
        for line in out.diagnosis:
            b.say(f"  {line}")
    b.sampler.sample()
    b.say(f"scale: worker VmHWM {b.sampler.mib(b.sampler.last_hwm_kib):.0f} MiB at the end of the Serving wait")

    # All workloads gone: every operation drains, terminates, removes its node and completes.
    t1 = utc_now()
    b.say(f"scale: deleting the {n} deployments")
    await asyncio.gather(*(b.blocking(b.delete_deployment, ns, name) for ns, name in names))
    total = await b.count(policy)

    async def closed_done() -> tuple[bool, str, tuple[int, ...]]:
        closed = await b.count(policy, "ExecutionStatus != 'Running'")
        completed = await b.count(policy, "ExecutionStatus = 'Completed'")
        phases = await b.phase_counts(policy)
        shown = " ".join(f"{p.value} {c}" for p, c in phases.items() if c)
        nodes = b.observer.nodes_snapshot()
        left = sum(1 for nd in nodes.values() if nd.operation in ops and nd.deleted_seen is None)
        line = f"workflows closed {closed}/{total} (Completed {completed}) [{shown}] | burst nodes left {left}"
        return closed >= total, line, (closed, left, *phases.values())

    if why.startswith(HUNG):
        out.completion_note = "not waited for: the worker is hung"
        b.say(f"scale: {out.completion_note}")
    else:
        why = await progress_loop(b, "drain", closed_done, b.args.complete_deadline, b.args.stall_seconds)
        if why:
            out.completion_note = why

    await refresh()
    closes = [r.closed for r in out.records if r.closed is not None]
    out.closed = len(closes)
    out.completed = sum(1 for r in out.records if r.final == WorkflowExecutionStatus.COMPLETED.name)
    last_close = await b.last_close(policy) if not out.completion_note else None
    if last_close is not None:
        out.completed_wall_s = (last_close - t1).total_seconds()
    audit = read_audit(b.audit_file)
    pods, nodes = pods_by_app(b.observer.pods_snapshot()), b.observer.nodes_snapshot()
    for rec in out.records:
        rec.fill(pods, nodes, audit)
    for pid, (comm, before) in cpu_before.items():
        after = cpu_seconds(pid)
        if after is not None:
            out.cpu[comm] = out.cpu.get(comm, 0.0) + after - before
    out.cpu["benchmark itself"] = (cpu_seconds(os.getpid()) or 0.0) - bench_cpu0
    return out


async def stranded(b: Bench, records: list[OpTimes], pods: dict[tuple[str, str], PodSeen]) -> list[str]:
    """Why each pod still pending is pending, counted: no workflow, or its workflow's latest run (phase, and for a
    Serving one whether its node serves another deployment's pod)."""
    why: Counter[str] = Counter()
    node_pod = {p.node_name: key for key, p in pods.items() if p.node_name}
    for rec in records:
        pod = pods.get((rec.namespace, rec.deployment))
        if pod is None or pod.node_name:
            continue
        if not rec.runs:
            why["no workflow started" + ("" if pod.unschedulable_seen else " (never seen Unschedulable)")] += 1
            continue
        try:
            desc = await b.temporal.get_workflow_handle(rec.workflow_id).describe()
        except Exception as exc:
            why[f"describe failed: {type(exc).__name__}"] += 1
            continue
        phase = desc.typed_search_attributes.get(sa.PHASE) or "?"
        status = desc.status.name if desc.status else "?"
        key = f"latest of {rec.runs} run(s) {status} in phase {phase}"
        if phase == Phase.SERVING.value and status == "RUNNING":
            other = node_pod.get(f"burst-{rec.operation}")
            key += (", its node serving another deployment's pod" if other and other != (rec.namespace, rec.deployment)
                    else ", its node serving no pod")
        elif status == "COMPLETED":
            res = await b.temporal.get_workflow_handle(rec.workflow_id, run_id=desc.run_id,
                                                       result_type=BurstResult).result()
            key += f" ({res.message[:60]})"
        why[key] += 1
    return [f"{n:>4} x {k}" for k, n in why.most_common()]


# -- report ----------------------------------------------------------------------------------------------------------
def report(b: Bench) -> None:
    s = b.settings
    print()
    print("=" * 120)
    print(f"KubeOn burst benchmark, sim provider on the local control plane — {utc_now():%Y-%m-%d %H:%M} UTC")
    print(f"machine: {os.cpu_count()} CPU(s), {platform.system()} {platform.release()}, Python "
          f"{platform.python_version()}; worker: max_concurrent_activities={s.max_concurrent_activities}, "
          f"serve_check_seconds={s.serve_check_seconds}; sim bootSeconds={b.args.boot_seconds}")
    print("=" * 120)
    head = f"  {'':<66} {'n':>4}  {'p50':>9}  {'p95':>9}  {'max':>9}"
    lat = [r for r in b.latency_records if r.verified]
    first, second = latency_series(lat, "idle")
    scale_first: list[Series] = []
    scale_second: list[Series] = []
    if b.scale and b.scale.records:
        scale_first, scale_second = latency_series(b.scale.records, "load")
    print("1. Pod Unschedulable -> BurstWorkflow started (Temporal start time)")
    print(head)
    for row in [*first, *scale_first]:
        print(row.row())
    print("2. Burst Node Ready -> operation verified (audit record 'verified')")
    print(head)
    for row in [*second, *scale_second]:
        print(row.row())
    if b.latency_note:
        print(f"  note: {b.latency_note}")
    if b.latency_completion:
        print(Series("idle: workload deleted -> workflow Completed", b.latency_completion).row())
    if b.scale and b.scale.ops:
        sc = b.scale
        print(f"3. {sc.ops} concurrent operations (Automatic, one pending 1-GPU Deployment and one kwok node each)")
        print(f"  {'deployments created in':<66} {sc.created_s:.1f}s")
        print(f"  {'reached Serving (audit verified)':<66} {sc.reached_serving}/{sc.ops}"
              f" (withdrawn before launch {sc.withdrawn}, failed {sc.failed})")
        for pct, secs in sorted(sc.milestones.items()):
            print(f"  {f'  {pct}% Serving after':<66} {secs:.1f}s")
        wall = f"{sc.serving_wall_s:.1f}s" if sc.serving_wall_s is not None else f"not reached ({sc.serving_note})"
        print(f"  {'wall time: workloads created -> all Serving':<66} {wall}")
        if sc.serving_wall_s is None and sc.settled_wall_s is not None:
            print(f"  {'wall time: workloads created -> all settled (Serving/withdrawn/failed)':<66} "
                  f"{sc.settled_wall_s:.1f}s")
        if sc.runs:
            print(f"  {'workflow runs (an ID started again for a pod left without a node)':<66} {sc.runs} runs "
                  f"of {sum(1 for r in sc.records if r.runs)} workflow IDs")
        if sc.placement is not None:
            print(f"  {'at the end of the wait':<66} {sc.placement.line()}")
        for line in sc.stranded:
            print(f"  {'  why pending':<66} {line}")
        done = (f"{sc.completed_wall_s:.1f}s" if sc.completed_wall_s is not None
                else f"not reached ({sc.completion_note or 'not all closed'})")
        print(f"  {'wall time: workloads deleted -> all workflows closed':<66} {done} "
              f"({sc.completed} Completed, {sc.closed} closed)")
        if sc.cpu:
            cpu = ", ".join(f"{k} {v:.0f}s" for k, v in sorted(sc.cpu.items(), key=lambda kv: -kv[1]) if v >= 0.5)
            print(f"  {'CPU seconds used during the scenario':<66} {cpu}")
    print(f"  {'telemetry (--telemetry)':<66} " + (b.telemetry.line() if b.telemetry else
                                                    "off: no exporter, text logs, no scrape"))
    print("4. Worker memory (kubeon-gpu worker subprocess)")
    print(f"  {'RSS idle after start-up':<66} {b.sampler.mib(b.idle_rss_kib):.0f} MiB")
    print(f"  {'peak RSS sampled every 0.5s':<66} {b.sampler.mib(b.sampler.peak_rss_kib):.0f} MiB")
    print(f"  {'peak (VmHWM from /proc/<pid>/status)':<66} {b.sampler.mib(b.sampler.last_hwm_kib):.0f} MiB")
    if b.scale and b.scale.diagnosis:
        print("Why not all operations reached Serving:")
        for line in b.scale.diagnosis:
            print(f"  {line}")
    print("=" * 120, flush=True)


# -- set-up and tear-down --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Point this process's stdout/stderr at ``path`` while a child that inherits them is started."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 40.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def wait_worker_started(proc: subprocess.Popen[bytes], log_file: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n{tail(log_file)}")
        if "worker started" in tail(log_file, 20_000):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the worker did not start within {timeout:.0f}s:\n{tail(log_file)}")


async def main_async(args: argparse.Namespace) -> int:
    clock = Stopwatch()
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-bench-"))
    run = uuid.uuid4().hex[:6]
    log(clock, f"work directory {workdir}")
    async with contextlib.AsyncExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, workdir, True)
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench")
        stack.callback(pool.shutdown, wait=False, cancel_futures=True)

        plane = ControlPlane(workdir / "controlplane")
        stack.callback(plane.stop)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, plane.start)
        log(clock, f"control plane up in {plane.started_seconds:.1f}s at {plane.server}")
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))

        temporal_log = workdir / "temporal.log"
        with output_to(temporal_log):  # the dev server inherits them: its errors go to its log, not the table
            env = await WorkflowEnvironment.start_local(
                dev_server_existing_path=str(dev_server_path()), data_converter=DATA_CONVERTER,
                search_attributes=list(sa.ALL), ui=False, dev_server_log_level="error",
                dev_server_extra_args=[a for kv in args.dynamic_config for a in ("--dynamic-config-value", kv)])
        stack.push_async_callback(env.shutdown)
        log(clock, f"Temporal dev server up at {env.client.service_client.config.target_host}")

        burst = await loop.run_in_executor(pool, build_stack, cluster, workdir / "burst")
        queue = f"bench-{run}"
        overrides: dict[str, Any] = {"serve_check_seconds": args.serve_check_seconds}
        if args.max_concurrent_activities:
            overrides["max_concurrent_activities"] = args.max_concurrent_activities
        settings = burst.settings(temporal_address=env.client.service_client.config.target_host, task_queue=queue,
                                  locations=sim_locations(args.capacity, args.boot_seconds), cluster_name=queue,
                                  health_port=free_port(), **overrides)
        telemetry: Telemetry | None = None
        worker_env: dict[str, str] = {"OTEL_SDK_DISABLED": "true"}
        if args.telemetry == "on":
            receiver = OtlpReceiver().__enter__()
            stack.callback(receiver.__exit__, None, None, None)
            telemetry = Telemetry(receiver=receiver, metrics_url=f"http://127.0.0.1:{settings.health_port}/metrics")
            worker_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "KUBEON_LOG_FORMAT": "json"}
        observer = ClusterObserver(Kube.from_kubeconfig(plane.admin_kubeconfig).api,
                                   pod_selector=f"{BENCH_LABEL}={run}",
                                   node_selector="gpu.kubeon.io/operation").start()
        stack.callback(observer.stop)

        worker_log = workdir / "worker.log"
        proc = worker_process(settings, worker_log, worker_env)
        stack.callback(stop_worker, proc)  # runs first: the worker goes before the servers it talks to
        await wait_worker_started(proc, worker_log)
        sampler = ProcessSampler(proc.pid).start()
        stack.callback(sampler.stop)
        await asyncio.sleep(1.0)
        sampler.sample()
        log(clock, f"worker pid {proc.pid} started (log {worker_log}); RSS "
                   f"{sampler.mib(sampler.last_rss_kib):.0f} MiB")

        b = Bench(args=args, clock=clock, workdir=workdir, run=run, cluster=cluster, stack=burst,
                  temporal_log=temporal_log,
                  temporal=env.client, settings=settings, worker=proc, worker_log=worker_log, sampler=sampler,
                  observer=observer, pool=pool, audit_file=settings.state_dir / "audit.jsonl",
                  idle_rss_kib=sampler.last_rss_kib, telemetry=telemetry)
        scraping = asyncio.create_task(telemetry.scrape_loop(loop, pool)) if telemetry else None
        try:
            await latency_scenario(b, args.latency_samples)
            await scale_scenario(b, args.ops)
        finally:
            if scraping is not None:
                scraping.cancel()
            sampler.sample()
            report(b)
            if observer.errors:
                log(clock, f"bench watch interruptions: {len(observer.errors)} (last: {observer.errors[-1]})")
            log(clock, "tearing down")
    left = children()
    if left:
        log(clock, f"left behind, killing: {left}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log(clock, "done" + (f"; work directory kept at {workdir}" if args.keep else ""))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.burst_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=200, help="concurrent operations in the scale scenario (0: skip)")
    p.add_argument("--latency-samples", type=int, default=20,
                   help="operations run one at a time for the latency figures (0: skip)")
    p.add_argument("--namespaces", type=int, default=1,
                   help="namespaces the scale scenario's deployments are spread over (round robin)")
    p.add_argument("--max-concurrent-activities", type=int, default=0,
                   help="override the worker's max_concurrent_activities (0: the product default)")
    p.add_argument("--serve-check-seconds", type=int, default=1, help="the worker's serve_check_seconds")
    p.add_argument("--capacity", type=int, default=300, help="simulated capacity of each sim location")
    p.add_argument("--boot-seconds", type=float, default=0.5, help="simulated boot delay of an instance")
    p.add_argument("--sample-timeout", type=float, default=60.0,
                   help="seconds one latency sample may take to reach Serving, and again to complete")
    p.add_argument("--latency-budget", type=float, default=240.0, help="seconds for all latency samples")
    p.add_argument("--serve-deadline", type=float, default=360.0,
                   help="seconds the scale scenario waits for all operations to be Serving")
    p.add_argument("--complete-deadline", type=float, default=180.0,
                   help="seconds the scale scenario waits for all workflows to close after deleting the workloads")
    p.add_argument("--stall-seconds", type=float, default=90.0,
                   help="stop a wait early when nothing moved for this long")
    p.add_argument("--hung-seconds", type=float, default=30.0,
                   help="stop a wait early when the worker used no CPU for this long while operations are open")
    p.add_argument("--dynamic-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a Temporal dev server dynamic config value, e.g. history.maxInFlightUpdates=1000 "
                        "(repeatable; default: the server's defaults)")
    p.add_argument("--py-spy", default="", help="py-spy binary for a stack dump of a hung worker (default: PATH)")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--telemetry", choices=["off", "on"], default="off",
                   help="on: OTLP/HTTP traces to a loopback receiver, JSON logs, /metrics scraped every 15 s")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, audit.jsonl)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
