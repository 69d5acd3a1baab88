"""Recording what happened to a burst node (R4.7): the local audit log, and a report for the hub (R2.8)."""

from __future__ import annotations

import asyncio

from temporalio import activity

from activities.context import PhaseActivities
from models.audit import AuditRecord
from models.hub import REPORT_ACTIONS
from models.hub import ActionReport
from models.hub import report_detail


def report_of(record: AuditRecord) -> ActionReport:
    """The hub's report of a written audit record, with the record's place in the log's hash chain: the hub checks
    that it follows the one before and records the head the cluster reports."""
    return ActionReport(
        idempotency_key=record.key, operation=record.operation, policy=record.policy,
        action=record.action if record.action in REPORT_ACTIONS else "failed",
        location=record.location, instance=record.instance_id, node=record.node_name,
        detail=report_detail(" ".join(p for p in (
            record.detail, f"(approver {record.approver})" if record.approver else "") if p)),
        occurred_at=record.at, audit_chain=record.chain, audit_seq=record.seq, audit_hash=record.hash,
        audit_prev=record.prev)


class AuditActivities(PhaseActivities):
    """record_audit"""

    @activity.defn(name="record_audit")
    async def record_audit(self, record: AuditRecord) -> bool:
        """Append the audit record, and queue it for the hub when one is configured (R2.8). Both are keyed, so a
        retry after a crash between the two writes each once (the retry reports the record as first written)."""
        stored, written = await asyncio.to_thread(self.context.audit_log.write, record)
        if self.context.report_sink is not None:
            await self.context.report_sink(report_of(stored))
        return written
