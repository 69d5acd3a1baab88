"""Burst benchmark, provisioning by batch: the sim provider on the local control plane, the worker as its own
process.

    .venv/bin/python -m bench.burst_bench [--ops 200] [--latency-samples 10]

Starts a real control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok; one non-GPU node so
the scheduler wakes pending pods when a node appears) and a Temporal dev server in a temporary directory, runs
``kubeon-gpu worker`` as a subprocess, and measures, for one-GPU Deployments under an Automatic policy:

1. idle (one at a time): pod Unschedulable -> batch planned, -> burst Node object, -> pod bound;
2. N at once: nodes launched against the exact bin-packing optimum (count and $/h), Unschedulable -> plan
   p50/p95, time until all are bound, the worker's peak RSS and CPU seconds.

Everything it starts is stopped at the end; see bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client

from bench.observe import ClusterObserver
from bench.observe import ProcessSampler
from bench.observe import Stopwatch
from bench.observe import children
from bench.observe import cpu_seconds
from bench.observe import percentile
from bench.observe import utc_now
from models import search_attributes as sa
from models.ids import provision_workflow_id
from models.locations import transfer_usd_per_gpu_hour
from models.policy import location_of_label_value
from models.provisioning import Offering
from models.provisioning import ProvisionView
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import worker_process
from tests.harness.controlplane import ControlPlane
from tests.harness.controlplane import free_port
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.otlp import OtlpReceiver
from tests.harness.temporal import start_dev_server
from worker.config import Settings

BENCH_LABEL = "kubeon-bench/run"
POLICY_LOCATIONS = ["sim/eu-west", "sim/us-west"]


def log(clock: Stopwatch, message: str) -> None:
    print(f"[{clock.elapsed():7.1f}s] {message}", flush=True)


def sim_locations(capacity: int, boot_seconds: float) -> list[dict[str, Any]]:
    """A 1-GPU and a 4-GPU L4 node in eu-west (four 1-GPU nodes $3.60/h, one 4-GPU node $3.40/h), a dearer 1-GPU
    node in us-west."""
    sim = {"capacity": capacity, "bootSeconds": boot_seconds}

    def l4(itype: str, gpus: int, price: float) -> dict[str, Any]:
        return {"instanceType": itype, "gpus": gpus, "gpuProduct": "NVIDIA-L4", "usdPerHour": price}

    return [{"name": "sim/eu-west", "sim": sim, "offerings": [l4("sim.l4.1", 1, 0.90), l4("sim.l4.4", 4, 3.40)]},
            {"name": "sim/us-west", "sim": sim, "offerings": [l4("sim.l4.1", 1, 1.40)]}]


def offered(settings: Settings) -> list[Offering]:
    cfg = settings.burst_config()
    out = []
    for name in POLICY_LOCATIONS:
        loc = cfg.location(name)
        transfer = transfer_usd_per_gpu_hour(cfg.home, loc)
        out += [Offering(location=name, instance_type=o.instance_type, gpus=o.gpus, gpu_product=o.gpu_product,
                         instance_usd_per_hour=o.usd_per_hour, transfer_usd_per_gpu_hour=transfer)
                for o in loc.offerings]
    return out


def optimum(offerings: list[Offering], pods: int) -> tuple[int, float]:
    """(nodes, $/h) of the cheapest set of nodes holding ``pods`` one-GPU pods: an unbounded covering DP,
    computed here independently of the planner."""
    best: list[tuple[float, int]] = [(0.0, 0)] + [(float("inf"), 0)] * pods
    for c in range(1, pods + 1):
        for o in offerings:
            cost, nodes = best[max(0, c - o.gpus)]
            if cost + o.usd_per_hour < best[c][0] - 1e-9:
                best[c] = (cost + o.usd_per_hour, nodes + 1)
    return best[pods][1], round(best[pods][0], 4)


@dataclass
class Bench:
    args: argparse.Namespace
    clock: Stopwatch
    run: str
    cluster: Cluster
    temporal: Client
    settings: Settings
    worker: subprocess.Popen[bytes]
    sampler: ProcessSampler
    observer: ClusterObserver
    pool: ThreadPoolExecutor
    lines: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        log(self.clock, message)

    def create(self, namespace: str, name: str) -> None:
        dep = gpu_deployment(name)
        assert dep.spec is not None and dep.spec.template.metadata is not None
        dep.spec.template.metadata.labels = {**(dep.spec.template.metadata.labels or {}), BENCH_LABEL: self.run}
        self.cluster.admin.apps.create_namespaced_deployment(namespace, dep)

    async def state(self, policy: str) -> ProvisionView:
        handle = self.temporal.get_workflow_handle(provision_workflow_id(self.settings.cluster, policy))
        view: ProvisionView = await handle.query("state", result_type=ProvisionView)
        return view

    def create_policy(self, name: str) -> None:
        self.cluster.admin.custom.create_cluster_custom_object("gpu.kubeon.io", "v1", "gpupolicies", {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
            "spec": {"kind": "Burst", "mode": "Automatic", "workloads": {"tolerate": "gpu.kubeon.io/burst"},
                     "locations": POLICY_LOCATIONS, "limits": {"maxNodes": 1000, "maxGpuHour": 100},
                     "returnHome": True}})

    async def nodes_closed(self, deadline_s: float) -> None:
        """Until no node or drain workflow of the bench's cluster runs (bounded)."""
        query = (f"{sa.CLUSTER.name} = '{self.settings.cluster}' AND ExecutionStatus = 'Running' AND "
                 f"{sa.OPERATION_KIND.name} IN ('Burst', 'Drain')")
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and (await self.temporal.count_workflows(query)).count:
            await asyncio.sleep(0.5)

    async def until(self, check: Any, deadline_s: float, what: str) -> bool:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited ({self.worker.returncode}) while waiting for {what}")
            if check():
                return True
            await asyncio.sleep(0.05)
        self.say(f"gave up waiting for {what} after {deadline_s:.0f}s")
        return False


