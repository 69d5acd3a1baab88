"""Scale decision cost: N GPU pods' metrics evaluated in one resync (time, Prometheus queries), against a real
Prometheus scraping the DCGM exporter fixture with 40 minutes of backfilled history.

    .venv/bin/python -m bench.scale_bench                 # --pods 1000 --namespaces 10 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.prometheus import backfilled
from planning.idle import judge_idle
from tests.harness.dcgm_exporter import DcgmExporter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scale_bench", description=__doc__)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--namespaces", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history-minutes", type=int, default=40)
    args = parser.parse_args(argv)

    exporter = DcgmExporter().start()
    try:
        nodes = (args.pods + 7) // 8
        for n in range(nodes):
            exporter.add_node(f"gpu-{n:04d}", gpus=8)
        pods = []
        for i in range(args.pods):
            ns = f"ns-{i % args.namespaces}"
            # Every tenth pod busy: the verdicts are not all the same.
            exporter.assign(ns, f"pod-{i:05d}", activity=0.5 if i % 10 == 0 else 0.01, fb_used_mib=4096)
            pods.append((ns, f"pod-{i:05d}"))
        namespaces = sorted({ns for ns, _ in pods})
        with backfilled(exporter, args.history_minutes) as (client, backfill_s):
            times, queries, idle = [], [], 0
            for _ in range(args.rounds):
                before = client.queries
                t0 = time.monotonic()
                activity = client.pod_activity(namespaces, 1800)
                idle = 0
                for ns in namespaces:  # one verdict per workload of 1 pod: the watcher's per-workload loop
                    for key in [p for p in pods if p[0] == ns]:
                        idle += judge_idle([key], activity, threshold=0.05, idle_for_s=1800,
                                           min_coverage=0.9).idle
                times.append(time.monotonic() - t0)
                queries.append(client.queries - before)
    finally:
        exporter.stop()
    print(f"scale decision cost: {args.pods} GPU pods in {args.namespaces} namespaces, 30m window, "
          f"{args.history_minutes}m history (backfill {backfill_s:.1f}s)")
    print(f"  per resync: median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms, "
          f"{queries[0]} Prometheus queries; {idle} idle / {args.pods - idle} not idle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
