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

import json
import secrets
from typing import Any

from klein import Klein
from twisted.internet.defer import CancelledError
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar.engines.llamacpp import EngineNotFound
from blazar.engines.supervisor import BreakerOpen, EngineError, EngineTimeout, Instance, NoCapacity
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelNotFound, ModelRegistry
from blazar.web.admission import AllSlotsBusy, WorkClass
from blazar.web.auth import record_usage
from blazar.web.quota import QuotaExceeded, retry_after
from blazar.web.proxy import (
    KEEP_ALIVE_HEADER,
    EngineProxy,
    EngineRejected,
    PromptTooLong,
    StreamStopped,
    UnsupportedByModel,
    keep_alive_of,
)
from blazar.web.observe import note_error, note_tokens
from blazar.web.scope import redact
from blazar.web.ignored import beta_values, note_ignored
from blazar.web.translate import anthropic as tr
from blazar.web.translate import leniency

log = Logger()

PING_INTERVAL = 5.0
# anthropic-beta values whose feature Blazar serves (others are listed in x-blazar-ignored)
HONOURED_BETAS = frozenset({
    "mid-conversation-system-2026-04-07", "interleaved-thinking-2025-05-14", "token-counting-2024-11-01",
    "fine-grained-tool-streaming-2025-05-14", "structured-outputs-2025-11-13", "effort-2025-11-24",
})


class AnthropicError(Exception):
    """
    An error answered in Anthropic's shape.

    @ivar status: HTTP status.
    @ivar kind: Anthropic's error type (C{invalid_request_error}, ...).
    """

    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        super().__init__(message)


def error_body(kind: str, message: str) -> bytes:
    """
    Anthropic's error envelope, encoded.
    """
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode("utf-8")


