"""
The third of a L{blazar.gateway.reply.Reply}'s answer sources: a child's
answer in another shape than the OpenAI chat completion every surface
translates from, turned into it on the way. One L{Translated} per shape:
an C{api = "anthropic"} remote's Messages answer (L{FromAnthropic}), an
OpenAI-compatible remote's answer that names its own model (L{Renamed}),
and llama-server's C{/completion} stream of a JSON answer
(L{FromCompletion}, L{blazar.gateway.jsonanswer}). Pure: bytes and chunks
in, bytes and chunks out.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from blazar import strictjson
from blazar.engines.remote import is_remote, scrub_bytes
from blazar.engines.sse import SSEEvents
from blazar.gateway import jsonanswer
from blazar.gateway.engine_proxy import stream_error_message
from blazar.gateway.errors import EngineRejected
from blazar.gateway.remotewire import AnthropicStream, RemoteStreamError, from_anthropic

Feed = Callable[[bytes], None]
OnChunk = Callable[[dict[str, Any]], Any]
DONE = b"data: [DONE]\n\n"


def scrubber(instance: Any) -> Callable[[bytes], bytes]:
    """
    What takes a remote's key out of its answer, should it have echoed it
    (L{blazar.engines.remote.scrub_bytes}); nothing for a local child.
    """
    if not is_remote(instance):
        return lambda data: data
    return lambda data: scrub_bytes(data, instance.remote, instance.environ)


class Translated:
    """
    An answer the child gives in another shape (this base: none).

    @cvar remote: Whether the shape is a remote's (whose stream request it
        may answer with one JSON answer:
        L{blazar.gateway.reply.Reply._remote_json}).
    """

    remote = False

    def whole(self, data: bytes) -> bytes:
        """
        A non-streamed answer, as the OpenAI chat completion.
        """
        return data

    def events(self, on_chunk: OnChunk) -> Feed | None:
        """
        A feed for the answer's stream that hands each OpenAI chat chunk it
        translates to to C{on_chunk}; L{None}: its stream is OpenAI's own.
        """
        return None

    def sse(self, feed: Feed) -> Feed:
        """
        A feed for the answer's stream that hands C{feed} OpenAI's SSE bytes.
        """
        return feed


class FromAnthropic(Translated):
    """
    An C{api = "anthropic"} remote's Messages answer (L{AnthropicStream}).
    """

    remote = True

    def __init__(self, stream: AnthropicStream, scrub: Callable[[bytes], bytes]) -> None:
        self.stream = stream
        self._scrub = scrub

    def whole(self, data: bytes) -> bytes:
        """
        @raise EngineRejected: Not a Messages answer.
        """
        try:
            message = json.loads(self._scrub(data))
            if not isinstance(message, dict) or message.get("type") != "message":
                raise ValueError("not a message object")
            answer = from_anthropic(message, self.stream.model, self.stream.created)
        except (ValueError, TypeError, AttributeError) as e:
            raise EngineRejected(502, f"the remote's answer is not an Anthropic message: {e}") from None
        return strictjson.encode(answer, ensure_ascii=False).encode("utf-8")

    def events(self, on_chunk: OnChunk) -> Feed:
        """
        @raise EngineRejected: The remote's stream reported an error.
        """
        stream = self.stream

        def on_event(data: bytes) -> None:
            try:
                event = strictjson.parse(self._scrub(data))
            except ValueError:
                raise EngineRejected(502, "the remote's stream is not Anthropic's: an event is not JSON") from None
            if not isinstance(event, dict):
                return
            try:
                chunks = stream.feed(str(event.get("type", "")), event)
            except RemoteStreamError as e:
                raise EngineRejected(502, f"the remote's stream failed ({e.kind}): {e}") from None
            for chunk in chunks:
                on_chunk(chunk)

        return SSEEvents(on_event).feed

    def sse(self, feed: Feed) -> Feed:
        """
        L{events}, encoded as OpenAI's SSE (C{data: [DONE]} after the last
        chunk).
        """
        stream = self.stream
        done = False

        def on_chunk(chunk: dict[str, Any]) -> None:
            nonlocal done
            feed(b"data: " + strictjson.compact(chunk) + b"\n\n")
            if stream.finished and not done and (chunk.get("usage") is not None or not stream.include_usage):
                done = True
                feed(DONE)

        return self.events(on_chunk)


class Renamed(Translated):
    """
    An OpenAI-compatible remote's answer, which names its own model
    (C{tiny} for C{peer:tiny}, a dated snapshot for an alias): this one's
    name put there instead.
    """

    remote = True

    def __init__(self, model: str, server: str, scrub: Callable[[bytes], bytes]) -> None:
        self._model = model
        self._server = server
        self._scrub = scrub

    def whole(self, data: bytes) -> bytes:
        """
        @raise EngineRejected: Not a JSON object.
        """
        return with_model(self._scrub(data), self._model, self._server)

    def sse(self, feed: Feed) -> Feed:
        """
        Each event handed on with this model's name, as compact JSON, whole
        events only.
        """

        def on_event(data: bytes) -> None:
            data = data if data == b"[DONE]" else with_model(self._scrub(data), self._model, self._server)
            feed(b"data: " + data + b"\n\n")

        return SSEEvents(on_event).feed


class FromCompletion(Translated):
    """
    llama-server's C{/completion} SSE stream of a JSON answer
    (L{jsonanswer.ChatFromCompletion}), as OpenAI's chat chunks.
    """

    def __init__(self, stream: jsonanswer.ChatFromCompletion) -> None:
        self.stream = stream

    def events(self, on_chunk: OnChunk, on_end: Callable[[], None] | None = None) -> Feed:
        """
        Calls C{on_end} after the last chunk.

        @raise EngineRejected: The engine's stream reported an error.
        """
        stream = self.stream

        def on_event(data: bytes) -> None:
            if data == b"[DONE]":
                return
            event = strictjson.parse(data)
            if not isinstance(event, dict):
                return
            if "error" in event:
                raise EngineRejected(500, stream_error_message(event["error"]))
            ended = stream.finished
            for chunk in stream.feed(event):
                on_chunk(chunk)
            if stream.finished and not ended and on_end is not None:
                on_end()

        return SSEEvents(on_event).feed

    def sse(self, feed: Feed) -> Feed:
        return self.events(lambda chunk: feed(jsonanswer.encode(chunk)), lambda: feed(DONE))


def with_model(data: bytes, model: str, server: str) -> bytes:
    """
    An OpenAI-compatible remote's JSON object (an answer, a stream's
    event) with C{model} as its C{"model"} (compact, so the surfaces'
    byte-level renames find it).

    @raise EngineRejected: Not a JSON object (a 502 naming C{server}).
    """
    try:
        value = strictjson.parse(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EngineRejected(
            502,
            f"{server} answered with something that is not an OpenAI JSON object "
            f"(it began {data[:60]!r}): check its base_url and api",
        )
    if "model" not in value:
        return data
    value["model"] = model
    return strictjson.compact(value)