async def scrape_forever(port: int, durations: list[float], every: float = 5.0) -> None:
    """GET the worker's /metrics every ``every`` seconds (as a Prometheus would), recording how long each took."""
    async with httpx.AsyncClient(timeout=30.0) as http:
        while True:
            t = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200:
                    durations.append(time.monotonic() - t)
            await asyncio.sleep(max(0.0, every - (time.monotonic() - t)))


def node_cidr_mask(nodes: int, pod_cidr_prefix: int = 16) -> int:
    """The gateway's per-node pod CIDR mask: 24 (256 nodes in the default /16), narrower when the load scenario
    could need more nodes than that (one per pod at worst), as an operator would size it."""
    mask = 24
    while 2 ** (mask - pod_cidr_prefix) < nodes + 16 and mask < 28:
        mask += 1
    return mask


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {percentile(values, 50):6.2f}s  p95 {percentile(values, 95):6.2f}s  (n={len(values)})"


def planned_at(views: ProvisionView) -> dict[str, datetime]:
    """pod -> when the first plan that placed it (on a new node or a node already there) was made."""
    out: dict[str, datetime] = {}
    for b in views.batches:
        at = b.plan.planned_at
        if at is None:
            continue
        for pod in [p for n in b.plan.new_nodes for p in n.pods] + list(b.plan.on_existing):
            out.setdefault(pod, at)
    return out


