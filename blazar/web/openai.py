"""
The OpenAI surface: C{/v1/models}, C{/v1/chat/completions},
C{/v1/completions}, C{/v1/embeddings}, plus C{/health} and C{/healthz}.

Wire format: OpenAI's API reference (platform.openai.com/docs/api-reference).
The child speaks the same format, so request bodies are forwarded as received
and response bytes are relayed as they come, with one change: the C{model}
the child reports is replaced by the name the client asked for.

Errors use OpenAI's envelope C{{"error": {"message", "type", "param",
"code"}}}.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import attrs
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
from blazar.web.auth import record_usage, wants_usage
from blazar.web.quota import QuotaExceeded, retry_after
from blazar.web.proxy import (
    KEEP_ALIVE_HEADER,
    EngineProxy,
    EngineRejected,
    PromptTooLong,
    UnsupportedByModel,
    keep_alive_of,
)
from blazar.web.observe import note_error, note_tokens, usage_of_reply, usage_of_timings
from blazar.web.responses import ResponseNotFound, Responses
from blazar.web.scope import redact, resolve_in_scope, visible
from blazar.web.sse import ModelRenamer, SSERelay, SSERewriter
from blazar.web.ignored import note_ignored
from blazar.web.translate import leniency
from blazar.web.translate import chat_logprobs, completions
from blazar.web.translate.responses import ResponsesRequestError

log = Logger()

OWNED_BY = "blazar"
LOADING = b": loading\n\n"
LOADING_PING = 2.0


class BadRequest(Exception):
    """
    The client's request is malformed (400).

    @ivar param: The offending field, or L{None}.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """
    OpenAI's error envelope, encoded.
    """
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode("utf-8")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """
    The request's JSON object.

    @raise BadRequest: Not JSON, or not an object.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def require_model(body: dict[str, Any]) -> str:
    """
    The C{model} field.

    @raise BadRequest: Missing or not a non-empty string.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter (a model name, see GET /v1/models)", "model")
    return model