class AnthropicSurface:
    """
    Anthropic Messages API over the supervisor's children.
    """

    app = Klein()

    def __init__(self, registry: ModelRegistry, proxy: EngineProxy, clock: Any) -> None:
        self._registry = registry
        self._proxy = proxy
        self._supervisor = proxy.supervisor
        self._clock = clock

    def _request_id(self, request: IRequest) -> None:
        request.setHeader(b"request-id", ("req_" + getattr(request, "trace_id", "")).encode("ascii"))

    def _body(self, request: IRequest) -> dict[str, Any]:
        self._request_id(request)
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise AnthropicError(400, "invalid_request_error", f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise AnthropicError(400, "invalid_request_error", "request body must be a JSON object")
        return body

    def _translate(
        self, request: IRequest, body: dict[str, Any], counting: bool = False
    ) -> tuple[dict[str, Any], list[str]]:
        try:
            ignored = leniency.screen("anthropic", body)
            translated = tr.request_to_openai(body, counting=counting, ignored=ignored)
        except (tr.AnthropicRequestError, leniency.MeaningChanged) as e:
            raise AnthropicError(400, "invalid_request_error", str(e)) from None
        note_ignored(request, "anthropic", ignored + beta_values(request, HONOURED_BETAS))
        return translated

    async def _resolve(self, model: str, request: IRequest) -> str:
        """
        The scope check (L{EngineProxy.check_scope}): a model outside a
        scoped key's scope is not found either.
        """
        try:
            return await self._proxy.check_scope(request, model)
        except ModelNotFound as e:
            note_error(request, e)
            raise AnthropicError(404, "not_found_error", f"model: {model} ({e})") from None

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    async def count_tokens(self, request: IRequest) -> bytes:
        body = self._body(request)
        engine_body, _ = self._translate(request, body, counting=True)
        model = body["model"]
        await self._resolve(model, request)
        await self._proxy.check_purpose(model, embedding=False)
        await self._proxy.place_system_messages(model, engine_body)
        count = await self._proxy.count_chat_tokens(model, engine_body)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"input_tokens": count}).encode("utf-8")

    @app.route("/v1/messages", methods=["POST"])
    async def messages(self, request: IRequest) -> bytes | None:
        body = self._body(request)
        engine_body, stops = self._translate(request, body)
        model = body["model"]
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise AnthropicError(400, "invalid_request_error", "stream: must be a boolean")
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise AnthropicError(400, "invalid_request_error", f"keep_alive: {e}") from None
        canonical = await self._resolve(model, request)
        await self._proxy.check_purpose(model, embedding=False)
        await self._proxy.place_system_messages(model, engine_body)
        counted = await self._proxy.preflight(
            model, engine_body.get("max_tokens"), len(json.dumps(engine_body)),
            lambda: self._proxy.count_chat_tokens(model, engine_body),
        )
        await self._proxy.admit(
            request, canonical, WorkClass.TOOL if engine_body.get("tools") else WorkClass.INTERACTIVE
        )
        translator = tr.AnthropicStream("msg_" + secrets.token_hex(12), model, stops)

        async def prompt_tokens() -> int:
            # the preflight may have counted already: never ask the child twice
            if counted is None:
                return await self._proxy.count_chat_tokens(model, engine_body)
            return counted
        raw = json.dumps(engine_body).encode("utf-8")
        if not stream:
            if stops:
                # a stop sequence cuts the child's stream before its usage
                # arrives: count the prompt up front
                translator.input_tokens = await prompt_tokens()
            instance, response = await self._proxy.send(model, "/v1/chat/completions", raw, request=request)
            await self._collect(instance, response, translator, None, keep_alive=keep_alive, observed=request)
            translator.finish()
            self._usage(request, translator)
            request.setHeader(b"content-type", b"application/json")
            return json.dumps(translator.message(), ensure_ascii=False).encode("utf-8")
        if self._proxy.is_ready(canonical):
            # A loaded model answers at once: send first, so a request the
            # engine rejects is an HTTP error, not a 200 stream with an error
            # event; and message_start can carry the prompt's token count.
            translator.input_tokens = await prompt_tokens()
            instance, response = await self._proxy.send(model, "/v1/chat/completions", raw, request=request)
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            self._write(request, translator.start())
            try:
                await self._collect(instance, response, translator, request, None, keep_alive)
            except (EngineError, EngineRejected) as e:
                self._stream_error(request, model, e)
                return None
            except CancelledError:
                raise
            except Exception:
                self._stream_broke(request, model)
                return None
            self._write(request, translator.finish())
            self._usage(request, translator)
            return None
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        self._write(request, translator.start())
        # pings while the child is silent (loading the model, reading the prompt)
        pinger = LoopingCall(request.write, tr.sse_event("ping", {"type": "ping"}))
        pinger.clock = self._clock
        pinger.start(PING_INTERVAL, now=False).addErrback(
            lambda f: log.failure("ping failed", f)
        )
        try:
            instance, response = await self._proxy.send(model, "/v1/chat/completions", raw, request=request)
            await self._collect(instance, response, translator, request, pinger, keep_alive)
        except (EngineError, EngineRejected, EngineNotFound, GGUFError, ModelNotFound) as e:
            self._stream_error(request, model, e)
            return None
        except CancelledError:
            raise
        except Exception:
            # the 200 is out: whatever broke ends the stream with an error event
            self._stream_broke(request, model)
            return None
        finally:
            if pinger.running:
                pinger.stop()
        self._write(request, translator.finish())
        self._usage(request, translator)
        return None

    def _usage(self, request: IRequest, translator: tr.AnthropicStream) -> None:
        note_tokens(request, translator.input_tokens, translator.total_tokens() - translator.input_tokens)
        record_usage(request, translator.total_tokens())

    def _stream_error(self, request: IRequest, model: str, e: Exception) -> None:
        note_error(request, e if not isinstance(e, EngineRejected) else "engine_error")
        log.error("anthropic stream for {model} failed: {error}", model=model, error=str(e))
        if isinstance(e, EngineRejected) and e.status < 500:
            kind = "invalid_request_error"
        else:
            kind = "not_found_error" if isinstance(e, ModelNotFound) else "api_error"
        request.write(tr.sse_event("error", {"type": "error", "error": {
            "type": kind, "message": redact(request, str(e))}}))

    def _stream_broke(self, request: IRequest, model: str) -> None:
        """
        A bug after the stream's 200 went out: logged, and the stream ends
        with an C{error} event (an error body now would be read as events).
        """
        log.failure("anthropic stream for {model} broke", model=model)
        note_error(request, "5xx")
        request.write(tr.sse_event("error", {"type": "error", "error": {
            "type": "api_error", "message": "internal error; see the daemon log"}}))

    def _write(self, request: IRequest, events: list[tuple[str, dict[str, Any]]]) -> None:
        if events:
            request.write(b"".join(tr.sse_event(name, payload) for name, payload in events))

    async def _collect(
        self, instance: Instance, response: Any, translator: tr.AnthropicStream,
        request: IRequest | None, pinger: Any = None, keep_alive: float | None = None,
        observed: IRequest | None = None,
    ) -> None:
        def on_chunk(chunk: dict[str, Any]) -> None:
            if pinger is not None and pinger.running:
                pinger.stop()
            events = translator.feed(chunk)
            if request is not None:
                self._write(request, events)
            if translator.stopped:
                raise StreamStopped()

        try:
            await self._proxy.relay_chunks(instance, response, on_chunk, observed or request)
        except StreamStopped:
            pass
        finally:
            instance.in_flight -= 1
            self._proxy.done(instance, keep_alive)

    # -- errors -------------------------------------------------------------

    def _error(self, request: IRequest, status: int, kind: str, message: str) -> bytes:
        self._request_id(request)
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return error_body(kind, redact(request, message))

    @app.handle_errors(AnthropicError)
    def _anthropic_error(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, AnthropicError)
        return self._error(request, e.status, e.kind, str(e))

    @app.handle_errors(PromptTooLong)
    def _too_long(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(request, 400, "invalid_request_error", str(failure.value))

    @app.handle_errors(QuotaExceeded)
    def _quota(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, QuotaExceeded)
        retry_after(request, e.retry_after)
        return self._error(request, 429, "rate_limit_error", str(e))

    @app.handle_errors(UnsupportedByModel)
    def _unsupported(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(request, 400, "invalid_request_error", str(failure.value))

    @app.handle_errors(ModelNotFound)
    def _not_found(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return self._error(request, 404, "not_found_error", str(failure.value))

    @app.handle_errors(EngineRejected)
    def _rejected(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, EngineRejected)
        if 400 <= e.status < 500 or e.status == 501:
            return self._error(request, 400, "invalid_request_error", str(e))
        return self._error(request, 500, "api_error", f"engine error ({e.status}): {e}")

    @app.handle_errors(AllSlotsBusy)
    def _all_slots_busy(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, AllSlotsBusy)
        retry_after(request, e.retry_after)
        return self._error(request, 503, "overloaded_error", str(e))

    @app.handle_errors(BreakerOpen, NoCapacity)
    def _breaker_open(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return self._error(request, 529, "overloaded_error", str(failure.value))

    @app.handle_errors(EngineTimeout)
    def _timeout(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return self._error(request, 504, "api_error", str(failure.value))

    @app.handle_errors(EngineError, EngineNotFound, GGUFError)
    def _engine(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        log.error("{error}", error=str(failure.value), trace_id=getattr(request, "trace_id", ""))
        return self._error(request, 500, "api_error", str(failure.value))

    @app.handle_errors(Exception)
    def _unexpected(self, request: IRequest, failure: Failure) -> bytes | None:
        if failure.check(CancelledError):
            return None
        from werkzeug.exceptions import MethodNotAllowed, NotFound
        from werkzeug.routing import RequestRedirect

        if failure.check(NotFound, RequestRedirect):
            return self._error(request, 404, "not_found_error", f"no route for {request.path.decode('ascii', 'replace')}")
        if failure.check(MethodNotAllowed):
            return self._error(request, 405, "invalid_request_error",
                               f"method {request.method.decode('ascii', 'replace')} not allowed here")
        log.failure("unexpected error", failure, trace_id=getattr(request, "trace_id", ""))
        return self._error(request, 500, "api_error",
                           f"internal error (request id req_{getattr(request, 'trace_id', '')})")