async def idle_scenario(b: Bench, samples: int, policy: str) -> None:
    if samples <= 0:
        return
    ns = b.cluster.create_namespace("bench-idle")
    plan, node, bound = [], [], []
    for i in range(samples):
        name = f"idle-{i}"
        before = set(b.observer.nodes_snapshot())
        created = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(b.pool, b.create, ns, name)

        def pod(name: str = name) -> Any:
            return next((p for p in b.observer.pods_snapshot() if p.app == name and p.namespace == ns), None)

        def is_bound(pod: Any = pod) -> bool:
            p = pod()
            return p is not None and p.scheduled_seen is not None

        if not await b.until(is_bound, 60, f"{name} bound"):
            break
        seen = pod()
        new = [n for k, n in b.observer.nodes_snapshot().items() if k not in before]
        start = seen.unschedulable_seen or seen.unschedulable_cond
        if start and new:
            node.append((min(n.first_seen for n in new) - start).total_seconds())
        if start and seen.scheduled_seen:
            bound.append((seen.scheduled_seen - start).total_seconds())
        at = planned_at(await b.state(policy)).get(f"{ns}/{seen.name}")
        if start and at:
            plan.append((at - start).total_seconds())
        b.cluster.admin.apps.delete_namespaced_deployment(name, ns)
        def home(before: set[str] = before) -> bool:
            return all(v.deleted_seen for k, v in b.observer.nodes_snapshot().items() if k not in before)

        await b.until(home, 60, "node home")
        # One pod now and then: a second pod within the trickle's idle window would be gathered with it (a rollout).
        await asyncio.sleep(max(0.0, created + 2 * b.settings.batch_load_idle_seconds - time.monotonic()))
        b.say(f"idle {i}: Unschedulable -> plan {plan[-1] if plan else float('nan'):.2f}s, -> Node "
              f"{node[-1] if node else float('nan'):.2f}s, -> bound {bound[-1] if bound else float('nan'):.2f}s")
    b.lines += [f"idle, {samples} one at a time",
                f"  Unschedulable -> plan        {fmt(plan)}",
                f"  Unschedulable -> Node object {fmt(node)}",
                f"  Unschedulable -> pod bound   {fmt(bound)}"]


# History events that are Temporal actions, as Temporal Cloud bills them (docs.temporal.io/cloud/actions; queries
# aside): starts (each run, so continue-as-new too), activities (each attempt), signals, timers, child starts (two
# actions each: the intent and the start), accepted updates, search attribute upserts, and local activities (their
# markers: all of one workflow task are one action, counted below per task).
ACTION_EVENTS = {
    "WORKFLOW_EXECUTION_STARTED": ("workflow runs", 1),
    "ACTIVITY_TASK_STARTED": ("activity attempts", 1),
    "WORKFLOW_EXECUTION_SIGNALED": ("signals", 1),
    "TIMER_STARTED": ("timers", 1),
    "START_CHILD_WORKFLOW_EXECUTION_INITIATED": ("child starts", 2),
    "WORKFLOW_EXECUTION_UPDATE_ACCEPTED": ("updates", 1),
    "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES": ("search attribute upserts", 1),
}


# Activities that wait for the cluster or hold for a node's service: their run time is not work.
LONG_ACTIVITIES = frozenset({"wait_for_node", "verify_node", "serve_until_done", "evict_pods", "confirm_gone",
                             "await_actions_allowed"})


@dataclass
class PlanRound:
    """One plan_batch of the provisioning, read from its history: which pods it was asked about, which it placed."""

    asked_at: datetime
    done_at: datetime
    asked: set[str]
    placed: set[str]
    unplaced: dict[str, str]  # pod -> why


@dataclass
class ActionCount:
    by_kind: dict[str, int] = field(default_factory=dict)
    workflow_tasks: int = 0
    events: int = 0
    runs: int = 0
    batches: set[str] = field(default_factory=set)
    activities: dict[str, int] = field(default_factory=dict)  # activity type -> times scheduled
    local_activities: int = 0
    # activity type -> seconds each waited in its task queue (scheduled -> started): a long wait for a short
    # activity says the worker's activity slots were all taken when it was scheduled.
    queued: dict[str, list[float]] = field(default_factory=dict)
    # workflow type -> seconds each workflow task waited (scheduled -> started)
    task_queued: dict[str, list[float]] = field(default_factory=dict)
    # activity type -> seconds each attempt that completed ran (started -> completed)
    ran: dict[str, list[float]] = field(default_factory=dict)
    # pod (namespace/name) -> when a provisioning first got it in a pods_waiting signal (from the watcher)
    signalled: dict[str, datetime] = field(default_factory=dict)
    # every plan_batch that completed, of every run of the provisioning (its query keeps only the last batches)
    rounds: list[PlanRound] = field(default_factory=list)

    @property
    def actions(self) -> int:
        return sum(self.by_kind.values())

    def queue_lines(self, top: int = 8) -> list[str]:
        def line(label: str, waits: dict[str, list[float]]) -> str:
            worst = sorted(waits.items(), key=lambda kv: -percentile(kv[1], 95))[:top]
            return label + ", ".join(f"{k} {percentile(v, 50):.2f} / {percentile(v, 95):.2f}" for k, v in worst)
        return [line("  activity queue wait p50 / p95  ", self.queued),
                line("  workflow task wait p50 / p95   ", self.task_queued),
                line("  activity run p50 / p95         ",
                     {k: v for k, v in self.ran.items() if k not in LONG_ACTIVITIES})]


