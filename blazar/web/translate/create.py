"""
Ollama's C{POST /api/create} body to a L{CreateSpec}: the JSON form of
Ollama 0.5 and later (C{model}, C{from}, C{files}, C{adapters},
C{template}, C{system}, C{parameters}, C{messages}, C{license},
C{quantize}) and the legacy one older clients send (C{name} and a
C{modelfile} text, its C{FROM} a model or a blob uploaded first as
C{@sha256:<hex>}). Pure: no reactor, no I/O.

Refusals are Ollama's words where it has some (C{invalid model name},
C{file path must be relative}, C{invalid digest format}, C{unknown
parameter 'x'}, the Modelfile parser's) and say what to do otherwise.
"""

from __future__ import annotations

from typing import Any

from blazar.gateway.errors import BadRequest
from blazar.models.create import CreateSpec, valid_file_name
from blazar.models.modelfile import ModelfileError, check_parameters, create_fields, parse
from blazar.models.ollama_store import InvalidName, StoreError, digest_hex, parse_name
from blazar.models.quantize import QuantizeError, quant_type

# fields of Ollama's CreateRequest Blazar accepts and does not honour
_IGNORED = ("draft_files", "draft_quantize", "renderer", "parser", "requires", "info", "remote_host")
_KNOWN = {
    "model",
    "name",
    "from",
    "files",
    "adapters",
    "template",
    "system",
    "parameters",
    "messages",
    "license",
    "quantize",
    "quantization",
    "stream",
    "modelfile",
    "path",
    *_IGNORED,
}


class CreateRefused(BadRequest):
    """
    A create request Blazar cannot take (400); the message says why.
    """


def _digests(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CreateRefused(f"{field} must be an object of file name -> blob digest (sha256:<hex>)", field)
    out = {}
    for name, digest in value.items():
        if not valid_file_name(name):
            raise CreateRefused("file path must be relative", field)
        if not isinstance(digest, str) or not digest:
            raise CreateRefused("invalid digest format", field)
        try:
            out[name] = f"sha256:{digest_hex(digest)}"
        except StoreError:
            raise CreateRefused(f"invalid digest format: {digest!r} (expected sha256:<64 hex digits>)", field) from None
    return out


def _text(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise CreateRefused(f"{field} must be a string", field)
    return value


def _messages(value: Any) -> tuple[dict[str, str], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise CreateRefused("messages must be an array of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise CreateRefused(f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise CreateRefused(f"messages[{i}].content must be a string", "messages")
        out.append({"role": message["role"], "content": content})
    return tuple(out)


def _licenses(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise CreateRefused("license must be a string or an array of strings", "license")


def decode_create(body: dict[str, Any]) -> tuple[CreateSpec, list[str]]:
    """
    A create request's body as a L{CreateSpec}.

    @return: The spec, and the fields (or Modelfile commands) accepted but
        not honoured, for C{x-blazar-ignored}: C{template} (recorded and
        shown, never applied: llama-server renders with the GGUF's own chat
        template), C{renderer}, C{parser}, C{draft_files}, ...
    @raise CreateRefused: What is wrong, naming the field.
    """
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise CreateRefused("model is required", "model")
    try:
        parsed = parse_name(name)
    except InvalidName:
        raise CreateRefused("invalid model name", "model") from None
    ignored = [f for f in _IGNORED if body.get(f)] + sorted(k for k in body if k not in _KNOWN)
    if body.get("path"):
        raise CreateRefused(
            "path (a Modelfile on the server) is not supported: send the Modelfile's text as "
            "modelfile, or the JSON fields (from, files, system, parameters, ...)",
            "path",
        )
    modelfile = body.get("modelfile")
    structured = any(body.get(f) is not None for f in ("from", "files", "adapters"))
    if modelfile and not structured:
        if not isinstance(modelfile, str):
            raise CreateRefused("modelfile must be a string", "modelfile")
        try:
            fields = create_fields(parse(modelfile))
        except ModelfileError as e:
            raise CreateRefused(str(e), "modelfile") from None
        ignored += list(fields.ignored)
        request: dict[str, Any] = {
            "from": fields.source,
            "files": dict(fields.files) or None,
            "adapters": dict(fields.adapters) or None,
            "template": fields.template,
            "system": fields.system,
            "license": list(fields.license) or None,
            "parameters": dict(fields.parameters) or None,
            "messages": list(fields.messages) or None,
        }
        # the JSON fields sent beside a Modelfile win, as Ollama's client merges them
        request.update(
            {k: body[k] for k in ("template", "system", "license", "parameters", "messages") if body.get(k) is not None}
        )
    else:
        request = body
    source = _text(request, "from")
    try:
        parameters, dropped = check_parameters(request.get("parameters"))
    except ModelfileError as e:
        raise CreateRefused(str(e), "parameters") from None
    ignored += [f"parameters.{p}" for p in dropped]
    asked = body.get("quantize") or body.get("quantization")
    quantize = None
    if asked is not None and asked != "":
        if not isinstance(asked, str):
            raise CreateRefused("quantize must be a string such as q4_K_M or q8_0", "quantize")
        try:
            quantize = quant_type(asked)
        except QuantizeError as e:
            raise CreateRefused(str(e), "quantize") from None
    template = _text(request, "template")
    if template:
        ignored.append("template")
    spec = CreateSpec(
        name=parsed,
        source=source or None,
        files=_digests(request.get("files"), "files"),
        adapters=_digests(request.get("adapters"), "adapters"),
        template=template,
        system=_text(request, "system"),
        parameters=parameters,
        messages=_messages(request.get("messages")),
        license=_licenses(request.get("license")),
        quantize=quantize,
        asked_quantize=asked.upper() if isinstance(asked, str) and quantize is not None else None,
    )
    return spec, ignored
