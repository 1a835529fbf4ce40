"""
Decoding a request's JSON body, the same way on every surface: RFC 8259
JSON (C{NaN} and C{Infinity}, which Python's C{json} takes, are refused:
they are not JSON, and they would be echoed back), an object at the top.
"""

from __future__ import annotations

import json
from typing import Any

from blazar.gateway.errors import BadRequest


class _NotJSON(Exception):
    pass


def _refuse(name: str) -> Any:
    raise _NotJSON(name)


_DECODER = json.JSONDecoder(parse_constant=_refuse)


def json_object(raw: bytes, empty_ok: bool = False) -> dict[str, Any]:
    """
    The request body's JSON object.

    @param empty_ok: An empty body is C{{}} (Ollama's management routes).
    @raise BadRequest: Not JSON, or not an object.
    """
    if empty_ok and not raw.strip():
        return {}
    try:
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except _NotJSON as e:
        raise BadRequest(f"request body is not valid JSON: {e} is not a JSON number") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def read_json(request: Any, empty_ok: bool = False) -> dict[str, Any]:
    """
    L{json_object} of C{request}'s body.
    """
    content = request.content
    return json_object(content.read() if content is not None else b"", empty_ok)
