"""
C{keep_alive}, the one parser every surface decodes it with: Ollama's
field, and on the OpenAI, Anthropic and Responses surfaces an extra body
field or the C{x-blazar-keep-alive} header. Pure: no reactor, no I/O.
"""

from __future__ import annotations

from typing import Any

from blazar.config import parse_duration

KEEP_ALIVE_HEADER = b"x-blazar-keep-alive"


def parse_keep_alive(value: Any) -> float | None:
    """
    A C{keep_alive} value, with Ollama's semantics (a duration string or
    seconds, L{blazar.config.parse_duration}): 0 unloads after the answer;
    negative keeps the model loaded.

    @return: Seconds; L{None} if absent.
    @raise ValueError: Not a duration; the message says what is expected.
    """
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise ValueError(f'keep_alive must be a duration like "5m" or a number of seconds, got {value!r}') from None


def keep_alive_of(body: dict[str, Any], header: bytes | None) -> float | None:
    """
    The C{keep_alive} an OpenAI or Anthropic request carries, as an extra
    body field or the C{x-blazar-keep-alive} header (L{parse_keep_alive}).

    @raise ValueError: Not a duration.
    """
    value: Any = body.get("keep_alive")
    if value is None and header is not None:
        value = header.decode("ascii", "replace")
    return parse_keep_alive(value)
