"""
The one error table: every domain error the gateway can answer with, and
what it means on the wire — its category, HTTP status, C{Retry-After},
the C{blazar_errors_total} kind, OpenAI's C{code} and C{param}.

Errors are raised where they happen (the registry, the supervisor,
admission, quotas, the pipeline, a translator) and travel up unchanged;
L{describe} turns any of them into a L{Problem}, and each surface has one
small function that renders a L{Problem} in its own shape. Lower layers
never build HTTP bodies, and no surface keeps a table of its own.

The errors the gateway itself defines live here too: L{BadRequest} (and the
translators' request errors, which subclass it), L{NotFound},
L{Forbidden}, L{PromptTooLong}, L{UnsupportedByModel}, L{EngineRejected};
and those a request meets at the door, before any surface sees it
(L{blazar.web.auth}, L{blazar.web.site}): L{Unauthorized}, L{Refused},
L{TooManyConnections}, and L{Forbidden} again. The door answers them by
this table too, so a status means the same thing whichever turned it away.
"""

from __future__ import annotations

import enum
from typing import Callable

import attrs

from blazar.engines.lanes import LaneError
from blazar.engines.llamacpp import EngineNotFound
from blazar.engines.supervisor import BreakerOpen, EngineCrashed, EngineError, EngineTimeout, NoCapacity
from blazar.gateway.quota import QuotaExceeded, retry_after_value
from blazar.models.create import CreateError
from blazar.models.gguf_meta import GGUFError
from blazar.models.hub import PullError
from blazar.models.registry import ModelChangeError, ModelNotFound
from blazar.postgres import StoreUnavailable


class BadRequest(ValueError):
    """
    The client's request is malformed or asks for what cannot be done
    (400, or C{status}).

    @ivar param: The offending field, or L{None}.
    @ivar status: The HTTP status (400 unless a subclass says otherwise).
    @ivar kind: Its C{blazar_errors_total} kind, or L{None} (counted by
        its status class).
    @ivar code: OpenAI's C{error.code}, or L{None}.
    """

    status = 400
    kind: str | None = None
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class NotFound(BadRequest):
    """
    Something the request names other than a model does not exist (404),
    e.g. a stored response.
    """

    status = 404


class Refused(BadRequest):
    """
    A request turned away at the door for how it came, before its body is
    read: a credential header sent twice or two that disagree, HTTP that
    does not parse (400), too slow (408), a body over its limit (413), a
    head over its limit (414, 431). The message names the limit and its
    setting.
    """

    def __init__(self, status: int, kind: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class Unauthorized(Exception):
    """
    No API key where one is needed, or one that no key has (401); the
    message says how to send one.
    """


class TooManyConnections(Exception):
    """
    A client over C{max_connections_per_ip} (503): busy for it, as when
    every slot is.

    @ivar retry_after: Seconds for C{Retry-After}.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class Unavailable(Exception):
    """
    Something the request needs cannot run on this daemon as configured
    (503); the message names the fix.
    """


class Forbidden(Exception):
    """
    The request's key may not do this operation (model management with a
    scoped key, or from the network without keys). A model outside a key's
    scope is not this but L{blazar.models.registry.ModelNotFound}
    (L{blazar.gateway.scope}).

    @ivar code: OpenAI's C{error.code}: C{insufficient_permissions} unless
        the refusal names another rule (C{host_not_allowed},
        C{origin_not_allowed}).
    """

    def __init__(self, message: str, code: str = "insufficient_permissions") -> None:
        self.code = code
        super().__init__(message)


class PromptTooLong(Exception):
    """
    The prompt plus the requested output does not fit in a slot's context
    (400). The message gives both numbers and the levers.

    @ivar param: The field at fault, as the client's API names it.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        self.param = param
        super().__init__(message)


class UnsupportedByModel(Exception):
    """
    The model is configured for something else (chat on an embedding
    model, embeddings on a chat model); the message names the config fix
    (400).
    """


