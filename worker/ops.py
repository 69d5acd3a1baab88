"""`kubeon-gpu ops`: list, show, approve, reject and cancel operations (Temporal visibility, queries, updates)."""

from __future__ import annotations

import json
from dataclasses import asdict
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from typing import Any
from typing import TypeVar

from kubernetes import client
from temporalio.client import Client
from temporalio.client import WorkflowExecutionStatus
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.clients.decisions import DecisionRefused
from activities.clients.decisions import OperationNotFound
from activities.clients.decisions import decide
from activities.clients.decisions import resolve
from models import search_attributes as sa
from models.autoscaling import GpuProductsView
from models.cost import TransferReading
from models.cost import actual_cost
from models.decisions import Approval
from models.decisions import DecisionResult
from models.decisions import Rejection
from models.hub import HubSyncStatus
from models.hub import hub_sync_workflow_id
from models.node import NodePhase
from models.node import OperationView
from models.packing import PackView
from models.policy import API_GROUP
from models.policy import PLURAL
from models.provisioning import ProvisionView
from models.scale import ScaleView
from models.scale import WakeRequest
from models.scale import WakeResult
from models.sharing import SharingView
from models.sharing import UndoRequest
from models.sharing import UndoResult

__all__ = ["DecisionRefused", "OperationNotFound", "approve", "cancel", "hub_status", "list_operations", "reject",
           "show", "undo", "wake"]

R = TypeVar("R")

# The operation workflows' KubeonOperationKind values `ops list` shows (HubSync, a cluster's reporter, is not one).
LISTED_KINDS = ("Provision", "Burst", "Drain", "Scale", "Sharing", "Pack", "GpuProducts")


@dataclass
class OperationRow:
    workflow_id: str
    operation: str
    kind: str
    status: str
    phase: str
    policy: str
    location: str
    started: str
    batch: str = ""

    @classmethod
    def header(cls) -> list[str]:
        return ["OPERATION", "KIND", "BATCH", "PHASE", "STATUS", "POLICY", "LOCATION", "STARTED", "WORKFLOW"]

    def cells(self) -> list[str]:
        return [self.operation, self.kind, self.batch, self.phase, self.status, self.policy, self.location,
                self.started, self.workflow_id]


async def list_operations(temporal: Client, *, cluster: str | None = None, limit: int = 200) -> list[OperationRow]:
    """Provisioning workflows (one per policy; OPERATION is its open or latest batch), their batches' nodes
    (BATCH), drains and scale operations."""
    query = f"{sa.OPERATION_KIND.name} IN ({', '.join(repr(k) for k in LISTED_KINDS)})"
    if cluster:
        query += f" AND {sa.CLUSTER.name} = '{cluster}'"
    rows = []
    async for wf in temporal.list_workflows(query, limit=limit):
        attrs = wf.typed_search_attributes
        started = wf.start_time.strftime("%Y-%m-%d %H:%M:%S") if isinstance(wf.start_time, datetime) else ""
        rows.append(OperationRow(
            workflow_id=wf.id, operation=attrs.get(sa.OPERATION) or "", kind=attrs.get(sa.OPERATION_KIND) or "",
            status=wf.status.name if wf.status else "", phase=attrs.get(sa.PHASE) or "",
            policy=attrs.get(sa.POLICY) or "", location=attrs.get(sa.LOCATION) or "", started=started,
            batch=attrs.get(sa.BATCH) or "",
        ))
    return rows


