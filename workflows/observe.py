"""Phase markers in an operation's trace, replay-safe: a zero-length span ``Phase:<phase>`` when the phase
changes, made only while the worker traces (Temporal's TracingInterceptor is on the workflow) and never while
replaying, so a worker restart adds no duplicate."""

from __future__ import annotations

from temporalio.contrib.opentelemetry import TracingWorkflowInboundInterceptor
from temporalio.contrib.opentelemetry.workflow import completed_span


def phase_span(kind: str, phase: str) -> None:
    if TracingWorkflowInboundInterceptor._from_context() is not None:
        completed_span(f"Phase:{phase}", attributes={"kubeon.operation_kind": kind, "kubeon.phase": phase})
