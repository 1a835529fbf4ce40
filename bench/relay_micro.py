"""
The gateway's CPU per relayed chunk, in process: llama-server-shaped SSE
bytes fed through the exact objects a server uses for one stream
(C{httpbody.relay_body}'s protocol, L{EngineProxy.relay} /
C{relay_chunks}, L{Reply.relay} / L{Reply.chunks} with the sentinel's
L{StreamWatch}, then the surface: L{SSERelay} for OpenAI's chat, the
Ollama, Anthropic and Responses translators and their encoders), on a
C{Clock}, with no socket. Each scenario is timed with
C{time.process_time} over whole streams (per-stream work spread over its
chunks) and printed as microseconds per chunk.

Run: C{python bench/relay_micro.py [--chunks N] [--streams S] [--rounds R]};
compare two trees by running it under each (C{PYTHONPATH=<tree>}),
alternating.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, cast

from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from blazar.gateway.context import RequestContext
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.reply import Reply
from blazar.web.sse import ModelRenamer, SSERelay
from blazar.web.translate import anthropic as atr
from blazar.web.translate import ollama as otr
from blazar.web.translate import responses as rtr

ENGINE_MODEL = "smollm2"
CLIENT_MODEL = "SmolLM2-135M"
WORDS = [" the", " quick", " brown", " fox", " jumps", " über", " 日本", " lazy", " dog", ".", "\n", " naïve"]


def _event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    chunk = {
        "choices": choices,
        "created": 1733380000,
        "id": "chatcmpl-Xq3b8W1pZk0hYc7T",
        "model": ENGINE_MODEL,
        "system_fingerprint": "b4000-7f1e2d3c",
        "object": "chat.completion.chunk",
        **extra,
    }
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def stream_events(n: int) -> list[bytes]:
    """
    One llama-server chat stream of C{n} content events: the role chunk,
    C{n} text deltas, the finish chunk with C{timings}, the usage chunk,
    C{[DONE]}.
    """
    events = [_event([{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}])]
    for i in range(n):
        events.append(_event([{"finish_reason": None, "index": 0, "delta": {"content": WORDS[i % len(WORDS)]}}]))
    events.append(
        _event(
            [{"finish_reason": "stop", "index": 0, "delta": {}}],
            timings={"prompt_n": 12, "cache_n": 0, "predicted_n": n, "predicted_ms": 123.4},
        )
    )
    events.append(_event([], usage={"completion_tokens": n, "prompt_tokens": 12, "total_tokens": n + 12}))
    events.append(b"data: [DONE]\n\n")
    return events


class _Transport:
    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Response:
    """
    An C{IResponse} whose body is delivered by hand (L{feed}, L{end}).
    """

    headers = None

    def __init__(self) -> None:
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(_Transport())

    def end(self) -> None:
        self.protocol.connectionLost(Failure(ResponseDone()))


class _Supervisor:
    pass


def _reply(clock: Clock, response: _Response, watched: dict[str, Any] | None) -> Reply:
    proxy = EngineProxy(cast(Any, _Supervisor()), cast(Any, None), clock)
    instance = SimpleNamespace(entry=SimpleNamespace(name=ENGINE_MODEL), protocol=object(), lane="llamacpp")
    lease = SimpleNamespace(instance=instance)
    context = RequestContext(started=0.0)
    return Reply(
        proxy,
        context,
        cast(Any, lease),
        response,
        None,
        0.0,
        0.0,
        watched=watched,
        clock=clock,
        stall=30.0,
    )


def _run(events: list[bytes], coalesce: int, start: Callable[[Reply], Any], watched: dict[str, Any] | None) -> None:
    clock = Clock()
    response = _Response()
    reply = _reply(clock, response, watched)
    done = ensureDeferred(start(reply))
    protocol = response.protocol
    for i in range(0, len(events), coalesce):
        protocol.dataReceived(b"".join(events[i : i + coalesce]) if coalesce > 1 else events[i])
    response.end()
    failures: list[Failure] = []
    done.addErrback(failures.append)
    if failures:
        failures[0].raiseException()


BODY = {"model": CLIENT_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def openai(sentinel: bool) -> Callable[[list[bytes], int], None]:
    def run(events: list[bytes], coalesce: int) -> None:
        out: list[bytes] = []
        relay = SSERelay(out.append, ModelRenamer(ENGINE_MODEL, CLIENT_MODEL), lambda total: None, True, lambda e: None)
        _run(events, coalesce, lambda reply: reply.relay(relay.feed), BODY if sentinel else None)
        relay.finish()
        assert relay.done

    return run


def ollama(events: list[bytes], coalesce: int) -> None:
    out: list[bytes] = []
    timing = otr.Timing(0.0, 0.0)
    translator = otr.OllamaStream("chat", CLIENT_MODEL, timing, lambda: 0.0)

    def on_chunk(chunk: dict[str, Any]) -> None:
        if timing.first_token is None:
            timing.first_token = 0.0
        lines = translator.feed(chunk)
        if lines:
            for line in lines:
                line["created_at"] = "2026-12-05T03:00:00.000000Z"
            out.append(otr.ndjson(lines))

    _run(events, coalesce, lambda reply: reply.chunks(on_chunk), BODY)


def anthropic(events: list[bytes], coalesce: int) -> None:
    out: list[bytes] = []
    translator = atr.AnthropicStream("msg_0123456789abcdef01234567", CLIENT_MODEL, [])

    def on_chunk(chunk: dict[str, Any]) -> None:
        pairs = translator.feed(chunk)
        if pairs:
            out.append(b"".join(atr.sse_event(name, payload) for name, payload in pairs))

    _run(events, coalesce, lambda reply: reply.chunks(on_chunk), BODY)


def responses(events: list[bytes], coalesce: int) -> None:
    out: list[bytes] = []
    translator = rtr.ResponsesStream(rtr.response_object({"model": CLIENT_MODEL}, CLIENT_MODEL, 1733380000, None))
    out.append(b"".join(rtr.sse(kind, payload) for kind, payload in translator.start()))

    def on_chunk(chunk: dict[str, Any]) -> None:
        pairs = translator.feed(chunk)
        if pairs:
            out.append(b"".join(rtr.sse(kind, payload) for kind, payload in pairs))

    _run(events, coalesce, lambda reply: reply.chunks(on_chunk), BODY)


SCENARIOS: dict[str, Callable[[list[bytes], int], None]] = {
    "openai": openai(False),
    "openai+sentinel": openai(True),
    "ollama": ollama,
    "anthropic": anthropic,
    "responses": responses,
}


def measure(name: str, chunks: int, streams: int, coalesce: int) -> float:
    """
    Microseconds of CPU per chunk for C{streams} streams of C{chunks}.
    """
    events = stream_events(chunks)
    run = SCENARIOS[name]
    run(events, coalesce)  # warm
    start = time.process_time()
    for _ in range(streams):
        run(events, coalesce)
    return (time.process_time() - start) / (streams * len(events)) * 1e6


def use_json() -> None:
    """
    Put C{json} where L{strictjson.parse} and L{strictjson.compact} use
    orjson (to measure what orjson saves per chunk).
    """
    from blazar import strictjson

    def compact(value: Any) -> bytes:
        return strictjson.encode(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    strictjson.parse = json.loads  # type: ignore[assignment]
    strictjson.compact = compact


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1000, help="content events per stream")
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="best of")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--json", action="store_true", help="strictjson.parse/compact by json, not orjson")
    args = parser.parse_args(argv)
    if args.json:
        use_json()
    names = [n for n in SCENARIOS if not args.only or n in args.only.split(",")]
    for coalesce, label in ((1, "one event a read"), (16, "16 events a read")):
        for name in names:
            best = min(measure(name, args.chunks, args.streams, coalesce) for _ in range(args.rounds))
            print(f"{name:18} {label:17} {best:7.2f} us/chunk", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
