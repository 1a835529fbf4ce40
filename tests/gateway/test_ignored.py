"""
x-blazar-ignored and the once-per-client-and-field log line.
"""

from __future__ import annotations

from typing import cast

from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.gateway.ignored import IGNORED_HEADER, IgnoredFields
from blazar.testing import FakeSupervisor, fake_engine_app
from blazar.web.anthropic import beta_values
from blazar.web.client import context_of, write_ignored
from tests.typed import not_none
from tests.web.gateway import MemoryGateway


def noted(seen: IgnoredFields, r: DummyRequest, surface: str, names: list[str]) -> None:
    """
    C{names} noted for C{r}, and the header written as the surfaces write it.
    """
    seen.note(context_of(r), surface, names)
    write_ignored(cast(IRequest, r))


def request(agent: bytes = b"claude-cli/2.1.332 (external, cli)") -> DummyRequest:
    r = DummyRequest([b""])
    r.requestHeaders.setRawHeaders(b"user-agent", [agent])
    return r


class IgnoredFieldsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.events: list[dict] = []
        globalLogPublisher.addObserver(cast(ILogObserver, self.events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, self.events.append))

    def lines(self) -> list[str]:
        return [e["field"] for e in self.events if "field" in e]

    def test_header_and_one_line_per_client_and_field(self) -> None:
        seen = IgnoredFields()
        r = request()
        noted(seen, r, "anthropic", ["metadata", "context_management", "metadata"])
        self.assertEqual(r.responseHeaders.getRawHeaders(IGNORED_HEADER), [b"metadata,context_management"])
        seen.note(context_of(request()), "anthropic", ["metadata"])
        self.assertEqual(self.lines(), ["metadata", "context_management"])
        seen.note(context_of(request(b"codex_exec/0.171.0")), "anthropic", ["metadata"])  # another client
        self.assertEqual(self.lines(), ["metadata", "context_management", "metadata"])

    def test_nothing_ignored_sets_no_header(self) -> None:
        r = request()
        noted(IgnoredFields(), r, "openai", [])
        self.assertIsNone(r.responseHeaders.getRawHeaders(IGNORED_HEADER))

    def test_bounded(self) -> None:
        seen = IgnoredFields(limit=2)
        for name in ("a", "b", "c"):
            seen.note(context_of(request()), "openai", [name])
        seen.note(context_of(request()), "openai", ["a"])  # forgotten, so logged again
        self.assertEqual(self.lines(), ["a", "b", "c", "a"])

    def test_beta_values(self) -> None:
        r = request()
        r.requestHeaders.setRawHeaders(b"anthropic-beta", [b"claude-code-20250219, effort-2025-11-24"])
        self.assertEqual(beta_values(r, frozenset({"effort-2025-11-24"})), ["anthropic-beta=claude-code-20250219"])
        self.assertEqual(beta_values(request()), [])


class HostileRequestTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.events: list[dict] = []
        globalLogPublisher.addObserver(cast(ILogObserver, self.events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, self.events.append))

    def test_many_and_long_names_are_bounded(self) -> None:
        seen = IgnoredFields()
        r = request()
        noted(seen, r, "openai", [f"{i}_" + "x" * (1 << 20) for i in range(1000)])
        self.assertLessEqual(len(self.events), 65)  # 64 names and one count line
        self.assertLessEqual(sum(len(k[2]) for k in seen._seen), 64 * 100)
        header = not_none(r.responseHeaders.getRawHeaders(IGNORED_HEADER))[0]
        self.assertLessEqual(len(header), 1100)
        self.assertTrue(any("936" in str(e.get("count", "")) for e in self.events))


class SurfaceTests(SynchronousTestCase):
    """
    What a client sees in C{x-blazar-ignored}, through the real surfaces.
    """

    def test_anthropic_tool_fields(self) -> None:
        """
        A per-tool field Blazar accepts but does not act on (here
        C{eager_input_streaming}, sent by a TypeScript SDK on each tool) is
        named in the header, once, as C{tools.FIELD}.
        """
        gateway = MemoryGateway(self, FakeSupervisor(["m:latest"]), fake_engine_app("m:latest"))
        tool = {"input_schema": {"type": "object"}, "eager_input_streaming": True}
        code, headers, body = gateway.post(
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", **tool}, {"name": "g", **tool}],
            },
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders(IGNORED_HEADER), [b"tools.eager_input_streaming"])
