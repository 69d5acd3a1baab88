"""Traces of workflows, replay-safe: one trace per operation, and phase markers in it.

Temporal's ``TracingInterceptor`` gives a workflow the trace of whoever started it. For a burst that would be one
trace for a whole policy: its provisioning workflow lives long (continue-as-new), started by the watcher's first
signal, and starts every node. So (``OperationTracingInbound``, a small subclass of the library's workflow
interceptor):

- each **batch** is its own trace: a round of the provisioning that plans (load the policy, plan, propose, wait
  for the approval, start the nodes) opens it with ``batch_trace``; signals and updates that arrive meanwhile (the
  approval) are in it; between rounds the provisioning traces nothing. Its root links to the watcher's
  ``pods_waiting`` signals that arrived since the previous round (the pods it plans for), at most
  ``MAX_ARRIVAL_LINKS``;
- each **burst node** is its own trace, rooted at a ``BurstNode`` span that links to the span of its batch that
  started it; launch, join, verify, serve and the drain child are in it, across retries and worker restarts;
- each **hub poll** is its own trace (``HubPoll``): the hub sync lives as long as the worker, so one trace for it
  would grow for ever; between polls it traces nothing.

An operation's root span is zero-length (the library's workflow spans are all zero-length: a span cannot stay open
across a replay) and has IDs derived from the workflow ID and run (and the round), so a replay on another worker
re-derives the same trace context without creating the span again. The worker (``worker.telemetry``) creates it
with those IDs, once, outside the sandbox."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from collections.abc import Mapping
from contextlib import AbstractContextManager
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import opentelemetry.context
from temporalio import workflow
from temporalio.contrib.opentelemetry import TracingWorkflowInboundInterceptor
from temporalio.contrib.opentelemetry._context import attached_context
from temporalio.contrib.opentelemetry.workflow import completed_span
from temporalio.worker import ExecuteWorkflowInput
from temporalio.worker import HandleSignalInput
from temporalio.worker import WorkflowInboundInterceptor

from models.ids import operation_id

# The extern function the worker gives the workflow sandbox to create an operation's root span.
ROOT_SPAN_EXTERN = "__kubeon_operation_root_span"
# Workflow types whose runs are operations of their own, and the one that opens a trace per round (batch).
NODE_WORKFLOW = "BurstNode"
PROVISION_WORKFLOW = "Provision"
HUB_SYNC_WORKFLOW = "HubSync"
BATCH_SPAN = "Batch"
NODE_SPAN = "BurstNode"
HUB_POLL_SPAN = "HubPoll"
ARRIVAL_SIGNAL = "pods_waiting"
MAX_ARRIVAL_LINKS = 16  # a batch of a large rollout gathers hundreds of signals: its first few say enough

Carrier = dict[str, str | list[str]]  # a text-map carrier, as the library keeps one


@dataclass(frozen=True)
class RootSpan:
    """What the worker needs to create an operation's root span with the IDs the workflow derived."""

    name: str
    trace_id: int
    span_id: int
    time_ns: int
    attributes: Mapping[str, str] = field(default_factory=dict)
    links: tuple[Carrier, ...] = ()  # the spans it came from (a node: its batch's start; a batch: the arrivals)
    create: bool = True  # False while replaying: only say whether the context would be valid