async def count_actions(b: Bench, since: datetime) -> ActionCount:
    """Temporal actions of every workflow of the bench's cluster since ``since``, read from their histories."""
    from temporalio.api.enums.v1 import EventType

    out = ActionCount()
    query = f"{sa.CLUSTER.name} = '{b.settings.cluster}'"
    async for wf in b.temporal.list_workflows(query, limit=100_000):
        if (wf.close_time or datetime.max.replace(tzinfo=since.tzinfo)) < since:
            continue
        out.runs += 1
        batch = wf.typed_search_attributes.get(sa.BATCH)
        if batch and wf.typed_search_attributes.get(sa.OPERATION_KIND) == "Burst":
            out.batches.add(str(batch))
        history = await b.temporal.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        tasks_with_markers: set[int] = set()
        scheduled: dict[int, tuple[str, datetime]] = {}
        started: dict[int, datetime] = {}
        asked: dict[int, set[str]] = {}  # plan_batch scheduled event -> the pods it was asked about
        for event in history.events:
            at = event.event_time.ToDatetime(tzinfo=since.tzinfo)
            if at < since:
                continue
            out.events += 1
            name = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
            if name == "WORKFLOW_TASK_COMPLETED":
                out.workflow_tasks += 1
            elif name == "ACTIVITY_TASK_SCHEDULED":
                kind_name = event.activity_task_scheduled_event_attributes.activity_type.name
                out.activities[kind_name] = out.activities.get(kind_name, 0) + 1
                scheduled[event.event_id] = (kind_name, at)
                request = event.activity_task_scheduled_event_attributes.input
                if kind_name == "plan_batch" and request.payloads:
                    asked[event.event_id] = {f"{p['namespace']}/{p['name']}" for p in
                                             json.loads(request.payloads[0].data).get("pods", [])}
            elif name == "WORKFLOW_TASK_SCHEDULED":
                scheduled[event.event_id] = (wf.workflow_type, at)
            elif name in ("ACTIVITY_TASK_STARTED", "WORKFLOW_TASK_STARTED"):
                attrs = (event.activity_task_started_event_attributes if name == "ACTIVITY_TASK_STARTED"
                         else event.workflow_task_started_event_attributes)
                if attrs.scheduled_event_id in scheduled:
                    kind_name, scheduled_at = scheduled[attrs.scheduled_event_id]
                    waits = out.queued if name == "ACTIVITY_TASK_STARTED" else out.task_queued
                    waits.setdefault(kind_name, []).append((at - scheduled_at).total_seconds())
                    started[event.event_id] = at
            elif name == "WORKFLOW_EXECUTION_SIGNALED":
                signal = event.workflow_execution_signaled_event_attributes
                if signal.signal_name == "pods_waiting" and signal.input.payloads:
                    for pod in json.loads(signal.input.payloads[0].data).get("pods", []):
                        # The earliest: the watcher sends a pod again while it waits, and each continued-as-new run
                        # of the provisioning is read (newest first).
                        key = f"{pod['namespace']}/{pod['name']}"
                        out.signalled[key] = min(at, out.signalled.get(key, at))
            elif name == "ACTIVITY_TASK_COMPLETED":
                done = event.activity_task_completed_event_attributes
                if done.scheduled_event_id in scheduled and done.started_event_id in started:
                    out.ran.setdefault(scheduled[done.scheduled_event_id][0], []).append(
                        (at - started[done.started_event_id]).total_seconds())
                if done.scheduled_event_id in asked and done.result.payloads:
                    plan = json.loads(done.result.payloads[0].data)
                    out.rounds.append(PlanRound(
                        asked_at=scheduled[done.scheduled_event_id][1], done_at=at,
                        asked=asked[done.scheduled_event_id],
                        placed={p for n in plan.get("new_nodes", []) for p in n["pods"]}
                        | set(plan.get("on_existing", {})),
                        unplaced={u["pod"]: u["why"] for u in plan.get("unplaced", [])}))
            elif name == "MARKER_RECORDED":
                out.local_activities += 1
                task = event.marker_recorded_event_attributes.workflow_task_completed_event_id
                if task not in tasks_with_markers:
                    tasks_with_markers.add(task)
                    out.by_kind["local activity tasks"] = out.by_kind.get("local activity tasks", 0) + 1
            if name in ACTION_EVENTS:
                kind, actions = ACTION_EVENTS[name]
                out.by_kind[kind] = out.by_kind.get(kind, 0) + actions
    return out


