"""`kubeon-gpu`: the optimizer's command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker's and the models' imports stay lazy: `kubeon-gpu node join` starts fast
    from activities.capacity.aks import AksNodePoolsCapacity
    from activities.capacity.eks import EksNodeGroupsCapacity
    from activities.capacity.gke import GkeNodePoolsCapacity
    from models.autoscaling import GpuProductsView
    from models.hub import HubSyncStatus
    from models.node import OperationView
    from models.packing import PackView
    from models.provisioning import ProvisionView
    from models.scale import ScaleView
    from models.sharing import SharingView
    from worker.config import Settings
    from worker.main import RuntimeFactory


def _validate(args: argparse.Namespace) -> int:
    """Validate GpuPolicy files as the optimizer would; print each problem with its field."""
    import yaml

    from models.policy import PolicyError
    from models.policy import parse_policy

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
    from importlib import metadata

    print(json.dumps({"kubeon-gpu-optimizer": metadata.version("kubeon-gpu-optimizer")}))
    return 0


def _worker(_: argparse.Namespace) -> int:
    return run_worker()


def run_worker(build: RuntimeFactory | None = None) -> int:
    """``kubeon-gpu worker``: logging, tracing, then the worker until SIGTERM; ``build`` makes its runtime (the
    test harness hands one that holds an in-process gateway)."""
    import asyncio

    from worker import telemetry
    from worker.config import ConfigError
    from worker.config import load_settings
    from worker.main import serve
    from worker.runtime import build_runtime

    try:
        telemetry.configure_logging()
        tracing = telemetry.setup_tracing("kubeon-gpu-worker")
    except ConfigError as exc:
        print(f"kubeon-gpu worker: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(load_settings(), build=build or build_runtime))
    finally:
        if tracing is not None:
            tracing.shutdown()  # flush the spans still queued
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """R1.6: print what the optimizer finds and misses, what a missing one disables and how to fix it."""
    from activities.clients.prometheus import PrometheusClient
    from common.kube import kube_api
    from worker.config import load_settings
    from worker.doctor import as_json
    from worker.doctor import render
    from worker.doctor import run_checks

    overrides = {"KUBEON_CLUSTER": os.environ.get("KUBEON_CLUSTER") or "unset"}
    if args.kubeconfig:
        overrides["KUBEON_KUBECONFIG"] = args.kubeconfig
    if args.prometheus_url is not None:
        overrides["KUBEON_PROMETHEUS_URL"] = args.prometheus_url
    settings = load_settings({**os.environ, **overrides})
    metrics = PrometheusClient(settings.prometheus_url, timeout=5) if settings.prometheus_url else None
    try:
        prereqs = run_checks(kube_api(settings.kubeconfig), metrics,
                             gpu_operator_namespace=settings.gpu_operator_namespace,
                             capacity_provider=settings.capacity_provider,
                             time_slicing_configmap=settings.time_slicing_configmap,
                             capacity=_doctor_capacity(settings))
    finally:
        if metrics is not None:
            metrics.close()
    print(json.dumps(as_json(prereqs), indent=2) if args.json else render(prereqs))
    return 0


def _doctor_capacity(settings: Settings) -> EksNodeGroupsCapacity | AksNodePoolsCapacity | GkeNodePoolsCapacity | None:
    """The managed node groups' provider `doctor` lists the groups through (None: checked from the cluster)."""
    from common.kube import kube_api
    from worker.config import managed_capacity

    if settings.capacity_provider not in ("eks-nodegroups", "aks-nodepools", "gke-nodepools"):
        return None
    return managed_capacity(kube_api(settings.kubeconfig), settings)


def _gateway(_: argparse.Namespace) -> int:
    from gateway.main import main as gateway_main

    gateway_main()
    return 0


def _console(args: argparse.Namespace) -> int:
    import uvicorn

    from worker.console import ConsoleSettings
    from worker.console import create_app

    host, _, port = args.listen.rpartition(":")
    app = create_app(ConsoleSettings(upstream=args.upstream, namespace=args.namespace))
    print(f"kubeon-gpu console: the Temporal UI at {args.upstream} with the Kubeon columns, on "
          f"http://{args.listen}/ (opens the operations awaiting approval)", flush=True)
    uvicorn.run(app, host=host or "127.0.0.1", port=int(port), log_level="warning")
    return 0


