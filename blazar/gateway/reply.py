"""
A call's answer (L{Reply}), as the pipeline (L{blazar.gateway.pipeline})
hands it to a surface, built whole: its three sources are an answer the
pipeline made itself (a forced tool call, a JSON answer, a semantic cache
hit: C{made}), the child's own OpenAI answer, and a child's answer in
another shape translated on the way (an C{api = "anthropic"} remote's, an
OpenAI-compatible remote's that names its own model, llama-server's
C{/completion} stream of a JSON answer: L{blazar.gateway.translated}).
The sentinel judges each
(L{blazar.gateway.sentinel}); usage is counted here.
"""

from __future__ import annotations

import json
import math
import re
from types import MappingProxyType
from typing import Any, Callable, Mapping

from twisted.logger import Logger

from blazar import strictjson
from blazar.engines.lease import InstanceLease
from blazar.engines.remote import is_remote
from blazar.engines.sse import EventTooLong, WholeEvents
from blazar.gateway import cache as semantic
from blazar.gateway import jsonanswer
from blazar.gateway.context import RequestContext, key_of, note_tokens, record_usage
from blazar.gateway.engine_proxy import EngineProxy, StreamStopped
from blazar.gateway.errors import EngineRejected
from blazar.gateway.isolation import Isolated
from blazar.gateway.remotewire import answer_chunks
from blazar.gateway.sentinel import HEADER as SENTINEL_HEADER
from blazar.gateway.sentinel import (
    UNPARSED,
    UNPARSED_BYTES,
    SentinelViolation,
    StreamWatch,
    drop_unparsed,
    ending,
    inspect_reply,
)
from blazar.gateway.sessions import Pin
from blazar.gateway.translated import Translated

log = Logger()


TIMINGS = b'"timings"'
_TIMINGS_AT = re.compile(rb'"timings"\s*:\s*\{')
_DECODER = json.JSONDecoder()