class EngineRejected(Exception):
    """
    The engine answered with an error status.

    @ivar status: The engine's HTTP status.
    @ivar retry_after: Seconds its C{Retry-After} asked for (a remote's
        429), or L{None}.
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        self.status = status
        self.retry_after = retry_after
        super().__init__(message)


class Category(enum.Enum):
    """
    What kind of failure a L{Problem} is; surfaces pick their error type
    (OpenAI's C{type}, Anthropic's C{error.type}) from it.
    """

    INVALID = "invalid"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    PERMISSION = "permission"
    RATE_LIMIT = "rate_limit"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    ENGINE = "engine"
    INTERNAL = "internal"


@attrs.frozen
class Problem:
    """
    A domain error as the wire sees it.

    @ivar category: Its L{Category}.
    @ivar status: The HTTP status.
    @ivar message: What the client is told (not yet redacted for a scoped
        key: the renderer does that).
    @ivar kind: The C{blazar_errors_total} kind, or L{None} (counted by
        its status class).
    @ivar logged: Whether it is a fault worth a log line (engine failures,
        not the client's mistakes).
    @ivar code: OpenAI's C{error.code}.
    @ivar param: OpenAI's C{error.param}.
    @ivar retry_after: Seconds for C{Retry-After}, or L{None}.
    @ivar subject: What was not found, as the client spelled it (a
        model's name), for surfaces whose clients expect their own wording.
    """

    category: Category
    status: int
    message: str
    kind: str | None = None
    logged: bool = False
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None
    subject: str | None = None


def _bad_request(e: BaseException) -> Problem:
    assert isinstance(e, BadRequest)
    if e.status == 404:
        return Problem(Category.NOT_FOUND, 404, str(e), code=e.code or "not_found", param=e.param, kind=e.kind)
    return Problem(Category.INVALID, e.status, str(e), param=e.param, kind=e.kind, code=e.code)


def _engine_rejected(e: BaseException) -> Problem:
    assert isinstance(e, EngineRejected)
    if e.status == 429:  # a remote's own rate limit: the client waits as it asks
        return Problem(
            Category.RATE_LIMIT,
            429,
            str(e),
            kind="quota",
            code="rate_limit_exceeded",
            retry_after=e.retry_after if e.retry_after is not None else 1.0,
        )
    if 400 <= e.status < 500 or e.status == 501:
        # 501: the engine cannot do this for this model (no --embeddings, no FIM tokens)
        return Problem(Category.INVALID, 400 if e.status == 501 else e.status, str(e))
    return Problem(
        Category.ENGINE, 502, f"engine error ({e.status}): {e}", kind="engine_error", code="engine_error", logged=True
    )


def _model_not_found(e: BaseException) -> Problem:
    assert isinstance(e, ModelNotFound)
    spelled = e.name if len(e.name) <= 200 else e.name[:200] + "..."
    return Problem(
        Category.NOT_FOUND, 404, str(e), kind="model_not_found", code="model_not_found", param="model", subject=spelled
    )


def _pull(e: BaseException) -> Problem:
    status = int(getattr(e, "status", 500))
    if status < 500:
        return Problem(Category.NOT_FOUND if status == 404 else Category.INVALID, status, str(e))
    return Problem(Category.ENGINE, status, str(e), kind="pull_failed", code="engine_error", logged=True)


def _create(e: BaseException) -> Problem:
    status = int(getattr(e, "status", 500))
    if status < 500:
        return Problem(Category.NOT_FOUND if status == 404 else Category.INVALID, status, str(e))
    return Problem(Category.ENGINE, status, str(e), kind="create_failed", code="engine_error", logged=True)


def _retry_after(e: BaseException, default: float) -> float:
    value = getattr(e, "retry_after", None)
    return float(value) if isinstance(value, (int, float)) else default


def _unavailable(kind: str) -> Callable[[BaseException], Problem]:
    def problem(e: BaseException) -> Problem:
        return Problem(
            Category.UNAVAILABLE, 503, str(e), kind=kind, code="engine_unavailable", retry_after=_retry_after(e, 5.0)
        )

    return problem


def _engine(kind: str, code: str = "engine_error") -> Callable[[BaseException], Problem]:
    def problem(e: BaseException) -> Problem:
        return Problem(Category.ENGINE, 502, str(e), kind=kind, code=code, logged=True)

    return problem


class AllSlotsBusy(Exception):
    """
    Every slot of the model stayed busy until the request's deadline, or
    its queue is full. Surfaces answer 503 C{all_slots_busy} with
    C{Retry-After}.

    @ivar waited: Seconds the request waited.
    @ivar retry_after: Seconds after which a retry is likely to be admitted.
    """

    def __init__(self, message: str, waited: float, retry_after: float) -> None:
        self.waited = waited
        self.retry_after = retry_after
        super().__init__(message)

    @property
    def retry_after_header(self) -> bytes:
        """
        The C{Retry-After} value surfaces send.
        """
        return retry_after_value(self.retry_after)


def _busy(e: BaseException) -> Problem:
    return Problem(
        Category.BUSY, 503, str(e), kind="all_slots_busy", code="all_slots_busy", retry_after=_retry_after(e, 1.0)
    )


def _quota(e: BaseException) -> Problem:
    return Problem(
        Category.RATE_LIMIT, 429, str(e), kind="quota", code="rate_limit_exceeded", retry_after=_retry_after(e, 1.0)
    )


def _table() -> list[tuple[type[BaseException], Callable[[BaseException], Problem]]]:
    return [
        (BadRequest, _bad_request),
        (ModelChangeError, lambda e: Problem(Category.INVALID, 400, str(e))),
        (PullError, _pull),
        (CreateError, _create),
        (
            PromptTooLong,
            lambda e: Problem(
                Category.INVALID, 400, str(e), code="context_length_exceeded", param=getattr(e, "param", "messages")
            ),
        ),
        (
            UnsupportedByModel,
            lambda e: Problem(Category.INVALID, 400, str(e), code="model_not_supported", param="model"),
        ),
        (ModelNotFound, _model_not_found),
        (Unauthorized, lambda e: Problem(Category.AUTHENTICATION, 401, str(e), kind="auth", code="invalid_api_key")),
        (
            Forbidden,
            lambda e: Problem(
                Category.PERMISSION, 403, str(e), kind="forbidden", code=getattr(e, "code", "insufficient_permissions")
            ),
        ),
        (QuotaExceeded, _quota),
        (AllSlotsBusy, _busy),
        (
            TooManyConnections,
            lambda e: Problem(
                Category.BUSY,
                503,
                str(e),
                kind="too_many_connections",
                code="too_many_connections",
                retry_after=_retry_after(e, 1.0),
            ),
        ),
        (BreakerOpen, _unavailable("breaker_open")),
        (Unavailable, _unavailable("unavailable")),
        (
            StoreUnavailable,
            lambda e: Problem(
                Category.UNAVAILABLE,
                503,
                str(e),
                kind="store_unavailable",
                code="store_unavailable",
                retry_after=_retry_after(e, 5.0),
            ),
        ),
        (NoCapacity, _unavailable("no_capacity")),
        (
            EngineTimeout,
            lambda e: Problem(Category.TIMEOUT, 504, str(e), kind="wedge", code="engine_timeout", logged=True),
        ),
        (EngineCrashed, _engine("engine_crash")),
        (EngineError, _engine("engine_error")),
        (EngineNotFound, _engine("engine_not_found", "engine_not_found")),
        (LaneError, _engine("engine_not_found", "no_engine_lane")),
        (GGUFError, _engine("engine_error")),
        (EngineRejected, _engine_rejected),
    ]


_TABLE: list[tuple[type[BaseException], Callable[[BaseException], Problem]]] = []


def domain_errors() -> list[type[BaseException]]:
    """
    Every error class the table knows, most specific first.
    """
    if not _TABLE:
        _TABLE.extend(_table())
    return [cls for cls, _ in _TABLE]


def describe(error: BaseException) -> Problem:
    """
    The L{Problem} for C{error}: a domain error by the table; anything
    else (a bug) is a 500 whose message names no internals.
    """
    if not _TABLE:
        _TABLE.extend(_table())
    for cls, problem in _TABLE:
        if isinstance(error, cls):
            return problem(error)
    return Problem(Category.INTERNAL, 500, "internal error", kind=None, code="internal_error")
