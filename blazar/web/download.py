"""
A file sent as a response body without holding it in memory: read in
L{PIECE} pieces, each in a thread (file I/O never runs on the reactor),
written to the request as a streaming producer, so a client that reads
slowly pauses the reading (the transport's backpressure) instead of
letting the file pile up in its write buffer.

At most one piece is read ahead of what the transport has taken: ten
clients downloading a 200 MB file hold about ten pieces, not ten files.
"""

from __future__ import annotations

import threading
from typing import Any, BinaryIO, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

log = Logger()

PIECE = 64 * 1024
"""Bytes read from the file at a time."""


class _Reader:
    """
    An open file read from worker threads: reads and the close take turns
    (a close while a read is under way waits for it), so a client that
    leaves mid-read never closes the file under the reading thread.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._lock = threading.Lock()

    def thd_read(self, size: int) -> bytes:
        with self._lock:
            return b"" if self._handle.closed else self._handle.read(size)

    def thd_close(self) -> None:
        with self._lock:
            self._handle.close()


@implementer(IPushProducer)
class FileProducer:
    """
    Writes an open file to a consumer (a request), piece by piece, honouring
    C{pauseProducing}/C{resumeProducing}; C{stopProducing} (the client
    left) ends it early.
    """

    def __init__(
        self, request: IConsumer, handle: BinaryIO, in_thread: Callable[..., Deferred[Any]], piece: int | None = None
    ) -> None:
        """
        @param request: Where the file goes: a request (twisted.web's
            C{Request} is an C{IConsumer}), its headers set.
        @param handle: The file, at the offset to start from; closed when
            the sending ends, however it ends.
        @param in_thread: Runs a blocking function in a thread pool.
        @param piece: Bytes read at a time (L{PIECE} unless given).
        """
        self._request = request
        self._reader = _Reader(handle)
        self._in_thread = in_thread
        self._piece = piece or PIECE
        self._paused = False
        self._stopped = False
        self._waiting: Deferred[None] | None = None

    async def send(self) -> int:
        """
        Write the whole file (the request is not finished: its caller
        does that).

        @return: The bytes written; fewer than the file holds when the
            client left.
        @raise CancelledError: The caller was cancelled (the client left).
        """
        sent = 0
        self._request.registerProducer(self, True)
        try:
            while not self._stopped:
                if self._paused:
                    self._waiting = Deferred()
                    await self._waiting
                    continue
                data = await self._in_thread(self._reader.thd_read, self._piece)
                if not data or self._stopped:
                    break
                self._request.write(data)
                sent += len(data)
        except CancelledError:
            self._stopped = True  # the client left (its connection is gone, and the request's channel with it)
            raise
        finally:
            if not self._stopped:
                self._request.unregisterProducer()
            # in the pool, after any read still under way (a cancelled one)
            self._in_thread(self._reader.thd_close).addErrback(
                lambda f: log.failure("closing a file sent to a client failed", f)
            )
        return sent

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.callback(None)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._wake()

    def stopProducing(self) -> None:
        self._stopped = True
        self._wake()