def timings_in(data: bytes) -> dict[str, Any] | None:
    """
    The last llama-server C{timings} object in C{data} (an answer, or
    stream events), parsed alone; L{None} if none is whole there.
    """
    found = None
    for found in _TIMINGS_AT.finditer(data):
        pass
    if found is None:
        return None
    try:
        value, _ = _DECODER.raw_decode(data[found.end() - 1 :].decode("utf-8", "replace"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _choice_text(obj: Any, part: str) -> str:
    # choices[0][part]["content"] (a chat answer's message, a chunk's delta), else choices[0]["text"]
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    inner = choices[0].get(part)
    text = inner.get("content") if isinstance(inner, dict) else choices[0].get("text")
    return text if isinstance(text, str) else ""


def answer_text(answer: Any) -> str:
    """
    The text of a non-streamed OpenAI answer (a chat completion's message
    content, a completion's text; C{""} if it has none).
    """
    return _choice_text(answer, "message")


def delta_text(chunk: Any) -> str:
    """
    The text one OpenAI stream chunk adds (a chat delta's content, a
    completion chunk's text).
    """
    return _choice_text(chunk, "delta")


class Reply:
    """
    A child's answer to one call, held on a lease until the call ends.

    @ivar model: The canonical name of the model that answers.
    @ivar prompt_tokens: The prompt's token count, if the pipeline counted
        it (L{Call.counting}, or the preflight needed it).
    @ivar started: Clock seconds when the pipeline began waiting for a child.
    @ivar loaded: Clock seconds when a ready child was there.
    @ivar cached: A semantic cache hit (L{blazar.gateway.pipeline.Pipeline._cached}): no lease,
        no child; C{made} is the stored answer, and its usage counts
        against nothing (L{usage}).
    @ivar keep: Called with the whole answer once L{read} has it and the
        sentinel found nothing: the cache step's store on a miss.
    @ivar headers: The response headers the pipeline decided for this
        answer (C{x-blazar-cache}, C{x-blazar-queue-ms}), as data the
        surface writes (L{blazar.web.client.opened}); read-only.
    @ivar verdict: The sentinel's verdict as a response header
        (C{x-blazar-sentinel}), decided by L{read}, L{relay} or L{chunks}
        on an answer not yet written; empty until then (and for a clean
        answer, or one already streamed). Data the surface writes before
        its body (L{blazar.web.client.judged}); read-only.
    """

    def __init__(
        self,
        proxy: EngineProxy,
        context: RequestContext | None,
        lease: InstanceLease | None,
        response: Any,
        prompt_tokens: int | None,
        started: float,
        loaded: float,
        model: str | None = None,
        *,
        made: bytes | None = None,
        cached: bool = False,
        keep: Callable[[bytes], None] | None = None,
        pin: Pin | None = None,
        isolated: Isolated | None = None,
        noted: tuple[str, str] | None = None,
        watched: dict[str, Any] | None = None,
        enforce: bool = False,
        max_tokens: int | None = None,
        stall: float = 30.0,
        clock: Any = None,
        translated: Translated | None = None,
        wants_usage: bool = False,
        headers: Mapping[bytes, bytes] | None = None,
        timed: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        """
        Built whole by the pipeline (L{blazar.gateway.pipeline.Pipeline._start}, L{blazar.gateway.pipeline.Pipeline._cached});
        nothing is set on it afterwards.

        @param lease: The hold on the child that answers; L{None} for an
            answer the pipeline has already (C{made}, then C{model} names
            the model).
        @param response: The child's response (headers read, body not yet),
            or L{None} for a C{made} answer.
        @param made: An answer the pipeline made itself (a forced tool call,
            a JSON answer, a cache hit): the OpenAI chat completion, or its
            SSE stream.
        @param cached: C{made} is a semantic cache hit (L{blazar.gateway.pipeline.Pipeline._cached}).
        @param keep: The cache step's store on a miss (see C{keep} above).
        @param pin: The session's slot pin (L{blazar.gateway.sessions}).
        @param isolated: Its slot on a model that isolates keys.
        @param noted: A finding the pipeline made while it got the answer
            (an engine that could not parse the model's tool call).
        @param watched: The chat request the sentinel judges the answer by
            (L{None}: no chat).
        @param enforce: C{sentinel_enforce} for this call.
        @param max_tokens: The call's output limit (a cut stream's finish
            reason).
        @param stall: Seconds without a chunk before a stream is flagged
            stalled.
        @param clock: C{IReactorTime} for the stall timer.
        @param translated: How the child's answer, in another shape, is
            turned into OpenAI's on the way (L{blazar.gateway.translated});
            L{None}: it is OpenAI's own.
        @param wants_usage: The request's C{stream_options.include_usage}
            (a remote's JSON answer made a stream: L{_remote_json}).
        @param headers: The response headers decided for it (copied).
        @param timed: Called with llama-server's C{timings} object of the
            answer and the answer's text, once (at a non-streamed answer, or
            a stream's last chunk): C{speculative = "auto"}'s tuner
            (L{blazar.engines.spectune}) and the model's lookup cache
            (L{blazar.engines.lookupcache}).
        """
        self._proxy = proxy
        self._context = context
        self._lease = lease
        self._response = response
        if model is None:
            assert lease is not None, "a reply without a lease names its model"
            model = lease.instance.entry.name
        self.model = model
        self.cached = cached
        self.keep = keep
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.loaded = loaded
        self.pin = pin
        self.isolated = isolated
        self.made = made
        self.watched = watched
        self.enforce = enforce
        self.max_tokens = max_tokens
        self.noted = noted
        self.stall = stall
        self.clock = clock
        self.translated = translated
        self.wants_usage = wants_usage
        self.headers: Mapping[bytes, bytes] = MappingProxyType(dict(headers or {}))
        self.verdict: Mapping[bytes, bytes] = MappingProxyType({})
        self._timed = timed
        self._text: list[str] = []  # a stream's text so far, for timed

    def _note_timings(self, data: bytes, text: str | None = None) -> None:
        """
        Hand the last C{timings} object in C{data} to C{timed} (once), with
        the answer's text (C{text}, else what the stream gave so far).
        """
        if self._timed is None:
            return
        timings = timings_in(data)
        if timings is not None:
            self._call_timed(timings, "".join(self._text) if text is None else text)

    def _call_timed(self, timings: dict[str, Any], text: str) -> None:
        timed, self._timed = self._timed, None
        if timed is None:
            return
        try:
            timed(timings, text)
        except Exception:
            log.failure("noting an answer's timings failed")

    async def read(self) -> bytes:
        """
        The whole answer.

        @raise blazar.engines.supervisor.EngineError: The child died or
            stalled before it finished.
        """
        if self.made is not None:
            data = self.made
        else:
            assert self._lease is not None
            data = await self._proxy.read(self._lease.instance, self._response)
            if self._timed is not None and TIMINGS in data:
                try:
                    text = answer_text(json.loads(data))
                except ValueError:
                    text = ""
                self._note_timings(data, text)
            if self.translated is not None:
                data = self.translated.whole(data)
        findings = (
            inspect_reply(self.watched, data) + ([self.noted] if self.noted else []) if self.watched is not None else []
        )
        self._judge(findings)
        keep, self.keep = self.keep, None
        if keep is not None and not findings:
            keep(data)
        if scoped(self._context):
            data = hide_prompt_cache_bytes(data)
        return data

    async def _cut_end(self, watch: StreamWatch) -> list[dict[str, Any]]:
        """
        The end of a stream the engine cut with L{UNPARSED} (an answer, not
        a fault): the finding, and the chunks a good stream ends with, its
        token counts from the child's tokenizer (the engine sent none).

        @raise EngineRejected: A JSON answer without tools (a model whose
            template reasons: the others' JSON answers do not go through
            the chat parser, L{blazar.gateway.jsonanswer}): the engine held
            text back, so the JSON is incomplete; the stream ends with the
            surface's error, never as a C{stop} with its JSON cut.
        """
        if self.watched is not None and not self.watched.get("tools") and jsonanswer.json_format(self.watched):
            watch.noted = (
                "format_invalid",
                "the engine could not parse the model's JSON answer and held its end "
                "back; the stream ended with an error",
            )
            log.info(
                "{model}: the engine could not parse the model's JSON answer and held its end back; the "
                "stream ends with an error",
                model=self.model,
            )
            raise EngineRejected(
                502,
                "the engine's chat parser refused the model's JSON answer at its end and "
                "held the rest of it back: the answer is incomplete; ask again",
            )
        code = "tool_args_invalid" if self.watched and self.watched.get("tools") else "format_invalid"
        watch.noted = (
            code,
            "the engine could not parse the model's output as a tool call or the format asked "
            "for; the stream ended with its text",
        )
        log.info(
            "{model}: the engine could not parse the model's output ({code}); the stream ends with its "
            "text instead of the engine's error",
            model=self.model,
            code=code,
        )
        completion, prompt = watch.deltas, self.prompt_tokens or 0
        try:
            text = watch.text()
            if text:
                completion = await self._proxy.count_text_tokens(self.model, text, add_special=False)
            if not prompt and self.watched is not None:
                prompt = await self._proxy.count_chat_tokens(self.model, self.watched)
        except Exception as e:
            log.info(
                "{model}: could not count a cut stream's tokens ({error}); estimated",
                model=self.model,
                error=str(e)[:200],
            )
        finish = "length" if self.max_tokens and completion >= self.max_tokens else "stop"
        options = (self.watched or {}).get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return ending(watch.last, finish, prompt, completion, usage)

    async def _remote_json(self) -> None:
        """
        A remote that answered a stream request with one JSON answer (its
        C{content-type} is C{application/json}, not C{text/event-stream}):
        that answer, read whole and translated as a non-streamed one is,
        becomes the stream it would have sent (L{answer_chunks}), so the
        client gets its surface's stream, not an empty one.

        @raise EngineRejected: The JSON is no answer (a 502 naming the
            remote).
        """
        lease = self._lease
        if (
            self.made is not None
            or lease is None
            or self._response is None
            or self.translated is None
            or not self.translated.remote
        ):
            return
        instance = lease.instance
        kind = (self._response.headers.getRawHeaders(b"content-type") or [b""])[0].lower()
        if not is_remote(instance) or not kind.startswith(b"application/json"):
            return
        data = await self._proxy.read(lease.instance, self._response)
        data = self.translated.whole(data)
        try:
            chunks = answer_chunks(json.loads(data), self.wants_usage)
        except ValueError as e:
            raise EngineRejected(
                502, f"{instance.server} answered a stream request with JSON, and {e}: check its base_url and api"
            ) from None
        self.made = (
            b"".join(
                b"data: " + strictjson.encode(c, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
                for c in chunks
            )
            + b"data: [DONE]\n\n"
        )

    async def relay(self, feed: Callable[[bytes], None]) -> None:
        """
        Feed the answer's bytes to C{feed} as they arrive, at the client's
        pace (L{EngineProxy.relay}).
        """
        await self._remote_json()
        hider = _CacheHider(feed) if scoped(self._context) else None
        if hider is not None:
            feed = hider.feed
        watch = StreamWatch(self.watched) if self.watched is not None else None
        timer = self._stall_timer(watch)
        cut = False
        whole = WholeEvents()
        if watch is not None:
            inner = feed
            note = timer.note if timer is not None else None

            def feed(data: bytes) -> None:
                nonlocal cut
                data = whole.feed(data)  # whole events only (a cut one can then be seen)
                if not data:
                    return
                if UNPARSED_BYTES in data:
                    data, dropped = drop_unparsed(data)
                    cut = cut or dropped
                    if not data.strip():
                        return
                watch.whole(data)
                if note is not None:
                    note()
                inner(data)

        try:
            if self.made is not None:
                feed(self.made)
            else:
                assert self._lease is not None
                relayed = self.translated.sse(feed) if self.translated is not None else feed
                if self._timed is not None:
                    relayed = self._timing(relayed)
                await self._proxy.relay(self._lease.instance, self._response, relayed, self._context)
        finally:
            if timer is not None:
                timer.cancel()
        if watch is not None:
            held = whole.rest()
            if held:
                inner(held)  # an unfinished last event: as the engine left it
            if cut:
                # an answer, not a fault: the stream ends as a good one does
                events = (
                    b"".join(
                        b"data: " + strictjson.encode(c, separators=(",", ":")).encode() + b"\n\n"
                        for c in await self._cut_end(watch)
                    )
                    + b"data: [DONE]\n\n"
                )
                watch.events(events)
                inner(events)
            self._judge(watch.findings())
        if hider is not None:
            hider.flush()

    def _timing(self, feed: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """
        C{feed}, first looking for C{timings} in each piece of a stream.
        """

        events = WholeEvents()

        def timing(data: bytes) -> None:
            if self._timed is not None:
                try:
                    whole = events.feed(data)  # (a timings object cut between pieces is read whole)
                except EventTooLong:
                    # a hint's bookkeeping never stops the client's stream: this answer goes unnoted
                    self._timed = None
                    feed(data)
                    return
                for event in whole.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        try:
                            self._text.append(delta_text(json.loads(event[len(b"data: ") :])))
                        except ValueError:
                            pass
                if TIMINGS in whole:
                    self._note_timings(whole)
            feed(data)

        return timing

    def _chunk_timing(self, on_chunk: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        """
        C{on_chunk}, first handing a chunk's C{timings} to C{timed}.
        """

        def timing(chunk: dict[str, Any]) -> Any:
            if self._timed is not None:
                self._text.append(delta_text(chunk))
                timings = chunk.get("timings")
                if isinstance(timings, dict):
                    self._call_timed(dict(timings), "".join(self._text))
            return on_chunk(chunk)

        return timing

    def _stall_timer(self, watch: StreamWatch | None) -> _StallTimer | None:
        """
        A timer that flags the stream C{stalled} (once) if no chunk comes for
        C{sentinel_stall_secs}; the stream goes on.
        """
        if watch is None or self.made is not None or self.stall <= 0 or self.clock is None:
            return None
        return _StallTimer(self.clock, self.stall, watch)

    async def chunks(self, on_chunk: Callable[[dict[str, Any]], Any]) -> None:
        """
        Feed each JSON chunk of the answer's SSE stream to C{on_chunk}; an
        C{on_chunk} that raises L{StreamStopped} ends the stream early, on
        purpose (a stop sequence matched), and this returns normally.

        @raise blazar.gateway.errors.EngineRejected: An in-stream error.
        """
        await self._remote_json()
        if scoped(self._context):
            hidden = on_chunk

            def on_chunk(chunk: dict[str, Any]) -> Any:
                hide_prompt_cache(chunk)
                return hidden(chunk)

        watch = StreamWatch(self.watched) if self.watched is not None else None
        timer = self._stall_timer(watch)
        keep, self.keep = self.keep, None
        answer = semantic.StreamedAnswer() if keep is not None else None
        if watch is not None:
            inner = on_chunk

            def on_chunk(chunk: dict[str, Any]) -> Any:
                watch.deltas += 1
                watch.chunk(chunk)
                if answer is not None:
                    answer.feed(chunk)
                if timer is not None:
                    timer.note()
                return inner(chunk)

        try:
            if self.cached and self.made is not None:  # a stored completion, as the stream it was made from
                for chunk in semantic.as_chunks(self.made):
                    on_chunk(chunk)
            elif self.made is not None:
                for event in self.made.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        on_chunk(json.loads(event[len(b"data: ") :]))
            elif self.translated is not None and (events := self.translated.events(on_chunk)) is not None:
                assert self._lease is not None
                await self._proxy.relay(self._lease.instance, self._response, events, self._context)
            else:
                assert self._lease is not None
                if self._timed is not None:
                    on_chunk = self._chunk_timing(on_chunk)
                try:
                    await self._proxy.relay_chunks(self._lease.instance, self._response, on_chunk, self._context)
                except EngineRejected as e:
                    if watch is None or not str(e).startswith(UNPARSED):
                        raise
                    # an answer, not a fault: the stream ends as a good one does
                    answer = None  # (not the engine's answer: never stored)
                    for chunk in await self._cut_end(watch):
                        on_chunk(chunk)
        except StreamStopped:
            return  # cut short on purpose (a surface's stop sequence): not a whole answer to keep
        finally:
            if timer is not None:
                timer.cancel()
        findings = watch.findings() if watch is not None else []
        self._judge(findings)
        made = answer.completion() if answer is not None and not findings else None
        if keep is not None and made is not None:
            keep(made)

    def _judge(self, findings: list[tuple[str, str]]) -> None:
        """
        The sentinel's findings on the whole answer: recorded (metrics,
        audit); on an answer not yet written (a non-streamed one), named in
        C{x-blazar-sentinel} (L{verdict}), or refused under
        C{sentinel_enforce}.

        @raise SentinelViolation: Enforced, and something was found.
        """
        if not findings:
            return
        codes = tuple(dict.fromkeys(code for code, _ in findings))
        context = self._context
        if context is None:
            return
        context.sentinel = codes
        if context.client is None or context.client.writing():
            return  # streamed to the client already: counted, never cut
        self.verdict = MappingProxyType({SENTINEL_HEADER.encode("ascii"): ",".join(codes).encode("ascii")})
        if self.enforce:
            raise SentinelViolation(findings)

    def usage(self, prompt: int, completion: int) -> None:
        """
        The tokens this call used, as the engine reported them: counted in
        the metrics and against the key's token limits. A cache hit's
        tokens count nowhere: no engine made them now (its answer still
        shows the usage of when it was made).
        """
        if self.cached:
            return
        note_tokens(self._context, prompt, completion)
        record_usage(self._context, prompt + completion)

    def tokens(self, prompt: int, completion: int) -> None:
        """
        The tokens, for the metrics only (the key's limits were counted
        from the stream's usage chunk: L{record}).
        """
        if self.cached:
            return
        note_tokens(self._context, prompt, completion)

    def audio_used(self) -> float:
        """
        The seconds of audio a transcription decoded, counted against the
        key's token limits (each second as one token) once it is answered.
        """
        seconds = (self._context.audio_seconds if self._context is not None else None) or 0.0
        record_usage(self._context, math.ceil(seconds))
        return seconds

    def record(self, total: int) -> None:
        """
        Tokens counted against the key's token limits only.
        """
        if self.cached:
            return
        record_usage(self._context, total)


_EARLY = 1e-6  # seconds: a stall timer this close to its bound has reached it (float rounding)


class _StallTimer:
    """
    Flags a stream C{stalled} (once) when no chunk came for C{seconds}.
    A chunk only notes the time (L{note}); the timer, when it fires early,
    waits on for the rest of the bound: no delayed call is moved per chunk.
    """

    def __init__(self, clock: Any, seconds: float, watch: StreamWatch) -> None:
        self._clock = clock
        self._seconds = seconds
        self._watch = watch
        self._last = clock.seconds()
        self._call = clock.callLater(seconds, self._check)

    def note(self) -> None:
        """
        A chunk came now.
        """
        self._last = self._clock.seconds()

    def _check(self) -> None:
        left = self._last + self._seconds - self._clock.seconds()
        if left > _EARLY:
            self._call = self._clock.callLater(left, self._check)
        else:
            self._watch.stalled(self._seconds)

    def cancel(self) -> None:
        """
        The stream ended (idempotent).
        """
        if self._call.active():
            self._call.cancel()


def scoped(context: RequestContext | None) -> bool:
    """
    Whether the request came with a key scoped to models (not an admin's).
    """
    key = key_of(context)
    return key is not None and not key.admin


def hide_prompt_cache(value: Any) -> None:
    """
    In place, in an answer or chunk: no sign of how much of the prompt the
    engine's KV cache held (C{prompt_tokens_details.cached_tokens} 0,
    C{timings.cache_n} folded into C{prompt_n}; the prompt's size stays).
    For keys scoped to models: another key's prompts on the same model
    are in that cache, and how far a guessed prefix matched told the
    guesser a secret in them a digit at a time (issue 36).
    """
    if isinstance(value, dict):
        timings = value.get("timings")
        if isinstance(timings, dict) and timings.get("cache_n"):
            timings["prompt_n"] = int(timings.get("prompt_n") or 0) + int(timings.get("cache_n") or 0)
            timings["cache_n"] = 0
        details = value.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens"):
            details["cached_tokens"] = 0
        for item in value.values():
            if isinstance(item, (dict, list)):
                hide_prompt_cache(item)
    elif isinstance(value, list):
        for item in value:
            hide_prompt_cache(item)


_CACHE_MARKS = (b'"cache_n"', b'"cached_tokens"')


def hide_prompt_cache_bytes(data: bytes) -> bytes:
    """
    L{hide_prompt_cache} on one JSON document (compact again), or C{data}
    as it is when it holds neither field or is not JSON.
    """
    if b'"cache_n"' not in data and b'"cached_tokens"' not in data:  # (_CACHE_MARKS)
        return data
    try:
        value = json.loads(data)
    except ValueError:
        return data
    hide_prompt_cache(value)
    return strictjson.encode(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class _CacheHider:
    """
    Hands an SSE stream on whole events at a time, each with
    L{hide_prompt_cache} applied to its C{data:} JSON where it has those
    fields; L{flush} hands on an unfinished last event as it is.
    """

    def __init__(self, feed: Callable[[bytes], None]) -> None:
        self._feed = feed
        self._whole = WholeEvents()

    def feed(self, data: bytes) -> None:
        events = self._whole.feed(data)
        if not events:
            return
        if b'"cache_n"' in events or b'"cached_tokens"' in events:  # (_CACHE_MARKS)
            out = []
            for event in events.split(b"\n\n")[:-1]:
                if event.startswith(b"data: {") and any(mark in event for mark in _CACHE_MARKS):
                    event = b"data: " + hide_prompt_cache_bytes(event[len(b"data: ") :])
                out.append(event + b"\n\n")
            events = b"".join(out)
        self._feed(events)

    def flush(self) -> None:
        rest = self._whole.rest()
        if rest:
            self._feed(rest)
