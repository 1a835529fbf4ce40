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

from blazar import strictjson
from blazar.gateway.errors import BadRequest

# Tool-call syntax engines lift into C{tool_calls} (Hermes/Qwen, Mistral,
# Llama 3.x, Functionary, DeepSeek, Kimi). When tools were offered, text
# that still holds one (outside code: a fence, a `span`) after
# the engine's parse is a call that did not become one: the model's own
# decision (auto tool choice), judged, never rewritten (issue 21, point 4).
# Without tools, such text is prose about the syntax, and not judged.
CALL_MARKERS = (
    "<tool_call>",
    "<|tool_call|>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<function=",
    "<\uff5ctool\u2581calls\u2581begin\uff5c>",
    "<|tool_calls_section_begin|>",
)
# llama-server's error when the model's output does not fit the format its
# parser expects (tool-call syntax that went wrong): an answer, not a fault
UNPARSED = "The model produced output that does not match the expected"
UNPARSED_BYTES = UNPARSED.encode()
CODES = (
    "truncated",
    "tool_args_invalid",
    "tool_name_unknown",
    "tool_args_schema",
    "format_invalid",
    "empty",
    "reasoning_only",
    "stalled",
)
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
    return {
        t["function"]["name"]: t["function"].get("parameters")
        for t in body.get("tools") or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
    }


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


def _check_call(offered: dict[str, Any], name: str, arguments: Any, found: list[tuple[str, str]]) -> None:
    if name not in offered:
        found.append(("tool_name_unknown", f"{name!r} is not an offered tool"))
        return
    if isinstance(arguments, str):
        try:
            arguments = strictjson.loads(arguments) if arguments else {}
        except ValueError:
            found.append(("tool_args_invalid", f"{name}: the arguments are not JSON"))
            return
    if not isinstance(arguments, dict):
        found.append(("tool_args_invalid", f"{name}: the arguments are not a JSON object"))
        return
    error = _schema_error(arguments, offered[name])
    if error is not None:
        found.append(("tool_args_schema", f"{name}: {error}"))


def _call_lines(content: str) -> list[tuple[str, int]]:
    """
    C{(marker, offset)} of each call marker outside code: not in a fenced
    block, not in an inline C{`code`} span.
    """
    found = []
    fenced = False
    offset = 0
    for line in content.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            for marker in CALL_MARKERS:
                at = line.find(marker)
                while at >= 0:
                    if line.count("`", 0, at) % 2 == 0:
                        found.append((marker, offset + at))
                    at = line.find(marker, at + len(marker))
        offset += len(line)
    return sorted(found, key=lambda f: f[1])


def _calls_in_text(offered: dict[str, Any], content: str, found: list[tuple[str, str]]) -> None:
    """
    Tool-call syntax left in the answer's text (L{CALL_MARKERS}): a
    C{<tool_call>} whose JSON names a call is judged as a call (name,
    arguments); one that is not JSON, or another engine's marker, is
    C{tool_args_invalid}.
    """
    judged: list[tuple[str, str]] = []
    for marker, at in _call_lines(content):
        if len(judged) >= 3:  # enough to say so (a garbled answer can repeat a marker hundreds of times)
            break
        if marker != "<tool_call>":
            judged.append(("tool_args_invalid", f"the text holds {marker} that the engine did not parse as a call"))
            continue
        start = at + len(marker)
        end = content.find("</tool_call>", start)
        inner = content[start : end if end >= 0 else len(content)].strip()
        try:
            value = json.loads(inner)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            _check_call(offered, value["name"], value.get("arguments", value.get("parameters", {})), judged)
        else:
            judged.append(
                (
                    "tool_args_invalid",
                    "the text holds a <tool_call> that does not parse" + ("" if end >= 0 else " (never closed)"),
                )
            )
    found.extend(judged)