async def load_scenario(b: Bench, n: int) -> None:
    if n <= 0:
        return
    ns = b.cluster.create_namespace("bench-load")
    names = [f"load-{i}" for i in range(n)]
    before = set(b.observer.nodes_snapshot())
    cpu0 = cpu_seconds(b.worker.pid) or 0.0
    t0, started = time.monotonic(), utc_now()
    profiler = Profiler.start(b.worker.pid, b.args.profile) if b.args.profile else None
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(b.pool, b.create, ns, name) for name in names))
    b.say(f"{n} Deployments created in {time.monotonic() - t0:.1f}s")

    def bound() -> int:
        return len([p for p in b.observer.pods_snapshot()
                    if p.namespace == ns and p.scheduled_seen is not None and not p.deleted])

    next_line = [0.0]

    def done() -> bool:
        if time.monotonic() > next_line[0]:
            next_line[0] = time.monotonic() + 5
            nodes = [k for k in b.observer.nodes_snapshot() if k not in before]
            b.say(f"  bound {bound()}/{n}, burst nodes {len(nodes)}, worker RSS "
                  f"{b.sampler.mib(b.sampler.last_rss_kib):.0f} MiB")
        return bound() >= n

    ok = await b.until(done, b.args.deadline, f"all {n} bound")
    wall = time.monotonic() - t0
    cpu = (cpu_seconds(b.worker.pid) or 0.0) - cpu0
    profile = profiler.stop() if profiler else None
    pods = [p for p in b.observer.pods_snapshot() if p.namespace == ns]
    nodes = {k: v for k, v in b.observer.nodes_snapshot().items() if k not in before}
    # What was launched, priced from the node watch (the provisioning's query keeps only its last batches).
    prices = {(o.location, o.instance_type): o.usd_per_hour for o in offered(b.settings)}
    kinds: dict[str, int] = {}
    usd = 0.0
    for nd in nodes.values():
        kinds[nd.instance_type] = kinds.get(nd.instance_type, 0) + 1
        usd += prices.get((location_of_label_value(nd.location), nd.instance_type), float("nan"))
    kinds_text = ", ".join(f"{c}x {k}" for k, c in sorted(kinds.items()))
    used = {p.node_name for p in pods if p.node_name}
    spare = [k for k in nodes if k not in used]
    opt_nodes, opt_usd = optimum(offered(b.settings), n)
    unsched = sorted((p.unschedulable_seen - started).total_seconds() for p in pods if p.unschedulable_seen)
    created = sorted((p.created_seen - started).total_seconds() for p in pods if p.created_seen)
    never = len([p for p in pods if p.unschedulable_seen is None])
    b.lines += [f"{n} one-GPU Deployments at once",
                f"  all bound                      {'yes' if ok else 'NO'} after {wall:.1f}s (from the first create)",
                f"  pods created (controller-manager) {created[0] if created else math.nan:.1f}s .. "
                f"{created[-1] if created else math.nan:.1f}s after the first create",
                f"  pods Unschedulable (scheduler) {unsched[0] if unsched else math.nan:.1f}s .. "
                f"{unsched[-1] if unsched else math.nan:.1f}s ({len(unsched)} pods; {never} bound before ever "
                "Unschedulable)",
                f"  nodes launched                 {len(nodes)} ({kinds_text}); {len(spare)} spare (no pod ever "
                f"bound); optimum {opt_nodes}",
                f"  $/h launched                   {usd:.2f} (optimum {opt_usd:.2f}, "
                f"+{100 * (usd / opt_usd - 1):.1f} %)",
                f"  worker CPU seconds             {cpu:.1f}"]
    split_at = len(b.lines) - 1  # Unschedulable -> plan goes here, once the histories are read
    if profile:
        b.lines += profile
    t1 = time.monotonic()
    await asyncio.gather(*(loop.run_in_executor(b.pool, b.cluster.admin.apps.delete_namespaced_deployment, name, ns)
                           for name in names))
    await b.until(lambda: all(v.deleted_seen for k, v in b.observer.nodes_snapshot().items() if k not in before),
                  b.args.deadline, "every node home")
    b.lines.append(f"  all nodes home after deletion  {time.monotonic() - t1:.1f}s")
    await b.nodes_closed(30)  # their last events (node_finished) belong to the count
    actions = await count_actions(b, started)
    unschedulable = {f"{ns}/{p.name}": since for p in pods
                     if (since := p.unschedulable_seen or p.unschedulable_cond) is not None}
    bound_at = {f"{ns}/{p.name}": p.scheduled_seen for p in pods if p.scheduled_seen is not None}
    b.lines[split_at:split_at] = plan_lines(actions, unschedulable, bound_at)
    b.lines += [f"  batches                        {len(actions.batches)}",
                f"  Temporal actions               {actions.actions} ({actions.actions / n:.1f} per pod; "
                + ", ".join(f"{k} {v}" for k, v in sorted(actions.by_kind.items(), key=lambda kv: -kv[1])) + ")",
                f"  workflow runs / tasks / events {actions.runs} / {actions.workflow_tasks} / {actions.events} "
                f"({actions.workflow_tasks / n:.1f} workflow tasks per pod)",
                "  activities scheduled           " + ", ".join(
                    f"{k} {v}" for k, v in sorted(actions.activities.items(), key=lambda kv: -kv[1])[:10]),
                f"  local activities               {actions.local_activities} (audit records, hub-hold checks)",
                *actions.queue_lines()]


