"""
Reading an engine's Server-Sent Events stream (WHATWG HTML, "Server-sent
events") event by event.
"""

from __future__ import annotations

from typing import Callable


class SSEEvents:
    """
    Splits an SSE byte stream into events and hands each event's C{data}
    payload (bytes, the C{data:} lines joined by newlines) to C{on_event}.
    Events may arrive split anywhere, including inside a UTF-8 character:
    nothing is decoded until an event is whole.
    """

    def __init__(self, on_event: Callable[[bytes], None]) -> None:
        self._on_event = on_event
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        """
        Take bytes from the engine; deliver every event they complete.
        """
        data = self._buffer + chunk if self._buffer else chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        for event in events:
            payload = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if payload:
                self._on_event(b"\n".join(payload))
