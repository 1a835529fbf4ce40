"""
The Ollama surface: Ollama's HTTP API (C{docs/api.md} in ollama/ollama) on
the same port, translated to and from the engines' OpenAI format by
L{blazar.web.translate.ollama}.

Errors are C{{"error": "..."}} with Ollama's statuses; a stream that fails
after its first line ends with an C{{"error": ...}} line.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Awaitable, Callable

from klein import Klein
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar import __version__, strictjson
from blazar.config import Config
from blazar.gateway.admission import Ticket, WorkClass
from blazar.gateway.call import OLLAMA_PLACEMENT, Asked, Call, CallKind, max_tokens_of
from blazar.gateway.context import key_of, note_error
from blazar.gateway.engine_facts import context_per_slot, model_kind, sees_images
from blazar.gateway.errors import BadRequest
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.reply import Reply, scoped
from blazar.gateway.scope import is_scoped, may_use, redact_value, resolve_in_scope, visible, visible_entries
from blazar.gateway.sessions import elsewhere
from blazar.models.gguf_meta import GGUFError, GGUFMetadata, template_capabilities
from blazar.models.modelfile import DEFAULT_TEMPLATE, model_commands, show_modelfile, show_parameters
from blazar.models.ollama_store import DigestMismatch, StoreError
from blazar.models.registry import ModelEntry, ModelNotFound, ModelRegistry
from blazar.web.auth import check_admin
from blazar.web.body import read_json
from blazar.web.client import asked_of, context_of, judged, note_ignored, opened, write_ignored
from blazar.web.errors import answer, in_stream, ollama_message
from blazar.web.translate import create as create_tr
from blazar.web.translate import images as images_tr
from blazar.web.translate import leniency
from blazar.web.translate import ollama as tr
from blazar.web.translate import rerank as rerank_tr

log = Logger()

NDJSON = b"application/x-ndjson"
# The Ollama release whose API this surface follows.
OLLAMA_API_VERSION = "0.12.0"


class OllamaError(BadRequest):
    """
    A request Ollama's API answers with C{{"error": message}} and C{status}
    (400 unless said).
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(request: IRequest, value: Any, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    text = strictjson.encode(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from the request
        return strictjson.encode(value, separators=(",", ":")).encode("ascii")


def _rfc3339(seconds: float) -> str:
    return tr.created_at(seconds)


def details(meta: GGUFMetadata) -> dict[str, Any]:
    """
    Ollama's C{details} object for a model.
    """
    return {
        "parent_model": "",
        "format": "gguf",
        "family": meta.architecture,
        "families": [meta.architecture],
        "parameter_size": meta.parameter_size,
        "quantization_level": meta.quantization_level,
    }


def remote_tag(entry: ModelEntry) -> dict[str, Any]:
    """
    C{/api/tags}' entry for a remote's model (C{[[remotes]]}), with the
    fields Ollama gives its own remote models (C{remote_model},
    C{remote_host}).
    """
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": _rfc3339(entry.modified),
        "size": 0,
        "digest": hashlib.sha256(entry.name.encode("utf-8")).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "remote",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        },
        "kind": "remote",
        "remote_model": entry.remote_model,
        "remote_host": entry.remote,
    }


def capabilities(entry: ModelEntry, meta: GGUFMetadata, config: Config | None = None) -> list[str]:
    """
    What the model can do, from its config, chat template and projector:
    C{completion}, C{embedding}, C{tools}, C{vision}, C{thinking}, in
    Ollama's order.

    @param config: The live config (its C{args} may give or take away a
        projector: L{sees_images}).
    """
    if entry.settings.embedding:
        return ["embedding"]
    caps = ["completion", *template_capabilities(meta.chat_template)]
    if sees_images(entry, meta, config or Config()):
        caps.insert(caps.index("thinking") if "thinking" in caps else len(caps), "vision")
    return caps


def show_capabilities(entry: ModelEntry, meta: GGUFMetadata, config: Config | None = None) -> list[str]:
    """
    C{/api/show}'s C{capabilities}: L{capabilities}, and as Ollama decides
    them also C{tools} for a chat template that names C{tool_call}, and
    C{insert} for a model whose vocabulary has fill-in-the-middle tokens
    (what llama-server's C{/infill}, behind C{suffix}, needs) or whose
    recorded Go template takes a C{.Suffix}.
    """
    caps = capabilities(entry, meta, config)
    if "embedding" in caps:
        return caps
    if "tools" not in caps and "tool_call" in (meta.chat_template or ""):
        caps.insert(1, "tools")
    fim = {"tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"} & set(meta.kv)
    template = entry.ollama.template if entry.ollama is not None else None
    if fim or ".Suffix" in (template or ""):
        caps.append("insert")
    return caps


