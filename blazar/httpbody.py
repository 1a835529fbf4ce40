"""
Bounded reads of HTTP client response bodies: an idle timeout, a size bound,
pause/resume for backpressure, and a cancel that closes the connection.
Used by the engine client (L{blazar.engines.client}) and by the Hugging Face
puller (L{blazar.models.hub}); it knows nothing of either.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Mapping, Sequence

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse


class BodyIdleTimeout(Exception):
    """
    The engine sent nothing for longer than the idle bound.
    """


class BodyStalled(BodyIdleTimeout):
    """
    The engine sent nothing for the quiet time, and then did not answer
    its health check (L{relay_body}'s C{quiet}).
    """


class BodyTooLarge(Exception):
    """
    The engine's body exceeded the size bound.
    """


class BodyValve:
    """
    Pauses and resumes the reading of a body that L{relay_body} relays.

    Paused, the engine's connection is not read: its bytes wait in the
    kernel's socket buffers, and once those are full the engine's writes
    block (TCP backpressure), so a slow consumer holds no more of the body
    in memory than one read. The idle timeout does not run while paused
    (the silence is the consumer's, not the engine's).

    Usable before the relay starts: the state is applied once it does.

    @ivar paused: Whether reading is paused.
    """

    def __init__(self) -> None:
        self.paused = False
        self._relay: _BodyRelay | None = None

    def pause(self) -> None:
        """
        Stop reading the engine's connection (idempotent).
        """
        if not self.paused:
            self.paused = True
            if self._relay is not None:
                self._relay.pause()

    def resume(self) -> None:
        """
        Read the engine's connection again (idempotent).
        """
        if self.paused:
            self.paused = False
            if self._relay is not None:
                self._relay.resume()

    def _attach(self, relay: _BodyRelay) -> None:
        self._relay = relay
        if self.paused:
            relay.pause()


_EARLY = 1e-6  # seconds: an idle timer this close to its bound has reached it (float rounding)


class _BodyRelay(Protocol):
    def __init__(
        self,
        finished: Deferred[None],
        on_chunk: Callable[[bytes], None],
        clock: IReactorTime,
        idle_timeout: float,
        max_bytes: int | None,
        close_ends: bool = False,
        quiet: tuple[float, Callable[[], Deferred[bool]]] | None = None,
    ) -> None:
        self.finished: Deferred[None] | None = finished
        self.quiet = quiet
        self.last = clock.seconds()  # when a byte last came (or reading resumed)
        self.asking: Deferred[bool] | None = None
        self.close_ends = close_ends
        self.on_chunk = on_chunk
        self.clock = clock
        self.idle_timeout = idle_timeout
        self.max_bytes = max_bytes
        self.received = 0
        self.paused = False
        self.timer = clock.callLater(self._wait(), self._idle)

    def _wait(self) -> float:
        return min(self.idle_timeout, self.quiet[0]) if self.quiet is not None else self.idle_timeout

    def pause(self) -> None:
        if self.finished is None or self.paused:
            return
        self.paused = True
        if self.timer.active():
            self.timer.cancel()
        if self.transport is not None:
            # a TransportProxyProducer: stops reading the TCP connection
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resume(self) -> None:
        if self.finished is None or not self.paused:
            return
        self.paused = False
        self.last = self.clock.seconds()
        self.timer = self.clock.callLater(self._wait(), self._idle)
        if self.transport is not None:
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _fail(self, error: BaseException | Failure) -> None:
        if self.timer.active():
            self.timer.cancel()
        asking, self.asking = self.asking, None
        if asking is not None:
            asking.cancel()
        if self.transport is not None:
            # an IPushProducer (TransportProxyProducer): closes the connection
            self.transport.stopProducing()  # type: ignore[attr-defined]
        finished, self.finished = self.finished, None
        if finished is not None:
            finished.errback(error)

    def _idle(self) -> None:
        silent = self.clock.seconds() - self.last
        left = self._wait() - silent
        if left > _EARLY:
            # bytes came since the timer was set (L{dataReceived} only notes
            # when, never moves the timer): wait for the rest of the bound
            self.timer = self.clock.callLater(left, self._idle)
            return
        if self.quiet is None or silent >= self.idle_timeout:
            self._fail(BodyIdleTimeout(f"engine sent nothing for {self.idle_timeout:g} s"))
            return
        # quiet for a while: is it still there?
        self.asking = asking = self.quiet[1]()

        def answered(alive: object) -> None:
            if self.asking is not asking or self.finished is None:
                return  # data came meanwhile, or it ended
            self.asking = None
            if alive is True:
                if not self.paused:  # (else resume starts the wait again)
                    self.timer = self.clock.callLater(self._wait(), self._idle)
            else:
                self._fail(BodyStalled(f"engine sent nothing for {silent:.0f} s and did not answer its health check"))

        asking.addBoth(answered)

    def cancel(self) -> None:
        self._fail(CancelledError())

    def dataReceived(self, data: bytes) -> None:
        if self.finished is None:
            return
        self.received += len(data)
        if self.max_bytes is not None and self.received > self.max_bytes:
            self._fail(BodyTooLarge(f"engine body over {self.max_bytes} bytes"))
            return
        self.last = self.clock.seconds()
        if self.asking is not None:  # it spoke while its health was asked: on as before
            asking = self.asking
            self.asking = None
            asking.cancel()
            if not self.paused:
                self.timer = self.clock.callLater(self._wait(), self._idle)
        # the idle timer is not moved per chunk (that was a reset of a
        # delayed call per chunk): when it fires, L{_idle} waits on from
        # C{last}; paused, the rest of a read already taken is still
        # delivered and resuming starts the wait again
        try:
            self.on_chunk(data)
        except BaseException:
            self._fail(Failure())

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.timer.active():
            self.timer.cancel()
        asking, self.asking = self.asking, None
        if asking is not None:
            asking.cancel()
        finished, self.finished = self.finished, None
        if finished is None:
            return
        if reason.check(ResponseDone) or (self.close_ends and reason.check(PotentialDataLoss)):
            finished.callback(None)
        else:
            # PotentialDataLoss included: a body without a length that ended
            # by a close is not trusted to be whole (unless close_ends)
            finished.errback(reason)


def relay_body(
    response: IResponse,
    on_chunk: Callable[[bytes], None],
    clock: IReactorTime,
    *,
    idle_timeout: float,
    max_bytes: int | None = None,
    valve: BodyValve | None = None,
    close_ends: bool = False,
    quiet: tuple[float, Callable[[], Deferred[bool]]] | None = None,
) -> Deferred[None]:
    """
    Feed C{response}'s body to C{on_chunk} as it arrives.

    Unlike C{treq.collect}, cancelling the returned Deferred closes the
    connection to the engine, so a client that goes away stops the
    engine's work too.

    @param idle_timeout: Seconds without a byte before failing with
        L{BodyIdleTimeout} (not counted while C{valve} is paused).
    @param max_bytes: Fail with L{BodyTooLarge} past this many bytes.
    @param valve: Pauses and resumes reading (a consumer that cannot keep
        up); C{on_chunk} may pause it from inside.
    @param close_ends: A body without a length ends when its connection
        closes, as HTTP allows (RFC 9112, 6.3): for a remote server, which
        may be Python's C{http.server}; an engine child's close without a
        length is taken as a crash.
    @param quiet: C{(seconds, alive)}: after that many seconds without a
        byte (not counted while paused), C{alive()} is asked (a child's
        C{/health}); L{True} goes on waiting, anything else fails with
        L{BodyIdleTimeout} at once (a child stopped mid-way, which a
        stream would otherwise wait C{idle_timeout} for).
    @return: Fires with L{None} when the whole body arrived; fails with the
        connection's failure (e.g. C{ResponseFailed}) if it broke.
    """
    relay: _BodyRelay | None = None

    def cancel(_: Deferred[None]) -> None:
        if relay is not None:
            relay.cancel()

    d: Deferred[None] = Deferred(cancel)
    relay = _BodyRelay(d, on_chunk, clock, idle_timeout, max_bytes, close_ends, quiet)
    response.deliverBody(relay)
    if valve is not None:
        # after deliverBody, which resumes the transport once it has handed
        # over what it had buffered (on_chunk may have paused the valve)
        valve._attach(relay)
    return d


async def read_body(
    response: IResponse,
    clock: IReactorTime,
    *,
    idle_timeout: float,
    max_bytes: int,
    close_ends: bool = False,
) -> bytes:
    """
    The whole body of C{response}, bounded as L{relay_body}.
    """
    parts: list[bytes] = []
    await relay_body(
        response, parts.append, clock, idle_timeout=idle_timeout, max_bytes=max_bytes, close_ends=close_ends
    )
    return b"".join(parts)


def multipart_body(
    fields: Mapping[str, str], files: Sequence[tuple[str, str, str, Any]], boundary: str | None = None
) -> tuple[bytes, str]:
    """
    A C{multipart/form-data} body (RFC 7578): text C{fields}, then
    C{files} as C{(field name, file name, content type, data)}, C{data}
    bytes or a tuple of byte strings joined in place (no copy of their own).

    @raise ValueError: A field that is not text (a lone surrogate).

    @return: The body and its C{content-type} header value.
    """
    boundary = boundary or "blazar-" + secrets.token_hex(16)

    def quoted(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")

    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{quoted(name)}"\r\n\r\n'.encode()
            + value.encode("utf-8")
            + b"\r\n"
        )
    for name, filename, content_type, data in files:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{quoted(name)}"; '
            f'filename="{quoted(filename)}"\r\nContent-Type: {quoted(content_type)}\r\n\r\n'.encode()
        )
        parts.extend(data if isinstance(data, tuple) else (data,))
        parts.append(b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"