def plan_lines(actions: ActionCount, unschedulable: dict[str, datetime], bound: dict[str, datetime],
               slow: float = 5.0) -> list[str]:
    """Unschedulable -> plan for every pod a plan placed (each plan_batch of every run, read from the histories),
    split at the watcher's signal; the pods no plan placed (the scheduler bound them first on room a plan made for
    others: a 4-GPU node planned for 3 pods), Unschedulable -> bound; then, for the pods planned more than ``slow``
    seconds after their signal, where the time went: waiting to be asked about (a round under way when they came,
    a back-off), or asked and not placed."""
    placed_at: dict[str, PlanRound] = {}
    for r in sorted(actions.rounds, key=lambda r: r.done_at):
        for pod in r.placed:
            placed_at.setdefault(pod, r)
    signalled = actions.signalled
    pods = [k for k in unschedulable if k in placed_at]
    to_plan = [(placed_at[k].done_at - unschedulable[k]).total_seconds() for k in pods]
    to_signal = [(signalled[k] - unschedulable[k]).total_seconds() for k in pods if k in signalled]
    signal_to_plan = {k: (placed_at[k].done_at - signalled[k]).total_seconds() for k in pods if k in signalled}
    never = [k for k in unschedulable if k not in placed_at]
    never_bound = [(bound[k] - unschedulable[k]).total_seconds() for k in never if k in bound]
    lines = [f"  Unschedulable -> plan          {fmt(to_plan)} ({len(actions.rounds)} plans)",
             f"    no plan placed {len(never)} pod(s) (bound first on room planned for others): Unschedulable -> "
             f"bound {fmt(never_bound)}",
             f"    of which -> the watcher's signal {fmt(to_signal)}",
             f"    and signal -> plan           {fmt(list(signal_to_plan.values()))}"]
    tail = [k for k, v in signal_to_plan.items() if v > slow]
    if not tail:
        return lines
    to_asked, asked_to_placed, rounds_before = [], [], []
    whys: dict[str, int] = {}
    for k in tail:
        asked = sorted((r for r in actions.rounds if k in r.asked and r.done_at <= placed_at[k].done_at),
                       key=lambda r: r.asked_at)
        first = asked[0] if asked else placed_at[k]
        to_asked.append((first.asked_at - signalled[k]).total_seconds())
        asked_to_placed.append((placed_at[k].done_at - first.asked_at).total_seconds())
        rounds_before.append(float(len(asked) - 1))
        for r in asked[:-1]:
            why = r.unplaced.get(k, "asked, neither placed nor unplaced")
            why = why.split(":")[0][:60]
            whys[why] = whys.get(why, 0) + 1
    lines += [f"    {len(tail)} pod(s) planned more than {slow:.0f}s after their signal:",
              f"      signal -> first asked in a plan {fmt(to_asked)}",
              f"      first asked -> placed          {fmt(asked_to_placed)}",
              f"      plans that asked and did not place them {fmt(rounds_before)}"]
    lines += [f"      not placed because: {why} ({n} times)"
              for why, n in sorted(whys.items(), key=lambda kv: -kv[1])[:5]]
    return lines


