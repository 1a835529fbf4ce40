"""
Splitting SSE streams is linear and bounded (issue 36: a remote's 64 MiB
unterminated event was re-joined and re-searched at every chunk: 50 s of
CPU, RSS 106 to 499 MB).
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.sse import EventTooLong, SSEEvents, WholeEvents


class WholeEventsTests(SynchronousTestCase):
    def test_events_split_anywhere_come_whole(self) -> None:
        stream = b"data: one\n\ndata: two\n\n: comment\n\ndata: three\n\n"
        for size in range(1, len(stream) + 1):
            whole, out = WholeEvents(), b""
            for i in range(0, len(stream), size):
                out += whole.feed(stream[i : i + size])
            self.assertEqual((out, whole.rest()), (stream, b""), size)

    def test_the_rest_is_held(self) -> None:
        whole = WholeEvents()
        self.assertEqual(whole.feed(b"data: a\n\ndata: b"), b"data: a\n\n")
        self.assertEqual(whole.rest(), b"data: b")
        self.assertEqual(whole.feed(b"\n"), b"")
        self.assertEqual(whole.feed(b"\n"), b"data: b\n\n")

    def test_an_unterminated_event_is_cut_at_the_cap_in_linear_time(self) -> None:
        whole, piece = WholeEvents(max_event=16 << 20), b"x" * (64 << 10)
        began = time.monotonic()
        with self.assertRaises(EventTooLong):
            for _ in range(1024):  # 64 MiB
                whole.feed(piece)
        self.assertLess(time.monotonic() - began, 2.0)

    def test_a_long_event_under_the_cap_is_whole(self) -> None:
        whole, piece = WholeEvents(), b"y" * (64 << 10)
        for _ in range(128):  # 8 MiB
            self.assertEqual(whole.feed(piece), b"")
        self.assertEqual(len(whole.feed(b"\n\n")), (8 << 20) + 2)


class SSEEventsTests(SynchronousTestCase):
    def test_payloads_and_crlf_split_between_chunks(self) -> None:
        got: list[bytes] = []
        events = SSEEvents(got.append)
        for piece in (b'data: {"a": 1}\r', b"\n\r", b"\ndata: x\r\ndata: y\r\n\r\n", b"data: [DONE]\n\n"):
            events.feed(piece)
        self.assertEqual(got, [b'{"a": 1}', b"x\ny", b"[DONE]"])

    def test_a_lone_cr_is_kept(self) -> None:
        got: list[bytes] = []
        events = SSEEvents(got.append)
        events.feed(b"data: a\r")
        events.feed(b"b\n\n")
        self.assertEqual(got, [b"data: a\rb"[6:]])

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(
            st.lists(
                st.sampled_from([b"data:", b"data: ", b"data:  ", b"event: x", b": c", b"id: 1", b"data"]).flatmap(
                    lambda head: st.binary(max_size=6).map(
                        lambda tail: head + tail.replace(b"\n", b"").replace(b"\r", b"")
                    )
                ),
                min_size=1,
                max_size=3,
            ),
            max_size=6,
        ),
        st.lists(st.integers(1, 200), max_size=10),
    )
    def test_payloads_as_the_lines_read(self, events: list[list[bytes]], cuts: list[int]) -> None:
        """
        Every event's C{data:} lines joined by newlines (their leading
        spaces dropped), one-line events (read without splitting lines)
        and many-line ones alike, however the stream is cut.
        """
        stream = b"".join(b"\n".join(lines) + b"\n\n" for lines in events)
        expected = []
        for lines in events:
            payload = [line[5:].lstrip(b" ") for line in b"\n".join(lines).split(b"\n") if line.startswith(b"data:")]
            if payload:
                expected.append(b"\n".join(payload))
        got: list[bytes] = []
        parser = SSEEvents(got.append)
        at = 0
        for cut in sorted(set(cuts)) + [len(stream)]:
            parser.feed(stream[at:cut])
            at = max(at, cut)
        self.assertEqual(got, expected)
