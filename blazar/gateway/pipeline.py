"""
The one request path. Every surface decodes its JSON into a
L{blazar.gateway.call.Call} (noting, as it decodes, what it accepts but
does not honour: C{x-blazar-ignored}, so a request refused before it is a
call still says so) and hands it here; what comes back is the engine's
answer, which the surface encodes. The steps, in this order, for every
surface:

 1. scope: a model outside a scoped key's scope does not exist (and the
    key's rate limits are checked: L{blazar.gateway.scope}); the model is
    resolved here, once, and its lane found (C{NAME:model} of a
    C{[[remotes]]} entry: the remote lane, L{blazar.engines.remote}, which
    skips steps 2-4, 6 and 8 and the grammar and the pin: the remote does
    its own; its body names the remote's model, as Anthropic Messages for
    C{api = "anthropic"}: L{blazar.gateway.remotewire});
 2. purpose: no chat on an embedding model, no embeddings on a chat model;
    the model's own defaults: a model of the Ollama store gets its
    Modelfile's system prompt, messages and parameters where the request
    set none (L{blazar.gateway.defaults});
    vision: a chat's images need a model with a projector, and those it
    names by http(s) URL are fetched here, never by the engine
    (L{Pipeline._vision});
 3. system-message placement for the model's chat template;
    then the semantic cache (L{Pipeline._cached}, chat calls only): a
    hit is answered here, with no slot, no child and no engine request;
 4. the surface's own rewrite, if any (L{Call.rewrite});
 5. the body encoded, once;
 6. the context preflight (prompt + output within a slot's context);
 7. admission (a slot of the model, by priority, class, deadline and key);
 8. the prompt's token count, if the surface needs it (after admission: no
    engine call for a request still queued);
 9. a lease on a ready child (loading one if needed); the session pin
    (L{blazar.gateway.sessions}: the session's slot, its KV bank entry
    restored into it); the send;
    a forced tool call is decoded under the offered tools' grammar instead
    (L{blazar.gateway.toolcalls}); a model's own call the engine could not
    parse is asked once more as text (L{Pipeline._as_text});
 10. the surface reads or relays the answer (L{Reply}), and the sentinel
     judges it (L{blazar.gateway.sentinel});
 11. usage (metrics, the key's token limits) as the surface reports it,
     and the lease's end (C{keep_alive}, unloading on 0).

Adding a step (a tool-call grammar, a cache lookup, remote routing) is a
change here, not in the surfaces. Errors are domain errors
(L{blazar.gateway.errors}); surfaces render them.
"""

from __future__ import annotations

import json
import re
import secrets
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping

import attrs
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.logger import Logger

from blazar import strictjson
from blazar.config import CommandLane, Config
from blazar.engines.lanes import BUILTIN, LANE_KIND, LLAMACPP, SDCPP, WHISPER, route
from blazar.engines.lease import InstanceLease
from blazar.engines.llamacpp import DEFAULT_PARALLEL, is_reranker, sees_images
from blazar.engines.remote import REMOTE, is_remote, shared_name
from blazar.engines.supervisor import InstanceState, InstanceView
from blazar.gateway import cache as semantic
from blazar.gateway import jsonanswer
from blazar.gateway.admission import CLASS_NAMES, QUEUE_MS_HEADER, Admission, admit_request, queue_ms
from blazar.gateway.audio import AudioUnreadable, thd_image_size, thd_to_multipart
from blazar.gateway.cachestore import CacheStore
from blazar.gateway.call import OLLAMA_PLACEMENT, Call, CallKind, Counting, Run
from blazar.gateway.context import RequestContext, key_of, note_span, note_tokens
from blazar.gateway.defaults import apply_model_defaults, model_context
from blazar.gateway.engine_proxy import EngineProxy, note_load
from blazar.gateway.errors import BadRequest, EngineRejected, UnsupportedByModel
from blazar.gateway.ignored import note_ignored
from blazar.gateway.imagefetch import ImageFetcher
from blazar.gateway.isolation import Isolated, KeyIsolation, with_fields
from blazar.gateway.remotewire import AnthropicStream, to_anthropic
from blazar.gateway.reply import Reply, scoped
from blazar.gateway.scope import may_use, resolve_in_scope
from blazar.gateway.sentinel import HEADER as SENTINEL_HEADER
from blazar.gateway.sentinel import UNPARSED, SentinelViolation
from blazar.gateway.sessions import Pin, Sessions
from blazar.gateway.toolcalls import (
    Forced,
    ToolChoiceError,
    ToolSchemaError,
    chat_completion,
    chat_stream,
    cut_short,
    forced_call,
    parse_calls,
    thd_prepare,
    tool_calls,
    usage_of,
)
from blazar.gateway.translated import FromAnthropic, FromCompletion, Renamed, Translated, scrubber
from blazar.models.gguf_meta import template_capabilities
from blazar.models.registry import ModelEntry, ModelNotFound, ModelRegistry

log = Logger()