class Profiler:
    """py-spy sampling the worker (the ``bench`` extra installs it): the functions the worker spent its samples
    in, ours and the libraries', printed as the share of non-idle samples."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path) -> None:
        self.proc, self.out = proc, out

    @classmethod
    def start(cls, pid: int, out: Path) -> Profiler:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            raise SystemExit("--profile needs py-spy: pip install -e '.[bench]'")
        proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "50",
                                 "--nonblocking", "--output", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        return cls(proc, out)

    def stop(self, top: int = 12) -> list[str]:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return summarize_profile(self.out, top)


OUR_PACKAGES = ("activities", "workflows", "worker", "models", "gateway", "node", "planning", "tunnel", "common")


def summarize_profile(path: Path, top: int) -> list[str]:
    """From py-spy's collapsed stacks (``frame;frame;... count``): the top frames by own samples, and our own
    functions (``OUR_PACKAGES``) by samples spent in them and below."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return [f"  profile: py-spy wrote no {path}"]
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")[1:]  # the first is the thread
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            if any(f"({pkg}/" in frame or f"/{pkg}/" in frame for pkg in OUR_PACKAGES):
                inclusive[frame] = inclusive.get(frame, 0) + count
    if not total:
        return ["  profile: no samples"]

    def rows(counts: dict[str, int]) -> list[str]:
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [f"    {100 * c / total:5.1f} %  {f[:110]}" for f, c in ranked]

    return [f"  profile: {total} samples of the worker's busy threads (py-spy, 50/s), {path}",
            "  by own samples:", *rows(own), "  our functions, with what they call:", *rows(inclusive)]


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
    lines: list[str] = []
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
        cluster.create_kwok_node("home-cpu", gpus=0)  # the scheduler then wakes pending pods on node events

        temporal_log = workdir / "temporal.log"
        with output_to(temporal_log):
            env = await start_dev_server()
        stack.push_async_callback(env.shutdown)
        burst = await loop.run_in_executor(pool, build_stack, cluster, workdir / "burst")
        queue = f"bench-{run}"
        settings = burst.settings(temporal_address=env.client.service_client.config.target_host, task_queue=queue,
                                  locations=sim_locations(args.capacity, args.boot_seconds), cluster_name=queue,
                                  serve_check_seconds=args.serve_check_seconds,
                                  batch_idle_seconds=args.batch_idle_seconds,
                                  batch_load_idle_seconds=args.batch_load_idle_seconds,
                                  batch_load_max_seconds=args.batch_load_max_seconds)
        observer = ClusterObserver(Kube.from_kubeconfig(plane.admin_kubeconfig).api,
                                   pod_selector=f"{BENCH_LABEL}={run}",
                                   node_selector="gpu.kubeon.io/operation").start()
        stack.callback(observer.stop)
        worker_log = workdir / "worker.log"
        telemetry_env: dict[str, str] = {}
        if args.telemetry == "on":
            # Traces to a real OTLP/HTTP receiver, and /metrics scraped every 5 s as Prometheus would.
            receiver = stack.enter_context(OtlpReceiver())
            telemetry_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "kubeon-bench"}
            settings = settings.model_copy(update={"health_port": free_port()})
        proc = worker_process(settings, worker_log, {**telemetry_env,
                              "KUBEON_GATEWAY_NODE_CIDR_MASK": str(node_cidr_mask(args.ops))}, stack=burst)
        stack.callback(stop_worker, proc)
        await wait_worker_started(proc, worker_log)
        sampler = ProcessSampler(proc.pid).start()
        stack.callback(sampler.stop)
        b = Bench(args=args, clock=clock, run=run, cluster=cluster, temporal=env.client, settings=settings,
                  worker=proc, sampler=sampler, observer=observer, pool=pool, lines=lines)
        scrapes: list[float] = []
        if args.telemetry == "on":
            scraper = asyncio.create_task(scrape_forever(settings.health_port, scrapes))
            stack.callback(scraper.cancel)
        try:
            policy = f"bench-{run}"  # one policy: the watcher gives a pod to the first matching one by name
            b.create_policy(policy)
            await idle_scenario(b, args.latency_samples, policy)
            await load_scenario(b, args.ops)
        finally:
            sampler.sample()
            lines += [f"worker peak RSS {sampler.mib(sampler.peak_rss_kib):.0f} MiB "
                      f"(VmHWM {sampler.mib(sampler.last_hwm_kib):.0f} MiB), CPU seconds in all "
                      f"{cpu_seconds(proc.pid) or math.nan:.1f}; telemetry {args.telemetry}"]
            if args.telemetry == "on":
                lines += [f"spans received {len(receiver.snapshot())} in {receiver.requests} OTLP requests; "
                          f"/metrics scraped {len(scrapes)} times, {fmt(scrapes)}"]
            print("=" * 100)
            print(f"KubeOn burst benchmark (by batch), sim boot {args.boot_seconds}s, {os.cpu_count()} CPU(s)")
            print("\n".join(lines))
            print("=" * 100, flush=True)
    left = children()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.burst_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=200, help="Deployments created at once (0: skip)")
    p.add_argument("--latency-samples", type=int, default=10, help="Deployments one at a time (0: skip)")
    p.add_argument("--serve-check-seconds", type=int, default=1, help="the worker's serve_check_seconds")
    p.add_argument("--capacity", type=int, default=1000, help="simulated capacity of each sim location")
    p.add_argument("--boot-seconds", type=float, default=0.0, help="simulated boot delay of an instance")
    p.add_argument("--batch-idle-seconds", type=float, default=Settings.model_fields["batch_idle_seconds"].default,
                   help="the worker's batch idle window (KUBEON_BATCH_IDLE_SECONDS)")
    p.add_argument("--batch-load-idle-seconds", type=float,
                   default=Settings.model_fields["batch_load_idle_seconds"].default,
                   help="the worker's batch idle window under load (KUBEON_BATCH_LOAD_IDLE_SECONDS)")
    p.add_argument("--batch-load-max-seconds", type=float,
                   default=Settings.model_fields["batch_load_max_seconds"].default,
                   help="the worker's longest batch window under load (KUBEON_BATCH_LOAD_MAX_SECONDS)")
    p.add_argument("--telemetry", choices=("on", "off"), default="off",
                   help="on: traces to a local OTLP/HTTP receiver and /metrics scraped every 5 s")
    p.add_argument("--profile", type=Path, default=None,
                   help="profile the worker with py-spy during the load scenario (collapsed stacks to this file)")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds any one wait may take")
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
