"""
The Anthropic surface: C{POST /v1/messages} and
C{POST /v1/messages/count_tokens}, per Anthropic's API reference, translated
to the engines' OpenAI format by L{blazar.web.translate.anthropic}.

Errors are C{{"type": "error", "error": {"type", "message"}}}; every
response carries a C{request-id} header. C{x-api-key}, C{anthropic-version}
and C{anthropic-beta} headers and query strings such as C{?beta=true} are
accepted and ignored.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs
from klein import Klein
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar import strictjson
from blazar.gateway.admission import WorkClass
from blazar.gateway.call import Call, CallKind, Counting, max_tokens_of
from blazar.gateway.context import trace_id_of
from blazar.gateway.engine_proxy import StreamStopped
from blazar.gateway.errors import BadRequest
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.reply import Reply
from blazar.gateway.sessions import anthropic_hint
from blazar.web.body import read_json
from blazar.web.client import asked_of, context_of, judged, note_ignored, opened
from blazar.web.errors import answer, anthropic_error, anthropic_status, anthropic_type, in_stream
from blazar.web.translate import anthropic as tr
from blazar.web.translate import leniency
from blazar.web.translate.keep_alive import KEEP_ALIVE_HEADER, keep_alive_of

log = Logger()

PING_INTERVAL = 5.0
# anthropic-beta values whose feature Blazar serves (others are listed in x-blazar-ignored)
HONOURED_BETAS = frozenset(
    {
        "mid-conversation-system-2026-04-07",
        "interleaved-thinking-2025-05-14",
        "token-counting-2024-11-01",
        "fine-grained-tool-streaming-2025-05-14",
        "structured-outputs-2025-11-13",
        "effort-2025-11-24",
    }
)


def beta_values(request: Any, honoured: frozenset[str] = frozenset()) -> list[str]:
    """
    The C{anthropic-beta} header's values Blazar does not act on, as
    C{anthropic-beta=VALUE} names for C{x-blazar-ignored}.
    """
    raw = request.getHeader(b"anthropic-beta")
    if not raw:
        return []
    values = [v.strip() for v in raw.decode("ascii", "replace").split(",")]
    return [f"anthropic-beta={v}" for v in values if v and v not in honoured]


class AnthropicSurface:
    """
    Anthropic Messages API over the pipeline.
    """

    app = Klein()

    def __init__(self, pipeline: Pipeline, clock: Any) -> None:
        self._pipeline = pipeline
        self._clock = clock

    def _request_id(self, request: IRequest) -> None:
        request.setHeader(b"request-id", ("req_" + trace_id_of(context_of(request))).encode("ascii"))

    def _call(self, request: IRequest, counting: bool = False) -> tuple[Call, dict[str, Any], list[str]]:
        """
        The request decoded: the call, the client's body, its stop sequences.
        """
        self._request_id(request)
        body = read_json(request)
        ignored = leniency.screen("anthropic", body)
        engine_body, stops = tr.request_to_openai(body, counting=counting, ignored=ignored)
        note_ignored(request, "anthropic", ignored + beta_values(request, HONOURED_BETAS))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream: must be a boolean", "stream")
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise BadRequest(f"keep_alive: {e}", "keep_alive") from None
        call = Call(
            "anthropic",
            CallKind.CHAT,
            body["model"],
            "/v1/chat/completions",
            engine_body,
            stream=True,
            keep_alive=keep_alive,
            max_tokens=max_tokens_of(engine_body),
            work=WorkClass.TOOL if engine_body.get("tools") else WorkClass.INTERACTIVE,
            asked=asked_of(request, anthropic_hint(body)),
        )
        return call, body, stops

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    async def count_tokens(self, request: IRequest) -> bytes:
        call, _, _ = self._call(request, counting=True)
        count = await self._pipeline.count(context_of(request), call)
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode({"input_tokens": count}).encode("utf-8")

    @app.route("/v1/messages", methods=["POST"])
    async def messages(self, request: IRequest) -> bytes | None:
        call, body, stops = self._call(request)
        model = call.model
        translator = tr.AnthropicStream("msg_" + secrets.token_hex(12), model, stops)
        if not body.get("stream", False):
            # a stop sequence cuts the child's stream before its usage
            # arrives: the prompt is counted up front
            # (client_stream: the engine's stream makes one message; the semantic cache may answer)
            call = attrs.evolve(call, counting=Counting.ALWAYS if stops else Counting.NEVER, client_stream=False)
            async with opened(self._pipeline, request, call) as reply:
                if reply.prompt_tokens is not None:
                    translator.input_tokens = reply.prompt_tokens
                await judged(request, reply, reply.chunks(self._feeder(translator, None)))
            translator.finish()
            self._usage(reply, translator)
            request.setHeader(b"content-type", b"application/json")
            return strictjson.encode(translator.message(), ensure_ascii=False).encode("utf-8")
        # A loaded model answers at once: the pipeline sends first, so a
        # request the engine rejects is an HTTP error, not a 200 stream
        # with an error event, and message_start carries the prompt's
        # token count. A model that must load first gets the headers and
        # message_start at once, then pings while the child is silent.
        pinger = LoopingCall(request.write, tr.sse_event("ping", {"type": "ping"}))
        pinger.clock = self._clock
        headers_out = False

        def start() -> None:
            nonlocal headers_out
            headers_out = True
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            self._write(request, translator.start())

        def on_send(cold: bool) -> None:
            if cold:
                start()
                pinger.start(PING_INTERVAL, now=False).addErrback(lambda f: log.failure("ping failed", f))

        call = attrs.evolve(call, counting=Counting.IF_READY, on_send=on_send)
        try:
            async with opened(self._pipeline, request, call) as reply:
                if not headers_out:
                    if reply.prompt_tokens is not None:
                        translator.input_tokens = reply.prompt_tokens
                    start()
                await judged(request, reply, reply.chunks(self._feeder(translator, request, pinger)))
        except Exception as e:
            problem = in_stream(request, e, model, "anthropic", headers_out)
            request.write(
                tr.sse_event(
                    "error", {"type": "error", "error": {"type": anthropic_type(problem), "message": problem.message}}
                )
            )
            return None
        finally:
            if pinger.running:
                pinger.stop()
        self._write(request, translator.finish())
        self._usage(reply, translator)
        return None

    def _feeder(
        self,
        translator: tr.AnthropicStream,
        request: IRequest | None,
        pinger: LoopingCall | None = None,
    ) -> Any:
        def on_chunk(chunk: dict[str, Any]) -> None:
            if pinger is not None and pinger.running:
                pinger.stop()
            events = translator.feed(chunk)
            if request is not None:
                self._write(request, events)
            if translator.stopped:
                raise StreamStopped()

        return on_chunk

    def _usage(self, reply: Reply, translator: tr.AnthropicStream) -> None:
        reply.usage(translator.input_tokens, translator.total_tokens() - translator.input_tokens)

    def _write(self, request: IRequest, events: list[tuple[str, dict[str, Any]]]) -> None:
        if events:
            request.write(b"".join(tr.sse_event(name, payload) for name, payload in events))

    # -- errors -------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "anthropic")
        if problem is None:
            return None
        self._request_id(request)
        request.setResponseCode(anthropic_status(problem))
        return anthropic_error(problem)
