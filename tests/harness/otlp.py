"""A real OTLP/HTTP receiver on loopback: accepts ``POST /v1/traces`` (protobuf, optionally gzip), decodes it with
``opentelemetry-proto`` and keeps every span and every raw body (so a test can grep what was exported)."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from dataclasses import field
from http.server import ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from tests.harness.quiet_http import QuietHandler


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0
    links: list[ReceivedLink] = field(default_factory=list)


@dataclass
class ReceivedLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(body)
                self.reply(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def _add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), service=str(resource.get("service.name", "")),
                        attributes={a.key: _value(a.value) for a in s.attributes}, resource=resource,
                        status_code=s.status.code,
                        links=[ReceivedLink(trace_id=link.trace_id.hex(), span_id=link.span_id.hex(),
                                            attributes={a.key: _value(a.value) for a in link.attributes})
                               for link in s.links]))
        with self._lock:
            self.requests += 1
            self.bodies.append(body)
            self.spans.extend(spans)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
