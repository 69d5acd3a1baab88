"""An operation's audit record (R4.7), written by the ``record_audit`` activity as a *local* activity.

Why local: a record is a keyed append to the worker's audit log and a signal to the hub sync, done in well under
a second; as a regular activity each record was three history events, a round-trip through the task queue (slow
when a large rollout fills it) and an action of its own. A local activity is one marker event, runs at once in the
worker that runs the workflow, and the records of one workflow task are one action. The record's key keeps a
re-run (a worker killed before the task completed) from writing it twice."""

from __future__ import annotations

from temporalio import workflow

from models.audit import AuditRecord
from workflows.failures import LOCAL_TIMEOUT
from workflows.failures import RETRY


async def record_audit(record: AuditRecord) -> None:
    # Retried without end: an operation's record is never dropped.
    await workflow.execute_local_activity("record_audit", record, start_to_close_timeout=LOCAL_TIMEOUT,
                                          retry_policy=RETRY, summary=f"audit: {record.action}")
