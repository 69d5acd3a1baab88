"""`kubeon-gpu`: the optimizer's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import yaml

from models.hub import HubSyncStatus
from models.operation import OperationView, ProvisionView
from models.policy import PolicyError, parse_policy


def _validate(args: argparse.Namespace) -> int:
    """Validate GpuPolicy files as the optimizer would; print each problem with its field."""
    failed = 0
    for path in args.files:
        try:
            docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as exc:
            print(f"{path}: cannot read: {exc}", file=sys.stderr)
            failed += 1
            continue
        for index, doc in enumerate(docs):
            where = f"{path}" + (f"[{index}]" if len(docs) > 1 else "")
            try:
                policy = parse_policy(doc)
            except PolicyError as exc:
                failed += 1
                for field, msg in exc.errors:
                    print(f"{where}: {field}: {msg}", file=sys.stderr)
                continue
            mode = policy.spec.effective_mode(args.default_mode)
            print(f"{where}: ok: {policy.name} ({policy.spec.kind}, mode {mode})")
    return 1 if failed else 0


def _version(_: argparse.Namespace) -> int:
    print(json.dumps({"kubeon-gpu-optimizer": metadata.version("kubeon-gpu-optimizer")}))
    return 0


def _worker(_: argparse.Namespace) -> int:
    from worker.config import load_settings
    from worker.main import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(load_settings()))
    return 0


def _gateway(_: argparse.Namespace) -> int:
    from worker.gateway_server import main as gateway_main

    gateway_main()
    return 0


def _ops(args: argparse.Namespace) -> int:
    from models.operation import Approval, Rejection
    from worker import ops
    from worker.config import load_settings
    from worker.runtime import connect_temporal

    async def run() -> int:
        settings = load_settings({**os.environ, "KUBEON_CLUSTER": os.environ.get("KUBEON_CLUSTER") or "unset"})
        temporal = await connect_temporal(settings)
        try:
            if args.ops_command == "list":
                rows = await ops.list_operations(temporal, cluster=args.cluster)
                print(ops.rows_json(rows) if args.json else ops.render_table(rows))
            elif args.ops_command == "show":
                view = await ops.show(temporal, args.operation)
                print(view.model_dump_json(indent=2) if args.json else _render_view(view))
            elif args.ops_command == "approve":
                result = await ops.approve(temporal, args.operation, Approval(
                    approver=args.approver, plan_id=args.plan, reason=args.reason))
                print(f"{result.operation}: {result.message}")
            elif args.ops_command == "reject":
                result = await ops.reject(temporal, args.operation, Rejection(approver=args.approver,
                                                                               reason=args.reason))
                print(f"{result.operation}: {result.message}")
            elif args.ops_command == "hub":
                status = await ops.hub_status(temporal, args.cluster or settings.cluster)
                print(status.model_dump_json(indent=2) if args.json else _render_hub(status))
            elif args.ops_command == "cancel":
                print(f"cancel requested for {await ops.cancel(temporal, args.operation)}: it drains and removes "
                      "what it made")
        except (ops.OperationNotFound, ops.DecisionRefused) as exc:
            print(f"kubeon-gpu ops {args.ops_command}: {exc}", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(run())


def _render_hub(status: HubSyncStatus) -> str:
    lines = [f"cluster          {status.cluster}", f"state            {status.state}"
             + (f": {status.message}" if status.message else ""),
             f"polls            {status.polls} (last {status.last_poll_at or 'never'})",
             f"approvals cursor {status.approvals_cursor}",
             f"reports queued   {status.pending_reports}"
             + (f" ({status.dropped_reports} dropped)" if status.dropped_reports else "")]
    if status.last_sync:
        lines.append(f"policies         hub revision {status.last_sync.revision}: {status.last_sync.summary()}")
        lines += [f"  invalid        {name}: {why}" for name, why in sorted(status.last_sync.invalid.items())]
    return "\n".join(lines)


def _render_view(view: OperationView | ProvisionView) -> str:
    if isinstance(view, ProvisionView):
        return _render_provision(view)
    lines = [f"operation  {view.operation}", f"workflow   {view.workflow_id}", f"policy     {view.policy}",
             f"batch      {view.batch}", f"phase      {view.phase.value}"]
    if view.message:
        lines.append(f"message    {view.message}")
    if view.node:
        lines.append(f"planned    {view.node.offering.describe()}")
        lines.append(f"for pods   {', '.join(view.node.pods)}")
    if view.instance:
        lines.append(f"instance   {view.instance.instance_id} ({view.instance.instance_type}) in "
                     f"{view.instance.location}")
    if view.node_name:
        lines.append(f"node       {view.node_name}")
    lines.append("history")
    lines += [f"  {h}" for h in view.history]
    return "\n".join(lines)


def _render_provision(view: ProvisionView) -> str:
    lines = [f"workflow   {view.workflow_id}", f"policy     {view.policy}", f"mode       {view.mode}",
             f"phase      {view.phase.value}" + (f": {view.message}" if view.message else ""),
             f"nodes      {len(view.nodes)} of maxNodes {view.max_nodes}"]
    lines += [f"  {n.workflow_id} {n.node_name} {n.offering.instance_type} in {n.offering.location} "
              f"(batch {n.batch}): {', '.join(n.pods)}" for n in view.nodes]
    if view.proposal:
        lines.append(f"proposal   batch {view.proposal.batch}, awaiting approval")
        lines += [f"  {line}" for line in view.proposal.plan.lines()]
        lines += [f"  refused  {r}" for r in view.proposal.plan.refused]
    if view.waiting:
        lines.append(f"waiting    {len(view.waiting)} pod(s)")
        lines += [f"  {w}" for w in view.waiting]
    lines.append("batches")
    for b in view.batches:
        lines.append(f"  {b.batch} {b.phase.value}" + (f" by {b.approver}" if b.approver else "")
                     + f": {b.plan.summary()}" + (f" ({b.message})" if b.message else ""))
        lines += [f"    node {wf}" for wf in b.nodes]
    lines.append("history")
    lines += [f"  {h}" for h in view.history]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeon-gpu", description="KubeOn GPU optimizer")
    sub = parser.add_subparsers(dest="command", required=True)

    policy = sub.add_parser("policy", help="work with GpuPolicy documents")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    validate = policy_sub.add_parser("validate", help="validate GpuPolicy YAML files")
    validate.add_argument("files", nargs="+")
    validate.add_argument("--default-mode", default="Recommend", choices=["Recommend", "Approve", "Automatic"],
                          help="the installation's defaultMode, for policies that set none")
    validate.set_defaults(func=_validate)

    sub.add_parser("version", help="print the version").set_defaults(func=_version)
    sub.add_parser("worker", help="run the Temporal worker and the pending-pod watcher").set_defaults(
        func=_worker)
    sub.add_parser("gateway", help="run the burst gateway (node admission and removal)").set_defaults(
        func=_gateway)
    sub.add_parser("hub", help="run the self-hosted hub (`kubeon-gpu hub --help`)")

    ops_parser = sub.add_parser("ops", help="list, show, approve, reject and cancel operations")
    ops_sub = ops_parser.add_subparsers(dest="ops_command", required=True)
    listing = ops_sub.add_parser("list", help="operations, newest first")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--cluster", help="only this cluster's operations")
    showing = ops_sub.add_parser("show", help="one operation: phase, plan, instance, history")
    showing.add_argument("operation", help="operation ID (op-...) or workflow ID")
    showing.add_argument("--json", action="store_true")
    approving = ops_sub.add_parser("approve", help="approve the proposed plan (refused if stale)")
    approving.add_argument("operation")
    approving.add_argument("--plan", help="approve only if this is still the proposed plan")
    approving.add_argument("--approver", default=os.environ.get("USER") or "cli")
    approving.add_argument("--reason", default="")
    rejecting = ops_sub.add_parser("reject", help="reject the proposed plan")
    rejecting.add_argument("operation")
    rejecting.add_argument("--approver", default=os.environ.get("USER") or "cli")
    rejecting.add_argument("--reason", default="")
    cancelling = ops_sub.add_parser("cancel", help="cancel: drain and remove what the operation made")
    cancelling.add_argument("operation")
    hub_sync = ops_sub.add_parser("hub", help="the hub sync: state, last policy sync, queued reports")
    hub_sync.add_argument("--cluster", help="the cluster (default KUBEON_CLUSTER)")
    hub_sync.add_argument("--json", action="store_true")
    ops_parser.set_defaults(func=_ops)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hub"]:  # the hub parses its own options (and --help)
        from hub.server import serve as hub_serve

        return int(hub_serve(argv[1:], prog="kubeon-gpu hub") or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
