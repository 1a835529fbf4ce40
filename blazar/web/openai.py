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

import base64
import binascii
import functools
import json
import re
import secrets
from typing import Any, Callable

import attrs
from klein import Klein
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar import strictjson
from blazar.config import Config
from blazar.gateway.admission import WorkClass
from blazar.gateway.call import Call, CallKind, Run, max_tokens_of
from blazar.gateway.context import note_error, wants_usage
from blazar.gateway.engine_facts import model_kind
from blazar.gateway.errors import BadRequest, EngineError, EngineRejected
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.reply import Reply
from blazar.gateway.scope import resolve_in_scope, visible_entries
from blazar.httpbody import multipart_body
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelEntry, ModelRegistry
from blazar.web.body import json_object, read_form, read_json
from blazar.web.client import asked_of, context_of, judged, note_ignored, opened
from blazar.web.errors import answer, in_stream, openai_error
from blazar.web.observe import usage_of_reply, usage_of_timings
from blazar.web.ollama import capabilities
from blazar.web.responses import Responses
from blazar.web.sse import ModelRenamer, SSERelay, SSERewriter, loading_comments
from blazar.web.translate import audio as audio_tr
from blazar.web.translate import chat_logprobs, completions, leniency
from blazar.web.translate import images as images_tr
from blazar.web.translate import rerank as rerank_tr
from blazar.web.translate.keep_alive import KEEP_ALIVE_HEADER, keep_alive_of

log = Logger()

OWNED_BY = "blazar"
IMAGE_FILES = "/v1/images/files/"  # images made with response_format "url" (HeldImages)
HELD_SECS = 3600.0  # as OpenAI's image URLs: an hour
HELD_MAX_BYTES = 256 * 1024 * 1024


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """
    OpenAI's error envelope, encoded.
    """
    return strictjson.encode(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
    ).encode("utf-8")


