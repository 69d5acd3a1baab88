"""Sharing decision cost: N GPU nodes' pods measured and decided in one resync (time, Prometheus queries), against a
real Prometheus scraping the DCGM exporter fixture with backfilled history. Every node has 4 GPUs with 4 pods;
every fifth node is busy (60 %), the others quiet (5 %) with 4 pods waiting each; MIG is allowed too.

    .venv/bin/python -m bench.sharing_bench                 # --nodes 100 --rounds 5
    .venv/bin/python -m bench.sharing_bench --rollout 20    # --budget 2: see bench/sharing_rollout.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.prometheus import backfilled
from planning.sharing import GpuPod
from planning.sharing import NodeFacts
from planning.sharing import Rule
from planning.sharing import decide
from tests.harness.dcgm_exporter import DcgmExporter

RULE = Rule(threshold=0.4, min_coverage=0.9, window="1h", max_replicas=4,
            mig_allowed=("all-1g.10gb", "all-3g.40gb", "all-balanced"), usd_per_gpu_hour=4.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sharing_bench", description=__doc__)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history-minutes", type=int, default=70)
    parser.add_argument("--rollout", type=int, default=0, metavar="NODES",
                        help="instead: a MIG rollout over this many nodes under a disruption budget")
    parser.add_argument("--budget", type=int, default=2, help="the rollout's spec.maxNodesAtOnce")
    args = parser.parse_args(argv)
    if args.rollout:
        from bench.sharing_rollout import main as rollout

        return rollout(["--nodes", str(args.rollout), "--budget", str(args.budget)])

    exporter = DcgmExporter().start()
    try:
        nodes = []
        for n in range(args.nodes):
            host = f"gpu-{n:04d}"
            exporter.add_node(host, gpus=4)
            pods = tuple(GpuPod(f"ns-{n % 10}", f"{host}-p{i}", 1) for i in range(4))
            for p in pods:
                exporter.assign(p.namespace, p.name, activity=0.6 if n % 5 == 0 else 0.05, fb_used_mib=8192)
            nodes.append(NodeFacts(name=host, product="NVIDIA-A100-SXM4-80GB", gpus=4, pods=pods,
                                   waiting=tuple(GpuPod("ns-w", f"{host}-w{i}", 1) for i in range(4))))
        with backfilled(exporter, args.history_minutes) as (client, backfill_s):
            measure, decide_s, queries, proposed = [], [], [], 0
            for _ in range(args.rounds):
                before = client.queries
                t0 = time.monotonic()
                usage = client.pod_memory([], 3600)
                t1 = time.monotonic()
                verdicts = [decide(node, usage, RULE) for node in nodes]
                t2 = time.monotonic()
                measure.append(t1 - t0)
                decide_s.append(t2 - t1)
                queries.append(client.queries - before)
                proposed = sum(1 for v in verdicts if v.proposals)
    finally:
        exporter.stop()
    print(f"sharing decision cost: {args.nodes} nodes x 4 GPUs ({args.nodes * 4} pods), 1h window, "
          f"{args.history_minutes}m history (backfill {backfill_s:.1f}s)")
    print(f"  per resync: Prometheus {statistics.median(measure) * 1000:.0f} ms median / {max(measure) * 1000:.0f} ms "
          f"max in {queries[0]} queries; decide {statistics.median(decide_s) * 1000:.1f} ms median; "
          f"{proposed} node(s) proposed, {args.nodes - proposed} not")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
