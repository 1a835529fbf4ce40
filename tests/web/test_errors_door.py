"""
The door and the surfaces answer from one error table
(L{blazar.gateway.errors}): a request the door turns away (no key, another
site's page, a head too large, too many connections, a key's concurrency
quota) gets, on each surface and on the dashboard, the status,
C{Retry-After} and body the surface gives for the same domain error raised
past the door, in that surface's one envelope.
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.gateway.errors import BadRequest, Forbidden, Refused, TooManyConnections, Unauthorized
from blazar.gateway.quota import QuotaExceeded
from blazar.testing import fake_engine_app
from blazar.web.auth import render_refusal
from blazar.web.dashboard import Dashboard
from tests.typed import StubTreq
from tests.web.gateway import MemoryGateway
from tests.web.test_error_table import SURFACES, Failing

DOOR: list[Exception] = [
    Unauthorized("missing API key: send it as `Authorization: Bearer <key>` or `x-api-key`"),
    Forbidden("the page at 'https://evil.example' is not this machine's", code="origin_not_allowed"),
    Refused(400, "bad_request", "the x-api-key header was sent 2 times; send it once"),
    Refused(408, "timeout", "the request's headers did not arrive within 10 s", code="request_timeout"),
    Refused(413, "too_large", "request body too large: the limit is 1024 bytes", code="request_too_large"),
    Refused(431, "headers_too_large", "request headers too large", code="request_header_fields_too_large"),
    TooManyConnections("too many connections from 10.1.2.3: at most max_connections_per_ip = 2"),
    QuotaExceeded("key 'k' already has 1 request(s) running (max_concurrent)", 1.0),
]


def at_the_door(path: str, error: Exception) -> tuple[int, list[bytes] | None, Any]:
    """
    The status, C{Retry-After} and decoded body the door answers C{error}
    with for a request to C{path}.
    """
    request = DummyRequest([b""])
    cast(Any, request).path = path.encode()  # the door reads it; DummyRequest does not declare it
    body = render_refusal(cast(IRequest, request), error)
    retry = request.responseHeaders.getRawHeaders(b"retry-after")
    return int(request.responseCode or 0), None if retry is None else list(retry), json.loads(body)


class DoorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.supervisor = Failing(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, fake_engine_app("m:latest"))

    def test_the_door_answers_as_each_surface_would(self) -> None:
        for error in DOOR:
            self.supervisor.failure = error
            for surface, (path, body) in SURFACES.items():
                where = f"{type(error).__name__}({error}) on {surface}"
                status, headers, data = self.gateway.post(path, body)
                self.assertEqual(
                    at_the_door(path, error), (status, headers.getRawHeaders(b"retry-after"), json.loads(data)), where
                )

    def test_a_401_names_the_scheme(self) -> None:
        request = DummyRequest([b""])
        cast(Any, request).path = b"/v1/models"
        render_refusal(cast(IRequest, request), DOOR[0])
        self.assertEqual(request.responseHeaders.getRawHeaders(b"www-authenticate"), [b'Bearer realm="blazar"'])

    def test_anthropic_keeps_https_own_refusals_statuses(self) -> None:
        for error, status in [(DOOR[3], 408), (DOOR[5], 431), (Refused(414, "headers_too_large", "too long"), 414)]:
            self.assertEqual(at_the_door("/v1/messages", error)[0], status)
            self.assertEqual(at_the_door("/v1/messages", error)[2]["error"]["type"], "invalid_request_error")


class DashboardTests(SynchronousTestCase):
    """
    The dashboard's errors are in OpenAI's envelope, as the door's
    refusals of its requests are (its page reads C{error.message}).
    """

    def test_its_errors_are_the_doors_envelope(self) -> None:
        for error in [BadRequest("no such model", "model"), Forbidden("scoped key"), *DOOR]:

            async def history(model: str | None, limit: int, error: Exception = error) -> list[dict[str, Any]]:
                raise error

            dashboard = Dashboard(
                cast(Any, None),
                cast(Any, None),
                cast(Any, None),
                Clock(),
                lambda: 0.0,
                cast(Any, lambda: None),
                bench=history,
            )
            response = self.successResultOf(StubTreq(dashboard.app.resource()).get("http://127.0.0.1/ui/api/bench"))
            data = json.loads(self.successResultOf(response.content()))
            self.assertEqual(set(data["error"]), {"message", "type", "param", "code"}, error)
            self.assertIn(str(error), data["error"]["message"])
            self.assertEqual(
                (response.code, response.headers.getRawHeaders(b"retry-after"), data),
                at_the_door("/ui/api/bench", error),
                error,
            )
