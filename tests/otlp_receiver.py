"""A small OTLP/HTTP trace receiver, run as its own process by the tracing tests.

No package provides the OpenTelemetry Collector binary here (neither pip nor
Debian), so this stands in for it on the wire: ``POST /v1/traces`` with a
protobuf ``ExportTraceServiceRequest`` (optionally gzip-compressed), decoded
with the official definitions of the ``opentelemetry-proto`` package, each
span appended to ``SPANS_FILE`` as one JSON line (ids in hex, times in ns,
the resource's ``service.name``, string/int/bool attributes), answered with
an empty ``ExportTraceServiceResponse`` as a collector does. Anything else
is a 404 or a 400, never a crash.

    python tests/otlp_receiver.py SPANS_FILE     # prints "listening PORT" once it accepts
"""

from __future__ import annotations

import gzip
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Lock

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _attributes(key_values) -> dict:
    out = {}
    for kv in key_values:
        value = _value(kv.value)
        if isinstance(value, (str, int, float, bool)):
            out[kv.key] = value
    return out


def spans_of(request: ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({
                    "service": resource.get("service.name"), "resource": resource, "name": span.name,
                    "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex() or None, "kind": span.kind,
                    "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                    "status": span.status.code, "attributes": _attributes(span.attributes),
                })
    return spans


def make_handler(out: Path):
    lock = Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != TRACES_PATH:
                self._answer(404, b"")
                return
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
            except (DecodeError, OSError) as exc:
                self._answer(400, str(exc).encode())
                return
            lines = "".join(json.dumps(span) + "\n" for span in spans_of(request))
            with lock, out.open("a") as file:
                file.write(lines)
            self._answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            pass

    return Handler


def main() -> None:
    out = Path(sys.argv[1])
    out.touch()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(out))
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