def _node_join(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.join import JoinError
    from node.join import main_join

    capacity = dict(kv.split("=", 1) for kv in args.capacity.split(",") if "=" in kv) if args.capacity else {}
    try:
        return main_join(Path(args.config), Path(args.state_dir), interface=args.interface,
                         kubelet_command=args.kubelet_command, provider_id=args.provider_id, capacity=capacity,
                         tunnel=not args.no_tunnel, retry_seconds=args.retry_seconds,
                         gpu_health_command=args.gpu_health_command)
    except (JoinError, OSError, ValueError) as exc:
        print(f"kubeon-gpu node join: {exc}", file=sys.stderr)
        return 1


def _node_renew(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.join import JoinError
    from node.join import main_renew

    try:
        return main_renew(Path(args.state_dir), kubelet_command=args.kubelet_command, force=args.force)
    except (JoinError, OSError, ValueError) as exc:
        print(f"kubeon-gpu node renew: {exc}", file=sys.stderr)
        return 1


def _ops(args: argparse.Namespace) -> int:
    import asyncio

    from models.decisions import Approval
    from models.decisions import Rejection
    from worker import ops
    from worker.config import load_settings
    from worker.runtime import connect_temporal

    if args.ops_command == "fit":
        from common.kube import kube_api

        env = {**os.environ, "KUBEON_CLUSTER": os.environ.get("KUBEON_CLUSTER") or "unset"}
        if args.kubeconfig:
            env["KUBEON_KUBECONFIG"] = args.kubeconfig
        rows = ops.fit_recommendations(kube_api(load_settings(env).kubeconfig))
        print(json.dumps(rows, indent=2) if args.json else ops.render_fit(rows))
        return 0

    async def run() -> int:
        settings = load_settings({**os.environ, "KUBEON_CLUSTER": os.environ.get("KUBEON_CLUSTER") or "unset"})
        temporal = await connect_temporal(settings)
        try:
            if args.ops_command == "list":
                rows = await ops.list_operations(temporal, cluster=args.cluster)
                print(ops.rows_json(rows) if args.json else ops.render_table(rows))
                if args.ui and not args.json:
                    print(ops.awaiting_approval_line(rows, args.ui, settings.temporal_namespace))
            elif args.ops_command == "show":
                view = await ops.show(temporal, args.operation)
                print(view.model_dump_json(indent=2) if args.json else _render_view(view))
            elif args.ops_command == "approve":
                result = await ops.approve(temporal, args.operation, Approval(
                    approver=args.approver, plan_id=args.plan, reason=args.reason))
                print(f"{result.operation}: {result.message}")
            elif args.ops_command == "wake":
                from models.scale import WakeRequest

                woken = await ops.wake(temporal, args.operation, WakeRequest(by=args.by, reason=args.reason))
                print(f"{woken.operation}: {woken.message}")
            elif args.ops_command == "undo":
                from models.sharing import UndoRequest

                undone = await ops.undo(temporal, args.operation, UndoRequest(by=args.by, reason=args.reason))
                print(f"{undone.operation}: {undone.message}")
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


def _audit(args: argparse.Namespace) -> int:
    """``audit verify [FILE] [--hub URL]``: 0 when every chain verifies, 1 naming the first broken record of each
    chain that does not, 2 when a file or the hub cannot be read."""
    import asyncio

    import httpx

    from worker import audit_verify as av

    if args.file is None and args.hub is None:
        print("kubeon-gpu audit verify: name a FILE (a worker's audit.jsonl), --hub URL, or both", file=sys.stderr)
        return 2
    outcomes: list[av.Outcome] = []
    try:
        data = None
        if args.hub is not None:
            key = (Path(args.api_key_file).read_text().strip() if args.api_key_file
                   else os.environ.get("KUBEON_HUB_API_KEY", "").strip())
            if not key:
                print("kubeon-gpu audit verify --hub: an admin API key is needed: --api-key-file F or "
                      "KUBEON_HUB_API_KEY", file=sys.stderr)
                return 2

            async def fetch() -> av.HubData:
                async with httpx.AsyncClient(base_url=args.hub.rstrip("/"), timeout=30,
                                             verify=args.ca_file or True,
                                             headers={"Authorization": f"Bearer {key}"}) as client:
                    return await av.fetch_hub(client)

            data = asyncio.run(fetch())
        if args.file is not None:
            path = Path(args.file)
            outcomes += av.verify_file_against_hub(path, data) if data is not None else [av.verify_file(path)]
        if data is not None:
            seen = {o.what for o in outcomes}
            outcomes += [o for o in av.verify_hub(data) if o.what not in seen]
    except (OSError, av.HubAccessError) as exc:
        print(f"kubeon-gpu audit verify: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([o.as_json() for o in outcomes], indent=2))
    else:
        print("\n".join(o.render() for o in outcomes) if outcomes else "nothing to verify: no chains")
    return 0 if all(o.ok for o in outcomes) else 1


def _render_hub(status: HubSyncStatus) -> str:
    lines = [f"cluster          {status.cluster}", f"state            {status.state}"
             + (f": {status.message}" if status.message else ""),
             f"polls            {status.total_polls} (last {status.last_poll_at or 'never'})",
             f"last sync        {status.last_success_at or 'never'}",
             *([f"last error       {status.last_error} ({status.last_error_at})"] if status.last_error else []),
             f"approvals cursor {status.approvals_cursor}",
             f"reports queued   {status.pending_reports}"
             + (f" ({status.dropped_reports} dropped)" if status.dropped_reports else "")]
    if status.last_sync:
        lines.append(f"policies         hub revision {status.last_sync.revision}: {status.last_sync.summary()}")
        lines += [f"  invalid        {name}: {why}" for name, why in sorted(status.last_sync.invalid.items())]
    return "\n".join(lines)


def _rows(*rows: tuple[str, object]) -> list[str]:
    """`ops show`'s lines: each label padded to the one column the values start in."""
    return [f"{label:<10} {value}" for label, value in rows]


def _rows_set(*rows: tuple[str, object]) -> list[str]:
    """The rows of what an operation has (an empty or None value says nothing, so it is not shown)."""
    return _rows(*((label, value) for label, value in rows if value))


def _with_history(lines: list[str], history: list[str]) -> str:
    return "\n".join([*lines, "history", *(f"  {h}" for h in history)])


def _render_pack(view: PackView) -> str:
    lines = _rows(("workflow", view.workflow_id), ("policy", view.policy), ("phase", view.phase))
    lines += _rows_set(("message", view.message))
    if view.plan is not None:
        lines += _rows(("plan", view.plan.summary()))
        lines += [f"  move     {m.pod} ({m.gpus} GPU) from {m.source} to {m.target}"
                  f"{f', waits for PDB {m.waits_for_pdb}' if m.waits_for_pdb else ''}" for m in view.plan.moves]
    lines += _rows_set(("removed", ", ".join(view.removed)), ("moved", ", ".join(view.moved)))
    return _with_history(lines, view.history)


def _render_gpu_products(view: GpuProductsView) -> str:
    lines = _rows(("operation", view.operation), ("workflow", view.workflow_id), ("policy", view.policy),
                  ("phase", view.phase))
    lines += _rows_set(("message", view.message))
    if view.change is not None:
        lines += _rows(("change", view.change.summary()))
    return _with_history(lines, view.history)


def _render_view(view: OperationView | ProvisionView | ScaleView | SharingView | PackView | GpuProductsView) -> str:
    from models.autoscaling import GpuProductsView
    from models.packing import PackView
    from models.provisioning import ProvisionView
    from models.scale import ScaleView
    from models.sharing import SharingView

    if isinstance(view, ProvisionView):
        return _render_provision(view)
    if isinstance(view, PackView):
        return _render_pack(view)
    if isinstance(view, GpuProductsView):
        return _render_gpu_products(view)
    if isinstance(view, SharingView):
        lines = _rows(("operation", view.operation), ("workflow", view.workflow_id), ("policy", view.policy),
                      ("node", view.node), ("mode", view.mode), ("phase", view.phase.value),
                      ("replicas", view.replicas), ("key", view.key or "-"),
                      ("previous", view.previous_label or "(none)"))
        lines += _rows_set(("message", view.message), ("unservable", ", ".join(view.unservable)))
        return _with_history(lines, view.history)
    if isinstance(view, ScaleView):
        lines = _rows(("operation", view.operation), ("workflow", view.workflow_id), ("policy", view.policy),
                      ("workload", view.workload), ("mode", view.mode), ("phase", view.phase.value))
        if view.replicas_before is not None:  # 0 is a count to show
            lines += _rows(("replicas", f"{view.replicas_before} before scale-down"))
        lines += _rows_set(("message", view.message), ("approver", view.approver), ("woken by", view.woken_by))
        return _with_history(lines, view.history)
    lines = _rows(("operation", view.operation), ("workflow", view.workflow_id), ("policy", view.policy),
                  ("batch", view.batch), ("phase", view.phase.value))
    lines += _rows_set(("message", view.message))
    if view.node:
        lines += _rows(("planned", view.node.offering.describe()), ("for pods", ", ".join(view.node.pods)))
    if view.instance:
        lines += _rows(("instance", f"{view.instance.instance_id} ({view.instance.instance_type}) in "
                                    f"{view.instance.location}"))
    lines += _rows_set(("node", view.node_name))
    if view.cost:  # issue 27: cost on actuals beside the proposal's estimate
        c = view.cost
        transfer = (f"(measured: {c.egress_bytes} B egress, {c.ingress_bytes} B ingress)" if c.transfer_measured
                    else "(estimated: not measured at the gateway)")
        lines += _rows(("cost", f"${c.total_usd:.4f}{'' if c.final else ' so far'} = compute {c.compute_hours:.3f} h "
                                f"${c.compute_usd:.4f} + transfer ${c.transfer_usd:.4f} {transfer}"),
                       ("per GPU-h", f"${c.usd_per_gpu_hour:.4f} actual, ${c.estimated_usd_per_gpu_hour:.4f} "
                                     f"estimated at the proposal (${c.estimated_usd:.4f} for the same hours)"))
    return _with_history(lines, view.history)


def _render_provision(view: ProvisionView) -> str:
    lines = _rows(("workflow", view.workflow_id), ("policy", view.policy), ("mode", view.mode),
                  ("phase", view.phase.value + (f": {view.message}" if view.message else "")),
                  ("nodes", f"{len(view.nodes)} of maxNodes {view.max_nodes}"))
    lines += [f"  {n.workflow_id} {n.node_name} {n.offering.instance_type} in {n.offering.location} "
              f"(batch {n.batch}): {', '.join(n.pods)}" for n in view.nodes]
    if view.proposal:
        lines += _rows(("proposal", f"batch {view.proposal.batch}, awaiting approval"))
        lines += [f"  {line}" for line in view.proposal.plan.lines()]
        lines += [f"  refused  {r}" for r in view.proposal.plan.refused]
    if view.waiting:
        lines += _rows(("waiting", f"{len(view.waiting)} pod(s)"))
        lines += [f"  {w}" for w in view.waiting]
    lines.append("batches")
    for b in view.batches:
        lines.append(f"  {b.batch} {b.phase.value}" + (f" by {b.approver}" if b.approver else "")
                     + f": {b.plan.summary()}" + (f" ({b.message})" if b.message else ""))
        lines += [f"    node {wf}" for wf in b.nodes]
    return _with_history(lines, view.history)


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
    console = sub.add_parser("console", help="serve the Temporal UI with the Kubeon columns, opening on the "
                                             "operations awaiting approval")
    console.add_argument("--upstream", default=os.environ.get("KUBEON_TEMPORAL_UI_URL", "http://127.0.0.1:8233"),
                         help="the Temporal UI to serve (env KUBEON_TEMPORAL_UI_URL)")
    console.add_argument("--listen", default="127.0.0.1:8234", help="host:port to serve on")
    console.add_argument("--namespace", default=os.environ.get("KUBEON_TEMPORAL_NAMESPACE", "default"))
    console.set_defaults(func=_console)
    sub.add_parser("onprem-agent", help="run on an on-prem GPU server: join bursts of its pool "
                   "(`kubeon-gpu onprem-agent --help`)")

    node = sub.add_parser("node", help="the burst node's side (run on the burst VM by its user data)")
    node_sub = node.add_subparsers(dest="node_command", required=True)
    joining = node_sub.add_parser("join", help="redeem the join ticket, bring up the tunnel, start the kubelet")
    joining.add_argument("--config", default="/etc/kubeon/join.json", help="the join document from user data")
    joining.add_argument("--state-dir", default="/var/lib/kubeon", help="keys, certificate, kubeconfig (0600)")
    joining.add_argument("--interface", default="kubeon0", help="the WireGuard interface")
    joining.add_argument("--kubelet-command", default="systemctl restart kubelet",
                         help="how the kubelet is started (KUBEON_NODE_DIR names the state directory)")
    joining.add_argument("--gpu-health-command", default="dcgmi diag -r 1",
                         help="the burn-in's GPU health check, run when the node's burn-in label names GpuHealth "
                         "(its result is posted as the Node condition gpu.kubeon.io/GpuHealthy)")
    joining.add_argument("--provider-id", default="", help="the Node's spec.providerID")
    joining.add_argument("--capacity", default="", help="capacity the kubelet reports, k=v,... (stand-ins)")
    joining.add_argument("--no-tunnel", action="store_true", help="simulated nodes only: no WireGuard")
    joining.add_argument("--retry-seconds", type=float, default=900.0,
                         help="how long to keep trying a gateway that does not answer (0: once)")
    joining.set_defaults(func=_node_join)
    renewing = node_sub.add_parser("renew", help="renew the kubelet certificate at the gateway when two thirds "
                                   "of its lifetime passed (burst nodes have no rotation of their own)")
    renewing.add_argument("--state-dir", default="/var/lib/kubeon", help="where `node join` keeps its state")
    renewing.add_argument("--kubelet-command", default="systemctl restart kubelet",
                          help="run after a renewal so the kubelet uses the new certificate ('' : none)")
    renewing.add_argument("--force", action="store_true", help="renew now, whatever the certificate's age")
    renewing.set_defaults(func=_node_renew)
    doctor = sub.add_parser("doctor", help="check the prerequisites: KubeOn agent, GPU Operator, Karpenter, DCGM")
    doctor.add_argument("--kubeconfig", help="default KUBEON_KUBECONFIG, else in-cluster credentials")
    doctor.add_argument("--prometheus-url", help="default KUBEON_PROMETHEUS_URL")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=_doctor)

    ops_parser = sub.add_parser("ops", help="list, show, approve, reject, wake and cancel operations")
    ops_sub = ops_parser.add_subparsers(dest="ops_command", required=True)
    listing = ops_sub.add_parser("list", help="operations, newest first")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--cluster", help="only this cluster's operations")
    listing.add_argument("--ui", default=os.environ.get("KUBEON_UI_URL", ""),
                         help="the Temporal UI (or `kubeon-gpu console`) URL: print a link to what awaits approval "
                              "(env KUBEON_UI_URL)")
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
    fitting = ops_sub.add_parser("fit", help="GPU type fit recommendations (GpuTypeFit policies' status)")
    fitting.add_argument("--kubeconfig", help="default KUBEON_KUBECONFIG, else in-cluster credentials")
    fitting.add_argument("--json", action="store_true")
    waking = ops_sub.add_parser("wake", help="wake a workload scaled to zero (back to its replicas, Ready)")
    waking.add_argument("operation")
    waking.add_argument("--by", default=os.environ.get("USER") or "cli", help="who wakes it (audit)")
    waking.add_argument("--reason", default="")
    undoing = ops_sub.add_parser("undo", help="restore the config a Sharing operation replaced (then verified)")
    undoing.add_argument("operation")
    undoing.add_argument("--by", default=os.environ.get("USER") or "cli", help="who undoes it (audit)")
    undoing.add_argument("--reason", default="")
    cancelling = ops_sub.add_parser("cancel", help="cancel: drain and remove what the operation made")
    cancelling.add_argument("operation")
    hub_sync = ops_sub.add_parser("hub", help="the hub sync: state, last policy sync, queued reports")
    hub_sync.add_argument("--cluster", help="the cluster (default KUBEON_CLUSTER)")
    hub_sync.add_argument("--json", action="store_true")
    ops_parser.set_defaults(func=_ops)

    audit = sub.add_parser("audit", help="the audit logs' hash chains")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    verifying = audit_sub.add_parser(
        "verify", help="check the hash chains of a worker's audit log and/or the hub's, naming the first broken "
        "record; exit 1 when one is broken")
    verifying.add_argument("file", nargs="?", help="a worker's audit log ($KUBEON_STATE_DIR/audit.jsonl)")
    verifying.add_argument("--hub", metavar="URL", help="the hub: check its chains, and FILE against it")
    verifying.add_argument("--api-key-file", help="a file holding an admin API key of the hub (default: "
                                                  "KUBEON_HUB_API_KEY)")
    verifying.add_argument("--ca-file", help="CA bundle of the hub's certificate")
    verifying.add_argument("--json", action="store_true")
    verifying.set_defaults(func=_audit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hub"]:  # the hub parses its own options (and --help)
        from hub.server import serve as hub_serve

        return int(hub_serve(argv[1:], prog="kubeon-gpu hub") or 0)
    if argv[:1] == ["onprem-agent"]:  # so does the agent
        from node.onprem_agent import main as agent_main

        return agent_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def entry() -> None:
    """The ``kubeon-gpu`` command: ``main``, then, once the Temporal SDK is loaded, out without the interpreter's
    teardown. The SDK's Rust threads can call into Python while it finalizes and abort the process ("Fatal Python
    error: PyGILState_Release: thread state ... must be current when releasing", temporalio/sdk-python#300): about
    one `ops list` in 20 exited 134 after printing its answer, which a script takes for a failure. Everything the
    command wrote is flushed first; the worker has flushed its spans by then.

    A reader that stops early (``kubeon-gpu ops show OP | grep -q Done``) closes the pipe: that ends the command
    quietly with 141 (128 + SIGPIPE, as a shell tool ends), not with a BrokenPipeError traceback."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice (signal docs, "Note on SIGPIPE"): point stdout at devnull so the exit's flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    if "temporalio.bridge.temporal_sdk_bridge" in sys.modules:
        logging.shutdown()
        with contextlib.suppress(BrokenPipeError):
            sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
