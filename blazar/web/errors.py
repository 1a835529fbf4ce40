"""
What every surface does with an error before it encodes it: one
function for an error answered with its own status (L{answer}), one for an
error after a stream's headers went out (L{in_stream}); then the
L{Problem}'s envelope in each API's shape: OpenAI's (L{openai_error}: the
OpenAI and Responses surfaces, the Batch API and the dashboard),
Anthropic's (L{anthropic_error}), Ollama's (L{ollama_message}), and
L{envelope}, which picks one by surface for the door (L{blazar.web.auth}),
where no surface is reached. The table of what each error means is
L{blazar.gateway.errors}; nothing here or in a surface keeps another.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from blazar import strictjson
from blazar.gateway.context import note_error, trace_id_of
from blazar.gateway.errors import Category, EngineRejected, Problem, describe
from blazar.gateway.scope import redact
from blazar.web.client import context_of, retry_after

log = Logger()


def answer(request: Any, error: BaseException | None, surface: str) -> Problem | None:
    """
    The L{Problem} to answer C{error} with, its side effects done: the
    metrics kind noted, C{Retry-After} set, the message redacted for a
    scoped key, a fault logged (a bug with its traceback), the status set.
    A client's departure is answered with nothing (L{None}).

    Routing errors (no such path, wrong method) are problems too: 404 and
    405.
    """
    if error is None or isinstance(error, CancelledError):
        return None
    if isinstance(error, (NotFound, RequestRedirect)):
        problem = Problem(
            Category.NOT_FOUND,
            404,
            f"no route for {request.path.decode('ascii', 'replace')}",
            code="not_found",
            subject="route",
        )
    elif isinstance(error, MethodNotAllowed):
        problem = Problem(
            Category.INVALID,
            405,
            f"method {request.method.decode('ascii', 'replace')} not allowed here",
            code="method_not_allowed",
            subject="route",
        )
    else:
        problem = describe(error)
        if problem.category is Category.INTERNAL:
            log.failure("unexpected error", _failure(error), trace_id=trace_id_of(context_of(request)), surface=surface)
            problem = Problem(
                Category.INTERNAL,
                500,
                f"internal error (trace id {trace_id_of(context_of(request))})",
                code="internal_error",
            )
        elif problem.logged:
            log.error("{error}", error=_logged(error), trace_id=trace_id_of(context_of(request)), surface=surface)
        note_error(context_of(request), problem.kind)
    if problem.retry_after is not None:
        retry_after(request, problem.retry_after)
    request.setResponseCode(problem.status)
    request.setHeader(b"content-type", b"application/json")
    return _redacted(request, problem)


def in_stream(
    request: Any,
    error: BaseException,
    model: str,
    surface: str,
    headers_out: bool = True,
) -> Problem:
    """
    The L{Problem} to end a stream with whose headers are out (an error
    event, line or chunk: an error body now would be read as events): the
    metrics kind noted, the failure logged (a bug with its traceback,
    under a message that names no internals). Call it in an C{except}.

    @param headers_out: Whether the stream's headers went out; if not, the
        error is raised again, to be answered with a status of its own.
    @raise BaseException: C{error} again, when the headers are not out or
        it is a client's departure (which ends nothing).
    """
    if not headers_out or isinstance(error, CancelledError):
        raise error
    problem = describe(error)
    if problem.category is Category.INTERNAL:
        log.failure(
            "{surface} stream for {model} broke",
            _failure(error),
            surface=surface,
            model=model,
            trace_id=trace_id_of(context_of(request)),
        )
        note_error(context_of(request), "5xx")
        return Problem(Category.INTERNAL, 500, "internal error; see the daemon log", code="internal_error")
    log.error(
        "{surface} stream for {model} failed: {error}",
        surface=surface,
        model=model,
        error=_logged(error),
        trace_id=trace_id_of(context_of(request)),
    )
    # the status is the stream's 200: a kind is noted for every failure, or
    # the metrics would not count it (an engine's own 4xx is an engine_error)
    kind = problem.kind or ("engine_error" if isinstance(error, EngineRejected) else f"{problem.status // 100}xx")
    note_error(context_of(request), kind)
    return _redacted(request, problem)


def _redacted(request: Any, problem: Problem) -> Problem:
    message = redact(context_of(request), problem.message)
    return problem if message == problem.message else attrs.evolve(problem, message=message)


def _logged(error: BaseException) -> str:
    """
    C{error} as the daemon's log tells it: its message, and its
    C{log_detail} where it has one (what only the log may hold: the path of
    an unreadable model file, L{blazar.models.registry.ModelUnreadable}).
    """
    detail = getattr(error, "log_detail", None)
    return f"{error} ({detail})" if detail else str(error)


def _failure(error: BaseException) -> Failure:
    return Failure(error, type(error), error.__traceback__)


# each category's error type: (OpenAI's, Anthropic's)
_TYPES = {
    Category.INVALID: ("invalid_request_error", "invalid_request_error"),
    Category.AUTHENTICATION: ("invalid_request_error", "authentication_error"),
    Category.NOT_FOUND: ("invalid_request_error", "not_found_error"),
    Category.PERMISSION: ("invalid_request_error", "permission_error"),
    Category.RATE_LIMIT: ("rate_limit_error", "rate_limit_error"),
    Category.BUSY: ("server_error", "overloaded_error"),
    Category.UNAVAILABLE: ("engine_unavailable", "overloaded_error"),
    Category.TIMEOUT: ("engine_error", "api_error"),
    Category.ENGINE: ("engine_error", "api_error"),
    Category.INTERNAL: ("server_error", "api_error"),
}


def openai_error(problem: Problem) -> bytes:
    """
    A L{Problem} in OpenAI's envelope, C{{"error": {"message", "type",
    "param", "code"}}}, encoded: the answer's body, or a stream's error
    event's data (the same C{type} and C{code} either way).
    """
    return strictjson.encode(
        {
            "error": {
                "message": problem.message,
                "type": _TYPES[problem.category][0],
                "param": problem.param,
                "code": problem.code,
            }
        }
    ).encode("utf-8")


# Anthropic's statuses where they differ from the table's: 529 for an
# overloaded API, 500 for its own failures
_ANTHROPIC_STATUSES = {Category.UNAVAILABLE: 529, Category.ENGINE: 500}
# what a request at fault keeps on Anthropic's surface (any other, an
# engine's 404 or 422, is its one 400): HTTP's own refusals, and the
# sentinel's 422
_ANTHROPIC_KEPT = (400, 405, 408, 413, 414, 431)


def anthropic_type(problem: Problem) -> str:
    """
    Anthropic's C{error.type} for a L{Problem}.
    """
    return "request_too_large" if problem.status == 413 else _TYPES[problem.category][1]


def anthropic_status(problem: Problem) -> int:
    """
    The status a L{Problem} is answered with on Anthropic's surface.
    """
    if problem.category in _ANTHROPIC_STATUSES:
        return _ANTHROPIC_STATUSES[problem.category]
    if problem.category is Category.INVALID and problem.status not in _ANTHROPIC_KEPT and problem.kind != "sentinel":
        return 400
    return problem.status


def anthropic_error(problem: Problem) -> bytes:
    """
    A L{Problem} in Anthropic's envelope, C{{"type": "error", "error":
    {"type", "message"}}}, encoded.
    """
    message = problem.message
    if problem.kind == "model_not_found":
        message = f"model: {problem.subject} ({problem.message})"  # Anthropic's wording
    return strictjson.encode({"type": "error", "error": {"type": anthropic_type(problem), "message": message}}).encode(
        "utf-8"
    )


def ollama_message(problem: Problem) -> str:
    """
    A L{Problem}'s message in Ollama's words (its shape is
    C{{"error": message}}).
    """
    if problem.subject == "route":
        return "404 page not found" if problem.status == 404 else "405 method not allowed"
    if problem.kind == "model_not_found":
        return f'model "{problem.subject}" not found, try pulling it first'  # clients look for it
    return problem.message


def envelope(surface: str, problem: Problem) -> tuple[int, bytes]:
    """
    The status and body that answer a L{Problem} on C{surface}
    (L{blazar.web.auth.surface_of}): C{"ollama"}, C{"anthropic"}, or
    OpenAI's shape for C{"openai"}, C{"responses"} and C{"ui"}.
    """
    if surface == "ollama":
        return problem.status, strictjson.encode({"error": ollama_message(problem)}).encode("utf-8")
    if surface == "anthropic":
        return anthropic_status(problem), anthropic_error(problem)
    return problem.status, openai_error(problem)