@functools.lru_cache(maxsize=256)
def _renamer(engine_name: str, client_name: str) -> ModelRenamer:
    """
    The L{ModelRenamer} of a pair of names for a whole answer's one
    rename, made once (it encodes both names as JSON: work a request
    need not repeat).
    """
    return ModelRenamer(engine_name, client_name)


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
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
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
    ignored = leniency.screen(kind, body)
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
                raise BadRequest(
                    'tool_choice: allowed_tools with mode "required" names no function tool in tools', "tool_choice"
                )
            del body["tools"]
            body.pop("tool_choice")
            return
    if kind == "custom":
        raise BadRequest(
            "tool_choice: custom tools are not served by this gateway; offer function tools", "tool_choice"
        )
    raise BadRequest(
        'tool_choice: must be "auto", "none", "required", {"type": "function", "function": '
        '{"name": ...}} or {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}',
        "tool_choice",
    )


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
        self,
        registry: ModelRegistry,
        pipeline: Pipeline,
        clock: Any,
        responses: Responses | None = None,
        config: Callable[[], Config] = Config,
    ) -> None:
        """
        @param config: The live config (L{blazar.config.LiveConfig}); its
            C{args} may give or take away a model's projector, so its
            C{vision} capability (L{capabilities}, as C{/api/show}).
        """
        self._config = config
        self._registry = registry
        self._pipeline = pipeline
        self._clock = clock
        self._responses = responses
        self.images = HeldImages(clock)

    # -- liveness -----------------------------------------------------------

    @app.route("/health", methods=["GET", "HEAD"])
    @app.route("/healthz", methods=["GET", "HEAD"])
    def health(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'

    # -- models ---------------------------------------------------------------

    async def _model_object(self, name: str, entry: ModelEntry) -> dict[str, Any]:
        if entry.remote is not None:  # a [[remotes]] model: owned by its remote, nothing of it here
            return {"id": name, "object": "model", "created": 0, "owned_by": entry.remote, "kind": "remote"}
        try:
            meta = await self._registry.metadata(entry)
            kind = model_kind(entry, meta)
            # Blazar's too, as Ollama's /api/show names them: "vision" for a model that takes images
            can = capabilities(entry, meta, self._config()) if kind in ("chat", "embedding") else [kind]
        except (GGUFError, OSError):
            kind, can = "chat", ["completion"]  # unreadable: its start says why
        # kind is Blazar's (chat, embedding or rerank): the endpoint it serves
        return {
            "id": name,
            "object": "model",
            "created": int(entry.modified),
            "owned_by": OWNED_BY,
            "kind": kind,
            "capabilities": can,
        }

    @app.route("/v1/models", methods=["GET"])
    async def list_models(self, request: IRequest) -> bytes:
        entries = await self._registry.refresh()
        allowed = set(visible_entries(context_of(request), entries))
        data = [await self._model_object(e.name, e) for e in entries if e.name in allowed]
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode({"object": "list", "data": data}).encode("utf-8")

    @app.route("/v1/models/<path:model_id>", methods=["GET"])
    async def get_model(self, request: IRequest, model_id: str) -> bytes:
        entry = await resolve_in_scope(context_of(request), self._registry, model_id)
        answer = await self._model_object(model_id, entry)
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode(answer).encode("utf-8")

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

    @app.route("/v1/rerank", methods=["POST"])
    @app.route("/rerank", methods=["POST"])
    @app.route("/v1/reranking", methods=["POST"])
    @app.route("/v2/rerank", methods=["POST"])  # Cohere's v2 client
    async def rerank(self, request: IRequest) -> bytes:
        """
        Rerank C{documents} against C{query} (L{blazar.web.translate.rerank}:
        Jina's, Cohere's v1 and v2 and llama.cpp's request shapes)
        on a reranker model (C{rerank = true}, or rank pooling in its GGUF).
        """
        raw = request.content.read() if request.content is not None else b""
        body = json_object(raw)
        model = require_model(body)
        engine_body, texts, top_n, return_documents, ignored = rerank_tr.decode(body)
        note_ignored(request, "openai", ignored)
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise BadRequest(str(e), "keep_alive") from None
        call = Call(
            "openai", CallKind.RERANK, model, "/v1/rerank", engine_body, keep_alive=keep_alive, asked=asked_of(request)
        )
        async with opened(self._pipeline, request, call) as reply:
            try:
                answer = json.loads(await judged(request, reply, reply.read()))
            except ValueError:
                answer = {}
            out = rerank_tr.encode(answer if isinstance(answer, dict) else {}, model, texts, top_n, return_documents)
            reply.usage(out["usage"]["prompt_tokens"], 0)
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode(out).encode("utf-8")

    # -- speech to text (blazar.web.translate.audio): the whisper lane --------

    @app.route("/v1/audio/transcriptions", methods=["POST"])
    async def transcriptions(self, request: IRequest) -> bytes:
        return await self._audio(request, translate=False)

    @app.route("/v1/audio/translations", methods=["POST"])
    async def translations(self, request: IRequest) -> bytes:
        return await self._audio(request, translate=True)

    async def _audio(self, request: IRequest, translate: bool) -> bytes:
        form, files = read_form(request)
        model = require_model({"model": (form.get("model") or [""])[-1]})
        uploads = files.get("file")
        if not uploads:
            raise BadRequest("you must provide the audio as the 'file' part of the form", "file")
        fields, response_format, granularities, ignored = audio_tr.decode(form, translate)
        note_ignored(request, "openai", ignored)
        call = Call(
            "openai",
            CallKind.TRANSCRIBE,
            model,
            "/inference",
            {},
            audio=uploads[0].data,
            audio_fields=fields,
            asked=asked_of(request),
        )
        async with opened(self._pipeline, request, call) as reply:
            try:
                answer = json.loads(await judged(request, reply, reply.read()))
            except ValueError:
                answer = {}
            seconds = reply.audio_used()
        body, content_type = audio_tr.encode(
            answer if isinstance(answer, dict) else {}, response_format, granularities, translate, seconds
        )
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return body

    # -- images (blazar.web.translate.images): the sdcpp lane -----------------

    @app.route("/v1/images/generations", methods=["POST"])
    async def images_generations(self, request: IRequest) -> bytes:
        body = read_json(request)
        model = require_model(body)
        engine_body, response_format, ignored = images_tr.decode(body)
        note_ignored(request, "openai", ignored)
        call = Call("openai", CallKind.IMAGE, model, "/v1/images/generations", engine_body, asked=asked_of(request))
        return await self._images(request, call, response_format, engine_body["output_format"])

    @app.route("/v1/images/edits", methods=["POST"])
    async def images_edits(self, request: IRequest) -> bytes:
        form, files = read_form(request)
        values = images_tr.form_fields(form)
        model = require_model(values)
        engine_body, response_format, ignored = images_tr.decode(values)
        note_ignored(request, "openai", ignored)
        images = files.get("image[]", []) + files.get("image", [])
        if not images:
            raise BadRequest(
                "you must provide the image to edit as the 'image' (or 'image[]') part of the form", "image"
            )
        parts = [("image[]", u.filename or "image.png", u.content_type or "image/png", u.data) for u in images]
        parts += [
            ("mask", u.filename or "mask.png", u.content_type or "image/png", u.data) for u in files.get("mask", [])[:1]
        ]
        raw, content_type = multipart_body({k: str(v) for k, v in engine_body.items()}, parts)
        call = Call(
            "openai",
            CallKind.IMAGE,
            model,
            "/v1/images/edits",
            engine_body,
            raw=raw,
            content_type=content_type,
            images=[u.data for u in images + files.get("mask", [])[:1]],
            asked=asked_of(request),
        )
        return await self._images(request, call, response_format, engine_body["output_format"])

    async def _images(self, request: IRequest, call: Call, response_format: str, output_format: str) -> bytes:
        async with opened(self._pipeline, request, call) as reply:
            try:
                answer = json.loads(await judged(request, reply, reply.read()))
            except ValueError:
                answer = {}
        base = _base_url(request)
        out = images_tr.encode(
            answer if isinstance(answer, dict) else {},
            response_format,
            output_format,
            int(self._clock.seconds()),
            lambda b64, fmt: base + IMAGE_FILES + self.images.keep(b64, fmt),
        )
        context_of(request).images = len(out["data"])
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode(out).encode("utf-8")

    @app.route(IMAGE_FILES + "<token>", methods=["GET", "HEAD"])
    def image_file(self, request: IRequest, token: str) -> bytes:
        """
        An image made with C{response_format: "url"}: its address is the
        capability (unguessable, no key needed, as an C{<img src>} sends
        none), for C{HELD_SECS} after it was made.
        """
        held = self.images.get(token)
        if held is None:
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"application/json")
            return error_body(
                "no such image: image URLs expire an hour after they were made; generate it again",
                "invalid_request_error",
                "not_found",
            )
        data, content_type = held
        request.setHeader(b"content-type", content_type.encode("ascii"))
        request.setHeader(b"cache-control", b"private, max-age=3600")
        return data

    # -- the Responses API (blazar.web.responses) ----------------------------

    def _responses_api(self) -> Responses:
        if self._responses is None:
            raise BadRequest("the Responses API is not configured on this gateway")
        return self._responses

    def _responses_body(self, request: IRequest) -> dict[str, Any]:
        return read_json(request)

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
        body = json_object(raw)
        model = require_model(body)
        validate(kind, body)
        ignored, changed = lenient(kind, body)
        note_ignored(request, "openai", ignored)
        stream = bool(body.get("stream") or False) and kind != "embedding"
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise BadRequest(str(e), "keep_alive") from None
        hide_usage = False
        if stream and wants_usage(context_of(request)):
            # token limits need the child's usage: ask for it, and keep the
            # usage chunk from a client that did not ask for it
            options = body.get("stream_options") or {}
            if not options.get("include_usage"):
                hide_usage = changed = True
                body["stream_options"] = {**options, "include_usage": True}
        # logprobs with tools in a stream: llama-server loses those of the
        # text its tool-call parser holds back, so the answer is asked whole
        # and streamed from it (blazar.web.translate.chat_logprobs)
        top = chat_logprobs.tool_stream_logprobs(body) if kind == "chat" and stream else None
        client_usage = bool((body.get("stream_options") or {}).get("include_usage")) and not hide_usage
        if top is not None:
            body, changed = chat_logprobs.whole_body(body), True
        if kind == "completion":
            work = WorkClass.RAW_LONG
        elif kind == "chat" and body.get("tools"):
            work = WorkClass.TOOL
        else:
            work = WorkClass.INTERACTIVE
        fixes: list[EngineFix] = []

        async def rewrite(call: Run) -> None:
            fix = await self._engine_fix(model, kind, call.body, stream)
            if fix is not None:
                fixes.append(fix)
                if fix.body is not call.body:
                    call.body, call.raw = fix.body, None

        headers_out = False

        def on_send(cold: bool) -> Callable[[], None] | None:
            nonlocal headers_out
            if not (stream and cold):
                return None
            # a model load first: the headers and an SSE comment go out at
            # once, and another comment every LOADING_PING seconds, so
            # clients with a header timeout do not give up
            headers_out = True
            self._sse_headers(request)
            return loading_comments(request.write, self._clock)

        call = Call(
            "openai",
            _KINDS[kind],
            model,
            path,
            body,
            raw=None if changed else raw,
            stream=stream and top is None,
            client_stream=True if top is not None else None,
            keep_alive=keep_alive,
            max_tokens=None if kind == "embedding" else max_tokens_of(body),
            work=work,
            rewrite=rewrite,
            on_send=on_send,
            names=(
                "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                "prompt" if kind == "completion" else "messages",
            ),
            asked=asked_of(
                request, body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None
            ),
        )
        try:
            async with opened(self._pipeline, request, call) as reply:
                fix = fixes[0] if fixes else None
                # (a stream's own: the relay may keep state in it)
                renamer = ModelRenamer(reply.model, model) if stream else _renamer(reply.model, model)
                if top is not None:
                    payload = await judged(request, reply, reply.read())
                    tokens = usage_of_reply(payload)
                    if tokens is not None:
                        reply.usage(*tokens)
                    chunks = chat_logprobs.stream_of(json.loads(payload), top, client_usage)
                    if not headers_out:
                        self._sse_headers(request)
                    request.write(renamer.rename(chat_logprobs.encode(chunks)))
                    return None
                if stream:
                    await self._relay_stream(request, reply, renamer, hide_usage, fix)
                    return None
                payload = await judged(request, reply, reply.read())
                if fix is not None and fix.reply is not None:
                    payload = fix.reply(payload)
                tokens = usage_of_reply(payload)
                if tokens is not None:
                    reply.usage(*tokens)
                answer = renamer.rename(payload)
                request.setHeader(b"content-type", b"application/json")
                # its length known: one write, not chunks and a terminator
                request.setHeader(b"content-length", b"%d" % len(answer))
                return answer
        except Exception as e:
            # once the loading comments are out, the failure is an error event
            problem = in_stream(request, e, model, "openai", headers_out)
            request.write(b"data: " + openai_error(problem) + b"\n\n")
            return None

    async def _engine_fix(self, model: str, kind: str, body: dict[str, Any], stream: bool) -> EngineFix | None:
        """
        The L{EngineFix} a request needs, if any: every completion (its
        stream's usage chunk; legacy C{logprobs}; C{echo}). (A streamed chat
        with C{tools} and C{logprobs} is asked whole: L{_forward}.)

        @raise BadRequest: A malformed C{logprobs} or C{echo}.
        """
        if kind != "completion":
            return None
        plan = completions.plan_completion(body)
        prompts = completions.prompts_of(body.get("prompt"))
        if plan.needs_pieces:
            texts = [completions.prompt_text(p, await self._pipeline.token_pieces(model, p)) for p in prompts]
        else:
            texts = [completions.prompt_text(p) for p in prompts]
        if stream:
            translator = completions.CompletionStream(plan, texts)
            return EngineFix(
                plan.engine_body,
                rewrite=translator.event,
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

    def _sse_headers(self, request: IRequest) -> None:
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")

    async def _relay_stream(
        self,
        request: IRequest,
        reply: Reply,
        renamer: ModelRenamer,
        hide_usage: bool = False,
        fix: EngineFix | None = None,
    ) -> None:
        self._sse_headers(request)
        on_usage = reply.record if wants_usage(context_of(request)) else None

        def on_timings(events: bytes) -> None:
            tokens = usage_of_timings(events)
            if tokens is not None:
                reply.tokens(*tokens)

        relay = SSERelay(request.write, renamer, on_usage, hide_usage, on_timings)
        feed, rewriter = relay.feed, None
        if fix is not None and fix.rewrite is not None:
            rewriter = SSERewriter(relay.feed, fix.rewrite, fix.wants)
            feed = rewriter.feed
        try:
            await judged(request, reply, reply.relay(feed))
        except (EngineError, EngineRejected) as error:
            # the stream is under way: an error event, never an error body
            problem = in_stream(request, error, reply.model, "openai")
            if isinstance(error, EngineError):  # it died mid-answer
                problem = attrs.evolve(problem, code="engine_crashed")
            relay.fail(openai_error(problem))
            return
        if rewriter is not None:
            rewriter.finish()
        relay.finish()
        if not relay.done:
            note_error(context_of(request), "engine_crash")
            relay.fail(
                error_body(
                    f"llama-server for model {reply.model!r} ended the stream early",
                    "engine_error",
                    "engine_crashed",
                )
            )

    # -- errors -------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "openai")
        return None if problem is None else openai_error(problem)


_KINDS = {"chat": CallKind.CHAT, "completion": CallKind.COMPLETION, "embedding": CallKind.EMBEDDING}


_HOST = re.compile(r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def _base_url(request: IRequest) -> str:
    """
    The scheme and authority the client reached this gateway at (its
    C{Host} header), for the image URLs it gets.
    """
    host = request.getHeader(b"host")
    if isinstance(host, bytes):
        host = host.decode("latin-1")
    if not host or not _HOST.fullmatch(host):  # no header, or one that is not a host[:port]
        address = request.getHost()
        host = f"{getattr(address, 'host', '127.0.0.1')}:{getattr(address, 'port', 0)}"
    forwarded = request.getHeader(b"x-forwarded-proto")  # behind a TLS-terminating proxy
    secure = request.isSecure() or (forwarded or b"").strip().lower() in (b"https", "https")
    return ("https://" if secure else "http://") + str(host)


class HeldImages:
    """
    Images made with C{response_format: "url"}, kept in memory for
    L{HELD_SECS} (at most L{HELD_MAX_BYTES}: the oldest go first), each
    under an unguessable token.
    """

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._held: dict[str, tuple[float, bytes, str]] = {}
        self._bytes = 0

    def keep(self, b64: str, output_format: str) -> str:
        """
        Keep one image; its token and file name (C{TOKEN.png}).
        """
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            data = b""
        self._expire()
        while self._held and self._bytes + len(data) > HELD_MAX_BYTES:
            oldest = next(iter(self._held))
            self._bytes -= len(self._held.pop(oldest)[1])
        token = secrets.token_urlsafe(24) + (".jpg" if output_format == "jpeg" else ".png")
        self._held[token] = (
            self._clock.seconds() + HELD_SECS,
            data,
            "image/jpeg" if output_format == "jpeg" else "image/png",
        )
        self._bytes += len(data)
        return token

    def get(self, token: str) -> tuple[bytes, str] | None:
        self._expire()
        held = self._held.get(token)
        return (held[1], held[2]) if held is not None else None

    def _expire(self) -> None:
        now = self._clock.seconds()
        for token in [t for t, (until, _, _) in self._held.items() if until <= now]:
            self._bytes -= len(self._held.pop(token)[1])
