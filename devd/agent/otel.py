"""OpenTelemetry export of trace records (`devd serve --otel-endpoint URL`): the only module that imports
opentelemetry.

Each trace record becomes one span, by the GenAI semantic conventions: a model call attempt is a CLIENT span
`chat {model}` (`gen_ai.operation.name` "chat", `gen_ai.provider.name`, `gen_ai.request.model`,
`gen_ai.usage.input_tokens` / `output_tokens`, and `devd.usage.estimated` true when those are devd's estimate), a
tool run an INTERNAL span `execute_tool {name}`
(`gen_ai.tool.name`); both carry `gen_ai.conversation.id` (the session) and, when they did not end `ok`,
`error.type` (the outcome) and an error status whose description is the record's error. Message content (prompts,
replies, arguments, outputs) is never exported: the records do not hold it (a tool run's error is what failed, `exit
status 1`, never what it printed). Spans are sent over OTLP/HTTP (protobuf) to `{endpoint}/v1/traces` by the
SDK's batch processor, on its own worker thread, so the daemon never waits for the collector; a collector that is
down loses spans, never a step.
"""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from devd import __version__
from devd.agent import kinds
from devd.agent.trace import seconds
from devd.protocol import TraceRecord

PROVIDER = "openai"  # the wire every profile speaks: an OpenAI-compatible chat-completions server


class Exporter:
    """Trace records out as spans; `shutdown` sends what is queued (at the daemon's stop)."""

    def __init__(self, endpoint: str | None = None, exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=f"{(endpoint or '').rstrip('/')}/v1/traces", timeout=5)
        resource = Resource.create({"service.name": "devd", "service.version": __version__})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
        self.tracer = self.provider.get_tracer("devd.agent", __version__)

    def export(self, session: str, record: TraceRecord) -> None:
        start_ns = int(seconds(record.started) * 1e9)
        end_ns = start_ns + int(record.duration_ms * 1e6)
        attributes: dict[str, str | int | bool] = {"gen_ai.conversation.id": session, "devd.action.id": record.action}
        if record.kind == "model":
            name, kind = f"chat {record.model or ''}".strip(), SpanKind.CLIENT
            attributes |= {"gen_ai.operation.name": "chat", "gen_ai.provider.name": PROVIDER}
            if record.model is not None:
                attributes["gen_ai.request.model"] = record.model
            if record.input_tokens is not None:
                attributes["gen_ai.usage.input_tokens"] = record.input_tokens
            if record.output_tokens is not None:
                attributes["gen_ai.usage.output_tokens"] = record.output_tokens
            if record.attempt is not None:
                attributes["devd.attempt"] = record.attempt
            if record.estimated:  # the counts are devd's estimate: the server sent none
                attributes["devd.usage.estimated"] = True
        else:
            # A named tool's span is named by the tool the model called (SERVER__TOOL), not by its kind.
            tool = record.name if record.kind == "tool" and record.name else kinds.BY_NAME[record.kind].name
            name, kind = f"execute_tool {tool}", SpanKind.INTERNAL
            attributes |= {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool}
        span = self.tracer.start_span(name, kind=kind, attributes=attributes, start_time=start_ns)
        if record.outcome != "ok":
            span.set_attribute("error.type", record.outcome)
            span.set_status(Status(StatusCode.ERROR, (record.error or record.outcome)[:1024]))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()
