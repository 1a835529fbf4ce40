"""
Relaying an engine's Server-Sent Events stream (WHATWG HTML, "Server-sent
events") to a client as bytes, event by event, without parsing the JSON in
each event; and the comments that keep a stream alive while its model
loads (L{loading_comments}).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from blazar import strictjson
from blazar.gateway.engine_facts import WholeEvents

log = Logger()

DONE = b"data: [DONE]\n\n"
LOADING = b": loading\n\n"
LOADING_PING = 2.0


def loading_comments(write: Callable[[bytes], None], clock: Any) -> Callable[[], None]:
    """
    Keep a stream whose headers are out alive while its model loads: an
    SSE comment (C{: loading}, which every SSE client skips) now and
    another every L{LOADING_PING} seconds of C{clock}, so clients with a
    read timeout do not give up.

    @param write: Writes bytes to the client.
    @return: What stops the comments (once the child answered).
    """
    write(LOADING)
    pinger = LoopingCall(write, LOADING)
    pinger.clock = clock
    pinger.start(LOADING_PING, now=False).addErrback(lambda f: log.failure("loading keepalive failed", f))
    return lambda: pinger.stop() if pinger.running else None


class ModelRenamer:
    """
    Puts the client's model name where the engine wrote its own.

    The child is started with C{--alias <canonical name>} and llama-server
    writes compact JSON, so its name appears as the exact bytes
    C{"model":"<canonical>"}; a byte replace is all it takes, per event.
    """

    def __init__(self, engine_name: str, client_name: str) -> None:
        self.needed = engine_name != client_name
        self._old = b'"model":' + strictjson.encode(engine_name).encode("utf-8")
        self._new = b'"model":' + strictjson.encode(client_name).encode("utf-8")

    def rename(self, data: bytes) -> bytes:
        """
        C{data} with the engine's model name replaced.
        """
        if not self.needed:
            return data
        return data.replace(self._old, self._new)


class _EventBuffer:
    """
    Holds an engine stream's bytes up to the last complete SSE event.
    """

    _whole: WholeEvents

    def _complete(self, chunk: bytes) -> bytes:
        """
        The complete events that C{chunk} (after what was held) ends,
        whole; the rest is held for the next call. C{b""}: none yet.

        @raise blazar.gateway.engine_facts.EventTooLong: An event over the cap.
        """
        return self._whole.feed(chunk)

    @property
    def _buffer(self) -> bytes:
        return self._whole.rest()


class SSERelay(_EventBuffer):
    """
    Buffers an engine's SSE bytes up to event boundaries and writes whole
    events to the client as soon as each one is complete. C{on_timings}
    gets the events that carry llama-server's C{timings} object (the last
    chunk of a stream).

    @ivar done: The last event written was C{data: [DONE]}.
    """

    def __init__(
        self,
        write: Callable[[bytes], None],
        renamer: ModelRenamer,
        on_usage: Callable[[int], None] | None = None,
        hide_usage: bool = False,
        on_timings: Callable[[bytes], None] | None = None,
    ) -> None:
        self._on_timings = on_timings
        self._write = write
        self._renamer = renamer
        self._on_usage = on_usage
        self._hide_usage = hide_usage
        self._whole = WholeEvents()
        self.done = False
        self.failed = False

    def feed(self, chunk: bytes) -> None:
        """
        Take bytes from the engine; write every event they complete.
        """
        events = self._complete(chunk)
        if not events:
            return
        self.done = events.endswith(DONE)
        if self._on_timings is not None and b'"timings":{' in events:
            self._on_timings(events)  # llama-server's last chunk: token counts
        if self._on_usage is not None and b'"usage":{' in events:
            events = self._take_usage(events)
        self._write(self._renamer.rename(events))

    def _take_usage(self, events: bytes) -> bytes:
        """
        Report the usage chunk's total tokens; drop it if the client did
        not ask for usage (only ever parses that one event).
        """
        kept = []
        for event in events.split(b"\n\n"):
            if event.startswith(b"data: {") and b'"usage":{' in event:
                try:
                    chunk = strictjson.parse(event[len(b"data: ") :])
                except ValueError:
                    chunk = {}
                usage = chunk.get("usage") or {}
                if self._on_usage is not None and usage:
                    self._on_usage(int(usage.get("total_tokens") or 0))
                if self._hide_usage and not chunk.get("choices"):
                    continue
            kept.append(event)
        return b"\n\n".join(kept)

    def finish(self) -> None:
        """
        The engine's body ended: write any trailing partial event.
        """
        held = self._buffer
        if held.strip():
            self._write(self._renamer.rename(held))
        self._whole = WholeEvents()

    def fail(self, error_json: bytes) -> None:
        """
        End the stream with an error event (OpenAI's SDKs raise on a
        C{data:} event carrying an C{error} object); no C{[DONE]} follows.
        """
        if self.done or self.failed:
            return
        self.failed = True
        self._write(b"data: " + error_json + b"\n\n")


class SSERewriter(_EventBuffer):
    """
    Rebuilds chosen events of an engine's SSE stream on their way to
    C{feed} (an L{SSERelay}'s): each C{data:} event whose payload C{wants}
    is replaced by the payloads C{rewrite} returns (zero or more), every
    other event passes as it came. Bytes are buffered up to event
    boundaries only; a batch of events none of which C{wants} (tested on
    the batch's bytes first) is passed on without being split.

    @param wants: L{None}: every event is rewritten.
    """

    def __init__(
        self,
        feed: Callable[[bytes], None],
        rewrite: Callable[[bytes], list[bytes]],
        wants: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._feed = feed
        self._rewrite = rewrite
        self._wants = wants
        self._whole = WholeEvents()

    def feed(self, chunk: bytes) -> None:
        """
        Take bytes from the engine; pass on every event they complete.
        """
        events = self._complete(chunk)
        if not events:
            return
        wants = self._wants
        if wants is not None and not wants(events):
            self._feed(events)
            return
        out: list[bytes] = []
        for event in events.split(b"\n\n")[:-1]:
            if event.startswith(b"data: ") and b"\n" not in event and (wants is None or wants(event)):
                out.extend(b"data: " + payload + b"\n\n" for payload in self._rewrite(event[6:]))
            else:
                out.append(event + b"\n\n")
        if out:
            self._feed(b"".join(out))

    def finish(self) -> None:
        """
        The engine's body ended: pass on any trailing partial event as it is.
        """
        held = self._buffer
        if held:
            self._feed(held)
        self._whole = WholeEvents()
