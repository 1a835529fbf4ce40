"""
A model whose file the daemon cannot read (issue 35): every surface answers
with an error that names the model and what to check, never the file's
path on the server, which only the daemon's log gets.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, cast

from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config
from blazar.engines.supervisor import Supervisor
from blazar.models.gguf_meta import GGUFMetadata, thd_read_metadata, unreadable
from blazar.models.registry import ModelRegistry
from blazar.testing import fake_engine_app
from tests.web.gateway import MemoryGateway

HELLO = [{"role": "user", "content": "hi"}]

# path, body: each surface a client may name the model on, streamed or not
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "x", "messages": HELLO}),
    ("/v1/chat/completions", {"model": "x", "messages": HELLO, "stream": True}),
    ("/v1/completions", {"model": "x", "prompt": "hi"}),
    ("/v1/responses", {"model": "x", "input": "hi"}),
    ("/v1/responses", {"model": "x", "input": "hi", "stream": True}),
    ("/v1/messages", {"model": "x", "max_tokens": 8, "messages": HELLO}),
    ("/v1/messages", {"model": "x", "max_tokens": 8, "messages": HELLO, "stream": True}),
    ("/api/chat", {"model": "x", "messages": HELLO, "stream": False}),
    ("/api/chat", {"model": "x", "messages": HELLO}),
    ("/api/generate", {"model": "x", "prompt": "hi"}),
    ("/api/show", {"model": "x"}),
]


def supervisor(config: Config, registry: ModelRegistry, reactor: Any) -> Supervisor:
    """
    The real supervisor, which reads a model's GGUF header before it starts
    the model's child.
    """

    async def probe(url: str) -> int:
        return 200

    return Supervisor(config, registry, reactor, probe, {}, port_finder=lambda: 5555)


class UnreadableModelTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.gateway = MemoryGateway(
            self,
            None,
            fake_engine_app("x:latest"),
            models=("m", "x"),
            config='[engines.llamacpp]\nbinary = "/bin/true"\n',
            supervise=supervisor,
        )
        self.file = self.gateway.root / "x.gguf"
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, self.events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, self.events.append))

    def no_read_permission(self) -> None:
        """
        Make C{x.gguf} unreadable to the daemon: mode 000, and, since root
        reads it anyway, a reader that meets what C{open} raises then
        (EACCES) in place of the file's first read.
        """
        os.chmod(self.file, 0)
        self.addCleanup(os.chmod, self.file, 0o644)
        real = thd_read_metadata

        def read(path: Path, shards: tuple[Path, ...]) -> GGUFMetadata:
            if path == self.file:
                raise unreadable(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path)))
            return real(path, shards)

        self.gateway.registry._read = read

    def answers(self) -> list[tuple[str, int, str]]:
        """
        Each request of L{REQUESTS}: path, status, and the answer's text.
        """
        out = []
        for path, body in REQUESTS:
            status, _, data = self.gateway.post(path, body)
            out.append((path, status, data.decode("utf-8")))
        return out

    def assertNamesTheModelNotThePath(self, text: str, where: str, check: str) -> None:
        text = text.replace('\\"', '"')  # as JSON writes it
        self.assertIn('model "x:latest"', text, where)
        self.assertIn(check, text, where)
        self.assertNotIn(str(self.gateway.root), text, where)
        self.assertNotIn("x.gguf", text, where)

    def test_not_readable(self) -> None:
        """
        A file the daemon's user may not read: every surface names the
        model and says to check the file's permissions; the log has the
        path.
        """
        self.no_read_permission()
        for path, status, text in self.answers():
            where = f"{path}: {text[:300]}"
            # 502, Anthropic's 500; 200: a stream, whose headers were out
            self.assertIn(status, (200, 500, 502), where)
            self.assertIn("error", text, where)
            self.assertNamesTheModelNotThePath(text, where, "check the file's permissions")
        logged = [formatEvent(e) for e in self.events if e.get("log_level") is not None]
        self.assertTrue(any(str(self.file) in line and "x:latest" in line for line in logged), logged)

    def test_gone(self) -> None:
        """
        A file gone since the scan (moved, deleted): named the same way, no
        path, whatever the surface.
        """
        self.file.unlink()
        for path, status, text in self.answers():
            where = f"{path}: {text[:300]}"
            self.assertIn("error", text, where)
            self.assertNamesTheModelNotThePath(text, where, "moved or deleted")

    def test_the_other_model_is_served(self) -> None:
        """
        One unreadable file spoils only its own model.
        """
        self.no_read_permission()
        status, _, data = self.gateway.post("/api/show", {"model": "m"})
        self.assertEqual(status, 200, data)
        self.assertEqual(json.loads(data)["details"]["format"], "gguf")
