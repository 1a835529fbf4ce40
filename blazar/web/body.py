"""
Decoding a request's JSON body, the same way on every surface: RFC 8259
JSON (C{NaN}, C{Infinity} and numbers beyond a double, which Python's
C{json} takes, are refused: they are not JSON, and they would be echoed
back), an object at the top; and a multipart form (L{read_form}).
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

from blazar import strictjson
from blazar.gateway.errors import BadRequest


def json_object(raw: bytes, empty_ok: bool = False) -> dict[str, Any]:
    """
    The request body's JSON object.

    @param empty_ok: An empty body is C{{}} (Ollama's management routes).
    @raise BadRequest: Not JSON, or not an object.
    """
    if empty_ok and not raw.strip():
        return {}
    try:
        body = strictjson.loads(raw)
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


FILE_FIELDS = frozenset({"file", "image", "image[]", "mask"})  # uploads even without a filename


class Upload(NamedTuple):
    """
    One file part of a C{multipart/form-data} body.
    """

    filename: str
    content_type: str
    data: bytes


def read_form(request: Any) -> tuple[dict[str, list[str]], dict[str, list[Upload]]]:
    """
    A C{multipart/form-data} body (RFC 7578; what OpenAI's audio and image
    edit endpoints take), parsed by the C{multipart} library: text fields
    and file parts by name, in order. The body is already capped by the
    site (C{max_body_bytes}).

    @raise BadRequest: Not multipart, or malformed.
    """
    import multipart

    header = request.getHeader(b"content-type") or ""
    kind, options = multipart.parse_options_header(header if isinstance(header, str) else header.decode("latin-1"))
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise BadRequest(
            "this endpoint takes multipart/form-data (a file upload with its fields), "
            f"not {kind or 'a body without a content-type'}"
        )
    content = request.content
    raw = content.read() if content is not None else b""
    fields: dict[str, list[str]] = {}
    files: dict[str, list[Upload]] = {}
    try:
        parser = multipart.MultipartParser(
            io.BytesIO(raw),
            options["boundary"],
            len(raw),
            strict=True,
            memory_limit=len(raw) + 1,
            spool_limit=len(raw) + 1,
            part_limit=256,
        )
        for part in parser:
            if part.filename is not None or part.name in FILE_FIELDS:
                files.setdefault(part.name, []).append(Upload(part.filename or "", part.content_type or "", part.raw))
            else:
                value = part.value
                value.encode("utf-8")  # a lone surrogate (from a utf-7 part, say) is not text
                fields.setdefault(part.name, []).append(value)
    except (multipart.MultipartError, UnicodeError, ValueError, LookupError) as e:
        raise BadRequest(f"malformed multipart/form-data body: {e}") from None
    return fields, files
