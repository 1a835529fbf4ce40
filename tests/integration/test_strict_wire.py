"""
The suite's strict reading of what the daemon wrote (issue 35):
L{strictwire.strict_loads}, its place as C{json.loads} for this package
(tests/integration/conftest.py), and the harness's strict body and SSE
readers, against a small local HTTP server. No engine, no daemon.
"""

from __future__ import annotations

import decimal
import http.server
import io
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.integration import strictwire
from tests.integration.harness import Daemon
from tests.integration.strictwire import strict_loads

NOT_STRICT = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "1" + "0" * 400, "-" + "9" * 310]


def refusal(text: str | bytes, **kw: Any) -> str:
    """
    The message L{strict_loads} refuses C{text} with, checked to be kept in
    L{strictwire.REFUSED} (which is then cleared, or the conftest would fail
    the test for it).
    """
    with pytest.raises(AssertionError) as caught:
        strict_loads(text, **kw)
    message = str(caught.value)
    assert strictwire.REFUSED == [message]
    strictwire.REFUSED.clear()
    assert message.startswith("not strict JSON: ")
    return message


@pytest.mark.parametrize("word", NOT_STRICT)
def test_refused(word: str) -> None:
    """
    NaN, the infinities and numbers beyond a double's range, integer or
    not, are refused anywhere in a document, as text or bytes; the message
    names the value.
    """
    for text in (word, f"[{word}]", f'{{"a": [1, {{"b": {word}}}], "c": "x"}}'):
        for value in (text, text.encode("utf-8")):
            assert word[:40] in refusal(value)


def test_caller_hooks_do_not_let_it_through() -> None:
    """
    A caller's own C{parse_constant}, C{parse_float} or C{parse_int} does
    not make a value that is not strict JSON acceptable.
    """
    refusal("[NaN]", parse_constant=lambda name: None)
    refusal("[1e999]", parse_float=decimal.Decimal)
    refusal("1" + "0" * 400, parse_int=decimal.Decimal)


def test_strict_json_read_as_json_loads_reads_it() -> None:
    """
    Strict JSON is read to what C{json.loads} reads, floats to the largest
    double, integers of any size that fits one.
    """
    text = (
        '{"a": [1, 1.5, -0.0, 1e308, -1.7976931348623157e308, 5e-324, 1e-999], "b": null, '
        '"c": true, "d": "NaN Infinity 1e999", "e": ' + "9" * 300 + "}"
    )
    assert strict_loads(text) == strictwire._LOADS(text)
    assert strict_loads(text.encode("utf-16")) == strictwire._LOADS(text)
    assert strictwire.REFUSED == []


def test_keywords_kept() -> None:
    """
    Every keyword C{json.loads} takes still does what it does.
    """

    class Decoder(json.JSONDecoder):
        def decode(self, s: str, *args: Any, **kw: Any) -> Any:
            return ["decoded", super().decode(s, *args, **kw)]

    assert strict_loads('{"a": 1.5}', parse_float=decimal.Decimal) == {"a": decimal.Decimal("1.5")}
    assert strict_loads('{"a": 15}', parse_int=str) == {"a": "15"}
    assert strict_loads('{"a": {"b": 1}}', object_hook=lambda d: sorted(d)) == ["a"]
    pairs = strict_loads('{"b": 1, "a": 2}', object_pairs_hook=OrderedDict)
    assert isinstance(pairs, OrderedDict) and list(pairs) == ["b", "a"]
    assert strict_loads("[1]", cls=Decoder) == ["decoded", [1]]
    with pytest.raises(ValueError):
        strict_loads('"\x01"')  # a control character
    assert strict_loads('"\x01"', strict=False) == "\x01"


def test_not_json_is_still_a_value_error() -> None:
    """
    Text that is not JSON at all is a C{ValueError}, as from C{json.loads}
    (callers catch it to say "not JSON"), not a refusal.
    """
    for text in ("", "{", "nan", "[1,]", "[Inf]"):
        with pytest.raises(ValueError):
            strict_loads(text)
    assert strictwire.REFUSED == []


def test_json_loads_is_strict_here() -> None:
    """
    In this package C{json.loads} is L{strict_loads}, so the test modules,
    C{json.load}, and the SDKs' readers (httpx's C{Response.json()}) read
    strictly.
    """
    assert json.loads is strict_loads
    refusal_of = []
    for read in (
        lambda: json.loads("[NaN]"),
        lambda: json.load(io.StringIO("[NaN]")),
        lambda: httpx.Response(200, content=b'{"x": Infinity}').json(),
    ):
        with pytest.raises(AssertionError):
            read()
        refusal_of.append(strictwire.REFUSED.pop())
    assert strictwire.REFUSED == [] and len(refusal_of) == 3


def test_put_back() -> None:
    """
    L{strictwire.strict_json_loads} puts C{json.loads} back after its block.
    """
    outer = json.loads
    try:
        with strictwire.strict_json_loads():
            assert json.loads is strict_loads
        assert json.loads is strictwire._LOADS
    finally:
        json.loads = outer  # the package's own block is still open


class _Server(http.server.BaseHTTPRequestHandler):
    answer = b""
    content_type = "application/json"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", self.content_type)
        self.send_header("content-length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, type[_Server]]]:
    """
    A L{Daemon} whose port is a local server answering every POST with
    C{_Server.answer}.
    """
    handler = type("Handler", (_Server,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Daemon(tmp_path, "", port=server.server_address[1]), handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_post_json_strict(served: tuple[Daemon, type[_Server]]) -> None:
    """
    The harness's C{post_json} reads the body strictly.
    """
    daemon, handler = served
    handler.answer = b'{"a": [1.5, 2]}'
    assert daemon.post_json("/x", {}) == (200, {"a": [1.5, 2]})
    handler.answer = b'{"a": [1.5, NaN]}'
    with pytest.raises(AssertionError, match="not strict JSON: NaN"):
        daemon.post_json("/x", {})
    strictwire.REFUSED.clear()


def test_stream_strict(served: tuple[Daemon, type[_Server]]) -> None:
    """
    The harness's SSE reader checks each C{data:} line but C{[DONE]} is
    strict JSON, whether or not the test reads it, and still yields the
    text.
    """
    daemon, handler = served
    handler.content_type = "text/event-stream"
    handler.answer = b'data: {"a": 1}\n\ndata: {"b": 2.5}\n\ndata: [DONE]\n\n'
    assert [data for data, _ in daemon.stream("/x", {})] == ['{"a": 1}', '{"b": 2.5}', "[DONE]"]
    handler.answer = b'data: {"a": 1}\n\ndata: {"b": -Infinity}\n\ndata: [DONE]\n\n'
    with pytest.raises(AssertionError, match="not strict JSON: -Infinity"):
        list(daemon.stream("/x", {}))
    strictwire.REFUSED.clear()
    handler.answer = b"data: {\n\n"
    with pytest.raises(AssertionError, match="SSE data is not JSON"):
        list(daemon.stream("/x", {}))
