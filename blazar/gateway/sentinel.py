"""
The sentinel: what was wrong with an answer, recorded after every chat
answer, never changing its bytes (issue 21).

Codes: C{truncated} (finish_reason length), C{tool_args_invalid}
(arguments that are not a JSON object), C{tool_name_unknown} (a call of a
tool that was not offered), C{tool_args_schema} (arguments that violate
the tool's parameters), C{format_invalid} (a C{json_object} /
C{json_schema} answer, Ollama's C{format} included, that does not parse
or validate), C{empty} (no text, no call), C{reasoning_only} (reasoning
but no answer), C{stalled} (a stream with no chunk for
C{sentinel_stall_secs}; it goes on). Each is counted (C{blazar_sentinel_total{model,code}}),
written in the audit line, and on a non-streamed answer named in the
C{x-blazar-sentinel} header. With C{sentinel_enforce} (global, per model
or per key), a flagged non-streamed answer is a 422 instead; streams are
never cut.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from blazar.gateway.errors import BadRequest

CODES = ("truncated", "tool_args_invalid", "tool_name_unknown", "tool_args_schema", "format_invalid", "empty",
         "reasoning_only", "stalled")
HEADER = "x-blazar-sentinel"


class SentinelViolation(BadRequest):
    """
    C{sentinel_enforce} refused an answer: 422, naming each finding.
    """

    status = 422
    kind = "sentinel"

    def __init__(self, findings: list[tuple[str, str]]) -> None:
        super().__init__("sentinel enforce: " + "; ".join(f"[{code}] {detail}" for code, detail in findings))
        self.findings = findings


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    return {t["function"]["name"]: t["function"].get("parameters") for t in body.get("tools") or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]}


def _schema_error(value: Any, schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return e.message[:200]
    except jsonschema.SchemaError:
        return None
    return None


def inspect(
    body: dict[str, Any], finish: str | None, content: str, reasoning: str, calls: list[tuple[str, str]],
) -> list[tuple[str, str]]:
    """
    The findings on one answer: C{(code, detail)} each.

    @param body: The chat request as the engine got it (tools,
        C{response_format}).
    @param calls: C{(name, arguments)} of each tool call, arguments as sent.
    """
    found: list[tuple[str, str]] = []
    if finish == "length":
        found.append(("truncated", "the answer reached max_tokens"))
    offered = _tools(body)
    for name, arguments in calls:
        if name not in offered:
            found.append(("tool_name_unknown", f"{name!r} is not an offered tool"))
            continue
        try:
            value = json.loads(arguments) if arguments else {}
        except ValueError:
            found.append(("tool_args_invalid", f"{name}: the arguments are not JSON"))
            continue
        if not isinstance(value, dict):
            found.append(("tool_args_invalid", f"{name}: the arguments are not a JSON object"))
            continue
        error = _schema_error(value, offered[name])
        if error is not None:
            found.append(("tool_args_schema", f"{name}: {error}"))
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema") and not calls:
        try:
            value = json.loads(content)
        except ValueError:
            found.append(("format_invalid", f"the answer is not the JSON {fmt['type']} asks for"))
        else:
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            error = _schema_error(value, schema) if fmt["type"] == "json_schema" else None
            if error is not None:
                found.append(("format_invalid", f"the answer violates the json_schema: {error}"))
            elif fmt["type"] == "json_object" and not isinstance(value, dict):
                found.append(("format_invalid", "the answer is JSON but not an object"))
    if not content.strip() and not calls:
        found.append(("reasoning_only", "reasoning but no answer") if reasoning.strip()
                     else ("empty", "no text and no tool call"))
    return found


def inspect_reply(body: dict[str, Any], reply: bytes) -> list[tuple[str, str]]:
    """
    L{inspect} on a non-streamed OpenAI chat completion.
    """
    try:
        parsed = json.loads(reply)
        choice = parsed["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return []
    message = choice.get("message") or {}
    calls = [((c.get("function") or {}).get("name") or "", (c.get("function") or {}).get("arguments") or "")
             for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return inspect(body, choice.get("finish_reason"), message.get("content") or "",
                   message.get("reasoning_content") or "", calls)


class StreamWatch:
    """
    L{inspect} on an OpenAI chat stream, chunk by chunk (the arguments of
    each call gathered by C{index}).
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body
        # the answer's text matters whole only for a JSON format; else an
        # event that only carries text is not parsed (relayed streams stay
        # cheap per chunk)
        self._whole_text = isinstance(body.get("response_format"), dict)
        self._finish: str | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, list[str]] = {}

    def chunk(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._content.append(delta["content"])
            if delta.get("reasoning_content"):
                self._reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                name_args = self._calls.setdefault(int(call.get("index") or 0), ["", ""])
                function = call.get("function") or {}
                name_args[0] += function.get("name") or ""
                name_args[1] += function.get("arguments") or ""

    _held = b""
    _some_text = False

    def events(self, data: bytes) -> None:
        """
        Feed raw SSE bytes, as they come (events may be split anywhere).
        """
        data = self._held + data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._held = data
            return
        self._held = data[cut + 2:]
        for event in data[:cut].split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            if not self._whole_text and b'"tool_calls"' not in event and b'"reasoning_content"' not in event \
                    and b'"finish_reason":"' not in event and b'"finish_reason": "' not in event:
                if not self._some_text and b'"content":"' in event and b'"content":""' not in event:
                    self._some_text = True  # some text (what it says does not matter here)
                continue
            try:
                self.chunk(json.loads(event[len(b"data: "):]))
            except ValueError:
                pass

    _stalled: float | None = None

    def stalled(self, seconds: float) -> None:
        """
        No chunk came for C{seconds} (the stream went on).
        """
        self._stalled = seconds

    def findings(self) -> list[tuple[str, str]]:
        calls = [(n, a) for _, (n, a) in sorted(self._calls.items())]
        content = "".join(self._content) or ("x" if self._some_text else "")
        found = inspect(self._body, self._finish, content, "".join(self._reasoning), calls)
        if self._stalled is not None:
            found.append(("stalled", f"no chunk for {self._stalled:g} s (sentinel_stall_secs)"))
        return found