class Opened:
    """
    C{async with pipeline.open(context, call) as reply}: the steps up to
    the send on entry; the lease's end on exit, however the block ends.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        context: RequestContext | None,
        call: Call,
        on_send: Callable[[bool], Callable[[], None] | None] | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._context = context
        self._call = Run.of(call, on_send)
        self._lease: InstanceLease | None = None
        self._reply: Reply | None = None

    @property
    def headers(self) -> Mapping[bytes, bytes]:
        """
        The response headers the steps decided so far (C{x-blazar-cache},
        C{x-blazar-queue-ms}, an enforced refusal's C{x-blazar-sentinel}),
        read-only: what the reply carries
        (L{Reply.headers}), and what a call that fails after deciding them
        must go out with; the surface writes them
        (L{blazar.web.client.opened}).
        """
        return MappingProxyType(dict(self._call.headers))

    async def __aenter__(self) -> Reply:
        self._reply, self._lease = await self._pipeline._start(self._context, self._call)
        return self._reply

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._reply is not None and self._reply.isolated is not None:
            self._pipeline.isolation.release(self._reply.isolated)
        if self._reply is not None and self._reply.pin is not None and self._pipeline.sessions is not None:
            tokens = self._context.tokens if self._context is not None else None
            self._pipeline.sessions.release(self._reply.pin, sum(tokens) if tokens else None)
        if self._lease is not None:
            self._pipeline._end(self._lease, applied_keep_alive(self._context, self._call))


class Pipeline:
    """
    Runs calls (see the module docstring).
    """

    def __init__(
        self,
        proxy: EngineProxy,
        clock: Any,
        registry: ModelRegistry | None = None,
        admission: Admission | None = None,
        sessions: Sessions | None = None,
        config: Callable[[], Config] = Config,
        in_thread: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self._config = config
        self._proxy = proxy
        self._clock = clock
        self._in_thread = in_thread or _inline
        self._decodes = Bounded(DECODES)  # uploads being decoded at once, daemon-wide
        # per (path, mtime): (general.architecture, reranker), read once per file version
        self._facts: dict[tuple[Any, float], _Facts] = {}
        self._registry = registry
        self.admission = admission
        self.sessions = sessions
        self.supervisor = proxy.supervisor
        self.cache: CacheStore | None = None  # the semantic cache's entries (L{_cached}); None: no cache
        self.images: ImageFetcher | None = None  # fetches image URLs (L{_vision}); None: they are refused
        self.isolation = KeyIsolation(clock)  # the slots of models with isolate_keys

    def open(
        self,
        context: RequestContext | None,
        call: Call,
        on_send: Callable[[bool], Callable[[], None] | None] | None = None,
    ) -> Opened:
        """
        Run C{call} up to the engine's answer; see L{Opened}.

        @param on_send: Called instead of C{call.on_send} (a wrapper of it),
            if given.
        """
        return Opened(self, context, call, on_send)

    async def count(self, context: RequestContext | None, call: Call) -> int:
        """
        The prompt tokens C{call} would report, counted by the child on the
        same rendering (steps 1-4, then the count): C{count_tokens},
        C{input_tokens}.
        """
        return await self._counted(context, Run.of(call))

    async def _counted(self, context: RequestContext | None, call: Run) -> int:
        await self._check(context, call)
        if call.lane is not None:
            raise UnsupportedByModel(
                f"model {call.model!r} is served by the {call.lane.name} lane, whose server Blazar cannot ask to "
                "count tokens (counting needs llama-server)"
            )
        if call.rewrite is not None:
            await call.rewrite(call)
        return await self._count(call)

    async def load(self, context: RequestContext | None, call: Call) -> tuple[float, float]:
        """
        Make sure a child for C{call.model} is ready (scope checked) and
        record the use with C{call.keep_alive}: Ollama's load with an empty
        prompt.

        @return: Clock seconds when it began and when the child was ready.
        """
        return await self._loaded(context, Run.of(call))

    async def _loaded(self, context: RequestContext | None, call: Run) -> tuple[float, float]:
        call.entry = await self._scope(context, call.model)
        model_context(call)  # a model's own num_ctx
        started = self._clock.seconds()
        await self._placement(context, call)
        instance = await self.supervisor.instance_for(call.model, call.ctx_size)
        loaded = self._clock.seconds()
        note_load(context, instance, started, loaded)
        self._end(InstanceLease(self.supervisor, instance), applied_keep_alive(context, call))
        return started, loaded

    async def scope(self, context: RequestContext | None, model: str) -> str:
        """
        Step 2 alone, for what is not a call (Ollama's unload with an
        empty prompt): the canonical name of a model the request's key may
        use.

        @raise ModelNotFound: No such model, or one the key may not use.
        """
        entry = await self._scope(context, model)
        return entry.name if entry is not None else model

    async def lane_kind(self, context: RequestContext | None, model: str) -> str | None:
        """
        What a built-in lane's model serves (C{transcription} or C{image}),
        or L{None} for llama.cpp's and command lanes' models: for a surface
        whose one endpoint takes more than one kind (Ollama's
        C{/api/generate} makes images too). The scope step runs here (its
        rate check once per context, as always).

        @raise ModelNotFound: No such model, or one the key may not use.
        """
        entry = await self._scope(context, model)
        if entry is None:
            return None
        architecture, _ = await self._facts_of(entry)
        try:
            lane = route(entry.name, entry.format, entry.settings.engine, self._config(), architecture)
        except Exception:
            return None  # no lane serves it: the call itself says so
        return LANE_KIND.get(lane.name) if lane is not None else None

    def running(self) -> list[InstanceView]:
        """
        A read-only view of each live child (C{GET /api/ps}).
        """
        return self.supervisor.snapshot()

    def speculative_auto(self, model: str) -> dict[str, Any] | None:
        """
        The speculative-decoding tuner's state for C{model} when its
        C{speculative} is C{"auto"} (C{GET /api/ps}; shape in
        L{blazar.engines.supervisor.Supervisor.speculative_auto}), else
        L{None}.
        """
        auto = getattr(self.supervisor, "speculative_auto", None)
        result: dict[str, Any] | None = auto(model) if auto is not None else None
        return result

    def queues(self, show: Callable[[str, Any], bool]) -> dict[str, Any]:
        """
        The admission queues as C{GET /api/queue} shows them
        (L{blazar.gateway.admission.Admission.snapshot}), filtered by
        C{show(model, ticket)}.
        """
        if self.admission is None:
            return {"models": []}
        return self.admission.snapshot(show)

    async def token_pieces(self, model: str, prompt: Any) -> list[Any]:
        """
        A prompt's tokens and their text, by the child's tokenizer (for a
        surface's rewrite step: completions' C{echo} and C{logprobs}).
        """
        return await self._proxy.token_pieces(model, prompt)

    # -- the steps ----------------------------------------------------------

    async def _start(self, context: RequestContext | None, call: Run) -> tuple[Reply, InstanceLease | None]:
        if call.asked.ignored and context is not None:  # headers decoded and not honoured (an unknown objective)
            note_ignored(context, call.surface, call.asked.ignored)
        asked = call.body  # what the sentinel judges by: the request as asked, before any rewrite
        canonical = await self._check(context, call)
        hit, keep = await self._cached(context, call, asked, canonical)
        if hit is not None:
            return hit, None
        if call.rewrite is not None and call.lane is None:  # a surface's llama-server dialect fixes
            await call.rewrite(call)
        # a command lane's server or a remote: no token counting, no grammar of Blazar's, no slots
        lane = call.lane
        raw = call.raw if call.raw is not None else strictjson.encode(call.body).encode("utf-8")
        path, anthropic = call.path, None
        if lane is not None and lane.name == REMOTE:
            raw, path, anthropic = self._remote_body(context, call)
        counted = None
        if lane is None and call.kind not in (CallKind.EMBEDDING, CallKind.INFILL):
            counted = await self._proxy.preflight(
                call.model,
                call.max_tokens,
                len(raw),
                lambda: self._count(call),
                call.ctx_size,
                call.entry,
                call.names,
                floor=await self._prompt_floor(call, len(raw)),
            )
        if call.images:
            await self._image_sizes(call.images)
        waited = await self._admit(context, canonical, call, call.entry, call.lane)
        if waited is not None:
            call.headers[QUEUE_MS_HEADER] = waited
        if call.kind is CallKind.TRANSCRIBE:
            # after admission: one upload decoded at a time per model (its PCM can be hundreds of MiB)
            await self._audio(context, call)
            raw = call.raw or b""
        # after admission: no engine call for a request still queued, and a
        # model that loaded while it waited is found ready
        # (a remote is always ready: its errors come as statuses, not after a stream's loading comments)
        ready = (lane is not None and lane.name == REMOTE) or self.is_ready(canonical)
        if lane is None and (call.counting is Counting.ALWAYS or (call.counting is Counting.IF_READY and ready)):
            if counted is None:
                counted = await self._count(call)
        stop = call.on_send(not ready) if call.on_send is not None else None
        started = self._clock.seconds()
        pin: Pin | None = None
        isolated: Isolated | None = None
        forced = self._forced_call(call) if lane is None else None  # a lane's server does its own
        json_route = lane is None and forced is None and await self._json_route(call)
        completion: jsonanswer.ChatFromCompletion | None = None
        try:
            await self._placement(context, call)
            instance = await self.supervisor.instance_for(call.model, call.ctx_size)
            loaded = self._clock.seconds()  # (Ollama's load_duration ends here)
            pin = await self._pin(context, call, instance)
            isolated = self._isolate(context, call, instance, pin)
            slot = isolated.fields() if isolated is not None else {"id_slot": pin.slot} if pin is not None else {}
            made, noted = None, None
            if getattr(instance, "lane", LLAMACPP) != LLAMACPP:
                forced = None  # re-routed to a lane (an architecture llama.cpp did not know): its server decides
                json_route = False
            if forced is not None:
                lease, made = await self._forced(context, call, forced, instance, started, slot)
                response = None
            elif json_route and not call.stream:
                lease, made = await self._json_answer(context, call, instance, slot)
                response = None
            elif json_route:
                lease, response = await self._json_send(context, call, instance, slot, stream=True)
                completion = jsonanswer.ChatFromCompletion(lease.instance.entry.name, call.body)
            else:
                raw = with_fields(raw, slot) or raw
                try:
                    lease, response = await self._proxy.send(
                        call.model,
                        path,
                        raw,
                        call.ctx_size,
                        context,
                        call.stream,
                        ready=(instance, started),
                        content_type=call.content_type,
                    )
                except EngineRejected as e:
                    if not (call.kind is CallKind.CHAT and UNPARSED in str(e)):
                        raise
                    if call.body.get("tools"):
                        noted, lease, response = await self._as_text(context, call, instance, slot, str(e))
                    elif jsonanswer.json_format(call.body) is not None:
                        # (a reasoning model's JSON): its text without the parser
                        log.info(
                            "{model}: the engine's chat parser refused the model's JSON answer; asked once "
                            "more without it, so its text is the answer",
                            model=call.model,
                        )
                        lease, made = await self._json_answer(context, call, instance, slot)
                        response = None
                    else:
                        raise
        except BaseException:
            if pin is not None and self.sessions is not None:
                self.sessions.release(pin, None)
            if isolated is not None:
                self.isolation.release(isolated)
            raise
        finally:
            if stop is not None:
                stop()
        translated: Translated | None = None
        if anthropic is not None:
            translated = FromAnthropic(anthropic, scrubber(lease.instance))
        elif lane is not None and lane.name == REMOTE:
            translated = Renamed(lease.instance.entry.name, lease.instance.server, scrubber(lease.instance))
        elif completion is not None:
            translated = FromCompletion(completion)
        options = call.body.get("stream_options")
        chat = call.kind is CallKind.CHAT
        reply = Reply(
            self._proxy,
            context,
            lease,
            response,
            counted,
            started,
            loaded,
            made=made,
            keep=keep,
            pin=pin,
            isolated=isolated,
            noted=noted,
            max_tokens=call.max_tokens,
            translated=translated,
            wants_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            watched=asked if chat else None,
            enforce=chat and self._enforce(context, lease.instance.entry),
            stall=self._config().sentinel_stall if chat else 30.0,
            clock=self._clock if chat else None,
            headers=call.headers,
            timed=self._timed(call, lease.instance),
        )
        return reply, lease

    def _timed(self, call: Run, instance: Any) -> Callable[[dict[str, Any], str], None] | None:
        """
        For a child with n-gram lookup (C{speculative = "ngram"}, or
        C{"auto"}): what hands its answer's text to the model's lookup
        cache (L{blazar.engines.lookupcache}, tokenized by that child) and,
        for C{"auto"}, its decode rate (C{timings.predicted_per_second}) to
        the supervisor's tuner (L{blazar.engines.spectune.SpecTuner}), with
        the call's work class and whether the child runs with n-gram lookup.
        """
        running = dict(getattr(instance, "profile", ())).get("speculative")
        settings = getattr(getattr(instance, "entry", None), "settings", None)
        ngram = getattr(settings, "speculative", None) == "ngram"
        tuner = getattr(self.supervisor, "spec_tuner", None)
        caches = getattr(self.supervisor, "lookup_caches", None)
        if running is None and not ngram:
            return None
        name, work, child = instance.entry.name, CLASS_NAMES[call.work], getattr(instance, "pid", None)
        window = getattr(settings, "speculative_window", None)

        def timed(timings: dict[str, Any], text: str) -> None:
            rate, tokens = timings.get("predicted_per_second"), timings.get("predicted_n")
            if running is not None and tuner is not None and isinstance(rate, (int, float)) and isinstance(tokens, int):
                tuner.observe(name, work, running == "ngram", float(rate), tokens, window, child)
            if caches is not None and text:
                caches.add(name, text, lambda t: self._proxy.answer_tokens(instance, t))

        return timed

    async def _cached(
        self,
        context: RequestContext | None,
        call: Run,
        asked: dict[str, Any],
        canonical: str,
    ) -> tuple[Reply | None, Callable[[bytes], None] | None]:
        """
        The semantic cache step (L{blazar.gateway.cache}), after scope,
        purpose and placement, for chat calls the cache is enabled for (the
        key's C{cache}, else the model's, else C{[cache] enabled}): a call
        that L{semantic.bypass} lets through has its prompt embedded by the
        local C{[cache] embedding_model} and looked up in its scope (model,
        key, lane, sampling). A hit is answered at once: a L{Reply} with no
        lease whose C{made} is the stored chat completion (reissued: a new
        id); it takes no slot and starts no child. On a miss, the answer is
        stored once it is read whole and the sentinel found nothing
        (L{Reply.keep}). An embedding that fails leaves the call uncached,
        with a log line, never an error.

        C{x-blazar-cache} says C{hit} or C{miss} when the cache was asked;
        the request's context says C{hit}, C{miss}, C{bypass} or C{error}
        (C{blazar_cache_total}).

        @param asked: The chat body as the client asked (before placement
            and the surface's rewrite).
        @return: The hit's reply, or the miss's store (C{keep}), or
            neither.
        """
        cache = self.cache
        if cache is None or call.kind is not CallKind.CHAT:
            return None, None
        config = self._config().cache
        key = key_of(context)
        entry = call.entry
        if not semantic.enabled_for(
            config.enabled, entry.settings.cache if entry is not None else None, key.cache if key is not None else None
        ):
            return None, None
        streamed = call.stream if call.client_stream is None else call.client_stream
        if call.stream and not streamed:  # the engine streams a whole answer: as a non-streamed chat
            asked = {k: v for k, v in asked.items() if k not in ("stream", "stream_options")}
        text = semantic.prompt_text(asked)
        if text is None or semantic.bypass(asked, streamed) is not None:
            _note_cache(context, semantic.BYPASSED)
            return None, None
        began = self._clock.seconds()
        vector = await self._embed(config.embedding_model or "", text, canonical)
        note_span(context, "cache", began, self._clock.seconds())
        if vector is None:
            _note_cache(context, semantic.FAILED)
            return None, None
        lane = call.lane.name if call.lane is not None else LLAMACPP
        scope = semantic.scope_of(canonical, key.owner if key is not None else "", lane, asked)
        similarity, found = cache.lookup(scope, vector)
        if found is None:
            _note_cache(context, semantic.MISS)
            call.headers[semantic.HEADER] = semantic.MISS.encode("ascii")

            def keep(answer: bytes) -> None:
                if semantic.storable(answer):
                    cache.store(scope, vector, answer)

            return None, keep
        _note_cache(context, semantic.HIT)
        call.headers[semantic.HEADER] = semantic.HIT.encode("ascii")
        log.debug("{model}: semantic cache hit (similarity {similarity:.4f})", model=canonical, similarity=similarity)
        now = self._clock.seconds()
        made = semantic.reissued(found.answer, "chatcmpl-" + secrets.token_hex(12), int(found.created))
        reply = Reply(
            self._proxy, context, None, None, None, now, now, canonical, made=made, cached=True, headers=call.headers
        )
        return reply, None

    async def _embed(self, model: str, text: str, chat_model: str) -> semantic.Vector | None:
        """
        C{text} embedded by the local embedding model C{model}, as a unit
        vector: one of the gateway's own small engine calls (no slot, as a
        token count), sent to the model's child like any request.

        @return: The vector, or L{None} (logged) if the embedding failed.
        """
        body = strictjson.encode({"model": model, "input": text}).encode("utf-8")
        try:
            lease, response = await self._proxy.send(model, "/v1/embeddings", body, stream=False)
            try:
                data = await self._proxy.read(lease.instance, response)
            finally:
                self._end(lease, None)
            vector = semantic.embedding_of(json.loads(data))
            if vector is None:
                raise ValueError("its answer held no embedding")
            return vector
        except CancelledError:
            raise
        except Exception as e:
            log.warn(
                "{model}: the semantic cache could not embed the prompt with {embedding_model} ({error}); "
                "the request goes on uncached",
                model=chat_model,
                embedding_model=model,
                error=str(e)[:300],
            )
            return None

    async def _forced(
        self,
        context: RequestContext | None,
        call: Run,
        forced: Forced,
        instance: Any,
        started: float,
        slot: dict[str, Any],
    ) -> tuple[InstanceLease, bytes]:
        """
        The tool-call step (L{blazar.gateway.toolcalls}): a forced call is
        decoded under the offered tools' schema, from the prompt the model's
        template renders with the tools, and answered as an OpenAI chat
        completion (or its stream) with C{tool_calls}.

        @raise BadRequest: The tools' parameters cannot be made a grammar.
        """
        # the client's limit is a limit (cost, latency, context): a call that
        # does not fit it ends cut short; Blazar's own default fits one call.
        # The grammar is CPU work that grows with the schemas: in a thread,
        # bounded (issue 36)
        limit = call.max_tokens if call.max_tokens and call.max_tokens > 0 else None
        try:
            forced, dropped, budget, body = await self._in_thread(thd_prepare, call.body, forced, limit)
        except ToolSchemaError as e:
            raise BadRequest(f"tools: {e}", "tools") from None
        names = ", ".join(t["function"]["name"] for t in forced.tools)
        if dropped:
            log.info(
                "forced tool call: left out of the grammar (not callable correctly): {dropped}",
                dropped="; ".join(dropped),
            )
        template = _rendered_only(
            {
                k: v
                for k, v in call.body.items()
                if k in ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")
            }
        )
        try:
            prompt, rendered_by = await self._rendered(context, call, template, instance, started)
        except EngineRejected as e:
            if e.status == 400:
                raise BadRequest(f"tools: the model's template refused the tools {names}: {e}", "tools") from None
            raise
        body["prompt"] = prompt
        body.update(slot)
        try:
            lease, response = await self._own_send(context, call, "/completion", body, rendered_by)
        except EngineRejected as e:
            if e.status == 400:
                raise BadRequest(
                    f"tools: the parameters of {names} cannot be made a grammar for a forced tool call: {e}",
                    "tools",
                ) from None
            raise
        done: Any = None
        finish = "tool_calls"
        try:
            done = json.loads(await self._proxy.read(lease.instance, response))
            try:
                calls = tool_calls(parse_calls(str(done.get("content") or ""), forced))
            except ValueError:
                if not cut_short(done, budget):
                    raise
                # the client's max_tokens ended it mid-call: the surface's
                # truncation, with no call (half a call is not a call)
                log.info(
                    "{model}: a forced tool call did not fit max_tokens={limit}; answered as cut short",
                    model=call.model,
                    limit=budget,
                )
                calls, finish = [], "length"
        except ValueError as e:
            lease.release()
            content = str(done.get("content") or "")[-120:] if isinstance(done, dict) else ""
            raise EngineRejected(
                502, f"the engine's forced tool call did not parse ({e}); it ended {content!r}"
            ) from None
        except BaseException:
            lease.release()
            raise
        usage = usage_of(done)
        note_tokens(context, usage["prompt_tokens"], usage["completion_tokens"])
        name = lease.instance.entry.name
        if not call.stream:
            return lease, chat_completion(name, calls, usage, finish)
        options = call.body.get("stream_options")
        wants = isinstance(options, dict) and bool(options.get("include_usage"))
        return lease, chat_stream(name, calls, usage if wants else None, done.get("timings"), finish)

    async def _own_send(
        self,
        context: RequestContext | None,
        call: Run,
        path: str,
        body: dict[str, Any],
        instance: Any,
        started: float | None = None,
        stream: bool = False,
    ) -> tuple[InstanceLease, Any]:
        """
        One of the pipeline's own requests for C{call} (a render, a forced
        call's or a JSON answer's C{/completion}): C{body}, as JSON, to
        C{path} of the ready child C{instance}.

        @param started: Clock seconds since when the child serves it
            (default: now).
        @return: The lease on the child (the caller ends it) and its 200
            response (body not read yet).
        """
        return await self._proxy.send(
            call.model,
            path,
            strictjson.encode(body).encode("utf-8"),
            call.ctx_size,
            context,
            stream=stream,
            ready=(instance, self._clock.seconds() if started is None else started),
        )

    async def _rendered(
        self, context: RequestContext | None, call: Run, template: dict[str, Any], instance: Any, started: float
    ) -> tuple[str, Any]:
        """
        The prompt the model's chat template renders for C{template} (a
        chat body's messages and template settings: llama-server's
        C{/apply-template}), and the child that rendered it.

        @raise EngineRejected: The template refused it.
        """
        lease, response = await self._own_send(context, call, "/apply-template", template, instance, started)
        try:
            return str(json.loads(await self._proxy.read(lease.instance, response))["prompt"]), lease.instance
        finally:
            lease.release()

    async def _json_send(
        self,
        context: RequestContext | None,
        call: Run,
        instance: Any,
        slot: dict[str, Any],
        stream: bool,
    ) -> tuple[InstanceLease, Any]:
        """
        A JSON answer without the engine's chat parser
        (L{blazar.gateway.jsonanswer}): the prompt the model's template
        renders, decoded by C{/completion} under the answer's schema (the
        engine's own grammar for it), its text as the model wrote it.

        @return: The lease on the child that answers (the caller ends it)
            and its 200 response (body not read yet).
        """
        schema = jsonanswer.json_format(call.body)
        assert schema is not None
        template = {
            k: v
            for k, v in call.body.items()
            if k
            in (
                "messages",
                "response_format",
                "chat_template_kwargs",
                "reasoning_effort",
                "add_generation_prompt",
                "continue_final_message",
            )
        }
        prompt, instance = await self._rendered(context, call, template, instance, self._clock.seconds())
        body = jsonanswer.completion_request(call.body, prompt, schema, stream)
        body.update(slot)
        return await self._own_send(context, call, "/completion", body, instance, stream=stream)

    async def _json_answer(
        self,
        context: RequestContext | None,
        call: Run,
        instance: Any,
        slot: dict[str, Any],
    ) -> tuple[InstanceLease, bytes]:
        """
        A non-streamed JSON answer by L{_json_send}, as an OpenAI chat
        completion (the sentinel says whether it follows the schema).

        @return: The lease on the child (held until the call ends, as every
            answer's is) and the chat completion.
        """
        lease, response = await self._json_send(context, call, instance, slot, stream=False)
        try:
            done = json.loads(await self._proxy.read(lease.instance, response))
            if not jsonanswer.results_of(done):
                raise EngineRejected(502, "the engine's /completion answer holds no answer")
        except BaseException:
            lease.release()
            raise
        usage = jsonanswer.usage_all(done)
        note_tokens(context, usage["prompt_tokens"], usage["completion_tokens"])
        return lease, jsonanswer.chat_completion(lease.instance.entry.name, done, call.body)

    async def _json_route(self, call: Run) -> bool:
        """
        Whether a chat's answer is decoded by L{_json_send} instead of the
        engine's chat path: it asks for JSON, offers no tools, and its
        model's template does not reason (a C{<think>} block would be
        forbidden by the schema's grammar; those stay on the chat path).
        """
        if call.kind is not CallKind.CHAT or call.body.get("tools") or jsonanswer.json_format(call.body) is None:
            return False
        capabilities = await self._capabilities(call.entry)
        return capabilities is not None and "thinking" not in capabilities

    def _enforce(self, context: RequestContext | None, entry: ModelEntry) -> bool:
        """
        C{sentinel_enforce}: the key's, else the model's, else the global.
        """
        key = key_of(context)
        if key is not None and key.sentinel_enforce is not None:
            return key.sentinel_enforce
        if entry.settings.sentinel_enforce is not None:
            return entry.settings.sentinel_enforce
        return self._config().sentinel_enforce

    async def _as_text(
        self,
        context: RequestContext | None,
        call: Run,
        instance: Any,
        slot: dict[str, Any],
        error: str,
    ) -> tuple[tuple[str, str], InstanceLease, Any]:
        """
        The engine could not parse the model's answer to a chat that offered
        tools (auto tool choice: the call is the model's own decision) and
        answered 500 (L{UNPARSED}). An answer, not a fault: asked once more
        with C{tool_choice} C{none} (the model still sees the tools), its
        text is the answer, and the sentinel says C{tool_args_invalid}.
        Under C{sentinel_enforce} the answer would be refused anyway: a 422
        at once, no second generation.

        @raise SentinelViolation: Enforced.
        """
        noted = (
            "tool_args_invalid",
            "the engine could not parse the model's tool call; the answer is the "
            "model's text, asked once more with tool_choice none",
        )
        if self._enforce(context, instance.entry):
            if context is not None:
                context.sentinel = ("tool_args_invalid",)
            call.headers[SENTINEL_HEADER.encode("ascii")] = b"tool_args_invalid"  # the refusal goes out with it
            raise SentinelViolation([("tool_args_invalid", "the engine could not parse the model's tool call")])
        log.info(
            "{model}: the engine could not parse the model's tool call ({error}); asking once more "
            "with tool_choice none, so its text is the answer",
            model=call.model,
            error=error[:200],
        )
        body = {k: v for k, v in call.body.items() if k != "parallel_tool_calls"}
        body["tool_choice"] = "none"
        raw = strictjson.encode(body).encode("utf-8")
        raw = with_fields(raw, slot) or raw
        lease, response = await self._proxy.send(
            call.model,
            call.path,
            raw,
            call.ctx_size,
            context,
            call.stream,
            ready=(instance, self._clock.seconds()),
        )
        return noted, lease, response

    def _within_limits(self, call: Run) -> None:
        """
        A chat request's size in what costs the engine most to render and
        tokenize (before admission, for the preflight) and Blazar to make a
        grammar of: messages, tools, and the subschemas of its tools and
        response format (C{max_messages}, C{max_tools}, C{max_schema_nodes};
        issue 36: 20,000 tools took a child to 8.3 GB, a tool of 20,000
        properties crashed it, 50,000 messages cost 129 s of its CPU, each
        to end in a 400).

        @raise BadRequest: Over a limit, naming it and its config key.
        """
        if call.kind is not CallKind.CHAT:
            return
        config = self._config()
        body = call.body
        messages, tools = body.get("messages"), body.get("tools")
        if isinstance(messages, list) and len(messages) > config.max_messages:
            raise BadRequest(
                f"{len(messages)} messages are more than this gateway takes in one request "
                f"(max_messages = {config.max_messages} in its config)",
                "messages",
            )
        if isinstance(tools, list) and len(tools) > config.max_tools:
            raise BadRequest(
                f"{len(tools)} tools are more than this gateway takes in one request "
                f"(max_tools = {config.max_tools} in its config)",
                "tools",
            )
        budget = config.max_schema_nodes
        if schema_nodes([tools, body.get("response_format")], budget) > budget:
            raise BadRequest(
                f"the tools' and the response format's schemas hold more than {budget} subschemas "
                f"(max_schema_nodes = {budget} in its config)",
                "tools" if tools else "response_format",
            )

    async def _tools_seen(self, call: Run) -> None:
        """
        Tools offered to a model whose chat template renders none
        (SmolLM2's, a base model's): the model would never see them, and
        the answer would be made as if none were offered. Refused, as
        Ollama does, unless the call is forced (C{tool_choice} required or
        a named function: Blazar's grammar makes the call on any model,
        L{blazar.gateway.toolcalls}) or C{tool_choice} is C{none}. A
        template the operator gives llama-server (C{--chat-template*} in
        C{args}) is not the GGUF's: not judged.

        @raise UnsupportedByModel: Naming the capability and the fixes.
        """
        tools = call.body.get("tools")
        if call.kind is not CallKind.CHAT or not isinstance(tools, list) or not tools:
            return
        if call.body.get("tool_choice") == "none" or self._forced_call(call) is not None:
            return
        entry = call.entry
        if entry is None:
            return
        args = (*self._config().llamacpp.args, *entry.settings.args)
        if any(a.startswith("--chat-template") or a.startswith("--jinja-template") for a in args):
            return
        capabilities = await self._capabilities(entry)
        if capabilities is None or "tools" in capabilities:
            return
        raise UnsupportedByModel(
            f"model {call.model!r} does not support tools: its chat template renders none, so the model would "
            "never see them. Use a model whose template supports tools, give this one such a template "
            f'(args = ["--chat-template-file", "..."] under [models."{entry.name}"]), or force the call with '
            'tool_choice ("required" or a named function; Blazar\'s grammar makes the call on any model)'
        )

    def _forced_call(self, call: Run) -> Forced | None:
        """
        The forced tool call a chat call asks for (C{tool_choice} required
        or a named function), if any.

        @raise BadRequest: It names a tool that is not offered.
        """
        if call.kind is not CallKind.CHAT:
            return None
        try:
            return forced_call(call.body)
        except ToolChoiceError as e:
            raise BadRequest(str(e), "tool_choice") from None

    async def _pin(self, context: RequestContext | None, call: Run, instance: Any) -> Pin | None:
        """
        The session step: a request that names a session
        (L{blazar.gateway.call.Asked.session}) goes to its session's slot
        of C{instance}, its bank entry restored there first if it has one.
        A request that picks its own slot (C{id_slot}) is left alone.
        """
        if self.sessions is None or not self.sessions.enabled:
            return None
        if call.kind not in (CallKind.CHAT, CallKind.COMPLETION) or not getattr(instance, "kv_bank", True):
            return None  # slots and the KV bank are llama-server's (not a lane's, not a reranker's)
        await self.sessions.warm(instance)
        name = call.asked.session
        if "id_slot" in call.body or name is None:
            return None
        key = key_of(context)
        return await self.sessions.pin(key.owner if key is not None else "", name, instance)

    async def _placement(self, context: RequestContext | None, call: Run) -> None:
        """
        The placement a request asks for (Ollama's C{num_gpu}, C{main_gpu},
        C{num_thread}, C{use_mmap}: L{Call.profile}) becomes the model's
        (L{blazar.engines.supervisor.Supervisor.want_profile}: a reload, as
        on Ollama), unless the key is scoped: a tenant does not reload a
        model others share (named in C{x-blazar-ignored}).
        """
        if not call.profile or call.lane is not None:
            return
        if scoped(context) and context is not None:
            note_ignored(
                context,
                call.surface,
                [f"options.{option}" for option, key in OLLAMA_PLACEMENT.items() if key in call.profile],
            )
            return
        await self.supervisor.want_profile(call.model, call.profile)

    def _isolate(self, context: RequestContext | None, call: Run, instance: Any, pin: Pin | None) -> Isolated | None:
        """
        The isolation step, for models with C{isolate_keys}
        (L{blazar.gateway.isolation}): the slot a chat or completion goes
        to, picked so that it reuses no other key's KV cache; a session's
        own slot is kept. A request that picks its own slot (C{id_slot})
        is sent with C{cache_prompt: false}.
        """
        # the config as it is now (a reload applies at once), the slots as the child has them
        settings = (call.entry or instance.entry).settings
        if not getattr(settings, "isolate_keys", False) or call.kind not in (CallKind.CHAT, CallKind.COMPLETION):
            return None
        if getattr(instance, "lane", LLAMACPP) != LLAMACPP or is_remote(instance):
            return None
        key = key_of(context)
        owner = key.owner if key is not None else ""
        slots = int(instance.entry.settings.parallel or DEFAULT_PARALLEL)
        if pin is not None:
            return self.isolation.hold(instance, slots, owner, pin.slot)
        if "id_slot" in call.body:
            return Isolated(instance, owner, None, True)
        return self.isolation.take(instance, slots, owner)

    async def _check(self, context: RequestContext | None, call: Run) -> str:
        """
        Steps 1-3: scope, purpose, placement.

        @return: The canonical model name.
        """
        call.entry = await self._scope(context, call.model)
        canonical = call.entry.name if call.entry is not None else call.model
        if call.entry is not None and call.entry.remote is not None:
            call.lane = self._remote_lane(call)  # the remote decides the rest: no purpose, no placement
            if context is not None:
                context.remote = call.entry.remote
            return canonical
        # a command lane's server (vLLM, MLX, ...) gets the OpenAI request as
        # it is: none of the llama-server extras (LaneError: no lane serves it);
        # whisper and sd models go to their built-in lanes
        if call.entry is not None:
            architecture, _ = await self._facts_of(call.entry)
            call.lane = route(
                call.entry.name, call.entry.format, call.entry.settings.engine, self._config(), architecture
            )
        else:
            call.lane = None
        await self._purpose(call)
        self._within_limits(call)
        if call.lane is None and apply_model_defaults(call):  # its Modelfile's system, messages, parameters
            call.raw = None
        await self._vision(call)
        if call.lane is None:
            await self._tools_seen(call)
        if (
            call.lane is None
            and call.kind is CallKind.CHAT
            and await self._proxy.place_system_messages(call.model, call.body)
        ):
            call.raw = None
        return canonical

    def _remote_lane(self, call: Run) -> CommandLane:
        """
        The lane of a remote model (C{[[remotes]]}): what it is asked must
        be something its API does.

        @raise ModelNotFound: Its remote is no longer configured.
        @raise UnsupportedByModel: A kind of call its API has no endpoint for.
        """
        assert call.entry is not None
        remote = self._config().remote(call.entry.remote or "")
        if remote is None:
            raise ModelNotFound(call.model, [])
        kinds = (
            (CallKind.CHAT,) if remote.api == "anthropic" else (CallKind.CHAT, CallKind.COMPLETION, CallKind.EMBEDDING)
        )
        if call.kind not in kinds:
            raise UnsupportedByModel(
                f"model {call.model!r} is on remote {remote.name!r} (api = {remote.api!r}), which Blazar sends "
                f"{', '.join(k.value for k in kinds)} requests only; use a local model for {call.kind.value}"
            )
        return CommandLane(REMOTE, (), health="/v1/models", formats=(), api=remote.api)

    def _remote_body(self, context: RequestContext | None, call: Run) -> tuple[bytes, str, AnthropicStream | None]:
        """
        The body a remote is sent, with its own name for the model; for
        C{api = "anthropic"}, the chat as a Messages request
        (L{blazar.gateway.remotewire}) and the translator of its answer.

        @return: The body, the path, the translator (or L{None}).
        @raise BadRequest: What Messages cannot express without changing
            the answer (C{n} > 1, logprobs, a JSON response format).
        """
        assert call.entry is not None and call.lane is not None
        model = call.entry.remote_model
        if call.lane.api != "anthropic":
            body = dict(call.body, model=model)
            return strictjson.encode(body).encode("utf-8"), call.path, None
        body, ignored = to_anthropic(call.body, model)
        if ignored and context is not None:
            note_ignored(context, "remote", ignored)
        options = call.body.get("stream_options")
        stream = AnthropicStream(
            call.model, int(self._clock.seconds()), isinstance(options, dict) and bool(options.get("include_usage"))
        )
        return strictjson.encode(body).encode("utf-8"), "/v1/messages", stream

    async def _scope(self, context: RequestContext | None, model: str) -> ModelEntry | None:
        """
        The scope check (L{blazar.gateway.scope.resolve_in_scope}): for a
        scoped key, a model outside its scope is answered as one that does
        not exist.

        @return: The model, resolved (L{None} on a pipeline without a
            registry).
        @raise ModelNotFound: No such model, or one the key may not use.
        @raise blazar.gateway.quota.QuotaExceeded: Over a rate limit.
        """
        if self._registry is None:
            if not may_use(context, model):
                raise ModelNotFound(model, [])
            return None
        return await resolve_in_scope(context, self._registry, model)

    async def _facts_of(self, entry: ModelEntry) -> tuple[str | None, bool]:
        """
        A GGUF's C{general.architecture} and whether it is a reranker
        (C{rerank = true}, or rank pooling), its header read once per file
        version: then a dict lookup per request.
        """
        facts = await self._file_facts(entry)
        if facts is None:
            return None, entry.settings.rerank
        return facts.architecture, facts.reranker or entry.settings.rerank

    async def _capabilities(self, entry: ModelEntry | None) -> tuple[str, ...] | None:
        """
        What the model's chat template shows it (C{tools}, C{thinking}:
        L{template_capabilities}), from the same once-per-file-version read
        as L{_facts_of}; L{None} when it has no GGUF to read.
        """
        facts = await self._file_facts(entry) if entry is not None else None
        return facts.capabilities if facts is not None else None

    async def _file_facts(self, entry: ModelEntry) -> _Facts | None:
        if entry.format != "gguf" or self._registry is None:
            return None
        key = (entry.path, entry.modified)
        known = self._facts.get(key)
        if known is None:
            try:
                meta = await self._registry.metadata(entry)
            except Exception:
                return None  # unreadable: the child's start says why
            known = _Facts(
                meta.architecture,
                is_reranker(entry, meta),
                tuple(template_capabilities(meta.chat_template)),
                meta.longest_token,
            )
            if len(self._facts) > 4096:
                self._facts.clear()
            self._facts[key] = known
        return known

    async def _prompt_floor(self, call: Run, size: int) -> int:
        """
        Tokens the prompt has at least, by its text's size alone: its
        bytes of text over the longest entry of the model's vocabulary
        (0 for a body under L{FLOOR_FROM} bytes, or a model whose
        vocabulary Blazar cannot read). A body that cannot fit by this
        count is refused without the child counting it.
        """
        if size < FLOOR_FROM or call.entry is None:
            return 0
        facts = await self._file_facts(call.entry)
        if facts is None or not facts.longest_token:
            return 0
        return prompt_text_bytes(call.body) // facts.longest_token

    async def _is_reranker(self, entry: ModelEntry) -> bool:
        if entry.settings.rerank:
            return True
        if entry.settings.embedding:
            return False
        return (await self._facts_of(entry))[1]

    async def _image_sizes(self, images: list[bytes]) -> None:
        """
        An image edit's uploads, read by their headers (nothing decoded):
        sd-server edits at an image's own size, so one bigger than
        L{MAX_IMAGE_SIDE} a side could take all the memory there is.

        @raise BadRequest: Not an image, or too big.
        """
        for data in images:
            try:
                width, height = await self._in_thread(thd_image_size, data)
            except AudioUnreadable as e:
                raise BadRequest(str(e), "image") from None
            if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE:
                raise BadRequest(
                    f"the image is {width}x{height}; edits take at most {MAX_IMAGE_SIDE} pixels a "
                    "side: scale it down first",
                    "image",
                )

    async def _audio(self, context: RequestContext | None, call: Run) -> None:
        """
        The audio step: the upload decoded and resampled to 16 kHz mono WAV
        (L{blazar.gateway.audio}, in the thread pool), then the child's
        multipart body around it. Its length is the call's usage
        (L{Reply.audio_used}).

        @raise BadRequest: Not audio the converter can read.
        """
        try:
            call.raw, call.content_type, seconds = await self._decodes.run(
                self._in_thread, thd_to_multipart, call.audio or b"", call.audio_fields or {}
            )
        except AudioUnreadable as e:
            raise BadRequest(f"{e}: send a WAV, MP3, OGG, FLAC, M4A or WebM file", "file") from None
        except ValueError as e:  # a field that is not text
            raise BadRequest(f"a form field is not text: {e}") from None
        call.audio = None
        if context is not None:
            context.audio_seconds = seconds

    async def _purpose(self, call: Run) -> None:
        """
        No chat on an embedding model or a reranker, no embeddings on a
        chat model, no reranking on anything but a reranker, before any
        child is started for it; the message is the config fix.

        @raise UnsupportedByModel: With the config fix.
        """
        entry = call.entry
        if entry is None:
            return
        section = f'[models."{entry.name}"]'
        lane_kind = LANE_KIND.get(call.lane.name) if call.lane is not None else None
        wanted = {CallKind.TRANSCRIBE: WHISPER, CallKind.IMAGE: SDCPP}.get(call.kind)
        if wanted is not None:
            if call.lane is None or call.lane.name != wanted:
                raise UnsupportedByModel(_not_of_lane(call.model, wanted, section))
            return
        if lane_kind is not None:
            endpoint = (
                "POST /v1/audio/transcriptions" if lane_kind == "transcription" else "POST /v1/images/generations"
            )
            raise UnsupportedByModel(
                f"model {call.model!r} is {'a speech-to-text' if lane_kind == 'transcription' else 'an image'} "
                f"model (served by the {call.lane.name} lane); send it {endpoint}, or use a chat model here"
            )
        reranker = await self._is_reranker(entry)
        if call.kind is CallKind.RERANK:
            if not reranker:
                raise UnsupportedByModel(
                    f"model {call.model!r} is not a reranker: set rerank = true under {section} in the config "
                    "for a reranker GGUF (one whose metadata says rank pooling is one already), or rerank with "
                    "such a model"
                )
            return
        if reranker:
            raise UnsupportedByModel(
                f"model {call.model!r} is a reranker (rank pooling in its GGUF, or rerank = true under "
                f"{section}); send it POST /v1/rerank, or use a chat or embedding model here"
            )
        if call.embedding and not entry.settings.embedding:
            raise UnsupportedByModel(
                f"model {call.model!r} is not an embedding model: set embedding = true under "
                f"{section} in the config to serve embeddings from it"
            )
        if not call.embedding and entry.settings.embedding:
            raise UnsupportedByModel(
                f"model {call.model!r} is configured for embeddings only (embedding = true under "
                f"{section}); use a chat model here"
            )

    async def _vision(self, call: Run) -> None:
        """
        The vision step, for a chat: its images (C{image_url} content
        parts, which every surface's images become) need a model whose
        child takes them (L{sees_images}: a projector); an image for any
        other llama.cpp model is refused with the fix, never dropped. An
        image named by C{http(s)} URL is fetched here (L{ImageFetcher}:
        bounded, public addresses only) and sent on as a C{data:} URL, for
        a command lane's server too: no engine fetches a URL it is given.
        Other URL schemes (C{file:} and the like) are refused; so are
        audio and video parts named by URL, under C{data} or C{url} (the
        engine reads C{data} first), and each such part is sent on with
        the one value that was checked.

        @raise UnsupportedByModel: Images for a model without a projector.
        @raise BadRequest: A URL that is refused or cannot be fetched.
        """
        messages = call.body.get("messages")
        if call.kind is not CallKind.CHAT or not isinstance(messages, list):
            return
        images: list[tuple[dict[str, Any], str, str]] = []  # (part, url, where)
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    continue
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type")
                if kind == "image_url":
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, dict) else image
                    if not isinstance(url, str):
                        raise BadRequest(
                            f"{where}.image_url.url: required (a data: or http(s) URL)", f"{where}.image_url"
                        )
                    if not isinstance(image, dict):  # a bare URL string: as the engine reads it
                        part["image_url"] = {"url": url}
                        call.raw = None
                    images.append((part, url, f"{where}.image_url"))
                elif kind in MEDIA_PARTS and isinstance(part.get(kind), dict):
                    # llama-server reads data, else url: every string under either is checked, and
                    # the engine is sent the one it would read, alone
                    media = part[kind]
                    values = {k: media[k] for k in ("data", "url") if isinstance(media.get(k), str)}
                    for key, value in values.items():
                        if _engine_fetches(value):
                            raise BadRequest(
                                f"{where}.{kind}.{key}: Blazar does not fetch {kind} URLs; send "
                                "the data itself (base64, or a data: URL)",
                                f"{where}.{kind}",
                            )
                    part[kind] = {k: v for k, v in media.items() if k not in ("data", "url")}
                    part[kind].update(list(values.items())[:1])
                    call.raw = None
        if not images:
            return
        entry = call.entry
        if call.lane is None and entry is not None and not sees_images(entry, None, self._config()):
            stem = entry.path.name.removesuffix(".gguf") if entry.format == "gguf" else entry.name
            raise UnsupportedByModel(
                f"model {call.model!r} cannot see images: it has no vision projector. Put its projector (the "
                f"model's *mmproj*.gguf, named like mmproj-{stem}.gguf) beside its GGUF file, or set "
                f'mmproj = "/path/to/mmproj.gguf" under [models."{entry.name}"] in the config; or send text only'
            )
        config = self._config()
        # one request's fetches, one after another, share the byte and the time bound
        budget, began = config.image_fetch_max_bytes, self._clock.seconds()
        for part, url, where in images:
            scheme = _scheme(url)
            if scheme in ("http", "https"):
                if self.images is None:
                    raise BadRequest(
                        f"{where}: this gateway does not fetch image URLs; send the image as base64 data (a data: URL)",
                        where,
                    )
                seconds = config.image_fetch_timeout - (self._clock.seconds() - began)
                data, size = await self.images.fetch(url, where, budget, seconds)
                budget -= size
                part["image_url"] = {**part["image_url"], "url": data}
                call.raw = None
            elif scheme == "data":
                head = url[len("data:") :].partition(",")[0].lower()
                if not head.startswith("image/") or not head.endswith(";base64"):
                    raise BadRequest(
                        f"{where}.url: a data: URL of an image must be base64 (data:image/png;base64,...)", where
                    )
            elif scheme is not None:
                raise BadRequest(f"{where}.url: {scheme}: URLs are not taken; send a data: or http(s) URL", where)
            elif _engine_fetches(url):  # (llama-server would fetch it)
                raise BadRequest(f"{where}.url: not a data: or http(s) URL, and not base64; send one of those", where)

    async def _count(self, call: Run) -> int:
        """
        The prompt's tokens, by the child's own template and tokenizer.
        """
        if "messages" in call.body:
            return await self._proxy.count_chat_tokens(call.model, _rendered_only(call.body))
        prompt = call.body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)]
        return max([await self._proxy.count_text_tokens(call.model, t) for t in texts] or [0])

    async def _admit(
        self,
        context: RequestContext | None,
        canonical: str,
        call: Run,
        entry: ModelEntry | None,
        lane: Any = None,
    ) -> bytes | None:
        """
        Wait for one of the model's slots (L{blazar.gateway.admission}); the
        slot is held until the response is finished or the client leaves.

        @return: How long it waited (C{x-blazar-queue-ms}), or L{None}: no
            admission.

        @raise blazar.gateway.admission.AllSlotsBusy: Still waiting at the
            deadline, or the model's queue is full.
        """
        if self.admission is None:
            return None
        loaded = self.supervisor.loaded(canonical)
        if loaded is not None:  # the running child's settings (a reload changes the next one's)
            entry = loaded.entry
        slots = (entry.settings.parallel if entry is not None else None) or DEFAULT_PARALLEL
        if lane is not None and lane.name in BUILTIN:
            slots = 1  # whisper-server and sd-server run one request at a time (the rest would wait inside)
        if lane is not None and lane.name == REMOTE and entry is not None:
            remote = self._config().remote(entry.remote or "")
            slots = remote.max_concurrent if remote is not None else 1  # requests it is sent at once
            canonical = shared_name(entry.remote or "")  # one queue for all its models
        asked = call.asked
        lease = await admit_request(
            self.admission,
            context,
            canonical,
            slots,
            call.work,
            priority=asked.priority,
            deadline=asked.deadline,
            fairness=asked.fairness,
        )
        return queue_ms(lease)

    def is_ready(self, canonical: str) -> bool:
        """
        Whether a ready child for canonical model name C{canonical} exists
        (a call for it will not wait for a load).
        """
        instance = self.supervisor.loaded(canonical)
        return instance is not None and instance.state == InstanceState.READY

    def _end(self, lease: InstanceLease, keep_alive: float | None) -> None:
        name = lease.instance.entry.name

        def waiting() -> bool:
            queue = self.admission.queues.get(name) if self.admission is not None else None
            return queue is not None and bool(queue.waiting)

        lease.finish(keep_alive, waiting)


DECODES = 2  # audio decodes in the thread pool at once (each holds up to MAX_SECONDS of PCM)
MAX_IMAGE_SIDE = 2048  # pixels, as blazar.web.translate.images.MAX_SIDE
# content parts of other media, whose URLs llama-server would fetch itself
MEDIA_PARTS = ("input_audio", "input_video", "video_url")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


def _scheme(url: str) -> str | None:
    """
    A URL's scheme, lower case; L{None} for what has none (bare base64,
    which llama-server decodes as it is).
    """
    m = _SCHEME.match(url)
    return m[1].lower() if m else None


def _engine_fetches(value: str) -> bool:
    """
    Whether llama-server would fetch or open C{value}, a media part's
    string, itself (C{handle_media}: anything that starts with C{http},
    C{file://}): any value with a scheme but C{data:}, or that starts with
    C{http} in any case (bare base64 that begins so is fetched, not
    decoded).
    """
    return _scheme(value) not in (None, "data") or value[:4].lower() == "http"


# bodies below this many bytes are not measured for L{Pipeline._prompt_floor}
FLOOR_FROM = 64 * 1024


def prompt_text_bytes(body: dict[str, Any]) -> int:
    """
    UTF-8 bytes of the text a request's prompt holds for certain: its
    messages' C{content} (strings, and the C{text} of text parts), or its
    C{prompt} (the longest, for a list of prompts, each its own
    context). Every chat template renders a message's content; what else
    a body holds (names, tools, other fields) is not counted, since a
    template may leave it out.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content.encode("utf-8", "surrogatepass"))
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        total += len(text.encode("utf-8", "surrogatepass"))
        return total
    prompt = body.get("prompt")
    texts = (
        [prompt]
        if isinstance(prompt, str)
        else [p for p in prompt if isinstance(p, str)]
        if isinstance(prompt, list)
        else []
    )
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0)


@attrs.frozen
class _Facts:
    """
    What the pipeline reads of a GGUF once per file version.
    """

    architecture: str | None
    reranker: bool
    capabilities: tuple[str, ...]  # its chat template's (template_capabilities)
    longest_token: int | None = None  # bytes of its vocabulary's longest entry


class Bounded:
    """
    At most C{limit} pieces of thread-pool work at once, counted until the
    work itself ends: a caller that leaves (its client gone, its Deferred
    cancelled) stops waiting, but its work still holds its place until the
    thread is done, so leaving and asking again cannot stack more.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._waiting: list[Deferred[None]] = []

    async def run(self, in_thread: Callable[..., Awaitable[Any]], f: Callable[..., Any], *args: Any) -> Any:
        """
        C{in_thread(f, *args)} once fewer than C{limit} are running.
        """
        while self.running >= self.limit:
            turn: Deferred[None] = Deferred(self._leave)
            self._waiting.append(turn)
            await turn
        self.running += 1
        try:
            work: Deferred[Any] = ensureDeferred(in_thread(f, *args))  # type: ignore[arg-type]
        except BaseException:
            self._release(None)
            raise
        work.addBoth(self._release)
        shield: Deferred[Any] = Deferred()  # cancelling it (the caller leaves) leaves the work alone

        def relay(result: Any) -> None:
            if not shield.called:
                shield.callback(result)  # a Failure goes down shield's errbacks

        work.addBoth(relay)
        return await shield

    def _leave(self, turn: Deferred[None]) -> None:
        if turn in self._waiting:
            self._waiting.remove(turn)

    def _release(self, result: Any) -> Any:
        self.running -= 1
        if self._waiting:
            self._waiting.pop(0).callback(None)
        return result


async def _inline(f: Callable[..., Any], *args: Any) -> Any:
    """
    The default C{in_thread} of a pipeline without a thread pool (unit
    tests): the function, called here.
    """
    return f(*args)


def _note_cache(context: RequestContext | None, outcome: str) -> None:
    """
    The semantic cache's outcome for the request (C{blazar_cache_total}).
    """
    if context is not None:
        context.cache = outcome


def applied_keep_alive(context: RequestContext | None, call: Run) -> float | None:
    """
    The C{keep_alive} a call's end applies: the client's, unless its key is
    scoped to models. A model is shared: a scoped key's C{keep_alive} 0
    unloaded it under other keys' requests (502s for them), -1 pinned it,
    a second unloaded it soon (issue 36). Theirs is named in
    C{x-blazar-ignored}, and the model's own C{keep_alive} applies.
    """
    if call.keep_alive is not None and scoped(context):
        if context is not None:
            note_ignored(context, call.surface, ["keep_alive"])
        return None
    return call.keep_alive


def schema_nodes(value: Any, limit: int) -> int:
    """
    About how many subschemas C{value} holds (every object and array in
    it, however deep), counted up to just past C{limit}: cheap, and
    bounded by C{limit} whatever the body.
    """
    count, stack = 0, [value]
    while stack and count <= limit:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            count += 1
            stack.extend(item)
    return count


def _rendered_only(body: dict[str, Any]) -> dict[str, Any]:
    """
    A forced call's chat body as llama-server should render or count it:
    with C{tool_choice} C{none}. The prompt is the same (the template shows
    the tools whatever the choice), but the engine then builds no grammar
    of its own from the tools' schemas, which Blazar's grammar replaces and
    which cost the engine seconds for a 1.5 KB schema (issue 36: a type
    list nested 4 deep, 8 s per render). Other bodies are left as they are.
    """
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        return {k: v for k, v in body.items() if k != "parallel_tool_calls"} | {"tool_choice": "none"}
    return body


def _not_of_lane(model: str, lane: str, section: str) -> str:
    if lane == WHISPER:
        return (
            f"model {model!r} is not a speech-to-text model: transcriptions need a whisper.cpp model (a ggml "
            f'whisper .bin file such as ggml-base.en.bin under models_dir, or engine = "whisper" under '
            f"{section})"
        )
    return (
        f"model {model!r} is not an image model: images need a diffusion model stable-diffusion.cpp loads (a "
        f'Flux or Stable Diffusion GGUF, or engine = "sdcpp" under {section})'
    )
