"""
The Ollama surface: Ollama's HTTP API (C{docs/api.md} in ollama/ollama) on
the same port, translated to and from the engines' OpenAI format by
L{blazar.web.translate.ollama}.

Errors are C{{"error": "..."}} with Ollama's statuses; a stream that fails
after its first line ends with an C{{"error": ...}} line.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from klein import Klein
from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar import __version__
from blazar.engines.llamacpp import EngineNotFound, context_per_slot
from blazar.engines.supervisor import BreakerOpen, EngineError, EngineTimeout, Instance, NoCapacity
from blazar.models.gguf_meta import GGUFError, GGUFMetadata
from blazar.models.registry import ModelChangeError, ModelEntry, ModelNotFound, ModelRegistry
from blazar.web.admission import AllSlotsBusy, Ticket, WorkClass
from blazar.web.auth import Forbidden, check_admin, key_of, record_usage
from blazar.web.quota import QuotaExceeded, retry_after
from blazar.web.hub import HubClient, PullError, parse_hub_name
from blazar.web.proxy import (
    EngineProxy,
    EngineRejected,
    PromptTooLong,
    UnsupportedByModel,
)
from blazar.web.observe import note_error, note_span, note_tokens
from blazar.web.scope import is_scoped, redact, redact_value, resolve_in_scope, visible
from blazar.web.translate import ollama as tr
from blazar.web.ignored import note_ignored
from blazar.web.translate import leniency

log = Logger()

NDJSON = b"application/x-ndjson"
# The Ollama release whose API this surface follows.
OLLAMA_API_VERSION = "0.12.0"


class OllamaError(Exception):
    """
    An error answered as C{{"error": message}} with C{status}.
    """

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def _json(request: IRequest, value: Any, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from the request
        return json.dumps(value, separators=(",", ":")).encode("ascii")


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


def capabilities(entry: ModelEntry, meta: GGUFMetadata) -> list[str]:
    """
    What the model can do, from its config and chat template:
    C{completion}, C{embedding}, C{tools}, C{thinking}.
    """
    if entry.settings.embedding:
        return ["embedding"]
    caps = ["completion"]
    template = meta.chat_template or ""
    if "tools" in template:
        caps.append("tools")
    if "<think>" in template or "enable_thinking" in template or "reasoning_content" in template:
        caps.append("thinking")
    return caps


class OllamaSurface:
    """
    Ollama-compatible HTTP API over the supervisor's children.
    """

    app = Klein()

    def __init__(
        self, registry: ModelRegistry, proxy: EngineProxy, clock: Any,
        wall_clock: Callable[[], float], hub: HubClient, default_keep_alive: float = 300.0,
    ) -> None:
        self._hub = hub
        self._default_keep_alive = default_keep_alive
        self._registry = registry
        self._proxy = proxy
        self._supervisor = proxy.supervisor
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
    @app.route("/api/push", methods=["POST"])
    def unsupported(self, request: IRequest) -> bytes:
        what = "create" if request.path.endswith(b"/create") else "push"
        hint = (
            "put a .gguf file in models_dir (or add [models.\"name\"] path = ... to the config)"
            if what == "create"
            else "copy the .gguf file from models_dir to where you want it"
        )
        return _json(request, {"error": f"/api/{what} is not supported by Blazar: {hint}"}, 501)

    # -- helpers --------------------------------------------------------------

    def _body(self, request: IRequest) -> dict[str, Any]:
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise OllamaError(400, f"invalid JSON in request body: {e}") from None
        if not isinstance(body, dict):
            raise OllamaError(400, "request body must be a JSON object")
        return body

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
                return await resolve_in_scope(request, self._registry, name)
            return await self._registry.resolve(name)
        except ModelNotFound as e:
            if request is not None:
                note_error(request, e)
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

    async def _load(self, model: str, ctx_size: int | None = None, request: IRequest | None = None) -> tr.Timing:
        """
        Make sure a child for C{model} is ready, timing how long that took
        (Ollama's C{load_duration}; a C{load} span in C{request}'s trace
        when it had to wait for one).
        """
        started = self._clock.seconds()
        entry = await self._entry(model)
        cold = not self._proxy.is_ready(entry.name)
        await self._supervisor.instance_for(model, ctx_size)
        loaded = self._clock.seconds()
        if cold and request is not None:
            note_span(request, "load", started, loaded)
        return tr.Timing(started=started, loaded=loaded)

    def _after(self, instance: Instance, keep_alive: float | None) -> None:
        # Ollama applies its default keep_alive to every request without one
        self._proxy.done(instance, self._default_keep_alive if keep_alive is None else keep_alive)

    # -- chat and generate -------------------------------------------------------

    @app.route("/api/chat", methods=["POST"])
    async def chat(self, request: IRequest) -> bytes | None:
        return await self._generate(request, "chat")

    @app.route("/api/generate", methods=["POST"])
    async def generate(self, request: IRequest) -> bytes | None:
        return await self._generate(request, "generate")

    async def _load_or_unload(
        self, request: IRequest, kind: str, model: str, keep_alive: float | None,
        ctx_size: int | None = None,
    ) -> bytes:
        entry = await self._entry(model)
        started = self._clock.seconds()
        if keep_alive == 0:
            instance = self._supervisor.loaded(entry.name)
            if instance is not None:
                await self._supervisor.stop_instance(instance, "keep_alive 0")
            reason = "unload"
        else:
            instance = await self._supervisor.instance_for(model, ctx_size)
            self._after(instance, keep_alive)
            reason = "load"
        line: dict[str, Any] = {"model": model, "created_at": _rfc3339(self._now())}
        if kind == "chat":
            line["message"] = {"role": "assistant", "content": ""}
        else:
            line["response"] = ""
        line.update({"done": True, "done_reason": reason})
        if reason == "load":
            line["load_duration"] = int((self._clock.seconds() - started) * 1e9)
        return _json(request, line)

    def _lenient(self, request: IRequest, surface: str, body: dict[str, Any]) -> None:
        """
        The leniency policy on an Ollama body: C{x-blazar-ignored} names
        what is accepted but not honoured; a field whose meaning would be
        lost is a 400.
        """
        try:
            ignored = leniency.screen(surface, body)
        except leniency.MeaningChanged as e:
            raise OllamaError(400, str(e)) from None
        note_ignored(request, "ollama", ignored + tr.ignored_options(body.get("options")))

    async def _generate(self, request: IRequest, kind: str) -> bytes | None:
        body = self._body(request)
        self._lenient(request, "ollama_chat" if kind == "chat" else "ollama_generate", body)
        model = self._model_field(body)
        stream = self._stream_flag(body)
        keep_alive = self._keep_alive(body)
        if kind == "generate" and body.get("prompt") is not None and not isinstance(body["prompt"], str):
            raise OllamaError(400, "prompt must be a string")
        empty = (
            not body.get("messages") if kind == "chat"
            else not body.get("prompt") and not body.get("suffix")
        )
        if empty:
            if kind == "chat" and "messages" in body and not isinstance(body["messages"], list):
                raise OllamaError(400, "messages must be an array")
            await self._entry(model, request)
            return await self._load_or_unload(request, kind, model, keep_alive, self._num_ctx(body))
        try:
            if kind == "chat":
                path, engine_body = "/v1/chat/completions", tr.chat_to_openai(body, stream)
            else:
                path, engine_body = tr.generate_to_openai(body, stream)
        except tr.TranslationError as e:
            raise OllamaError(400, str(e)) from None
        ctx_size = self._num_ctx(body)
        entry = await self._entry(model, request)
        await self._proxy.check_purpose(model, embedding=False)
        if "messages" in engine_body:
            await self._proxy.place_system_messages(model, engine_body)
        if path != "/infill":
            max_tokens = engine_body.get("max_tokens")

            async def count() -> int:
                if "messages" in engine_body:
                    return await self._proxy.count_chat_tokens(model, engine_body)
                return await self._proxy.count_text_tokens(model, engine_body.get("prompt", ""))

            await self._proxy.preflight(
                model, max_tokens, len(json.dumps(engine_body)), count, ctx_size,
            )
        if kind == "chat":
            work = WorkClass.TOOL if body.get("tools") else WorkClass.INTERACTIVE
        else:
            work = WorkClass.RAW_LONG if body.get("raw") is True else WorkClass.INTERACTIVE
        await self._proxy.admit(request, entry.name, work)
        timing = await self._load(model, ctx_size, request)
        instance, response = await self._proxy.send(
            model, path, json.dumps(engine_body).encode("utf-8"), ctx_size, request, stream
        )
        try:
            if not stream:
                reply = json.loads(await self._proxy.read(instance, response))
                now_wall = self._now()
                timing_now = self._clock.seconds()
                if kind == "chat":
                    out = tr.chat_reply(reply, model, timing, timing_now)
                else:
                    out = tr.generate_reply(reply, model, timing, timing_now)
                out["created_at"] = _rfc3339(now_wall)
                note_tokens(request, out["prompt_eval_count"], out["eval_count"])
                record_usage(request, out["prompt_eval_count"] + out["eval_count"])
                return _json(request, out)
            await self._stream(request, kind, model, instance, response, timing, path == "/infill")
            return None
        finally:
            instance.in_flight -= 1
            self._after(instance, keep_alive)

    async def _stream(
        self, request: IRequest, kind: str, model: str, instance: Instance, response: Any,
        timing: tr.Timing, infill: bool,
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
            await self._proxy.relay_chunks(instance, response, on_chunk, request)
        except (EngineError, EngineRejected) as error:
            note_error(request, error if isinstance(error, EngineError) else "engine_error")
            log.error("stream from {model} broke: {error}", model=instance.entry.name, error=str(error))
            request.write(tr.ndjson([{"error": redact(request, str(error))}]))
            return
        except CancelledError:
            raise
        except Exception:
            # lines may be out: whatever broke ends the stream with an error line
            log.failure("stream from {model} broke", model=instance.entry.name)
            note_error(request, "5xx")
            request.write(tr.ndjson([{"error": "internal error; see the daemon log"}]))
            return
        final = translator.finish()
        note_tokens(request, final["prompt_eval_count"], final["eval_count"])
        record_usage(request, final["prompt_eval_count"] + final["eval_count"])
        final["created_at"] = _rfc3339(wall())
        request.write(tr.ndjson([final]))

    # -- embeddings -------------------------------------------------------------

    @app.route("/api/embed", methods=["POST"])
    async def embed(self, request: IRequest) -> bytes:
        body = self._body(request)
        self._lenient(request, "ollama_embed", body)
        model = self._model_field(body)
        keep_alive = self._keep_alive(body)
        try:
            inputs = tr.embed_input(body)
        except tr.TranslationError as e:
            raise OllamaError(400, str(e)) from None
        await self._entry(model, request)
        reply, timing, instance = await self._embed(request, model, inputs, keep_alive, self._num_ctx(body))
        out = tr.embed_reply(reply, model, timing, self._clock.seconds())
        note_tokens(request, out["prompt_eval_count"], 0)
        record_usage(request, out["prompt_eval_count"])
        return _json(request, out)

    @app.route("/api/embeddings", methods=["POST"])
    async def embeddings(self, request: IRequest) -> bytes:
        body = self._body(request)
        self._lenient(request, "ollama_embed", body)
        model = self._model_field(body)
        keep_alive = self._keep_alive(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        if prompt == "":
            return _json(request, {"embedding": []})
        await self._entry(model, request)
        reply, _, _ = await self._embed(request, model, [prompt], keep_alive, self._num_ctx(body))
        return _json(request, {"embedding": reply["data"][0]["embedding"]})

    async def _embed(
        self, request: IRequest, model: str, inputs: list[str], keep_alive: float | None,
        ctx_size: int | None = None,
    ) -> tuple[dict[str, Any], tr.Timing, Instance]:
        entry = await self._entry(model)
        await self._proxy.check_purpose(model, embedding=True)
        await self._proxy.admit(request, entry.name, WorkClass.INTERACTIVE)
        timing = await self._load(model, ctx_size, request)
        instance, response = await self._proxy.send(
            model, "/v1/embeddings", json.dumps({"input": inputs}).encode("utf-8"), ctx_size, request, False
        )
        try:
            reply = json.loads(await self._proxy.read(instance, response))
        finally:
            instance.in_flight -= 1
            self._after(instance, keep_alive)
        return reply, timing, instance

    # -- model management ---------------------------------------------------------

    @app.route("/api/tags", methods=["GET", "HEAD"])
    async def tags(self, request: IRequest) -> bytes:
        models = []
        entries = await self._registry.refresh()
        allowed = set(visible(request, [e.name for e in entries]))
        for entry in (e for e in entries if e.name in allowed):
            try:
                meta = await self._registry.metadata(entry)
                digest = await self._registry.digest(entry)
            except (GGUFError, OSError) as e:
                log.warn("skipping {path}: {error}", path=str(entry.path), error=str(e))
                continue
            models.append({
                "name": entry.name, "model": entry.name,
                "modified_at": _rfc3339(entry.modified),
                "size": meta.size, "digest": digest.removeprefix("sha256:"),
                "details": details(meta),
            })
        return _json(request, {"models": models})

    @app.route("/api/show", methods=["POST"])
    async def show(self, request: IRequest) -> bytes:
        body = self._body(request)
        model = self._model_field(body)
        entry = await self._entry(model, request)
        meta = await self._registry.metadata(entry)
        parameters = "\n".join(
            f"{k:<24}{v}" for k, v in [
                ("num_ctx", context_per_slot(entry, meta)),
                ("num_parallel", entry.settings.parallel or 4),
            ]
        )
        if is_scoped(request):
            # no file paths for a scoped key: the model by name
            modelfile = f"# Served by Blazar\nFROM {entry.name}\n"
        else:
            modelfile = f"# Served by Blazar from {entry.path}\nFROM {entry.path}\n"
        if meta.chat_template:
            modelfile += f'TEMPLATE """{meta.chat_template}"""\n'
        kv = dict(meta.kv)
        kv.pop("tokenizer.chat_template", None)
        kv["general.parameter_count"] = meta.parameter_count
        return _json(request, {
            "modelfile": modelfile,
            "parameters": parameters,
            "template": meta.chat_template or "",
            "details": details(meta),
            "model_info": redact_value(request, kv),
            "capabilities": capabilities(entry, meta),
            "modified_at": _rfc3339(entry.modified),
        })

    @app.route("/api/ps", methods=["GET"])
    async def ps(self, request: IRequest) -> bytes:
        models = []
        offset = self._now() - self._clock.seconds()
        views = self._supervisor.snapshot()
        allowed = set(visible(request, [view.name for view in views]))
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
            models.append({
                "name": entry.name, "model": entry.name, "size": meta.size, "size_vram": 0,
                "digest": digest.removeprefix("sha256:"), "details": details(meta),
                # "forever" is shown far in the future, as Ollama does
                "expires_at": _rfc3339(expires + offset if expires is not None else 253402300799.0),
                "context_length": view.ctx or context_per_slot(entry, meta),
                # Blazar's: starting | ready | stopping, and the crash breaker
                "state": view.state,
                "breaker": view.breaker,
            })
        return _json(request, {"models": models})

    @app.route("/api/queue", methods=["GET"])
    def queue(self, request: IRequest) -> bytes:
        """
        Blazar's admission queues (not in Ollama's API): per model, slots
        busy/total, waiting counts by priority and class, the oldest wait,
        and each waiting request (by trace id) with its position and
        estimated start; shape in L{blazar.web.admission.ModelQueue.snapshot}.
        A scoped key sees its models, and only its own requests in them.
        """
        admission = self._proxy.admission
        if admission is None:
            return _json(request, {"models": []})
        key = key_of(request)
        allowed = set(visible(request, list(admission.queues)))

        def show(model: str, ticket: Ticket | None) -> bool:
            if model not in allowed:
                return False
            return ticket is None or key is None or key.admin or ticket.key == key.name

        return _json(request, admission.snapshot(show))

    @app.route("/api/copy", methods=["POST"])
    async def copy(self, request: IRequest) -> bytes:
        body = self._body(request)
        check_admin(request, "copy models")
        source = self._model_field(body, "source")
        destination = self._model_field(body, "destination")
        entry = await self._entry(source)
        try:
            await self._registry.copy(entry, destination)
        except ModelChangeError as e:
            raise OllamaError(400, str(e)) from None
        request.setResponseCode(200)
        return b""

    @app.route("/api/pull", methods=["POST"])
    async def pull(self, request: IRequest) -> bytes | None:
        body = self._body(request)
        check_admin(request, "pull models")
        model = self._model_field(body)
        stream = self._stream_flag(body)
        try:
            name = parse_hub_name(model)
        except PullError as e:
            raise OllamaError(e.status, str(e)) from None
        models_dir = self._registry.models_dir
        if not stream:
            try:
                await self._hub.pull(name, models_dir, lambda _: None)
            except PullError as e:
                raise OllamaError(e.status, str(e)) from None
            finally:
                self._registry.forget()
            return _json(request, {"status": "success"})
        request.setHeader(b"content-type", NDJSON)

        def progress(line: dict[str, Any]) -> None:
            request.write(tr.ndjson([line]))

        try:
            await self._hub.pull(name, models_dir, progress)
        except PullError as e:
            log.error("pull of {model} failed: {error}", model=model, error=str(e))
            request.write(tr.ndjson([{"error": str(e)}]))
        except CancelledError:
            raise
        except Exception:
            log.failure("pull of {model} broke", model=model)
            note_error(request, "5xx")
            request.write(tr.ndjson([{"error": "internal error; see the daemon log"}]))
        finally:
            self._registry.forget()
        return None

    @app.route("/api/delete", methods=["DELETE"])
    async def delete(self, request: IRequest) -> bytes:
        check_admin(request, "delete models")
        body = self._body(request)
        model = self._model_field(body)
        entry = await self._entry(model)
        try:
            self._registry.check_removable(entry)  # refuse before stopping anything
        except ModelChangeError as e:
            raise OllamaError(400, str(e)) from None
        instance = self._supervisor.loaded(entry.name)
        if instance is not None:
            await self._supervisor.stop_instance(instance, "model deleted")
        try:
            await self._registry.remove(entry)
        except ModelChangeError as e:
            raise OllamaError(400, str(e)) from None
        request.setResponseCode(200)
        return b""

    # -- errors -------------------------------------------------------------

    @app.handle_errors(OllamaError)
    def _ollama_error(self, request: IRequest, failure: Failure) -> bytes:
        e = failure.value
        assert isinstance(e, OllamaError)
        return _json(request, {"error": str(e)}, e.status)

    @app.handle_errors(QuotaExceeded)
    def _quota(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, QuotaExceeded)
        retry_after(request, e.retry_after)
        return _json(request, {"error": str(e)}, 429)

    @app.handle_errors(Forbidden)
    def _forbidden(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, "forbidden")
        return _json(request, {"error": str(failure.value)}, 403)

    @app.handle_errors(PromptTooLong)
    def _too_long(self, request: IRequest, failure: Failure) -> bytes:
        return _json(request, {"error": str(failure.value)}, 400)

    @app.handle_errors(UnsupportedByModel)
    def _unsupported(self, request: IRequest, failure: Failure) -> bytes:
        return _json(request, {"error": str(failure.value)}, 400)

    @app.handle_errors(ModelNotFound)
    def _not_found(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, ModelNotFound)
        return _json(request, {"error": f'model "{e.name}" not found, try pulling it first'}, 404)

    @app.handle_errors(EngineRejected)
    def _rejected(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, EngineRejected)
        return _json(request, {"error": redact(request, str(e))}, client_status(e.status))

    @app.handle_errors(AllSlotsBusy)
    def _all_slots_busy(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        e = failure.value
        assert isinstance(e, AllSlotsBusy)
        retry_after(request, e.retry_after)
        return _json(request, {"error": str(e)}, 503)

    @app.handle_errors(BreakerOpen, NoCapacity)
    def _breaker_open(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return _json(request, {"error": redact(request, str(failure.value))}, 503)

    @app.handle_errors(EngineTimeout)
    def _timeout(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        return _json(request, {"error": redact(request, str(failure.value))}, 504)

    @app.handle_errors(EngineError, EngineNotFound, GGUFError)
    def _engine(self, request: IRequest, failure: Failure) -> bytes:
        note_error(request, failure.value)
        log.error("{error}", error=str(failure.value), trace_id=getattr(request, "trace_id", ""))
        return _json(request, {"error": redact(request, str(failure.value))}, 502)

    @app.handle_errors(Exception)
    def _unexpected(self, request: IRequest, failure: Failure) -> bytes | None:
        if failure.check(CancelledError):
            return None
        from werkzeug.exceptions import MethodNotAllowed, NotFound
        from werkzeug.routing import RequestRedirect

        if failure.check(NotFound, RequestRedirect):
            return _json(request, {"error": "404 page not found"}, 404)
        if failure.check(MethodNotAllowed):
            return _json(request, {"error": "405 method not allowed"}, 405)
        log.failure("unexpected error", failure, trace_id=getattr(request, "trace_id", ""))
        return _json(
            request, {"error": f"internal error (trace id {getattr(request, 'trace_id', '')})"}, 500
        )


def client_status(engine_status: int) -> int:
    """
    The status to answer for an engine's error status: its 4xx as they are,
    501 (the model cannot do that, e.g. infill without FIM tokens) as 400,
    anything else as 502.
    """
    if 400 <= engine_status < 500:
        return engine_status
    if engine_status == 501:
        return 400
    return 502