def render_table(rows: list[OperationRow]) -> str:
    table = [OperationRow.header()] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def rows_json(rows: list[OperationRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


async def show(temporal: Client, operation: str
               ) -> OperationView | ProvisionView | ScaleView | SharingView | PackView | GpuProductsView:
    """A node (launch ... return home), a policy's provisioning (its open proposal, plan, batches, nodes), a
    ScaleToZero, Sharing or packing operation."""
    handle = await resolve(temporal, operation)
    if handle.id.startswith("scale/"):
        scale: ScaleView = await handle.query("state", result_type=ScaleView)
        return scale
    if handle.id.startswith("sharing/"):
        shared: SharingView = await handle.query("state", result_type=SharingView)
        return shared
    desc = await handle.describe()
    if desc.workflow_type == "PackWorkflow":
        packing: PackView = await handle.query("state", result_type=PackView)
        return packing
    if desc.workflow_type == "GpuProducts":
        products: GpuProductsView = await handle.query("state", result_type=GpuProductsView)
        return products
    if desc.workflow_type == "Provision":
        view: ProvisionView = await handle.query("state", result_type=ProvisionView)
        return view
    result: OperationView = await handle.query("state", result_type=OperationView)
    if result.phase == NodePhase.SERVING:
        await _live_cost(temporal, desc, result)
    return result


async def _live_cost(temporal: Client, desc: Any, view: OperationView) -> None:
    """While a node serves, its newest transfer reading is in the serving activity's heartbeat (the operation gets
    it when the serve ends): price that one, to now, when it is newer than what the operation holds."""
    if view.launched_at is None or view.node is None or view.instance is None:
        return
    for pending in desc.raw_description.pending_activities:
        if pending.activity_type.name != "serve_until_done" or not pending.heartbeat_details.payloads:
            continue
        try:
            details = await temporal.data_converter.decode(pending.heartbeat_details.payloads)
            reading = TransferReading.model_validate(details[-1])
        except (ValueError, IndexError, TypeError):
            return
        if not reading.measured or (view.cost and view.cost.transfer_measured
                                    and view.cost.egress_bytes > reading.rx_bytes):
            return
        offering = next((o for o in (view.node.offering, *view.node.alternatives)
                         if (o.location, o.instance_type) == (view.instance.location, view.instance.instance_type)),
                        view.node.offering)
        view.cost = actual_cost(offering, view.launched_at, datetime.now(UTC), reading)
        return


async def wake(temporal: Client, operation: str, request: WakeRequest) -> WakeResult:
    """Wake a workload a ScaleToZero operation scaled to zero: back to its replicas, then verified Ready."""
    return await _update_running(temporal, operation, "scale/", "ScaleToZero", "wake", request, WakeResult)


async def undo(temporal: Client, operation: str, request: UndoRequest) -> UndoResult:
    """Restore the config a Sharing operation replaced on its node (through the same label, then verified)."""
    return await _update_running(temporal, operation, "sharing/", "Sharing", "undo", request, UndoResult)


async def _update_running(temporal: Client, operation: str, prefix: str, kind: str, update: str, request: Any,
                          result_type: type[R]) -> R:
    """The ``update`` of a running ``kind`` operation (its workflow ID starts with ``prefix``); refused with the
    reason when it is another kind, not running, or its validator refuses."""
    handle = await resolve(temporal, operation)
    if not handle.id.startswith(prefix):
        raise DecisionRefused(f"operation {operation} is not a {kind} operation")
    desc = await handle.describe()
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise DecisionRefused(f"operation {operation} is not running ({desc.status.name if desc.status else '?'})")
    try:
        return await handle.execute_update(update, request, result_type=result_type)
    except WorkflowUpdateFailedError as exc:
        raise DecisionRefused(str(getattr(exc.cause, "message", None) or exc)) from None


async def approve(temporal: Client, operation: str, approval: Approval) -> DecisionResult:
    return await decide(temporal, operation, approval)


async def reject(temporal: Client, operation: str, rejection: Rejection) -> DecisionResult:
    return await decide(temporal, operation, rejection)


async def hub_status(temporal: Client, cluster: str) -> HubSyncStatus:
    handle = temporal.get_workflow_handle(hub_sync_workflow_id(cluster))
    try:
        status: HubSyncStatus = await handle.query("status", result_type=HubSyncStatus)
    except RPCError as exc:
        raise OperationNotFound(f"no hub sync for cluster {cluster} (is KUBEON_HUB_URL set on the worker?): "
                                f"{exc.message}") from None
    return status


def fit_recommendations(api: Any) -> list[dict[str, Any]]:
    """GPU type fit recommendations from every GpuTypeFit policy's status (Recommend only: nothing acts on them)."""
    listed: Any = client.CustomObjectsApi(api).list_cluster_custom_object(API_GROUP, "v1", PLURAL)
    rows = []
    for doc in listed.get("items", []):
        if (doc.get("spec") or {}).get("kind") != "GpuTypeFit":
            continue
        for rec in ((doc.get("status") or {}).get("gpuTypeFit") or {}).get("recommendations") or []:
            rows.append({"policy": doc["metadata"]["name"], **rec})
    return rows


def render_fit(rows: list[dict[str, Any]]) -> str:
    table = [["POLICY", "WORKLOAD", "CURRENT", "RECOMMENDED", "PEAK MIB", "P95", "SAVING $/MONTH", "REASON"]]
    table += [[r["policy"], r["workload"], r["current"], r["recommended"] or "-", str(r["peakMiB"]),
               f"{r['p95Activity']:.0%}", f"{r['savingUsdPerMonth']:,.2f}", r["reason"]] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


async def cancel(temporal: Client, operation: str) -> str:
    handle = await resolve(temporal, operation)
    desc = await handle.describe()
    if desc.workflow_type == "Provision":
        # The provisioning holds maxNodes and the nodes of every batch: it is not cancelled; its nodes are, one
        # by one, and a proposal is rejected.
        raise DecisionRefused(f"{operation} is the policy's provisioning, not a node: reject its proposal "
                              "(`ops reject`) or cancel a node (`ops list` shows them)")
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise DecisionRefused(f"operation {operation} is {desc.status.name if desc.status else '?'}, not running")
    await handle.cancel()
    return handle.id


def awaiting_approval_line(rows: list[OperationRow], ui_url: str, namespace: str) -> str:
    """The line under `ops list` that links the Temporal UI, filtered to what waits for approval."""
    from worker.console import workflows_url

    waiting = sum(1 for r in rows if r.phase == "AwaitingApproval")
    return f"{waiting} awaiting approval; in the Temporal UI: {workflows_url(ui_url, namespace)}"
