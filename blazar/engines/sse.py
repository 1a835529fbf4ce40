"""
Reading an engine's Server-Sent Events stream (WHATWG HTML, "Server-sent
events") event by event.
"""

from __future__ import annotations

from typing import Callable

MAX_EVENT_BYTES = 16 << 20  # one SSE event, at most (llama-server's are a few KiB)


class EventTooLong(ValueError):
    """
    A stream sent more than L{MAX_EVENT_BYTES} without ending an event
    (a remote's unterminated event): the stream ends with an error.
    """


class WholeEvents:
    """
    Holds a stream's bytes until they end an SSE event (a blank line):
    L{feed} gives back the complete events, whole, and keeps the rest.
    Linear in the bytes: only the new bytes are searched (and one before
    them), and what is held is joined once, when its event ends (issue 36:
    a 64 MiB unterminated event was re-joined and re-searched at every
    chunk, 50 s of CPU).
    """

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self._parts: list[bytes] = []
        self._held = 0
        self._max = max_event

    def feed(self, chunk: bytes) -> bytes:
        """
        The complete events C{chunk} ends (with what was held before it),
        or C{b""}.

        @raise EventTooLong: More than the cap held without an event's end.
        """
        if not self._parts and chunk.endswith(b"\n\n"):
            return chunk  # whole events and nothing held (a relay fed whole events): no copy
        tail = self._parts[-1][-1:] if self._parts else b""
        end = (tail + chunk if tail else chunk).rfind(b"\n\n")
        if end < 0:
            if chunk:
                self._parts.append(chunk)
                self._held += len(chunk)
            if self._held > self._max:
                raise EventTooLong(f"an event over {self._max >> 20} MiB")
            return b""
        cut = end + 2 - len(tail)
        out = b"".join(self._parts) + chunk[:cut] if self._parts else chunk[:cut]
        rest = chunk[cut:]
        self._parts, self._held = ([rest], len(rest)) if rest else ([], 0)
        return out

    def rest(self) -> bytes:
        """
        What is held: the start of an event not ended yet.
        """
        return b"".join(self._parts)


class SSEEvents:
    """
    Splits an SSE byte stream into events and hands each event's C{data}
    payload (bytes, the C{data:} lines joined by newlines) to C{on_event}.
    Events may arrive split anywhere, including inside a UTF-8 character:
    nothing is decoded until an event is whole. CRLF line ends are read as
    LF (one split across two chunks too).

    @raise EventTooLong: From L{feed}, past L{MAX_EVENT_BYTES} in one event.
    """

    def __init__(self, on_event: Callable[[bytes], None], max_event: int = MAX_EVENT_BYTES) -> None:
        self._on_event = on_event
        self._whole = WholeEvents(max_event)
        self._cr = False  # the last chunk ended with \r (maybe half of a CRLF)

    def feed(self, chunk: bytes) -> None:
        """
        Take bytes from the engine; deliver every event they complete.
        """
        if self._cr:
            chunk, self._cr = b"\r" + chunk, False
        if chunk.endswith(b"\r"):
            chunk, self._cr = chunk[:-1], True
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        events = self._whole.feed(chunk)
        if not events:
            return
        on_event = self._on_event
        for event in events.split(b"\n\n"):
            if event.startswith(b"data:") and b"\n" not in event:
                on_event(event[5:].lstrip(b" "))  # one line (llama-server's every event)
                continue
            payload = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if payload:
                on_event(b"\n".join(payload))
