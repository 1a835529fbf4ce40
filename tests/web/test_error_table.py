"""
Every domain error through every surface: the status, the surface's own
error shape, C{Retry-After} and the C{blazar_errors_total} kind, all from
the one table (L{blazar.gateway.errors}). The expectations are written out
here, not derived from the table, so a change to the table that changes
what a client gets fails this test; and every class the table knows must
appear below, so a new domain error cannot go untested.

Through the real surfaces and the real pipeline in memory (StubTreq): the
error is raised where a child would be found, after scope, purpose,
preflight and admission ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.lanes import LaneError
from blazar.engines.llamacpp import EngineNotFound
from blazar.engines.supervisor import (
    BreakerOpen,
    EngineCrashed,
    EngineError,
    EngineStartFailed,
    EngineTimeout,
    NoCapacity,
)
from blazar.gateway.admission import AllSlotsBusy
from blazar.gateway.errors import (
    BadRequest,
    EngineRejected,
    Forbidden,
    NotFound,
    PromptTooLong,
    Refused,
    TooManyConnections,
    Unauthorized,
    Unavailable,
    UnsupportedByModel,
    domain_errors,
)
from blazar.gateway.quota import QuotaExceeded
from blazar.models.create import CreateError
from blazar.models.gguf_meta import GGUFError
from blazar.models.hub import PullError
from blazar.models.registry import ModelChangeError, ModelNotFound, ModelUnreadable
from blazar.postgres import StoreUnavailable
from blazar.testing import FakeInstance, FakeSupervisor, fake_engine_app
from tests.web.gateway import MemoryGateway

HELLO = [{"role": "user", "content": "hi"}]
SURFACES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": ("/v1/chat/completions", {"model": "m", "messages": HELLO}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi"}),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": HELLO}),
    "ollama": ("/api/chat", {"model": "m", "messages": HELLO, "stream": False}),
}


class Bug(Exception):
    """
    Stands for a bug: no domain error.
    """


# error, (status, Anthropic's status), Retry-After, metrics kind (None:
# counted by its status class), OpenAI's error type and code
CASES: list[tuple[Exception, tuple[int, int], str | None, str | None, str, str | None]] = [
    (BadRequest("bad field", "f"), (400, 400), None, None, "invalid_request_error", None),
    (NotFound("no such thing", "id"), (404, 404), None, None, "invalid_request_error", "not_found"),
    (PromptTooLong("too long: shorten it"), (400, 400), None, None, "invalid_request_error", "context_length_exceeded"),
    (UnsupportedByModel("an embedding model"), (400, 400), None, None, "invalid_request_error", "model_not_supported"),
    (
        ModelNotFound("nope", ["m:latest"]),
        (404, 404),
        None,
        "model_not_found",
        "invalid_request_error",
        "model_not_found",
    ),
    (Forbidden("scoped key"), (403, 403), None, "forbidden", "invalid_request_error", "insufficient_permissions"),
    (
        Forbidden("not this machine's page", code="origin_not_allowed"),
        (403, 403),
        None,
        "forbidden",
        "invalid_request_error",
        "origin_not_allowed",
    ),
    (Unauthorized("missing API key"), (401, 401), None, "auth", "invalid_request_error", "invalid_api_key"),
    (
        Refused(400, "bad_request", "x-api-key sent twice"),
        (400, 400),
        None,
        "bad_request",
        "invalid_request_error",
        None,
    ),
    (
        Refused(408, "timeout", "headers too slow", code="request_timeout"),
        (408, 408),
        None,
        "timeout",
        "invalid_request_error",
        "request_timeout",
    ),
    (
        Refused(413, "too_large", "body too large", code="request_too_large"),
        (413, 413),
        None,
        "too_large",
        "invalid_request_error",
        "request_too_large",
    ),
    (
        Refused(431, "headers_too_large", "headers too large", code="request_header_fields_too_large"),
        (431, 431),
        None,
        "headers_too_large",
        "invalid_request_error",
        "request_header_fields_too_large",
    ),
    (ModelChangeError("in use"), (400, 400), None, None, "invalid_request_error", None),
    (PullError("no such repo", 404), (404, 404), None, None, "invalid_request_error", None),
    (PullError("not a GGUF repo", 400), (400, 400), None, None, "invalid_request_error", None),
    (PullError("hub unreachable", 502), (502, 500), None, "pull_failed", "engine_error", "engine_error"),
    (CreateError("blob sha256:ab is not on this server", 404), (404, 404), None, None, "invalid_request_error", None),
    (
        CreateError("quantization is only supported for F16, BF16 and F32 models"),
        (400, 400),
        None,
        None,
        "invalid_request_error",
        None,
    ),
    (CreateError("llama-quantize failed", 500), (500, 500), None, "create_failed", "engine_error", "engine_error"),
    (QuotaExceeded("over the rpm limit", 7.2), (429, 429), "8", "quota", "rate_limit_error", "rate_limit_exceeded"),
    (AllSlotsBusy("all slots busy", 3.0, 2.5), (503, 503), "3", "all_slots_busy", "server_error", "all_slots_busy"),
    (
        TooManyConnections("too many connections from 10.1.2.3"),
        (503, 503),
        "1",
        "too_many_connections",
        "server_error",
        "too_many_connections",
    ),
    (
        BreakerOpen("m:latest", "crashed too often", 30.0),
        (503, 529),
        "30",
        "breaker_open",
        "engine_unavailable",
        "engine_unavailable",
    ),
    (
        NoCapacity("m:latest", "does not fit"),
        (503, 529),
        "5",
        "no_capacity",
        "engine_unavailable",
        "engine_unavailable",
    ),
    (
        Unavailable("cannot run here: set a shorter data_dir"),
        (503, 529),
        "5",
        "unavailable",
        "engine_unavailable",
        "engine_unavailable",
    ),
    (
        StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: connection refused"),
        (503, 529),
        "5",
        "store_unavailable",
        "engine_unavailable",
        "store_unavailable",
    ),
    (EngineTimeout("m:latest", "wedged"), (504, 504), None, "wedge", "engine_error", "engine_timeout"),
    (EngineCrashed("m:latest", "died"), (502, 500), None, "engine_crash", "engine_error", "engine_error"),
    (
        EngineStartFailed("m:latest", "exited while loading"),
        (502, 500),
        None,
        "engine_error",
        "engine_error",
        "engine_error",
    ),
    (EngineError("m:latest", "unreachable"), (502, 500), None, "engine_error", "engine_error", "engine_error"),
    (
        EngineNotFound("no llama-server: run scripts/build-engine.sh"),
        (502, 500),
        None,
        "engine_not_found",
        "engine_error",
        "engine_not_found",
    ),
    (
        LaneError("st:latest", "no engine lane serves safetensors"),
        (502, 500),
        None,
        "engine_not_found",
        "engine_error",
        "no_engine_lane",
    ),
    (GGUFError(Path("m.gguf"), "is truncated"), (502, 500), None, "engine_error", "engine_error", "engine_error"),
    (
        ModelUnreadable("m:latest", GGUFError(Path("/srv/models/m.gguf"), "cannot be read (Permission denied)")),
        (502, 500),
        None,
        "engine_error",
        "engine_error",
        "engine_error",
    ),
    (EngineRejected(400, "bad grammar"), (400, 400), None, None, "invalid_request_error", None),
    (EngineRejected(404, "no such slot"), (404, 400), None, None, "invalid_request_error", None),
    (EngineRejected(501, "no FIM tokens"), (400, 400), None, None, "invalid_request_error", None),
    (EngineRejected(500, "llama-server broke"), (502, 500), None, "engine_error", "engine_error", "engine_error"),
    (Bug("secret internals"), (500, 500), None, None, "server_error", "internal_error"),
]

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


def test_every_domain_error_has_a_case() -> None:
    covered = {type(error) for error, *_ in CASES}
    missing = [cls.__name__ for cls in domain_errors() if cls not in covered]
    assert not missing, f"add these to CASES: {missing}"


class Failing(FakeSupervisor):
    failure: Exception | None = None

    async def instance_for(self, name: str, ctx_size: int | None = None) -> FakeInstance:
        if self.failure is not None:
            raise self.failure
        return await super().instance_for(name, ctx_size)


class ErrorTableTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.supervisor = Failing(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, fake_engine_app("m:latest"))

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
        status, headers, data = self.gateway.post(path, body)
        return status, headers, json.loads(data)

    def test_every_error_through_every_surface(self) -> None:
        for error, (status, anthropic_status), retry, kind, openai_type, code in CASES:
            self.supervisor.failure = error
            for surface, (path, body) in SURFACES.items():
                where = f"{type(error).__name__}({error}) on {surface}"
                got, headers, answer = self.post(path, body)
                expected = anthropic_status if surface == "anthropic" else status
                self.assertEqual(got, expected, where)
                self.assertEqual(headers.getRawHeaders(b"retry-after"), [retry.encode()] if retry else None, where)
                self.assertEqual(self.gateway.context().error, kind, where)
                message = str(error) if not isinstance(error, Bug) else "internal error"
                if surface in ("openai", "responses"):
                    self.assertEqual(set(answer), {"error"}, where)
                    self.assertEqual(set(answer["error"]), {"message", "type", "param", "code"}, where)
                    self.assertEqual((answer["error"]["type"], answer["error"]["code"]), (openai_type, code), where)
                    text = answer["error"]["message"]
                elif surface == "anthropic":
                    self.assertEqual(answer["type"], "error", where)
                    self.assertEqual(answer["error"]["type"], ANTHROPIC_TYPES[expected], where)
                    self.assertTrue(headers.getRawHeaders(b"request-id")[0].startswith(b"req_"), where)
                    text = answer["error"]["message"]
                else:
                    self.assertEqual(set(answer), {"error"}, where)
                    text = answer["error"]
                if isinstance(error, ModelNotFound) and surface == "ollama":
                    self.assertEqual(text, 'model "nope" not found, try pulling it first', where)
                else:
                    self.assertIn(message, text, where)
                self.assertNotIn("secret internals", text, where)
                self.assertNotIn("/srv/models", text, where)  # a server's paths: its log only
        self.assertEqual(len(self.flushLoggedErrors(Bug)), len(SURFACES))

    def test_nan_is_refused_on_every_surface(self) -> None:
        for surface, (path, body) in SURFACES.items():
            raw = json.dumps({**body, "temperature": float("nan")}).encode()
            self.assertIn(b"NaN", raw)
            status, _, data = self.gateway.post(path, body, raw)
            self.assertEqual(status, 400, surface)
            self.assertIn(b"NaN is not a JSON number", data, surface)


@pytest.mark.parametrize("error", [c[0] for c in CASES], ids=lambda e: type(e).__name__)
def test_a_problem_never_leaks_a_bugs_message(error: Exception) -> None:
    from blazar.gateway.errors import describe

    problem = describe(error)
    if isinstance(error, Bug):
        assert "secret" not in problem.message
    else:
        assert str(error) in problem.message