def root_ids(key: str) -> tuple[int, int]:
    """A trace ID and a span ID from ``key``: the same on every replay of the same run."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


class OperationTracingInbound(TracingWorkflowInboundInterceptor):
    """The library's workflow interceptor, except where an operation's trace begins (see the module)."""

    def __init__(self, next: WorkflowInboundInterceptor) -> None:
        super().__init__(next)
        self._operation: Carrier | None = None  # the running operation's trace context (a node, a round, a poll)
        # The provisioning's pods_waiting signals (their senders' contexts) since its last round: the next batch's
        # links. Kept on replay too (signals replay in order), so the state is the same on every worker.
        self._arrivals: list[Carrier] = []

    def _load_workflow_context_carrier(self) -> Carrier | None:
        kind = workflow.info().workflow_type
        if kind in (PROVISION_WORKFLOW, HUB_SYNC_WORKFLOW):
            return self._operation  # the open round's batch or poll, else nothing: not the run's first caller
        if kind == NODE_WORKFLOW and self._operation is not None:
            return self._operation
        return super()._load_workflow_context_carrier()

    async def handle_signal(self, input: HandleSignalInput) -> None:
        if (input.signal == ARRIVAL_SIGNAL and workflow.info().workflow_type == PROVISION_WORKFLOW
                and len(self._arrivals) < MAX_ARRIVAL_LINKS and (header := input.headers.get(self.header_key))):
            self._arrivals.append(self.payload_converter.from_payloads([header])[0])
        await super().handle_signal(input)

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        if info.workflow_type == NODE_WORKFLOW:
            arg = input.args[0] if input.args else None
            operation = operation_id(info.workflow_id, info.run_id)
            started_by = super()._load_workflow_context_carrier()  # the batch's start of this node
            self._operation = self._open_root(
                NODE_SPAN, f"{info.workflow_id}/{info.run_id}",
                {"kubeon.operation_kind": "Burst", "kubeon.operation": operation,
                 "kubeon.batch": str(getattr(arg, "batch", "")), "kubeon.policy": str(getattr(arg, "policy", ""))},
                links=(started_by,) if started_by else ())
        return await super().execute_workflow(input)

    def _open_root(self, name: str, key: str, attributes: Mapping[str, str], links: tuple[Carrier, ...] = ()
                   ) -> Carrier | None:
        """The trace context of a new operation (None when the worker does not trace); its root span is created
        unless replaying."""
        trace_id, span_id = root_ids(key)
        create = workflow.extern_functions().get(ROOT_SPAN_EXTERN)
        if create is None:  # a worker without the operation tracing
            return None
        valid = create(RootSpan(name=name, trace_id=trace_id, span_id=span_id, time_ns=workflow.time_ns(),
                                attributes=dict(attributes), links=links,
                                create=not workflow.unsafe.is_replaying()))
        carrier: Carrier = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}
        return carrier if valid else None

    @contextmanager
    def operation_trace(self, name: str, key: str, attributes: Mapping[str, str]) -> Iterator[None]:
        """Run the block (and the signal and update handlers meanwhile) in a new operation's trace."""
        links: tuple[Carrier, ...] = ()
        if name == BATCH_SPAN:
            links, self._arrivals = tuple(self._arrivals), []
        carrier = self._open_root(name, key, attributes, links)
        if carrier is None:
            yield
            return
        previous, self._operation = self._operation, carrier
        context = self._set_on_context(self.text_map_propagator.extract(carrier,
                                                                        opentelemetry.context.Context()))
        try:
            with attached_context(context):  # the library's: safe where an evicted workflow is finalized
                yield
        finally:
            self._operation = previous


@contextmanager
def _operation_trace(name: str, key: str, attributes: Mapping[str, str]) -> Iterator[None]:
    interceptor = TracingWorkflowInboundInterceptor._from_context()
    # Duck-typed: the sandbox imports this module anew, the worker's interceptor is of the module outside.
    open_trace = getattr(interceptor, "operation_trace", None)
    if open_trace is None:
        yield
        return
    with open_trace(name, key, attributes):
        yield


def batch_trace(batch: str, policy: str, key: str) -> AbstractContextManager[None]:
    """A provisioning round as its own trace (``key``: unique for the round, the same on replay)."""
    return _operation_trace(BATCH_SPAN, key, {"kubeon.operation_kind": "Provision", "kubeon.operation": batch,
                                              "kubeon.batch": batch, "kubeon.policy": policy})


def hub_poll_trace(cluster: str, key: str) -> AbstractContextManager[None]:
    """One poll of the hub sync as its own trace (``key``: unique for the poll, the same on replay)."""
    return _operation_trace(HUB_POLL_SPAN, key, {"kubeon.operation_kind": "HubSync", "kubeon.cluster": cluster})


def phase_span(kind: str, phase: str) -> None:
    """A zero-length span ``Phase:<phase>`` when the phase changes; only while the worker traces, never while
    replaying (a worker restart adds no duplicate)."""
    if TracingWorkflowInboundInterceptor._from_context() is not None:
        completed_span(f"Phase:{phase}", attributes={"kubeon.operation_kind": kind, "kubeon.phase": phase})
