"""Spans and product metrics around the optimizer's outbound calls: cloud APIs, the hub, the gateway.

Every cloud call goes through ``TracedProvider`` (one seam: ``BurstActivities`` wraps each provider it is given),
so a new provider gets its span, request counter and latency histogram without code of its own. Attributes and
labels name only the provider, location, instance type, call and outcome: never user data, a ticket, a token or
a request body. Without a configured tracer provider (``OTEL_*`` unset) the spans are OpenTelemetry's no-op
spans; the metrics are always kept (``/metrics``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from typing import ParamSpec
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.trace import SpanKind
from opentelemetry.trace import Status
from opentelemetry.trace import StatusCode

from activities.providers.base import Provider
from activities.providers.errors import InstanceNotFoundError
from activities.providers.errors import InsufficientCapacityError
from activities.providers.errors import LocationNotAllowedError
from activities.providers.errors import NotOwnedError
from activities.providers.errors import ProviderError
from activities.telemetry import metrics as pm
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

TRACER_NAME = "kubeon.optimizer"
P = ParamSpec("P")
T = TypeVar("T")


def tracer() -> trace.Tracer:
    # Looked up per call: the worker installs its tracer provider after modules are imported.
    return trace.get_tracer(TRACER_NAME)


def untraced(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Run an async call with no current span: for a call that starts a long-lived workflow (a policy's ledger),
    which would otherwise carry the first operation's trace for good and gather every later one's spans in it."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        token = otel_context.attach(otel_context.Context())
        try:
            return await fn(*args, **kwargs)
        finally:
            otel_context.detach(token)

    return call


def outcome_of(exc: BaseException | None) -> str:
    """A short, bounded outcome label for a failed (or not) call; never the message (it may name anything)."""
    if exc is None:
        return "ok"
    for kind, label in ((InsufficientCapacityError, "insufficient_capacity"),
                        (LocationNotAllowedError, "location_not_allowed"), (InstanceNotFoundError, "not_found"),
                        (NotOwnedError, "not_owned")):
        if isinstance(exc, kind):
            return label
    if isinstance(exc, ProviderError):
        return "error" if exc.retryable else "rejected"
    return "error"


def _end(span: Span, exc: BaseException | None, outcome: str) -> None:
    span.set_attribute("kubeon.outcome", outcome)
    if exc is not None:
        # The exception type only: messages of cloud SDKs and HTTP clients can quote request data.
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.set_attribute("error.type", type(exc).__name__)


@contextmanager
def _client_span(name: str, attributes: dict[str, str], outcome: Callable[[BaseException | None], str],
                 done: Callable[[str, float], None]) -> Iterator[Span]:
    """A CLIENT span around one outgoing call: its outcome label on the span (the exception's type only, never its
    message) and handed to ``done`` with the call's seconds, for the metrics."""
    start = time.monotonic()
    with tracer().start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes, record_exception=False,
                                        set_status_on_exception=False) as span:
        error: BaseException | None = None
        try:
            yield span
        except BaseException as exc:
            error = exc
            raise
        finally:
            result = outcome(error)
            _end(span, error, result)
            done(result, time.monotonic() - start)


@contextmanager
def cloud_call(provider: str, call: str, location: str, instance_type: str | None = None) -> Iterator[Span]:
    """A CLIENT span ``cloud.<call>`` and the cloud request metrics, around one provider call."""
    attributes: dict[str, str] = {"cloud.provider": provider, "cloud.region": location, "kubeon.location": location}
    if instance_type:
        attributes["kubeon.instance_type"] = instance_type

    def counted(outcome: str, seconds: float) -> None:
        pm.CLOUD_REQUESTS.labels(provider=provider, call=call, outcome=outcome).inc()
        pm.CLOUD_REQUEST_SECONDS.labels(provider=provider, call=call).observe(seconds)

    with _client_span(f"cloud.{call}", attributes, outcome_of, counted) as span:
        yield span


class HttpCall:
    """What one hub or gateway request tells its span: the response status."""

    def __init__(self) -> None:
        self.span: Span | None = None
        self.status: int | None = None

    def response(self, status: int) -> None:
        self.status = status
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)

    def outcome(self, error: BaseException | None) -> str:
        if error is not None:
            return "error"
        return "ok" if self.status is None or self.status < 400 else str(self.status)


@contextmanager
def http_call(peer: str, method: str, route: str) -> Iterator[HttpCall]:
    """A CLIENT span around one request to the hub or the gateway. ``route`` is the path template (no IDs,
    no query string, never a header)."""
    call = HttpCall()

    def counted(outcome: str, seconds: float) -> None:
        pm.HTTP_REQUESTS.labels(peer=peer, route=route, outcome=outcome).inc()
        pm.HTTP_REQUEST_SECONDS.labels(peer=peer, route=route).observe(seconds)

    attributes = {"http.request.method": method, "url.template": route, "kubeon.peer": peer}
    with _client_span(f"{peer} {method} {route}", attributes, call.outcome, counted) as span:
        call.span = span
        yield call


class TracedProvider:
    """A ``Provider`` whose every call is a span of its own (child of the activity's span) and counted."""

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, item: str) -> Any:  # provider-specific extras (tests, the sim's stop())
        return getattr(self.inner, item)

    def price_offerings(self, location: str) -> list[Offering]:
        with cloud_call(self.name, "price_offerings", location):
            return self.inner.price_offerings(location)

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        with cloud_call(self.name, "launch", request.offering.location, request.offering.instance_type) as span:
            instance = self.inner.launch(request, user_data)
            span.set_attribute("kubeon.instance_state", instance.state)
            return instance

    def get(self, location: str, instance_id: str) -> Instance:
        with cloud_call(self.name, "get", location):
            return self.inner.get(location, instance_id)

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        with cloud_call(self.name, "list", location):
            return self.inner.list(location, policy=policy, operation=operation)

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None:
        with cloud_call(self.name, "terminate", location):
            self.inner.terminate(location, instance_id, policy=policy)


def traced(provider: Provider) -> Provider:
    return provider if isinstance(provider, TracedProvider) else TracedProvider(provider)


__all__ = ["HttpCall", "TracedProvider", "cloud_call", "http_call", "outcome_of", "traced", "tracer", "untraced"]
