"""
Reply.relay on a stream the engine cut with its "output does not match
the expected format" error (issue 21): only that error event goes, however
the reads split it, and the stream ends as a good one does; text or call
arguments that quote the sentence are left alone. (From the attack on the
first version.)
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from twisted.internet.defer import ensureDeferred

from blazar.engines.lease import InstanceLease
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.reply import Reply
from blazar.gateway.sentinel import StreamWatch, inspect
from blazar.web.client import context_of

TEXT = b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
ERR = (
    b'data: {"error":{"code":500,"message":"The model produced output that does not match the expected '
    b'peg-native format","type":"server_error"}}\n\n'
)
BODY = {"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}


class Proxy:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def relay(self, instance: Any, response: Any, feed: Any, request: Any) -> None:
        for p in self.pieces:
            feed(p)


def relayed(pieces: list[bytes]) -> bytes:
    lease = SimpleNamespace(instance=SimpleNamespace(entry=SimpleNamespace(name="m")))
    reply = Reply(
        cast(EngineProxy, Proxy(pieces)),
        context_of(SimpleNamespace(startedWriting=True)),
        cast(InstanceLease, lease),
        None,
        None,
        0.0,
        0.0,
        watched=BODY,
    )
    got: list[bytes] = []
    d = ensureDeferred(reply.relay(got.append))
    assert d.called, d
    return b"".join(got)


def test_error_in_one_read() -> None:
    out = relayed([TEXT + ERR])
    assert b'"error"' not in out and out.endswith(b"data: [DONE]\n\n")


def test_error_event_split_across_reads() -> None:
    whole = TEXT + ERR
    cut = len(TEXT) + 40  # inside the error event, before the message
    out = relayed([whole[:cut], whole[cut:]])
    assert b'"error"' not in out and out.endswith(b"data: [DONE]\n\n"), out[-200:]


def test_error_event_split_after_marker() -> None:
    whole = TEXT + ERR
    cut = len(TEXT) + 3  # 'dat' | 'a: {"error"...'
    out = relayed([whole[:cut], whole[cut:]])
    assert b'"error"' not in out and out.endswith(b"data: [DONE]\n\n"), out[-200:]


def test_prose_without_tools_is_not_a_call() -> None:
    prose = 'Qwen writes a call as:\n```\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n```'
    assert inspect({"messages": []}, "stop", prose, "", []) == []


def test_stream_without_tools_marker_split_across_tokens() -> None:
    # non-streamed judges '<tool_call>{...}' (tool_name_unknown); a stream whose tokens split the marker
    pieces = ["<tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_call>"]
    data = b"".join(
        b"data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}, separators=(",", ":")).encode()
        + b"\n\n"
        for p in pieces
    )
    w = StreamWatch({"messages": []})
    w.events(data)
    assert [c for c, _ in w.findings()] == [c for c, _ in inspect({"messages": []}, None, "".join(pieces), "", [])]


def test_split_error_is_still_flagged() -> None:
    whole = TEXT + ERR
    cut = len(TEXT) + 40
    lease = SimpleNamespace(instance=SimpleNamespace(entry=SimpleNamespace(name="m")))
    req = SimpleNamespace(startedWriting=True)
    reply = Reply(
        cast(EngineProxy, Proxy([whole[:cut], whole[cut:]])),
        context_of(req),
        cast(InstanceLease, lease),
        None,
        None,
        0.0,
        0.0,
        watched=BODY,
    )
    ensureDeferred(reply.relay(lambda b: None))
    assert "tool_args_invalid" in (req.blazar.sentinel or ())


def test_forced_call_arguments_quoting_the_phrase() -> None:
    from blazar.gateway.toolcalls import chat_stream

    args = json.dumps({"title": "The model produced output that does not match the expected format"})
    made = chat_stream(
        "m", [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args}}], None, None
    )
    lease = SimpleNamespace(instance=SimpleNamespace(entry=SimpleNamespace(name="m")))
    reply = Reply(
        cast(EngineProxy, Proxy([])),
        context_of(SimpleNamespace(startedWriting=True)),
        cast(InstanceLease, lease),
        None,
        None,
        0.0,
        0.0,
        watched=BODY,
        made=made,
    )
    got: list[bytes] = []
    ensureDeferred(reply.relay(got.append))
    out = b"".join(got)
    assert b"expected format" in out and out.count(b"[DONE]") == 1, out
