"""
The audit lane (opt-in, C{audit_log = PATH}): one JSON line per request,
C{{ts, node, trace, key, method, path, model, status, ms, priority,
queue_depth}} (C{node}: this node's name, L{blazar.config.node_name}, so
the lines of a cluster's nodes can be merged), handed to a writer thread through a bounded queue. A full
queue drops the line and counts it (C{dropped}, shown by C{blazar status}):
auditing never blocks a request. The file rotates to C{PATH.1} at
C{max_bytes}. Both files are mode 0600 (set at open, whatever the umask).

A write that fails (a full disk: ENOSPC, a removed folder) drops its line
and counts it, and marks the writer down (C{down}: the error, shown in
C{/metrics} and C{blazar status}); the writer reopens the file after a
back-off (1 s, doubling to 60 s) and is up again at its first good write.
It never dies: issue 36 saw the first ENOSPC end the thread for good.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from blazar import strictjson
from blazar.files import PRIVATE_FILE, open_private, set_mode

_STOP = object()


class AuditLog:
    """
    A bounded, dropping, rotating JSON-lines writer on its own thread.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 16 * 1024 * 1024,
        queue_size: int = 4096,
        wall: Callable[[], float] = time.time,
        retry_secs: float = 1.0,
        node: str | None = None,
    ) -> None:
        """
        @param retry_secs: The first back-off after a failed write (it
            doubles, to 60 s).
        @param node: This node's name, in every line.
        """
        self.path = path
        self.max_bytes = max_bytes
        self.dropped = 0
        self.written = 0
        self.down: str | None = None  # the last write's error while the writer cannot write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._wall = wall
        self._retry = retry_secs
        self._node = node
        self._thread: threading.Thread | None = None
        self.gate = threading.Event()  # tests close it to stall the writer
        self.gate.set()

    def submit(self, event: dict[str, Any]) -> None:
        """
        Queue one request's line; never blocks. Secrets never reach here:
        the key is named, not shown.
        """
        line = {
            "ts": round(self._wall(), 3),
            "node": self._node,
            "trace": event.get("trace"),
            "key": event.get("key") or None,
            "method": event.get("method"),
            "path": event.get("path"),
            "model": event.get("model"),
            "status": event.get("status"),
            "ms": event.get("ms"),
            "priority": event.get("priority"),
            "queue_depth": event.get("queue_depth"),
            "sentinel": event.get("sentinel") or [],  # what the sentinel flagged (blazar.gateway.sentinel)
        }
        for usage in (
            "audio_seconds",
            "images",
            "remote",
            "cache",
        ):  # the lanes' usage; the [[remotes]] name; the cache's outcome
            if usage in event:
                line[usage] = event[usage]
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def start(self) -> None:
        # a directory made here holds only audit lines: 0700 (an existing
        # one, say /var/log/blazar, keeps the mode its owner gave it)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="blazar-audit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """
        Write what is queued, then end the thread. Blocking (at shutdown).
        """
        if self._thread is None:
            return
        self.gate.set()
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None

    def _open(self) -> TextIO:
        return os.fdopen(open_private(self.path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")

    @staticmethod
    def _close(f: TextIO | None) -> None:
        if f is None:
            return
        try:
            f.close()
        except OSError:
            pass  # (its buffer could not be written either: those lines were counted)

    def _run(self) -> None:
        f: TextIO | None = None
        retry_at, backoff = 0.0, self._retry
        try:
            set_mode(self.path.with_name(self.path.name + ".1"), PRIVATE_FILE)
            f = self._open()  # (at once: the file is there from the start)
        except OSError as e:
            self.down = f"{e.strerror or e} ({type(e).__name__})"
        try:
            while True:
                self.gate.wait()
                item = self._queue.get()
                if item is _STOP:
                    return
                data = strictjson.encode(item, separators=(",", ":")) + "\n"
                if f is None and time.monotonic() < retry_at:
                    self.dropped += 1  # down, before its next try
                    continue
                try:
                    if f is None:
                        set_mode(self.path.with_name(self.path.name + ".1"), PRIVATE_FILE)
                        f = self._open()
                    if f.tell() + len(data) > self.max_bytes and f.tell() > 0:
                        f.close()
                        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                        f = self._open()
                    f.write(data)
                    f.flush()
                except OSError as e:
                    self.dropped += 1
                    self.down = f"{e.strerror or e} ({type(e).__name__})"
                    self._close(f)
                    f, retry_at, backoff = None, time.monotonic() + backoff, min(backoff * 2, 60.0)
                    continue
                self.written += 1
                self.down, backoff = None, self._retry
        finally:
            self._close(f)
