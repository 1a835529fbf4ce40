"""
Reading what the daemon wrote as strict JSON (issue 35): every body and SSE
C{data:} line a test reads must be RFC 8259 JSON that a strict parser
(every TypeScript SDK's C{JSON.parse}) reads to the same values. Python's
C{json} takes C{NaN}, C{Infinity} and C{-Infinity}, which are not JSON, and
turns a number too large for a double into infinity (or, for an integer,
into a Python int that C{JSON.parse} reads as C{Infinity}).

L{strict_loads} is C{json.loads} with those refused by an C{AssertionError}.
The integration conftest puts it in place of C{json.loads} for the whole
session, so the test modules, L{tests.integration.harness} and the SDKs
(httpx's C{Response.json()}, the openai, anthropic and ollama stream
readers) all read strictly; and, because a library may catch the error and
carry on (the openai SDK reads an error body with C{except Exception}),
each refusal is also kept in L{REFUSED}, which the conftest checks after
every test.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_LOADS = json.loads

REFUSED: list[str] = []
"""
The message of every refusal since the list was last cleared, in order.
"""


class _Refused(Exception):
    pass


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def strict_loads(
    s: str | bytes | bytearray,
    *,
    parse_float: Callable[[str], Any] | None = None,
    parse_int: Callable[[str], Any] | None = None,
    parse_constant: Callable[[str], Any] | None = None,
    **kw: Any,
) -> Any:
    """
    C{json.loads(s, ...)}, strictly. Every keyword C{json.loads} takes keeps
    its meaning; a caller's own C{parse_float} and C{parse_int} still make
    the values, after the number is checked, and a caller's
    C{parse_constant} is never reached: every constant is refused.

    @raise AssertionError: C{s} holds C{NaN}, C{Infinity}, C{-Infinity} or
        a number (integer or not) beyond a double's range; the message
        starts with C{"not strict JSON: "}, names the value and quotes the
        document's start.
    @raise ValueError: C{s} is not JSON at all, as from C{json.loads}.
    """
    del parse_constant  # refused, whatever the caller wanted done with it

    def number(text: str) -> Any:
        if not math.isfinite(float(text)):
            raise _Refused(f"{text[:40]} is out of range of a double")
        return float(text) if parse_float is None else parse_float(text)

    def integer(text: str) -> Any:
        value = int(text)
        try:
            float(value)
        except OverflowError:
            raise _Refused(f"{text[:40]}... ({len(text)} characters) is out of range of a double") from None
        return value if parse_int is None else parse_int(text)

    try:
        return _LOADS(s, parse_float=number, parse_int=integer, parse_constant=_constant, **kw)
    except _Refused as e:
        message = f"not strict JSON: {e}: {s[:300]!r}"
        REFUSED.append(message)
        raise AssertionError(message) from None


@contextmanager
def strict_json_loads() -> Iterator[None]:
    """
    C{json.loads} is L{strict_loads} inside the block, and is put back
    after.
    """
    json.loads = strict_loads
    try:
        yield
    finally:
        json.loads = _LOADS