def inspect(
    body: dict[str, Any],
    finish: str | None,
    content: str,
    reasoning: str,
    calls: list[tuple[str, str]],
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
        _check_call(offered, name, arguments, found)
    if offered and ("<" in content or "[TOOL_CALLS]" in content):
        _calls_in_text(offered, content, found)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema") and not calls:
        try:
            value = strictjson.loads(content)  # (a number beyond a double is not JSON a client can read)
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
        found.append(
            ("reasoning_only", "reasoning but no answer")
            if reasoning.strip()
            else ("empty", "no text and no tool call")
        )
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
    calls = [
        ((c.get("function") or {}).get("name") or "", (c.get("function") or {}).get("arguments") or "")
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    return inspect(
        body, choice.get("finish_reason"), message.get("content") or "", message.get("reasoning_content") or "", calls
    )


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
        # (or tools were offered: call syntax in the text is judged)
        self._whole_text = isinstance(body.get("response_format"), dict) or bool(body.get("tools"))
        self._finish: str | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, list[str]] = {}
        self.last: dict[str, Any] | None = None  # the last chunk parsed
        self.deltas = 0  # events seen with text or a call (about one token each)

    def chunk(self, chunk: dict[str, Any]) -> None:
        self.last = chunk
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
        data = self._held + data if self._held else data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._held = data
            return
        self._held = data[cut + 2 :]
        self.whole(data[: cut + 2])

    def whole(self, events: bytes) -> None:
        """
        Feed whole SSE events (C{events} ends where an event does): for a
        relay that buffered them already, and never fed L{events} a part
        of one.

        Only what the findings need is read from the bytes: an event that
        carries nothing but text is not parsed unless the text matters whole
        (L{_whole_text}); finish reasons, tool-call fragments and reasoning
        are.
        """
        whole_text = self._whole_text
        for event in events.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            if b'"delta":{}' not in event and b'"role":"assistant","content":null' not in event:
                self.deltas += 1
            if (
                not whole_text
                and b'"tool_calls"' not in event
                and b'"reasoning_content"' not in event
                and b'"finish_reason":"' not in event
                and b'"finish_reason": "' not in event
            ):
                if not self._some_text and b'"content":"' in event and b'"content":""' not in event:
                    # read until the text holds more than whitespace (whitespace
                    # alone is no answer); after that, what it says does not matter
                    try:
                        self.chunk(strictjson.parse(event[6:]))
                    except ValueError:
                        pass
                    self._some_text = bool("".join(self._content).strip())
                continue
            try:
                self.chunk(strictjson.parse(event[6:]))
            except ValueError:
                pass

    def text(self) -> str:
        """
        What the stream carried that the model wrote: text, reasoning, call
        arguments (whole only when L{_whole_text}).
        """
        return "".join(self._content) + "".join(self._reasoning) + "".join(n + a for n, a in self._calls.values())

    _stalled: float | None = None
    noted: tuple[str, str] | None = None  # a finding the relay made (L{unparsed_end})

    def stalled(self, seconds: float) -> None:
        """
        No chunk came for C{seconds} (the stream went on).
        """
        self._stalled = seconds

    def findings(self) -> list[tuple[str, str]]:
        calls = [(n, a) for _, (n, a) in sorted(self._calls.items())]
        content = "".join(self._content) or ("x" if self._some_text else "")
        found = inspect(self._body, self._finish, content, "".join(self._reasoning), calls)
        if self.noted is not None:
            found.append(self.noted)
        if self._stalled is not None:
            found.append(("stalled", f"no chunk for {self._stalled:g} s (sentinel_stall_secs)"))
        return found


def is_unparsed(event: bytes) -> bool:
    """
    Whether one SSE event is llama-server's in-stream L{UNPARSED} error
    (a top-level C{error} object with that message; text that merely
    quotes it is not).
    """
    if not event.startswith(b"data: {") or UNPARSED_BYTES not in event:
        return False
    try:
        error = json.loads(event[len(b"data: ") :]).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and str(error.get("message", "")).startswith(UNPARSED)


def drop_unparsed(events: bytes) -> tuple[bytes, bool]:
    """
    Whole SSE events without L{is_unparsed} ones; whether one was there.
    """
    kept, dropped = [], False
    for event in events.split(b"\n\n"):
        if is_unparsed(event):
            dropped = True
        else:
            kept.append(event)
    return b"\n\n".join(kept), dropped


def ending(last: dict[str, Any] | None, finish: str, prompt: int, completion: int, usage: bool) -> list[dict[str, Any]]:
    """
    The chunks a good stream ends with, for one the engine cut with
    L{UNPARSED}: C{finish_reason} (with llama-server's C{timings} token
    counts), then, if the request asked for it, the usage chunk.

    @param last: The last chunk seen (its C{id}, C{created}, C{model} and
        C{system_fingerprint} are kept).
    """
    head: dict[str, Any] = {k: last[k] for k in ("id", "created", "model", "system_fingerprint") if last and k in last}
    head["object"] = "chat.completion.chunk"
    chunks = [
        dict(
            head,
            choices=[{"index": 0, "delta": {}, "finish_reason": finish}],
            timings={"prompt_n": prompt, "cache_n": 0, "predicted_n": completion},
        )
    ]
    if usage:
        chunks.append(
            dict(
                head,
                choices=[],
                usage={"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            )
        )
    return chunks
