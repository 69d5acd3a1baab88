"""A day of `make dev`-like audit records, generated and written through the real audit log (``AuditLog.write``).

`make dev` runs the `dev` cluster with the sim locations `sim/eu-west` and `sim/us-east`, an on-prem pool and the
example policies (burst, scale-to-zero); over a day its workflows write, per burst batch, ``proposed``,
``approved`` (or ``rejected``/``expired``) and per node ``launched``, ``joined``, ``verified``, later ``drained``
and ``removed`` (some ``failed``, retried in the next zone); per idle workload ``proposed``, ``approved``,
``scaled``, ``woken``. The records here are those, with their details (a proposal carries its plan as JSON), at
the times of a 24-hour day, written from several threads at once as concurrent activities do. Deterministic for a
seed; the chain fields are the writer's, never made here.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from datetime import timedelta

from activities.clients.audit_log import AuditLog
from models.audit import AuditRecord
from models.hub import scale_proposal_detail

CLUSTER = "dev"
DAY = datetime(2025, 3, 1, tzinfo=UTC)
BURST_POLICIES = ("inference-burst-eu", "training-burst-any")
LOCATIONS = ("sim/eu-west", "sim/us-east", "onprem/dc1")


@dataclass(frozen=True)
class DayPlan:
    batches: int = 160  # burst batches over the day: ~7 an hour
    idle_workloads: int = 60  # scale-to-zero decisions


def _op(rng: random.Random) -> str:
    return "op-" + "".join(rng.choice("0123456789abcdef") for _ in range(12))


def _batch(rng: random.Random, at: datetime, index: int) -> Iterator[AuditRecord]:
    policy = rng.choice(BURST_POLICIES)
    batch = _op(rng)
    nodes = rng.randint(1, 4)
    location = rng.choice(LOCATIONS)

    def rec(action: str, t: datetime, **kw: object) -> AuditRecord:
        op = str(kw.pop("operation", batch))
        return AuditRecord(key=f"{op}/{action}", at=t, cluster=CLUSTER, policy=policy, operation=op,
                           action=action, **kw)

    plan = {"plan_id": f"plan-{index}", "batch": batch, "summary": f"{nodes} node(s) in {location}",
            "total_usd_per_hour": round(0.95 * nodes, 2),
            "nodes": [{"location": location, "instance_type": "g6.xlarge", "gpus": 1, "gpu_product": "NVIDIA-L4",
                       "pods": [f"llm-{index}-{n}"]} for n in range(nodes)]}
    yield rec("proposed", at, location=location, detail=json.dumps(plan, separators=(",", ":")))
    decided = at + timedelta(seconds=rng.randint(5, 300))
    outcome = rng.random()
    if outcome < 0.05:
        yield rec("rejected", decided, approver="alice", detail="not today")
        return
    if outcome < 0.08:
        yield rec("expired", decided, detail="no decision within the approval timeout")
        return
    yield rec("approved", decided, location=location, approver=rng.choice(("alice", "bob", "hub:otto")),
              detail=plan["summary"])
    for _ in range(nodes):
        node_op = _op(rng)
        instance = f"i-{rng.getrandbits(48):012x}"
        node = f"burst-{node_op}"
        t = decided + timedelta(seconds=rng.randint(1, 20))
        where = {"location": location, "instance_id": instance}
        yield rec("launched", t, operation=node_op, **where, detail=f"g6.xlarge in {location}")
        if rng.random() < 0.04:
            yield rec("failed", t + timedelta(minutes=2), operation=node_op, **where,
                      detail="join timed out; the next zone is tried")
            continue
        t += timedelta(seconds=rng.randint(30, 120))
        yield rec("joined", t, operation=node_op, node_name=node, **where, detail="ticket redeemed, tunnel up")
        t += timedelta(seconds=rng.randint(5, 60))
        yield rec("verified", t, operation=node_op, node_name=node, **where, detail="Ready, GPUs allocatable")
        t += timedelta(minutes=rng.randint(10, 240))
        yield rec("drained", t, operation=node_op, node_name=node, **where, detail="idle: pods evicted, PDBs kept")
        yield rec("removed", t + timedelta(minutes=1), operation=node_op, node_name=node, **where,
                  detail="instance terminated, Node deleted")


def _idle(rng: random.Random, at: datetime, index: int) -> Iterator[AuditRecord]:
    op = _op(rng)
    workload = f"team-{index % 5}/llm-{index}"

    def rec(action: str, t: datetime, **kw: object) -> AuditRecord:
        return AuditRecord(key=f"{op}/{action}", at=t, cluster=CLUSTER, policy="scale-to-zero-inference",
                           operation=op, action=action, **kw)

    yield rec("proposed", at, detail=scale_proposal_detail(
        plan_id=f"{op}-r2", summary=f"scale {workload} from 2 to 0 replicas", workload=workload, replicas=2,
        idle_evidence="idle for 30 min (GPU util 1%)"))
    yield rec("approved", at + timedelta(minutes=1), approver="bob", detail=workload)
    yield rec("scaled", at + timedelta(minutes=2), detail=f"{workload}: 2 -> 0 replicas")
    yield rec("woken", at + timedelta(hours=rng.randint(1, 6)), approver="bob", detail=f"{workload}: back to 2")


def day_records(seed: int = 27, plan: DayPlan = DayPlan()) -> list[list[AuditRecord]]:
    """The day's operations, each as its records in the order its workflow writes them."""
    rng = random.Random(seed)
    ops: list[list[AuditRecord]] = []
    for i in range(plan.batches):
        ops.append(list(_batch(rng, DAY + timedelta(seconds=rng.randint(0, 86_000)), i)))
    for i in range(plan.idle_workloads):
        ops.append(list(_idle(rng, DAY + timedelta(seconds=rng.randint(0, 80_000)), i)))
    return ops


def write_day(log: AuditLog, *, threads: int = 8, seed: int = 27, plan: DayPlan = DayPlan(),
              retries: float = 0.1) -> list[AuditRecord]:
    """Write the day through ``log`` from ``threads`` threads at once (each operation's records in order, as one
    workflow writes them), retrying a share of the records as a re-run activity does. Returns the stored records
    of the first writes, in the order they were acknowledged."""
    ops = day_records(seed, plan)
    rng = random.Random(seed + 1)
    retried = {r.key for op in ops for r in op if rng.random() < retries}
    stored: list[AuditRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def work(mine: list[list[AuditRecord]]) -> None:
        try:
            start.wait()
            for op in mine:
                for record in op:
                    written, new = log.write(record)
                    assert new, f"{record.key} written before"
                    if record.key in retried:
                        again, new = log.write(record)
                        assert not new and again == written, f"{record.key} written twice"
                    with lock:
                        stored.append(written)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(ops[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return stored


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.harness.audit_day FILE SEED [GO]``: another worker process writing its own day's
    operations into the same audit log (a shared volume), two threads at once. With GO, it writes ``GO.ready-SEED``
    once imported and set up, then starts writing only when the file GO exists (at most 120 s later), so that a test
    can start every writer at the same moment."""
    import sys
    import time
    from pathlib import Path

    args = argv or sys.argv[1:]
    path, seed = args[:2]
    log = AuditLog(Path(path))
    if len(args) > 2:
        go = Path(args[2])
        Path(f"{go}.ready-{seed}").touch()
        deadline = time.monotonic() + 120
        while not go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.005)
    write_day(log, threads=2, seed=int(seed), plan=DayPlan(batches=20, idle_workloads=10))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