def validate(kind: str, body: dict[str, Any]) -> None:
    """
    Check the fields OpenAI requires for C{kind}
    (C{"chat"}, C{"completion"} or C{"embedding"}).

    @raise BadRequest: Naming the field.
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of message objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    elif kind == "completion":
        if "prompt" not in body:
            raise BadRequest("you must provide a 'prompt' (string or array of strings)", "prompt")
    elif kind == "embedding":
        value = body.get("input")
        if value is None or value == "" or value == []:
            raise BadRequest("'input' must be a non-empty string or array", "input")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", "stream")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise BadRequest("'tools' must be an array of tool objects", "tools")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")


def lenient(kind: str, body: dict[str, Any]) -> tuple[list[str], bool]:
    """
    The leniency policy (L{blazar.web.translate.leniency}) on a chat,
    completion or embedding body, and what the engine must not get: the
    ignored fields, tools that are not functions (built-in ones a local
    model cannot run), C{best_of} and C{suffix} (llama-server refuses them)
    are taken out of C{body}; a named or C{allowed_tools} C{tool_choice}
    becomes what llama-server honours (only those tools, a call required).

    @return: (the names accepted but not honoured, whether C{body} changed).
    @raise BadRequest: A field whose meaning would be lost, named.
    """
    try:
        ignored = leniency.screen(kind, body)
    except leniency.MeaningChanged as e:
        raise BadRequest(str(e), e.field) from None
    changed = False
    # what the engine would ignore anyway is not sent to it (a body can carry
    # any number of unknown fields; the engine's JSON handling is slow in them)
    for name in ignored:
        if name in body:
            del body[name]
            changed = True
    tools = body.get("tools")
    if kind == "chat" and isinstance(tools, list) and any(t.get("type", "function") != "function" for t in tools):
        ignored += [f"tools:{t.get('type')}"[:80] for t in tools if t.get("type", "function") != "function"]
        body["tools"] = [t for t in tools if t.get("type", "function") == "function"]
        if not body["tools"]:
            del body["tools"]
            body.pop("tool_choice", None)
        changed = True
    if kind == "chat" and isinstance(body.get("tool_choice"), dict):
        _tool_choice(body)
        changed = True
    for name in ("best_of", "suffix"):
        # llama-server refuses these by name, even null; a real suffix was refused above
        if kind == "completion" and name in body:
            del body[name]
            changed = True
    return ignored, changed


def _tool_choice(body: dict[str, Any]) -> None:
    """
    An object C{tool_choice} as llama-server honours it (it takes only
    "auto", "none" and "required", and silently reads anything else as
    "auto"): a named function offers only that tool and requires a call;
    C{allowed_tools} narrows the tools and keeps its mode.

    @raise BadRequest: A name no offered tool has, or a shape OpenAI does
        not define.
    """
    choice = body["tool_choice"]
    tools = body.get("tools") or []

    def name_of(tool: Any) -> Any:
        return (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None

    kind = choice.get("type")
    if kind == "function" and isinstance(name_of(choice), str):
        named = [t for t in tools if name_of(t) == name_of(choice)]
        if not named:
            raise BadRequest(f"tool_choice: no function tool named {name_of(choice)!r} in tools", "tool_choice")
        body["tools"], body["tool_choice"] = named, "required"
        return
    if kind == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
        spec = choice["allowed_tools"]
        mode, allowed = spec.get("mode", "auto"), spec.get("tools")
        if mode in ("auto", "required") and isinstance(allowed, list):
            names = {name_of(t) for t in allowed}
            body["tools"] = [t for t in tools if name_of(t) in names]
            if body["tools"]:
                body["tool_choice"] = mode
                return
            if mode == "required":
                raise BadRequest('tool_choice: allowed_tools with mode "required" names no function tool in tools',
                                 "tool_choice")
            del body["tools"]
            body.pop("tool_choice")
            return
    if kind == "custom":
        raise BadRequest("tool_choice: custom tools are not served by this gateway; offer function tools",
                         "tool_choice")
    raise BadRequest('tool_choice: must be "auto", "none", "required", {"type": "function", "function": '
                     '{"name": ...}} or {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}', "tool_choice")


#: an SSE payload -> the payloads the client gets instead
Rewrite = Callable[[bytes], list[bytes]]


@attrs.frozen
class EngineFix:
    """
    Where llama-server's own answer would break clients, what Blazar sends
    it instead and how its answer is rebuilt (L{blazar.web.translate.completions},
    L{blazar.web.translate.chat_logprobs}).

    @ivar body: What the engine gets.
    @ivar reply: A non-streamed reply's bytes -> the client's; L{None}:
        relayed as they are.
    @ivar rewrite: For a stream: each SSE payload -> the client's payloads.
    @ivar wants: Which payloads L{rewrite} must see (tested on raw bytes,
        also on a whole batch of events); L{None}: all of them.
    """

    body: dict[str, Any]
    reply: Callable[[bytes], bytes] | None = None
    rewrite: Rewrite | None = None
    wants: Callable[[bytes], bool] | None = None


def _completion_events(data: bytes) -> bool:
    """
    Whether SSE bytes of a completion stream hold an event that
    L{completions.CompletionStream} changes when it rewrites no logprobs:
    usage, C{[DONE]}, the C{data: null} of several prompts.
    """
    return b'"usage":{' in data or b"[DONE]" in data or b"data: null" in data


class OpenAISurface:
    """
    OpenAI-compatible HTTP API over the supervisor's children.
    """

    app = Klein()

    def __init__(
        self, registry: ModelRegistry, proxy: EngineProxy, clock: Any, responses: Responses | None = None,
    ) -> None:
        self._registry = registry
        self._proxy = proxy
        self._clock = clock
        self._responses = responses

    # -- liveness -----------------------------------------------------------

    @app.route("/health", methods=["GET", "HEAD"])
    @app.route("/healthz", methods=["GET", "HEAD"])
    def health(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'

    # -- models ---------------------------------------------------------------

    def _model_object(self, name: str, modified: float) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(modified), "owned_by": OWNED_BY}

    @app.route("/v1/models", methods=["GET"])
    async def list_models(self, request: IRequest) -> bytes:
        entries = await self._registry.refresh()
        allowed = set(visible(request, [e.name for e in entries]))
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"object": "list", "data": [
            self._model_object(e.name, e.modified) for e in entries if e.name in allowed
        ]}).encode("utf-8")

    @app.route("/v1/models/<path:model_id>", methods=["GET"])
    async def get_model(self, request: IRequest, model_id: str) -> bytes:
        entry = await resolve_in_scope(request, self._registry, model_id)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(self._model_object(model_id, entry.modified)).encode("utf-8")

    # -- inference ------------------------------------------------------------

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat_completions(self, request: IRequest) -> Any:
        return self._forward(request, "chat", "/v1/chat/completions")

    @app.route("/v1/completions", methods=["POST"])
    def completions(self, request: IRequest) -> Any:
        return self._forward(request, "completion", "/v1/completions")

    @app.route("/v1/embeddings", methods=["POST"])
    def embeddings(self, request: IRequest) -> Any:
        return self._forward(request, "embedding", "/v1/embeddings")

    # -- the Responses API (blazar.web.responses) ----------------------------

    def _responses_api(self) -> Responses:
        if self._responses is None:
            raise BadRequest("the Responses API is not configured on this gateway")
        return self._responses

    def _responses_body(self, request: IRequest) -> dict[str, Any]:
        raw = request.content.read() if request.content is not None else b""
        if b"NaN" in raw or b"Infinity" in raw:
            # json.loads takes these; JSON does not, and they would be echoed back
            def refuse(name: str) -> Any:
                raise BadRequest(f"request body is not valid JSON: {name} is not a JSON number")

            try:
                json.loads(raw, parse_constant=refuse)
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
        return parse_json_body(raw)

    @app.route("/v1/responses", methods=["POST"])
    async def create_response(self, request: IRequest) -> bytes | None:
        return await self._responses_api().create(request, self._responses_body(request))

    @app.route("/v1/responses/input_tokens", methods=["POST"])
    async def response_input_tokens(self, request: IRequest) -> bytes:
        return await self._responses_api().input_tokens(request, self._responses_body(request))

    @app.route("/v1/responses/<string:response_id>", methods=["GET"])
    async def retrieve_response(self, request: IRequest, response_id: str) -> bytes:
        return await self._responses_api().retrieve(request, response_id)

    @app.route("/v1/responses/<string:response_id>", methods=["DELETE"])
    async def delete_response(self, request: IRequest, response_id: str) -> bytes:
        return await self._responses_api().delete(request, response_id)

    @app.route("/v1/responses/<string:response_id>/input_items", methods=["GET"])
    async def response_input_items(self, request: IRequest, response_id: str) -> bytes:
        return await self._responses_api().items(request, response_id)

    async def _forward(self, request: IRequest, kind: str, path: str) -> bytes | None:
        raw = request.content.read() if request.content is not None else b""
        body = parse_json_body(raw)
        model = require_model(body)
        validate(kind, body)
        ignored, changed = lenient(kind, body)
        note_ignored(request, "openai", ignored)
        stream = bool(body.get("stream") or False) and kind != "embedding"
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise BadRequest(str(e), "keep_alive") from None
        canonical = await self._proxy.check_scope(request, model)
        await self._proxy.check_purpose(model, embedding=kind == "embedding")
        if kind == "chat" and await self._proxy.place_system_messages(model, body):
            changed = True
        hide_usage = False
        if stream and wants_usage(request):
            # token limits need the child's usage: ask for it, and keep the
            # usage chunk from a client that did not ask for it
            options = body.get("stream_options") or {}
            if not options.get("include_usage"):
                hide_usage = changed = True
                body["stream_options"] = {**options, "include_usage": True}
        fix = await self._engine_fix(model, kind, body, stream)
        if fix is not None and fix.body is not body:
            raw = json.dumps(fix.body).encode("utf-8")
        elif changed:  # encoded once, whatever the steps above changed
            raw = json.dumps(body).encode("utf-8")
        if kind != "embedding":
            await self._preflight(model, kind, body, len(raw))
        if kind == "completion":
            work = WorkClass.RAW_LONG
        elif kind == "chat" and body.get("tools"):
            work = WorkClass.TOOL
        else:
            work = WorkClass.INTERACTIVE
        await self._proxy.admit(request, canonical, work)
        if stream and not self._proxy.is_ready(canonical):
            await self._stream_cold(request, model, path, raw, keep_alive, hide_usage, fix)
            return None
        instance, response = await self._proxy.send(model, path, raw, request=request, stream=stream)
        renamer = ModelRenamer(instance.entry.name, model)
        try:
            if stream:
                await self._relay_stream(request, instance, response, renamer, hide_usage, fix)
                return None
            payload = await self._proxy.read(instance, response)
            if fix is not None and fix.reply is not None:
                payload = fix.reply(payload)
            tokens = usage_of_reply(payload)
            if tokens is not None:
                note_tokens(request, *tokens)
                record_usage(request, tokens[0] + tokens[1])
            request.setHeader(b"content-type", b"application/json")
            return renamer.rename(payload)
        finally:
            instance.in_flight -= 1
            self._proxy.done(instance, keep_alive)

    async def _engine_fix(
        self, model: str, kind: str, body: dict[str, Any], stream: bool
    ) -> EngineFix | None:
        """
        The L{EngineFix} a request needs, if any: every completion (its
        stream's usage chunk; legacy C{logprobs}; C{echo}), and a streamed
        chat with C{tools} and C{logprobs}.

        @raise BadRequest: A malformed C{logprobs} or C{echo}.
        """
        if kind == "chat" and stream:
            top = chat_logprobs.tool_stream_logprobs(body)
            if top is None:
                return None
            fixer = chat_logprobs.ToolStreamLogprobs(top)
            return EngineFix(chat_logprobs.engine_body(body, top), rewrite=fixer.event)
        if kind != "completion":
            return None
        try:
            plan = completions.plan_completion(body)
        except completions.CompletionRequestError as e:
            raise BadRequest(str(e), e.param) from None
        prompts = completions.prompts_of(body.get("prompt"))
        if plan.needs_pieces:
            texts = [completions.prompt_text(p, await self._token_pieces(model, p)) for p in prompts]
        else:
            texts = [completions.prompt_text(p) for p in prompts]
        if stream:
            translator = completions.CompletionStream(plan, texts)
            return EngineFix(
                plan.engine_body, rewrite=translator.event,
                wants=None if plan.rewrites else _completion_events,
            )
        if not plan.rewrites:
            return None

        def reply(payload: bytes) -> bytes:
            try:
                parsed = json.loads(payload)
            except ValueError:
                return payload
            if not isinstance(parsed, dict):
                return payload
            return completions.dumps(completions.completion_reply(parsed, plan, texts))

        return EngineFix(plan.engine_body, reply=reply)

    async def _token_pieces(self, model: str, prompt: Any) -> list[Any]:
        """
        A prompt's tokens and their text, by the child's tokenizer
        (C{/tokenize} with C{with_pieces}; no BOS: only the prompt's own).
        """
        instance, response = await self._proxy.send(
            model, "/tokenize",
            json.dumps({"content": prompt, "add_special": False, "with_pieces": True}).encode("utf-8"),
            stream=False,
        )
        try:
            tokens = json.loads(await self._proxy.read(instance, response)).get("tokens")
        finally:
            instance.in_flight -= 1
        return tokens if isinstance(tokens, list) else []

    async def _preflight(self, model: str, kind: str, body: dict[str, Any], size: int) -> None:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            return  # absent, or invalid: the engine answers that

        async def count() -> int:
            if kind == "chat":
                return await self._proxy.count_chat_tokens(model, body)
            prompt = body.get("prompt")
            texts = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)]
            return max([await self._proxy.count_text_tokens(model, t) for t in texts] or [0])

        await self._proxy.preflight(model, max_tokens, size, count)

    async def _stream_cold(
        self, request: IRequest, model: str, path: str, raw: bytes, keep_alive: float | None,
        hide_usage: bool = False, fix: EngineFix | None = None,
    ) -> None:
        """
        A streaming request that has to wait for a model load: the headers
        and an SSE comment go out at once, and another comment every
        L{LOADING_PING} seconds, so clients with a header timeout do not
        give up. Failures from here on are C{data: {"error": ...}} events.
        """
        self._sse_headers(request)
        request.write(LOADING)
        keepalive = LoopingCall(request.write, LOADING)
        keepalive.clock = self._clock
        keepalive.start(LOADING_PING, now=False).addErrback(
            lambda f: log.failure("loading keepalive failed", f)
        )
        try:
            instance, response = await self._proxy.send(model, path, raw, request=request)
        except (EngineError, EngineRejected, EngineNotFound, GGUFError, ModelNotFound) as e:
            note_error(request, e)
            code = "engine_unavailable" if isinstance(e, BreakerOpen) else "engine_error"
            request.write(b"data: " + error_body(redact(request, str(e)), "engine_error", code) + b"\n\n")
            return None
        finally:
            if keepalive.running:
                keepalive.stop()
        try:
            await self._relay_stream(
                request, instance, response, ModelRenamer(instance.entry.name, model), hide_usage, fix
            )
        finally:
            instance.in_flight -= 1
            self._proxy.done(instance, keep_alive)
        return None

    def _sse_headers(self, request: IRequest) -> None:
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")

    async def _relay_stream(
        self, request: IRequest, instance: Instance, response: Any, renamer: ModelRenamer,
        hide_usage: bool = False, fix: EngineFix | None = None,
    ) -> None:
        self._sse_headers(request)
        on_usage = (lambda tokens: record_usage(request, tokens)) if wants_usage(request) else None
        def on_timings(events: bytes) -> None:
            tokens = usage_of_timings(events)
            if tokens is not None:
                note_tokens(request, *tokens)

        relay = SSERelay(request.write, renamer, on_usage, hide_usage, on_timings)
        feed, rewriter = relay.feed, None
        if fix is not None and fix.rewrite is not None:
            rewriter = SSERewriter(relay.feed, fix.rewrite, fix.wants)
            feed = rewriter.feed
        try:
            await self._proxy.relay(instance, response, feed, request)
        except EngineError as error:
            note_error(request, error)
            log.error(
                "stream from {model} broke: {error}", model=instance.entry.name,
                error=str(error), trace_id=getattr(request, "trace_id", ""),
            )
            relay.fail(error_body(redact(request, str(error)), "engine_error", "engine_crashed"))
            return
        if rewriter is not None:
            rewriter.finish()
        relay.finish()
        if not relay.done:
            note_error(request, "engine_crash")
            relay.fail(
                error_body(
                    f"llama-server for model {instance.entry.name!r} ended the stream early",
                    "engine_error", "engine_crashed",
                )
            )

    # -- errors -------------------------------------------------------------

    def _error(self, request: IRequest, status: int, body: bytes) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return body

    @app.handle_errors(BadRequest)
    def _bad_request(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, BadRequest)
        return self._error(request, 400, error_body(str(e), "invalid_request_error", None, e.param))

    @app.handle_errors(ResponsesRequestError)
    def _responses_request(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, ResponsesRequestError)
        return self._error(request, 400, error_body(str(e), "invalid_request_error", None, e.param))

    @app.handle_errors(ResponseNotFound)
    def _response_not_found(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, ResponseNotFound)
        return self._error(request, 404, error_body(str(e), "invalid_request_error", "not_found", e.param))

    @app.handle_errors(QuotaExceeded)
    def _quota(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, QuotaExceeded)
        retry_after(request, e.retry_after)
        return self._error(request, 429, error_body(str(e), "rate_limit_error", "rate_limit_exceeded"))

    @app.handle_errors(PromptTooLong)
    def _too_long(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(request, 400, error_body(
            str(failure.value), "invalid_request_error", "context_length_exceeded", "messages"))

    @app.handle_errors(UnsupportedByModel)
    def _unsupported(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(
            request, 400, error_body(str(failure.value), "invalid_request_error", "model_not_supported", "model")
        )

    @app.handle_errors(ModelNotFound)
    def _model_not_found(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return self._error(
            request, 404, error_body(str(failure.value), "invalid_request_error", "model_not_found", "model")
        )

    @app.handle_errors(EngineRejected)
    def _engine_rejected(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, EngineRejected)
        if 400 <= e.status < 500 or e.status == 501:
            # 501: the engine cannot do this for this model (no --embeddings, no FIM tokens)
            status = 400 if e.status == 501 else e.status
            return self._error(request, status, error_body(redact(request, str(e)), "invalid_request_error", None))
        return self._error(
            request, 502,
            error_body(redact(request, f"engine error ({e.status}): {e}"), "engine_error", "engine_error"),
        )

    @app.handle_errors(AllSlotsBusy)
    def _all_slots_busy(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, AllSlotsBusy)
        retry_after(request, e.retry_after)
        return self._error(request, 503, error_body(str(e), "server_error", "all_slots_busy"))

    @app.handle_errors(BreakerOpen, NoCapacity)
    def _breaker_open(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        retry_after_secs = getattr(e, "retry_after", 5.0)
        retry_after(request, retry_after_secs)
        return self._error(request, 503, error_body(redact(request, str(e)), "engine_unavailable", "engine_unavailable"))

    @app.handle_errors(EngineTimeout)
    def _timeout(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return self._error(request, 504, error_body(redact(request, str(failure.value)), "engine_error", "engine_timeout"))

    @app.handle_errors(EngineError, EngineNotFound, GGUFError)
    def _engine_failed(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        code = "engine_not_found" if failure.check(EngineNotFound) else "engine_error"
        log.error("{error}", error=str(failure.value), trace_id=getattr(request, "trace_id", ""))
        return self._error(request, 502, error_body(redact(request, str(failure.value)), "engine_error", code))

    @app.handle_errors(Exception)
    def _unexpected(self, request: IRequest, failure: Failure) -> bytes | None:
        if failure.check(CancelledError):
            return None
        from werkzeug.exceptions import MethodNotAllowed, NotFound
        from werkzeug.routing import RequestRedirect

        if failure.check(NotFound, RequestRedirect):
            return self._error(
                request, 404,
                error_body(f"no route for {request.path.decode('ascii', 'replace')}",
                           "invalid_request_error", "not_found"),
            )
        if failure.check(MethodNotAllowed):
            return self._error(
                request, 405,
                error_body(f"method {request.method.decode('ascii', 'replace')} not allowed here",
                           "invalid_request_error", "method_not_allowed"),
            )
        log.failure("unexpected error", failure, trace_id=getattr(request, "trace_id", ""))
        return self._error(
            request, 500,
            error_body(f"internal error (trace id {getattr(request, 'trace_id', '')})",
                       "server_error", "internal_error"),
        )