def show_kv(kv: Any, verbose: bool = False) -> dict[str, Any]:
    """
    A GGUF's key/values as Ollama's C{/api/show} gives them: without
    C{general.name} and C{tokenizer.chat_template}, an array of more than
    five values as C{[]} unless C{verbose}, and one too long to have been
    read (L{blazar.models.gguf_meta.MAX_ARRAY}) as C{[]} always.
    """
    out = {}
    for key, value in dict(kv).items():
        if key in ("general.name", "tokenizer.chat_template"):
            continue
        out[key] = [] if value is None or not verbose and isinstance(value, list) and len(value) > 5 else value
    return out


class OllamaSurface:
    """
    Ollama-compatible HTTP API over the supervisor's children.
    """

    app = Klein()

    def __init__(
        self,
        registry: ModelRegistry,
        pipeline: Pipeline,
        clock: Any,
        wall_clock: Callable[[], float],
        operations: ModelOperations,
        config: Callable[[], Config] = Config,
        hints: Any = None,
    ) -> None:
        """
        @param config: The live config (L{blazar.config.LiveConfig}); its
            C{keep_alive} is read per request.
        @param hints: What the engines say about themselves per model
            (L{blazar.engines.hints.IEngineHints}: C{for_model(name)});
            C{/api/ps} shows its speculative-decoding figures.
        """
        self._hints = hints
        self._operations = operations
        self._config = config
        self._registry = registry
        self._pipeline = pipeline
        self._clock = clock
        self._now = wall_clock

    # -- small endpoints --------------------------------------------------------

    @app.route("/", methods=["GET", "HEAD"])
    def root(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"Ollama is running"

    @app.route("/api/version", methods=["GET", "HEAD"])
    def version(self, request: IRequest) -> bytes:
        return _json(request, {"version": OLLAMA_API_VERSION, "blazar": __version__})

    @app.route("/api/create", methods=["POST"])
    async def create(self, request: IRequest) -> bytes | None:
        """
        Create a model of the Ollama store (L{blazar.models.create}): the
        JSON form (C{model}, C{from}, C{files}, C{adapters}, C{template},
        C{system}, C{parameters}, C{messages}, C{license}, C{quantize}) or
        the legacy C{modelfile} text, streaming Ollama's status lines
        (C{parsing GGUF}, C{quantizing F16 model to Q8_0}, C{using existing
        layer sha256:...}, C{writing manifest}, C{success}). What is
        accepted and not honoured (a C{template}: llama-server keeps the
        GGUF's own chat template) is named in C{x-blazar-ignored}.
        """
        body = self._body(request)
        check_admin(request, "create models")
        stream = self._stream_flag(body)
        spec, ignored = create_tr.decode_create(body)
        note_ignored(request, "ollama", ignored)
        if not stream:
            await self._operations.create(spec)
            return _json(request, {"status": "success"})

        async def run(progress: Callable[[dict[str, Any]], None]) -> None:
            await self._operations.create(spec, progress)
            progress({"status": "success"})

        await self._progress(request, spec.name.display, run)
        return None

    @app.route("/api/blobs/<string:digest>", methods=["HEAD"])
    async def has_blob(self, request: IRequest, digest: str) -> bytes:
        """
        200 if the store holds blob C{digest} (C{sha256:<hex>}), else 404.
        """
        check_admin(request, "upload blobs")
        try:
            found = await self._operations.has_blob(digest)
        except StoreError as e:
            raise OllamaError(400, str(e)) from None
        if not found:
            raise OllamaError(404, f'blob "{digest}" not found')
        request.setResponseCode(200)
        return b""

    @app.route("/api/blobs/<string:digest>", methods=["POST"])
    async def upload_blob(self, request: IRequest, digest: str) -> bytes:
        """
        Store the body as blob C{digest} for a later C{/api/create}: 201
        once its sha256 is checked (it is named only then), 200 if the
        store had it, 400 if the sha256 is another. The body may be up to
        C{max_blob_bytes}; the site spools it into the store's directory.
        """
        check_admin(request, "upload blobs")
        try:
            if await self._operations.has_blob(digest):
                request.setResponseCode(200)
                return b""
            created = await self._operations.store_upload(digest, request.content)
        except DigestMismatch as e:
            raise OllamaError(400, f'digest mismatch, expected "{e.expected}", got "{e.actual}"') from None
        except StoreError as e:
            raise OllamaError(400, str(e)) from None
        request.setResponseCode(201 if created else 200)
        return b""

    # -- helpers --------------------------------------------------------------

    def _body(self, request: IRequest) -> dict[str, Any]:
        return read_json(request, empty_ok=True)

    def _model_field(self, body: dict[str, Any], key: str = "model") -> str:
        model = body.get(key) or (body.get("name") if key == "model" else None)
        if not isinstance(model, str) or not model:
            raise OllamaError(400, f"{key} is required")
        return model

    async def _entry(self, name: str, request: IRequest | None = None) -> ModelEntry:
        """
        The model C{name}; with C{request}, the scope check first
        (L{resolve_in_scope}: a model outside a scoped key's scope is not
        found either).
        """
        try:
            if request is not None:
                return await resolve_in_scope(context_of(request), self._registry, name)
            return await self._registry.resolve(name)
        except ModelNotFound as e:
            if request is not None:
                note_error(context_of(request), e)
            shown = name if len(name) <= 200 else name[:200] + "..."
            raise OllamaError(404, f'model "{shown}" not found, try pulling it first') from None

    def _stream_flag(self, body: dict[str, Any]) -> bool:
        stream = body.get("stream")
        if stream is None:
            return True
        if not isinstance(stream, bool):
            raise OllamaError(400, "stream must be true or false")
        return stream

    def _keep_alive(self, body: dict[str, Any]) -> float | None:
        try:
            return tr.parse_keep_alive(body.get("keep_alive"))
        except tr.TranslationError as e:
            raise OllamaError(400, str(e)) from None

    def _num_ctx(self, body: dict[str, Any]) -> int | None:
        """
        C{options.num_ctx}, the context per slot the request asks for
        (the supervisor grows the child to it under C{ctx_policy =
        "grow"}), if it is a positive integer; anything else is ignored.
        """
        options = body.get("options")
        num_ctx = options.get("num_ctx") if isinstance(options, dict) else None
        if isinstance(num_ctx, float) and num_ctx.is_integer():
            num_ctx = int(num_ctx)  # as the options translator takes it
        if isinstance(num_ctx, int) and not isinstance(num_ctx, bool) and num_ctx > 0:
            return num_ctx
        return None

    def _placement(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """
        The placement C{options} ask for, as the model profile's keys:
        C{num_gpu} (layers on the GPU; -1, Ollama's "all it can", leaves
        llama-server's fit) as C{gpu_layers}, C{main_gpu}, C{num_thread} as
        C{threads}, C{use_mmap}. Values of the wrong kind are left out.
        """
        options = body.get("options")
        if not isinstance(options, dict):
            return None

        def whole(name: str, least: int) -> int | None:
            value = options.get(name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= least else None

        least = {"num_gpu": 0, "main_gpu": 0, "num_thread": 1}
        wanted: dict[str, Any] = {OLLAMA_PLACEMENT[o]: whole(o, n) for o, n in least.items()}
        if isinstance(options.get("use_mmap"), bool):
            wanted[OLLAMA_PLACEMENT["use_mmap"]] = options["use_mmap"]
        return {k: v for k, v in wanted.items() if v is not None} or None

    def _call(
        self,
        kind: CallKind,
        model: str,
        path: str,
        engine_body: dict[str, Any],
        body: dict[str, Any],
        stream: bool,
        work: WorkClass = WorkClass.INTERACTIVE,
        asked: Asked = Asked(),
    ) -> Call:
        keep_alive = self._keep_alive(body)
        return Call(
            "ollama",
            kind,
            model,
            path,
            engine_body,
            stream=stream,
            # Ollama applies its default keep_alive to every request without one
            keep_alive=self._config().keep_alive if keep_alive is None else keep_alive,
            ctx_size=self._num_ctx(body),
            profile=self._placement(body),
            max_tokens=max_tokens_of(engine_body) if kind in (CallKind.CHAT, CallKind.COMPLETION) else None,
            work=work,
            names=("num_predict", "messages" if kind is CallKind.CHAT else "prompt"),
            asked=asked,
        )

    # -- chat and generate -------------------------------------------------------

    @app.route("/api/chat", methods=["POST"])
    async def chat(self, request: IRequest) -> bytes | None:
        return await self._generate(request, "chat")

    @app.route("/api/generate", methods=["POST"])
    async def generate(self, request: IRequest) -> bytes | None:
        return await self._generate(request, "generate")

    async def _load_or_unload(self, request: IRequest, kind: str, call: Call) -> bytes:
        # (a key scoped to models may not unload a model other keys share:
        # its keep_alive is ignored, keep_alive_of, and the request loads it)
        if self._keep_alive(call.body) == 0 and not scoped(context_of(request)):
            await self._operations.unload(await self._pipeline.scope(context_of(request), call.model), "keep_alive 0")
            reason, duration = "unload", None
        else:
            try:
                started, loaded = await self._pipeline.load(context_of(request), call)
            finally:
                write_ignored(request)  # a scoped key's placement and keep_alive
            reason, duration = "load", loaded - started
        line: dict[str, Any] = {"model": call.model, "created_at": _rfc3339(self._now())}
        if kind == "chat":
            line["message"] = {"role": "assistant", "content": ""}
        else:
            line["response"] = ""
        line.update({"done": True, "done_reason": reason})
        if duration is not None:
            line["load_duration"] = int(duration * 1e9)
        return _json(request, line)

    def _lenient(self, request: IRequest, surface: str, body: dict[str, Any]) -> None:
        """
        The leniency policy on an Ollama body: C{x-blazar-ignored} names
        what is accepted but not honoured; a field whose meaning would be
        lost is a 400.
        """
        note_ignored(request, "ollama", leniency.screen(surface, body) + tr.ignored_options(body.get("options")))

    async def _image(self, request: IRequest, model: str, body: dict[str, Any], stream: bool) -> bytes:
        """
        Ollama's experimental image generation on C{/api/generate} (Ollama
        0.14-0.2x: C{width}, C{height}, C{steps}, C{options.seed}; the
        answer's C{image}, base64 PNG), on the sdcpp lane. sd-server
        reports no progress, so a stream is the final line alone.
        """
        options: dict[str, Any] = body["options"] if isinstance(body.get("options"), dict) else {}
        fields: dict[str, Any] = {"prompt": body.get("prompt"), "response_format": "b64_json"}
        width, height = body.get("width"), body.get("height")
        if width is not None or height is not None:
            for name, value in (("width", width), ("height", height)):
                if isinstance(value, bool) or not isinstance(value, int) or not 16 <= value <= images_tr.MAX_SIDE:
                    raise OllamaError(
                        400, f"{name} must be an integer from 16 to {images_tr.MAX_SIDE} (both width and height)"
                    )
            fields["size"] = f"{width}x{height}"
        if body.get("steps") is not None:
            fields["steps"] = body["steps"]
        if options.get("seed") is not None:
            fields["seed"] = options["seed"]
        try:
            engine_body, _, _ = images_tr.decode(fields)
        except BadRequest as e:
            raise OllamaError(400, str(e)) from None
        call = self._call(
            CallKind.IMAGE, model, "/v1/images/generations", engine_body, body, False, asked=asked_of(request)
        )
        async with opened(self._pipeline, request, call) as reply:
            started = reply.started
            try:
                answer = json.loads(await judged(request, reply, reply.read()))
            except ValueError:
                answer = {}
        data = [d for d in (answer.get("data") or []) if isinstance(d, dict)] if isinstance(answer, dict) else []
        context_of(request).images = len(data[:1])
        line = {
            "model": model,
            "created_at": _rfc3339(self._now()),
            "image": str(data[0].get("b64_json", "")) if data else "",
            "done": True,
            "done_reason": "stop",
            "total_duration": int(max(0.0, self._clock.seconds() - started) * 1e9),
        }
        if stream:
            request.setHeader(b"content-type", b"application/x-ndjson")
            return strictjson.encode(line).encode("utf-8") + b"\n"
        return _json(request, line)

    async def _generate(self, request: IRequest, kind: str) -> bytes | None:
        body = self._body(request)
        model = self._model_field(body)
        if (
            kind == "generate"
            and body.get("prompt")
            and await self._pipeline.lane_kind(context_of(request), model) == "image"
        ):
            return await self._image(request, model, body, self._stream_flag(body))
        self._lenient(request, "ollama_chat" if kind == "chat" else "ollama_generate", body)
        stream = self._stream_flag(body)
        self._keep_alive(body)
        if kind == "generate" and body.get("prompt") is not None and not isinstance(body["prompt"], str):
            raise OllamaError(400, "prompt must be a string")
        empty = not body.get("messages") if kind == "chat" else not body.get("prompt") and not body.get("suffix")
        if empty:
            if kind == "chat" and "messages" in body and not isinstance(body["messages"], list):
                raise OllamaError(400, "messages must be an array")
            call = self._call(CallKind.CHAT, model, "", body, body, False, asked=asked_of(request))
            return await self._load_or_unload(request, kind, call)
        if kind == "chat":
            path, engine_body = "/v1/chat/completions", tr.chat_to_openai(body, stream)
            call_kind, work = CallKind.CHAT, WorkClass.TOOL if body.get("tools") else WorkClass.INTERACTIVE
        else:
            path, engine_body = tr.generate_to_openai(body, stream)
            call_kind = (
                CallKind.INFILL
                if path == "/infill"
                else CallKind.CHAT
                if "messages" in engine_body
                else CallKind.COMPLETION
            )
            work = WorkClass.RAW_LONG if body.get("raw") is True else WorkClass.INTERACTIVE
        call = self._call(call_kind, model, path, engine_body, body, stream, work, asked=asked_of(request))
        async with opened(self._pipeline, request, call) as reply:
            timing = tr.Timing(started=reply.started, loaded=reply.loaded)
            if not stream:
                answer = json.loads(await judged(request, reply, reply.read()))
                now = self._clock.seconds()
                if kind == "chat":
                    out = tr.chat_reply(answer, model, timing, now)
                else:
                    out = tr.generate_reply(answer, model, timing, now)
                out["created_at"] = _rfc3339(self._now())
                reply.usage(out["prompt_eval_count"], out["eval_count"])
                return _json(request, out)
            await self._stream(request, kind, model, reply, timing, path == "/infill")
            return None

    async def _stream(
        self,
        request: IRequest,
        kind: str,
        model: str,
        reply: Reply,
        timing: tr.Timing,
        infill: bool,
    ) -> None:
        request.setHeader(b"content-type", NDJSON)
        translator = tr.OllamaStream(kind, model, timing, self._clock.seconds)
        wall = self._now

        def emit(lines: list[dict[str, Any]]) -> None:
            if lines:
                for line in lines:
                    line["created_at"] = _rfc3339(wall())
                request.write(tr.ndjson(lines))

        def on_chunk(chunk: dict[str, Any]) -> None:
            if timing.first_token is None:
                timing.first_token = self._clock.seconds()
            if infill:
                emit(tr.infill_line(chunk, translator))
            else:
                emit(translator.feed(chunk))

        try:
            await judged(request, reply, reply.chunks(on_chunk))
        except Exception as e:
            # lines may be out: whatever broke ends the stream with an error line
            problem = in_stream(request, e, reply.model, "ollama")
            request.write(tr.ndjson([{"error": problem.message}]))
            return
        final = translator.finish()
        reply.usage(final["prompt_eval_count"], final["eval_count"])
        final["created_at"] = _rfc3339(wall())
        request.write(tr.ndjson([final]))

    # -- embeddings -------------------------------------------------------------

    @app.route("/api/embed", methods=["POST"])
    async def embed(self, request: IRequest) -> bytes:
        body = self._body(request)
        self._lenient(request, "ollama_embed", body)
        model = self._model_field(body)
        inputs = tr.embed_input(body)
        call = self._call(
            CallKind.EMBEDDING, model, "/v1/embeddings", {"input": inputs}, body, False, asked=asked_of(request)
        )
        async with opened(self._pipeline, request, call) as reply:
            timing = tr.Timing(started=reply.started, loaded=reply.loaded)
            out = tr.embed_reply(
                json.loads(await judged(request, reply, reply.read())), model, timing, self._clock.seconds()
            )
            reply.usage(out["prompt_eval_count"], 0)
        return _json(request, out)

    @app.route("/api/rerank", methods=["POST"])
    async def rerank(self, request: IRequest) -> bytes:
        """
        Reranking as Ollama-style clients call it (the shape of ollama#11389
        and langchain's OllamaRerank: C{model}, C{query}, C{documents},
        C{top_n}, C{return_documents}; C{results} with C{index},
        C{relevance_score} and C{document}), the same call as
        C{POST /v1/rerank}, Ollama's error shape.
        """
        body = self._body(request)
        model = self._model_field(body)
        try:
            engine_body, texts, top_n, return_documents, ignored = rerank_tr.decode(body)
        except BadRequest as e:
            raise OllamaError(400, str(e)) from None
        note_ignored(request, "ollama", ignored)
        call = self._call(CallKind.RERANK, model, "/v1/rerank", engine_body, body, False, asked=asked_of(request))
        async with opened(self._pipeline, request, call) as reply:
            try:
                answer = json.loads(await judged(request, reply, reply.read()))
            except ValueError:
                answer = {}
            out = rerank_tr.encode(answer if isinstance(answer, dict) else {}, model, texts, top_n, return_documents)
            reply.usage(out["usage"]["prompt_tokens"], 0)
        return _json(request, out)

    @app.route("/api/embeddings", methods=["POST"])
    async def embeddings(self, request: IRequest) -> bytes:
        body = self._body(request)
        self._lenient(request, "ollama_embed", body)
        model = self._model_field(body)
        self._keep_alive(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        if prompt == "":
            await self._pipeline.scope(context_of(request), model)  # an unknown model is still a 404
            return _json(request, {"embedding": []})
        call = self._call(
            CallKind.EMBEDDING, model, "/v1/embeddings", {"input": [prompt]}, body, False, asked=asked_of(request)
        )
        async with opened(self._pipeline, request, call) as reply:
            out = json.loads(await judged(request, reply, reply.read()))
        return _json(request, {"embedding": out["data"][0]["embedding"]})

    # -- model management ---------------------------------------------------------

    @app.route("/api/tags", methods=["GET", "HEAD"])
    async def tags(self, request: IRequest) -> bytes:
        models = []
        entries = await self._registry.refresh()
        allowed = set(visible_entries(context_of(request), entries))
        for entry in (e for e in entries if e.name in allowed):
            if entry.remote is not None:
                models.append(remote_tag(entry))
                continue
            try:
                meta = await self._registry.metadata(entry)
                digest = await self._registry.digest(entry)
            except (GGUFError, OSError) as e:
                log.warn("skipping {path}: {error}", path=str(entry.path), error=str(e))
                continue
            models.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "modified_at": _rfc3339(entry.modified),
                    # a store model: all its blobs, as Ollama counts it
                    "size": entry.ollama.size if entry.ollama is not None else meta.size,
                    "digest": digest.removeprefix("sha256:"),
                    "details": details(meta),
                    "kind": model_kind(entry, meta),  # Blazar's: chat, embedding or rerank
                }
            )
        return _json(request, {"models": models})

    @app.route("/api/show", methods=["POST"])
    async def show(self, request: IRequest) -> bytes:
        body = self._body(request)
        model = self._model_field(body)
        entry = await self._entry(model, request)
        if entry.remote is not None:
            # nothing of it is on this machine: what Ollama shows of its own remote models
            return _json(
                request,
                {
                    "modelfile": f"# Served by Blazar from remote {entry.remote}\nFROM {entry.name}\n",
                    "parameters": "",
                    "template": "",
                    "details": remote_tag(entry)["details"],
                    "model_info": {},
                    "capabilities": ["completion"],
                    "remote_model": entry.remote_model,
                    "remote_host": entry.remote,
                },
            )
        meta = await self._registry.metadata(entry)
        layers = entry.ollama
        own = dict(layers.parameters) if layers is not None else {}
        # the model's parameters, then (Blazar's) the context per slot and the slots it is served with
        shown = {
            **own,
            "num_ctx": own.get("num_ctx", context_per_slot(entry, meta)),
            "num_parallel": entry.settings.parallel or 4,
        }
        hidden = is_scoped(context_of(request))  # no file paths for a scoped key: the model by name
        commands = model_commands(
            entry.name if hidden else str(entry.path),
            adapters=[] if hidden else [str(path) for path, _ in entry.adapters],
            projectors=[] if hidden or entry.projector is None else [str(entry.projector)],
            template=layers.template if layers is not None else None,
            system=layers.system if layers is not None else None,
            parameters=own,
            license=[layers.license] if layers is not None and layers.license else [],
            messages=layers.messages if layers is not None else [],
        )
        verbose = body.get("verbose") is True
        kv = show_kv(meta.kv, verbose)
        kv["general.parameter_count"] = meta.parameter_count
        config = self._config()
        shaped: dict[str, Any] = {
            "license": layers.license if layers is not None else None,
            "modelfile": show_modelfile(entry.name, commands),
            "parameters": show_parameters(shown),
            # what llama-server renders a chat with: the GGUF's own template (a recorded Go one is not applied)
            "template": meta.chat_template or (layers.template if layers is not None else None) or DEFAULT_TEMPLATE,
            "system": layers.system if layers is not None else None,
            "details": details(meta),
            "messages": [
                {"role": m.get("role", ""), "content": m.get("content", "")}
                for m in (layers.messages if layers is not None else [])
                if isinstance(m, dict)
            ],
            "model_info": redact_value(context_of(request), kv),
            "capabilities": show_capabilities(entry, meta, config),
            "modified_at": _rfc3339(entry.modified),
        }
        if entry.projector is not None:
            projector = await self._registry.metadata(ModelEntry(entry.name, entry.projector))
            shaped["projector_info"] = redact_value(context_of(request), show_kv(projector.kv, verbose))
        # (Ollama leaves out what is empty, model_info aside)
        return _json(request, {k: v for k, v in shaped.items() if v or k == "model_info"})

    @app.route("/api/ps", methods=["GET"])
    async def ps(self, request: IRequest) -> bytes:
        models = []
        offset = self._now() - self._clock.seconds()
        views = self._pipeline.running()
        allowed = set(visible(context_of(request), [view.name for view in views]))
        for view in views:
            if not view.live or view.name not in allowed:
                continue
            entry = view.entry
            try:
                meta = await self._registry.metadata(entry)
                digest = await self._registry.digest(entry)
            except (GGUFError, OSError):
                continue
            expires = view.expires_at
            models.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "size": meta.size,
                    # NVML's figure for the child once measured, its plan's before (Ollama reads its child's log)
                    "size_vram": sum(view.gpu_held().values()),
                    "digest": digest.removeprefix("sha256:"),
                    "details": details(meta),
                    # "forever" is shown far in the future, as Ollama does
                    "expires_at": _rfc3339(expires + offset if expires is not None else 253402300799.0),
                    "context_length": view.ctx or context_per_slot(entry, meta),
                    # Blazar's: starting | ready | stopping, and the crash breaker
                    "state": view.state,
                    "breaker": view.breaker,
                    "speculative": self._speculative(entry),
                }
            )
        return _json(request, {"models": models})

    def _speculative(self, entry: ModelEntry) -> dict[str, Any]:
        """
        Blazar's C{speculative} object in C{/api/ps} (not in Ollama's API):
        the model's C{mode} (C{off}, C{ngram}, C{draft}, C{auto}) and what
        its engine measured, as EWMAs (L{blazar.engines.hints}):
        C{acceptance} (accepted / drafted tokens, 0-1) and
        C{accepted_per_draft} (tokens); L{None} until it drafted. For
        C{auto}, the tuner's state too
        (L{blazar.gateway.pipeline.Pipeline.speculative_auto}):
        C{decided} (C{"measuring"}, C{"on"}, C{"off"}), C{running}, C{lookup},
        C{rates} and C{last}.
        """
        hint = self._hints.for_model(entry.name) if self._hints is not None else None
        shown: dict[str, Any] = {
            "mode": entry.settings.speculative,
            "acceptance": hint.draft_acceptance if hint is not None else None,
            "accepted_per_draft": hint.accepted_per_draft if hint is not None else None,
        }
        auto = self._pipeline.speculative_auto(entry.name)
        if auto is not None:
            shown.update(auto, mode="auto")
        return shown

    @app.route("/api/queue", methods=["GET"])
    def queue(self, request: IRequest) -> bytes:
        """
        Blazar's admission queues (not in Ollama's API): per model, slots
        busy/total, waiting counts by priority and class, the oldest wait,
        and each waiting request (by trace id) with its position and
        estimated start; shape in L{blazar.gateway.admission.ModelQueue.snapshot}.
        A scoped key sees its models, and only its own requests in them.
        """
        key = key_of(context_of(request))

        def show(model: str, ticket: Ticket | None) -> bool:
            if not may_use(context_of(request), model):
                return False
            return ticket is None or key is None or key.admin or ticket.key == key.name

        return _json(request, self._pipeline.queues(show))

    @app.route("/api/session", methods=["GET"])
    async def sessions(self, request: IRequest) -> bytes:
        """
        Blazar's sessions (not in Ollama's API): the caller's key's own,
        most recent first: C{session}, C{model}, C{node} (the node that
        holds its KV: with C{[cluster] database}, other nodes' sessions too,
        from the KV bank's index), C{slot} (in the running child, or null),
        C{last_used} (RFC 3339), C{tokens_cached}, C{saved} (a KV bank entry
        on disk) and C{saved_tokens}.
        """
        key = key_of(context_of(request))
        owner = key.owner if key is not None else ""
        table = self._pipeline.sessions
        offset = self._now() - self._clock.seconds()
        shown: list[dict[str, Any]] = []
        if table is None:
            return _json(request, {"sessions": shown, "enabled": False})
        for session in table.of_key(owner):
            view = session.view(table.node)
            view["last_used"] = _rfc3339(view["last_used"] + offset)
            shown.append(view)
        if table.index is not None:
            mine = {(v["session"], v["model"]) for v in shown}
            for _, name, model, node, last_used in await table.index(owner):
                if node != table.node and (name, model) not in mine:
                    shown.append(elsewhere(name, model, node, _rfc3339(last_used)))
        return _json(request, {"sessions": shown, "enabled": table.enabled})

    @app.route("/api/session", methods=["POST"])
    def session_action(self, request: IRequest) -> bytes:
        """
        C{{"action": "close", "session": NAME}}: end one of the caller's
        sessions (its slot given up, its bank entry deleted); 404 if the
        key has none by that name.
        """
        body = self._body(request)
        if body.get("action") != "close":
            raise OllamaError(400, 'action: must be "close"')
        name = body.get("session")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "session is required: the name of one of this key's sessions (GET /api/session)")
        key = key_of(context_of(request))
        table = self._pipeline.sessions
        closed = table.close(key.owner if key is not None else "", name) if table is not None else []
        if not closed:
            raise OllamaError(404, f"no session {name!r} for this key (GET /api/session lists them)")
        return _json(request, {"closed": name, "models": sorted({s.model for s in closed})})

    @app.route("/api/copy", methods=["POST"])
    async def copy(self, request: IRequest) -> bytes:
        body = self._body(request)
        check_admin(request, "copy models")
        source = self._model_field(body, "source")
        destination = self._model_field(body, "destination")
        await self._operations.copy(source, destination)
        request.setResponseCode(200)
        return b""

    @app.route("/api/pull", methods=["POST"])
    async def pull(self, request: IRequest) -> bytes | None:
        return await self._transfer(request, "pull models", self._operations.pull)

    @app.route("/api/push", methods=["POST"])
    async def push(self, request: IRequest) -> bytes | None:
        """
        Push a model of the Ollama store to the registry its name names
        (C{registry} in the config for C{name[:tag]} and C{ns/name[:tag]};
        C{insecure: true} for a plain-http one), streaming Ollama's push
        progress (C{retrieving manifest}, C{pushing <digest>} with
        C{total} and C{completed}, C{pushing manifest}, C{success}).
        """
        return await self._transfer(request, "push models", self._operations.push)

    async def _transfer(self, request: IRequest, what: str, transfer: Callable[..., Awaitable[object]]) -> bytes | None:
        """
        Pull or push the body's C{model} with C{transfer} (C{name},
        C{progress}, C{insecure}: L{ModelOperations.pull} or C{push}), for
        an admin (C{what} names the refusal): C{{"status": "success"}} once
        done, or, unless C{stream} is false, its progress as it goes
        (L{_progress}).
        """
        body = self._body(request)
        check_admin(request, what)
        model = self._model_field(body)
        stream = self._stream_flag(body)
        insecure = body.get("insecure") is True
        if not stream:
            await transfer(model, insecure=insecure)
            return _json(request, {"status": "success"})
        await self._progress(request, model, lambda progress: transfer(model, progress, insecure))
        return None

    async def _progress(
        self,
        request: IRequest,
        model: str,
        run: Callable[[Callable[[dict[str, Any]], None]], Awaitable[object]],
    ) -> None:
        """
        Stream the progress lines C{run} reports as NDJSON; a failure after
        the first line ends the stream with an C{{"error": ...}} line.
        """
        streaming = False

        def progress(line: dict[str, Any]) -> None:
            nonlocal streaming
            if not streaming:  # a refusal before the first line is a plain error answer
                streaming = True
                request.setHeader(b"content-type", NDJSON)
            request.write(tr.ndjson([line]))

        try:
            await run(progress)
        except Exception as e:
            # a refusal before the first line is a plain error answer
            problem = in_stream(request, e, model, "ollama", streaming)
            request.write(tr.ndjson([{"error": problem.message}]))

    @app.route("/api/delete", methods=["DELETE"])
    async def delete(self, request: IRequest) -> bytes:
        check_admin(request, "delete models")
        body = self._body(request)
        model = self._model_field(body)
        await self._operations.delete(model)
        request.setResponseCode(200)
        return b""

    # -- errors -------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "ollama")
        return None if problem is None else _json(request, {"error": ollama_message(problem)}, problem.status)
