"""
The pass-through relay against a decoding relay (issue 41): the same
llama-server SSE byte streams, cut at arbitrary byte boundaries (inside
UTF-8 characters too), go through the relay the OpenAI surface uses (the
engine body's protocol, L{EngineProxy.relay}, L{Reply.relay} with the
sentinel's L{StreamWatch}, L{SSERelay}: bytes passed on, the model renamed
by a byte replace, the usage chunk read and perhaps hidden) and through a
relay that parses every event, makes the same changes and encodes it
again. The client sees the same events; the pass-through's bytes are the
engine's but for the renamed model and the hidden usage chunk; and what
the pipeline watches (finish reason, usage total, tool calls, the
sentinel's findings) is the same as read from the decoded chunks.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone

from blazar import strictjson
from blazar.gateway.context import RequestContext
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.reply import Reply
from blazar.gateway.sentinel import StreamWatch
from blazar.web.observe import usage_of_timings
from blazar.web.sse import ModelRenamer, SSERelay
from blazar.web.translate import anthropic as atr
from blazar.web.translate import ollama as otr
from blazar.web.translate import responses as rtr

ENGINE = "smollm2"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# what a model writes: any character (split across reads, its UTF-8 bytes
# are cut too), quotes, backslashes and newlines included; llama-server
# writes UTF-8, never a lone surrogate
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=6)
ARGS = st.sampled_from(['{"city":', '"Paris"', "}", "{", '"日本"', "x", ""]) | TEXT


@st.composite
def deltas(draw: Any) -> list[dict[str, Any]]:
    """
    The deltas of one answer: text, reasoning and tool-call fragments
    (each call's first fragment carries its id and name).
    """
    out: list[dict[str, Any]] = []
    named: set[int] = set()
    for kind in draw(st.lists(st.sampled_from(["content", "reasoning", "tool"]), max_size=12)):
        if kind == "content":
            out.append({"content": draw(TEXT)})
        elif kind == "reasoning":
            out.append({"reasoning_content": draw(TEXT)})
        else:
            index = draw(st.integers(0, 1))
            call: dict[str, Any] = {"index": index, "function": {"arguments": draw(ARGS)}}
            if index not in named:
                named.add(index)
                call["id"] = f"call_{index}"
                call["type"] = "function"
                call["function"]["name"] = draw(st.sampled_from(["get_weather", "unknown_tool"]))
            out.append({"tool_calls": [call]})
    return out


def _event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    chunk = {
        "choices": choices,
        "created": 1733380000,
        "id": "chatcmpl-abc",
        "model": ENGINE,
        "system_fingerprint": "b4000-7f1e",
        "object": "chat.completion.chunk",
        **extra,
    }
    # as llama-server writes JSON: compact, UTF-8 (no \\u escapes)
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


@st.composite
def streams(draw: Any) -> tuple[bytes, list[bytes]]:
    """
    One llama-server chat stream (role chunk, deltas, the finish chunk with
    C{timings}, perhaps the usage chunk, C{[DONE]}) and its bytes cut into
    reads at arbitrary places.
    """
    events = [_event([{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}])]
    answer = draw(deltas())
    for delta in answer:
        events.append(_event([{"finish_reason": None, "index": 0, "delta": delta}]))
    n = len(answer)
    events.append(
        _event(
            [{"finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])), "index": 0, "delta": {}}],
            timings={"prompt_n": 9, "cache_n": 3, "predicted_n": n, "predicted_ms": 1.5},
        )
    )
    if draw(st.booleans()):
        events.append(_event([], usage={"completion_tokens": n, "prompt_tokens": 12, "total_tokens": n + 12}))
    events.append(b"data: [DONE]\n\n")
    data = b"".join(events)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=24))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if data[a:b]]
    return data, pieces


BODIES = st.sampled_from(
    [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
    ]
)
CLIENT_NAMES = st.sampled_from([ENGINE, "SmolLM2-135M", 'qu"ote\\d', "modèle-日本"]) | TEXT.filter(bool)


class _Body:
    """
    An engine's response whose body is delivered by hand.
    """

    headers = None

    def __init__(self) -> None:
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(SimpleNamespace(pauseProducing=id, resumeProducing=id, stopProducing=id))


def decoding_relay(data: bytes, client: str, hide_usage: bool) -> tuple[list[bytes], list[int]]:
    """
    The reference: every event parsed, the model renamed and the usage
    chunk read (and dropped if hidden) on the parsed chunk, encoded again.

    @return: The events the client gets, and the usage totals read.
    """
    out, usage = [], []
    for event in data.split(b"\n\n")[:-1]:
        payload = event[len(b"data: ") :]
        if payload == b"[DONE]":
            out.append(event + b"\n\n")
            continue
        chunk = json.loads(payload)
        if chunk.get("usage"):
            usage.append(int(chunk["usage"]["total_tokens"]))
            if hide_usage and not chunk.get("choices"):
                continue
        if chunk.get("model") == ENGINE:
            chunk["model"] = client
        out.append(b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n")
    return out, usage


def decoded(events: bytes | list[bytes]) -> list[Any]:
    """
    The events a client reads: each C{data:} payload, parsed.
    """
    if isinstance(events, list):
        events = b"".join(events)
    out: list[Any] = []
    for event in events.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def chunks_of(data: bytes) -> list[dict[str, Any]]:
    return [c for c in decoded(data) if c != "[DONE]"]


class PassThroughTests(SynchronousTestCase):
    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(streams(), CLIENT_NAMES, st.booleans(), st.booleans(), BODIES)
    def test_same_client_visible_output(
        self, stream: tuple[bytes, list[bytes]], client: str, hide_usage: bool, sentinel: bool, body: dict[str, Any]
    ) -> None:
        """
        The pass-through relay, on the server's own objects, writes what the
        decoding relay writes, event for event; its bytes are the engine's
        but for the model's name and the hidden usage chunk; it reads the
        same usage total and hands C{timings} on once.
        """
        data, pieces = stream
        clock = Clock()
        response = _Body()
        context = RequestContext(started=0.0)
        instance = SimpleNamespace(entry=SimpleNamespace(name=ENGINE), protocol=None, lane="llamacpp")
        reply = Reply(
            EngineProxy(cast(Any, None), cast(Any, None), clock),
            context,
            cast(Any, SimpleNamespace(instance=instance)),
            response,
            None,
            0.0,
            0.0,
            watched=body if sentinel else None,
            clock=clock,
            stall=30.0,
        )
        out: list[bytes] = []
        usage: list[int] = []
        timings: list[bytes] = []
        renamer = ModelRenamer(ENGINE, client)
        relay = SSERelay(out.append, renamer, usage.append, hide_usage, timings.append)
        done = ensureDeferred(reply.relay(relay.feed))
        for piece in pieces:
            clock.advance(0.01)
            response.protocol.dataReceived(piece)
        response.protocol.connectionLost(Failure(ResponseDone()))
        self.successResultOf(done)
        relay.finish()
        self.assertTrue(relay.done)

        expected, expected_usage = decoding_relay(data, client, hide_usage)
        self.assertEqual(decoded(out), decoded(expected))
        self.assertEqual(usage, expected_usage)
        self.assertEqual(sum(b'"timings":{' in t for t in timings), 1)
        self.assertEqual([usage_of_timings(t) for t in timings if b'"timings":{' in t], [(12, _n(data))])

        # bytes: the engine's, the model renamed (a byte replace), the usage chunk perhaps left out
        engine_events = [e + b"\n\n" for e in data.split(b"\n\n")[:-1]]
        kept = [e for e in engine_events if not (hide_usage and b'"choices":[],' in e and b'"usage":{' in e)]
        renamed = b"".join(kept).replace(
            b'"model":"' + ENGINE.encode() + b'"', b'"model":' + json.dumps(client).encode("ascii")
        )
        self.assertEqual(b"".join(out), renamed)

        if sentinel:
            self.assertEqual(context.sentinel, _codes(StreamWatch(body), chunks_of(data)))

    @settings(max_examples=250, deadline=None)
    @given(streams(), BODIES)
    def test_the_watch_reads_what_decoding_reads(self, stream: tuple[bytes, list[bytes]], body: dict[str, Any]) -> None:
        """
        L{StreamWatch} on the bytes (parsing only the events it needs) finds
        what it finds on every decoded chunk: finish reason, tool calls (name
        and arguments by index), findings.
        """
        data, pieces = stream
        on_bytes = StreamWatch(body)
        for piece in pieces:
            on_bytes.events(piece)
        on_chunks = StreamWatch(body)
        chunks = chunks_of(data)
        for chunk in chunks:
            on_chunks.chunk(chunk)

        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        self.assertEqual(on_bytes._finish, finish[-1])
        calls: dict[int, list[str]] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    name_args = calls.setdefault(call["index"], ["", ""])
                    name_args[0] += call["function"].get("name") or ""
                    name_args[1] += call["function"].get("arguments") or ""
        self.assertEqual(on_bytes._calls, calls)
        self.assertEqual(on_chunks._calls, calls)
        self.assertEqual(on_bytes.findings(), on_chunks.findings())


def _n(data: bytes) -> int:
    return int(data.split(b'"predicted_n":', 1)[1].split(b",", 1)[0])


def _codes(watch: StreamWatch, chunks: list[dict[str, Any]]) -> tuple[str, ...]:
    for chunk in chunks:
        watch.chunk(chunk)
    return tuple(dict.fromkeys(code for code, _ in watch.findings()))


def _translated(surface: str, pieces: list[bytes]) -> bytes:
    """
    What a translated surface writes for one engine stream, through the
    server's objects (the body's protocol, L{EngineProxy.relay_chunks},
    L{Reply.chunks} with the sentinel's watch, the surface's translator and
    encoder).
    """
    clock = Clock()
    response = _Body()
    instance = SimpleNamespace(entry=SimpleNamespace(name=ENGINE), protocol=None, lane="llamacpp")
    reply = Reply(
        EngineProxy(cast(Any, None), cast(Any, None), clock),
        RequestContext(started=0.0),
        cast(Any, SimpleNamespace(instance=instance)),
        response,
        None,
        0.0,
        0.0,
        watched={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
        clock=clock,
        stall=30.0,
    )
    out: list[bytes] = []
    if surface == "ollama":
        ollama = otr.OllamaStream("chat", "client", otr.Timing(0.0, 0.0), clock.seconds)

        def on_chunk(chunk: dict[str, Any]) -> None:
            out.append(otr.ndjson(ollama.feed(chunk)))

    elif surface == "anthropic":
        anthropic = atr.AnthropicStream("msg_1", "client", [])

        def on_chunk(chunk: dict[str, Any]) -> None:
            out.append(b"".join(atr.sse_event(name, payload) for name, payload in anthropic.feed(chunk)))

    else:
        responses = rtr.ResponsesStream(rtr.response_object({"model": "client"}, "client", 1, None))

        def on_chunk(chunk: dict[str, Any]) -> None:
            out.append(b"".join(rtr.sse(kind, payload) for kind, payload in responses.feed(chunk)))

    done = ensureDeferred(reply.chunks(on_chunk))
    for piece in pieces:
        response.protocol.dataReceived(piece)
    response.protocol.connectionLost(Failure(ResponseDone()))
    failed: list[Failure] = []
    done.addErrback(failed.append)
    if failed:
        failed[0].raiseException()
    if surface == "ollama":
        out.append(otr.ndjson([ollama.finish()]))
    elif surface == "anthropic":
        out.append(b"".join(atr.sse_event(name, payload) for name, payload in anthropic.finish()))
    else:
        out.append(b"".join(rtr.sse(kind, payload) for kind, payload in responses.finish()))
    return b"".join(out)


_RANDOM_ID = re.compile(r"^([a-z]+_)[0-9A-Za-z]{8,}$")


def _documents(data: bytes) -> list[Any]:
    """
    The JSON documents in NDJSON lines or SSE C{data:} lines, parsed (and
    the SSE C{event:} names), random ids (C{resp_...}, C{msg_...}) made
    equal.
    """

    def same_ids(value: Any) -> Any:
        if isinstance(value, str):
            return _RANDOM_ID.sub(r"\1*", value)
        if isinstance(value, dict):
            return {k: same_ids(v) for k, v in value.items()}
        if isinstance(value, list):
            return [same_ids(v) for v in value]
        return value

    out: list[Any] = []
    for line in data.split(b"\n"):
        if line.startswith(b"event: "):
            out.append(line.decode())
        elif line.startswith(b"data: "):
            out.append(same_ids(json.loads(line[len(b"data: ") :])))
        elif line:
            out.append(same_ids(json.loads(line)))
    return out


class TranslatedTests(SynchronousTestCase):
    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(streams(), st.sampled_from(["ollama", "anthropic", "responses"]))
    def test_orjson_writes_what_json_writes(self, stream: tuple[bytes, list[bytes]], surface: str) -> None:
        """
        A translated surface parses each chunk once and encodes each of its
        own once with orjson (L{strictjson.parse}, L{strictjson.compact});
        with json doing both, the client reads the same documents.
        """
        _, pieces = stream
        fast = _translated(surface, pieces)
        self.assertTrue(fast)
        self.patch(strictjson, "parse", json.loads)
        self.patch(
            strictjson,
            "compact",
            lambda value: strictjson.encode(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
        )
        self.assertEqual(_documents(fast), _documents(_translated(surface, pieces)))
