"""
What a surface decodes from a request's headers for its call
(L{blazar.web.client.asked_of}): the gateway reads the decoded facts,
never the headers.
"""

from __future__ import annotations

from typing import cast

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.gateway.call import Asked
from blazar.gateway.priority import Priority
from blazar.web.client import asked_of


def request(**headers: bytes) -> IRequest:
    made = DummyRequest([b"v1"])
    for name, value in headers.items():
        made.requestHeaders.addRawHeader(name.replace("_", "-"), value)
    return cast(IRequest, made)  # DummyRequest declares no interface


class AskedTests(SynchronousTestCase):
    def test_nothing_asked(self) -> None:
        self.assertEqual(asked_of(request()), Asked(Priority.NORMAL, None, None))

    def test_priority_and_deadline(self) -> None:
        asked = asked_of(request(x_blazar_priority=b"High", x_blazar_deadline_ms=b"1500"))
        self.assertEqual((asked.priority, asked.deadline), (Priority.HIGH, 1.5))

    def test_the_session_header_first_then_the_hint(self) -> None:
        self.assertEqual(asked_of(request(x_blazar_session=b"mine"), "hint").session, "mine")
        self.assertEqual(asked_of(request(x_claude_code_session_id=b"cc"), "hint").session, "cc")
        self.assertEqual(asked_of(request(), "hint").session, "hint")

    def test_a_session_header_that_is_not_utf8_still_names_one(self) -> None:
        self.assertEqual(asked_of(request(x_blazar_session=b"caf\xe9")).session, "caf\ufffd")

    def test_the_first_of_repeated_session_headers(self) -> None:
        made = request(x_blazar_session=b"one")
        made.requestHeaders.addRawHeader(b"x-blazar-session", b"two")
        self.assertEqual(asked_of(made).session, "one")
