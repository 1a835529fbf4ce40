"""
OpenAI chat completions to and from Anthropic's Messages API, for a
C{[[remotes]]} entry with C{api = "anthropic"} (api.anthropic.com, or
another Blazar's C{/v1/messages}).

Inside Blazar every chat call is an OpenAI chat-completions body; this
module turns one into an Anthropic Messages request (L{to_anthropic}) and
the Anthropic answer back into an OpenAI C{chat.completion}
(L{from_anthropic}) or, streamed, into C{chat.completion.chunk} dicts
(L{AnthropicStream}). It is the opposite direction of
L{blazar.web.translate.anthropic}, which serves Blazar's own
C{/v1/messages} surface.

Sources: Anthropic's API reference ("Messages", "Streaming Messages",
"Extended thinking") as typed by the official C{anthropic} SDK
(C{anthropic/types/}: C{StopReason}, C{Usage}, C{MessageDeltaUsage},
C{ToolChoice*Param}, C{ThinkingConfig*Param}, C{Base64ImageSource},
C{URLImageSource}, C{MetadataParam}); OpenAI's chat-completions reference
(C{openai/types/chat/}). Pure functions and one incremental state
machine; no reactor, no I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

from blazar import strictjson
from blazar.gateway.errors import BadRequest

DEFAULT_MAX_TOKENS = 4096
"""
C{max_tokens} when the OpenAI body names none: Anthropic requires it,
OpenAI's default is "as many as fit".
"""

THINKING_BUDGETS = {"minimal": 1024, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
"""
OpenAI C{reasoning_effort} to Anthropic's C{thinking.budget_tokens}
(Anthropic's minimum is 1024, and the budget must be below
C{max_tokens}). C{"none"} turns thinking off.
"""

# OpenAI fields that are handled by to_anthropic (everything else is ignored, and named)
_HANDLED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_effort",
        "user",
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
    }
)

# Anthropic's base64 image types (Base64ImageSourceParam.media_type)
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


class RemoteRequestError(BadRequest):
    """
    The OpenAI request cannot be sent to an Anthropic remote without
    changing its meaning (answered as 400, naming the field in C{param}).
    A L{ValueError}.
    """


class RemoteStreamError(Exception):
    """
    The remote sent an C{error} event in the middle of a stream.

    @ivar kind: Anthropic's error type (C{overloaded_error}, ...), or
        C{"error"}.
    """

    def __init__(self, message: str, kind: str = "error") -> None:
        self.kind = kind
        super().__init__(message)


def _fail(param: str, message: str) -> RemoteRequestError:
    return RemoteRequestError(f"{param}: {message}", param=param)


def _text(content: Any, where: str, *, refusal: bool = False) -> list[dict[str, Any]]:
    """
    OpenAI text content (a string or text parts) as Anthropic text
    blocks; empty texts left out (Anthropic rejects empty text blocks).
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise _fail(where, "must be a string or an array of content parts")
    blocks = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text = part["text"]
        elif refusal and kind == "refusal" and isinstance(part.get("refusal"), str):
            text = part["refusal"]
        else:
            raise _fail(f"{where}.{i}", "expected a text part")
        if text:
            blocks.append({"type": "text", "text": text})
    return blocks


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """
    An OpenAI C{image_url} part as an Anthropic image block: a C{data:}
    URL as a base64 source, an http(s) URL as a url source. C{detail} has
    no Anthropic equivalent and is dropped.
    """
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise _fail(f"{where}.image_url.url", "required (a string)")
    if url.startswith("data:"):
        header, comma, data = url[5:].partition(",")
        media, _, encoding = header.partition(";")
        if not comma or encoding != "base64" or media not in _IMAGE_TYPES:
            raise _fail(
                f"{where}.image_url.url", "a data: URL must be base64 image/jpeg, image/png, image/gif or image/webp"
            )
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _fail(f"{where}.image_url.url", "must be a data: or http(s) URL")


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return _text(content, where)
    blocks = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            assert isinstance(part, dict)
            blocks.append(_image(part, f"{where}.{i}"))
        elif kind == "text":
            blocks += _text([part], where)
        elif (
            kind == "file"
            and isinstance(part.get("file"), dict)
            and str(part["file"].get("file_data", "")).startswith("data:application/pdf;base64,")
        ):
            data = part["file"]["file_data"].partition(",")[2]
            blocks.append(
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}
            )
        else:
            raise _fail(
                f"{where}.{i}.type",
                f"{kind!r} parts cannot be sent to an Anthropic remote (text, image_url and PDF file parts can)",
            )
    return blocks


def _tool_input(arguments: Any, ignored: list[str]) -> dict[str, Any]:
    """
    A tool call's JSON string arguments as a C{tool_use} block's C{input}
    object. Arguments that are not a JSON object (a model's broken
    output, kept in the history) are sent as C{{"_raw": arguments}}, and
    noted, so the conversation can go on.
    """
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    try:
        value = strictjson.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    ignored.append("tool_calls:unparsed-arguments")
    return {"_raw": arguments if isinstance(arguments, str) else strictjson.encode(arguments)}


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.tool_call_id", "required")
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    if isinstance(content, str) or content is None:
        block["content"] = content or ""
    else:
        block["content"] = _text(content, f"{where}.content")
    return block


def _messages(messages: Any, ignored: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """
    OpenAI messages as (Anthropic system text blocks, Anthropic messages),
    consecutive same-role messages merged (Anthropic wants user and
    assistant turns to alternate), C{tool_result} blocks first in their
    user turn.
    """
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "must be a non-empty array")
    system: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise _fail(where, "must be an object")
        role = m.get("role")
        if "name" in m:
            ignored.append("messages:name")
        if role in ("system", "developer"):
            if out:
                ignored.append("messages:system-moved-to-top")
            system += _text(m.get("content"), f"{where}.content")
            continue
        if role == "user":
            blocks = _user_blocks(m.get("content"), f"{where}.content")
            anthropic_role = "user"
        elif role == "assistant":
            blocks = _text(m.get("content"), f"{where}.content", refusal=True)
            if m.get("reasoning_content") or m.get("reasoning"):
                ignored.append("messages:reasoning_content")  # unsigned: Anthropic cannot take it back
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call.get("function") if isinstance(call, dict) else None
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(call.get("id"), str)
                ):
                    raise _fail(f"{where}.tool_calls.{j}", "needs id and function.name")
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": fn["name"],
                        "input": _tool_input(fn.get("arguments"), ignored),
                    }
                )
            anthropic_role = "assistant"
        elif role == "tool":
            blocks = [_tool_result(m, where)]
            anthropic_role = "user"
        else:
            raise _fail(
                f"{where}.role",
                f"{role!r} cannot be sent to an Anthropic remote (system, developer, user, assistant and tool can)",
            )
        if not blocks:
            continue  # an empty turn (Anthropic rejects empty content)
        if out and out[-1]["role"] == anthropic_role:
            out[-1]["content"] += blocks
        else:
            out.append({"role": anthropic_role, "content": blocks})
    for m in out:
        if m["role"] == "user":
            m["content"].sort(key=lambda b: b["type"] != "tool_result")  # stable: results first
        content = m["content"]
        if len(content) == 1 and content[0]["type"] == "text":
            m["content"] = content[0]["text"]
    if not out:
        raise _fail("messages", "needs at least one user or assistant message with content")
    return system, out


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(key, "must be a finite number")
    return value


def _tools(body: dict[str, Any], ignored: list[str]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if not tools:
        return []
    if not isinstance(tools, list):
        raise _fail("tools", "must be an array")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _fail(f"tools.{i}.type", f"{kind!r} tools cannot be sent to an Anthropic remote (function tools can)")
        if not isinstance(fn.get("name"), str):
            raise _fail(f"tools.{i}.function.name", "required")
        if fn.get("strict"):
            ignored.append("tools:strict")
        tool: dict[str, Any] = {"name": fn["name"]}
        if isinstance(fn.get("description"), str) and fn["description"]:
            tool["description"] = fn["description"]
        schema = fn.get("parameters")
        tool["input_schema"] = schema if isinstance(schema, dict) else {"type": "object", "properties": {}}
        out.append(tool)
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]], ignored: list[str]) -> dict[str, Any] | None:
    """
    OpenAI C{tool_choice} and C{parallel_tool_calls} as Anthropic's
    C{tool_choice} (L{None}: leave Anthropic's default, auto).
    """
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if choice is None:
        out: dict[str, Any] | None = None
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "none":
        out = {"type": "none"}
    elif choice == "required":
        out = {"type": "any"}
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance((choice.get("function") or {}).get("name"), str)
    ):
        name = choice["function"]["name"]
        if not any(t["name"] == name for t in tools):
            raise _fail("tool_choice.function.name", f"no tool named {name!r} in tools")
        out = {"type": "tool", "name": name}
    else:
        raise _fail(
            "tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if not tools:
        if out is not None and out["type"] in ("any", "tool"):
            raise _fail("tool_choice", "requires a tool call, but the request has no tools")
        if out is not None or parallel is not None:
            ignored.append("tool_choice" if out is not None else "parallel_tool_calls")
        return None
    if parallel is False:
        if out is None:
            out = {"type": "auto"}
        if out["type"] != "none":
            out["disable_parallel_tool_use"] = True
    return out


def to_anthropic(body: dict[str, Any], model: str) -> tuple[dict[str, Any], list[str]]:
    """
    An OpenAI chat-completions request body as an Anthropic Messages
    request body (C{POST /v1/messages}).

    System and developer messages become the top-level C{system} (a string
    for one text, else text blocks; ones after the first turn move to the
    top, noted). User content parts: text, C{image_url} (C{data:} URL to a
    base64 source, http(s) to a url source), PDF C{file} parts to a
    document block. Assistant C{tool_calls} become C{tool_use} blocks
    (arguments parsed; see L{_tool_input}); C{tool} messages become
    C{tool_result} blocks of a user turn. Consecutive same-role turns are
    merged.

    C{max_completion_tokens} (else C{max_tokens}, else
    L{DEFAULT_MAX_TOKENS}) becomes C{max_tokens}; C{stop} becomes
    C{stop_sequences}; C{temperature} (clamped to Anthropic's 0..1, noted
    when it was above), C{top_p}, C{top_k}, C{stream} pass; C{user} becomes
    C{metadata.user_id}; C{reasoning_effort} becomes C{thinking} with a
    L{THINKING_BUDGETS} budget: cut to C{max_tokens - 1} when the request
    names C{max_tokens}, else added to the default C{max_tokens} (thinking
    tokens count against it).

    @param body: The OpenAI request (not modified).
    @param model: The remote's own model name (C{model} in the result).
    @return: (Anthropic body, names of fields accepted but not honoured,
        for C{x-blazar-ignored}).
    @raise RemoteRequestError: (a L{ValueError}) for what would change the
        request's meaning if dropped: C{n} > 1, C{logprobs}/C{top_logprobs},
        a C{json_object}/C{json_schema} C{response_format} (Anthropic has
        no JSON mode), audio or other non-text/image parts, non-function
        tools, a required tool call without tools, and malformed fields.
    """
    ignored: list[str] = []
    n = body.get("n")
    if n is not None and n != 1:
        raise _fail("n", "an Anthropic remote gives one choice per request (n must be 1)")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _fail(
            "logprobs" if body.get("logprobs") else "top_logprobs",
            "an Anthropic remote does not return log probabilities",
        )
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            raise _fail("response_format", f"{kind!r} cannot be honoured by an Anthropic remote (it has no JSON mode)")
    system, messages = _messages(body.get("messages"), ignored)
    out: dict[str, Any] = {"model": model}
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    defaulted = max_tokens is None
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _fail(key, "must be a positive integer")
    out["max_tokens"] = max_tokens
    out["messages"] = messages
    if system:
        out["system"] = system[0]["text"] if len(system) == 1 else system
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _fail("stop", "must be a string or an array of strings")
        if stops:
            out["stop_sequences"] = list(stops)
    temperature = _number(body, "temperature")
    if temperature is not None:
        if temperature > 1:
            ignored.append("temperature:above-1")
        out["temperature"] = min(max(temperature, 0), 1)
    for name in ("top_p", "top_k"):
        value = _number(body, name)
        if value is not None:
            out[name] = value
    if body.get("stream") is not None:
        out["stream"] = bool(body["stream"])
    tools = _tools(body, ignored)
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body, tools, ignored)
    if choice is not None:
        out["tool_choice"] = choice
    effort = body.get("reasoning_effort")
    if effort is not None and effort != "none":
        if effort not in THINKING_BUDGETS:
            raise _fail("reasoning_effort", "must be none, minimal, low, medium, high or xhigh")
        budget = THINKING_BUDGETS[effort]
        if defaulted:
            # thinking counts against max_tokens: leave the answer its default room
            max_tokens = out["max_tokens"] = DEFAULT_MAX_TOKENS + budget
        budget = min(budget, max_tokens - 1)
        if budget < 1024:
            raise _fail("reasoning_effort", "an Anthropic remote needs max_tokens above 1024 to think")
        if choice is not None and choice["type"] in ("any", "tool"):
            raise _fail("reasoning_effort", "Anthropic cannot think with a forced tool call (tool_choice)")
        out["thinking"] = {"type": "enabled", "budget_tokens": budget}
    if isinstance(body.get("user"), str) and body["user"]:
        out["metadata"] = {"user_id": body["user"]}
    ignored += [k for k in body if k not in _HANDLED]
    return out, list(dict.fromkeys(ignored))


FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
"""
Anthropic C{stop_reason} to OpenAI C{finish_reason} (anything else, or
none, is C{"stop"}).
"""


def finish_reason(stop_reason: Any) -> str:
    """
    L{FINISH_REASONS}, defaulting to C{"stop"}.
    """
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def openai_usage(usage: Any) -> dict[str, Any]:
    """
    Anthropic C{usage} as OpenAI's: C{prompt_tokens} is
    C{input_tokens + cache_read_input_tokens + cache_creation_input_tokens}
    (Anthropic's C{input_tokens} leaves out what the cache read or wrote),
    C{prompt_tokens_details.cached_tokens} the cache reads,
    C{completion_tokens} C{output_tokens}.
    """
    usage = usage if isinstance(usage, dict) else {}
    cached = _count(usage, "cache_read_input_tokens")
    prompt = _count(usage, "input_tokens") + cached + _count(usage, "cache_creation_input_tokens")
    completion = _count(usage, "output_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _completion_id(message_id: Any) -> str:
    return f"chatcmpl-{message_id}" if isinstance(message_id, str) and message_id else "chatcmpl-remote"


def from_anthropic(message: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    """
    An Anthropic Messages response as an OpenAI C{chat.completion}.

    Text blocks are joined into C{content} (L{None} when there is none);
    C{tool_use} blocks become C{tool_calls} (ids kept, C{input} as a JSON
    string); C{thinking} blocks are joined into C{reasoning_content}
    (C{redacted_thinking} and server-tool blocks are left out).

    @param model: The name the client asked for (C{model} in the result).
    @param created: Unix seconds, for C{created}.
    @return: C{{id: "chatcmpl-" + message id, object, created, model,
        choices: [{index: 0, message, finish_reason, logprobs: None}],
        usage}}; see L{finish_reason} and L{openai_usage}.
    """
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": strictjson.encode(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thinking:
        reply["reasoning_content"] = "".join(thinking)
    if calls:
        reply["tool_calls"] = calls
    return {
        "id": _completion_id(message.get("id")),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": reply, "finish_reason": finish_reason(message.get("stop_reason")), "logprobs": None}
        ],
        "usage": openai_usage(message.get("usage")),
    }


class AnthropicStream:
    """
    Turns an Anthropic Messages stream, one SSE event at a time, into
    OpenAI C{chat.completion.chunk} dicts.

    C{message_start} gives the first chunk (C{role: "assistant"}); text,
    thinking and tool-input deltas give content, C{reasoning_content} and
    C{tool_calls} deltas (a tool call's C{index} counts only C{tool_use}
    blocks; its first delta carries C{id}, C{type} and C{function.name},
    the following ones C{function.arguments} fragments); C{message_stop}
    gives the chunk with C{finish_reason} and, with C{include_usage}, a
    usage chunk with empty C{choices}. C{ping}, C{content_block_stop},
    C{signature_delta} and unknown events give nothing.
    """

    def __init__(self, model: str, created: int, include_usage: bool) -> None:
        """
        @param model: The name the client asked for.
        @param created: Unix seconds, for every chunk's C{created}.
        @param include_usage: The client's C{stream_options.include_usage}.
        """
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._id = _completion_id(None)
        self._tools: dict[int, int] = {}  # content block index -> tool call index
        self._stop_reason: Any = None
        self._usage: dict[str, Any] = {}
        self._started = False
        self.finished = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    def _start(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        self._id = _completion_id(message.get("id"))
        if isinstance(message.get("usage"), dict):
            self._usage.update(message["usage"])
        self._started = True
        return [self._chunk({"role": "assistant", "content": ""})]

    def feed(self, event: str, data: dict[str, Any]) -> list[dict[str, Any]]:
        """
        One Anthropic SSE event (its C{event:} name and parsed C{data:}) in;
        zero or more OpenAI chunks out.

        @raise RemoteStreamError: On an C{error} event, with the remote's
            message.
        """
        if event == "error":
            error = data.get("error")
            error = error if isinstance(error, dict) else {}
            raise RemoteStreamError(
                str(error.get("message") or "the remote's stream failed"), str(error.get("type") or "error")
            )
        if event == "message_start":
            return self._start(data.get("message") or {})
        chunks = [] if self._started or event in ("ping", "message_stop") else self._start({})
        if event == "content_block_start":
            block = data.get("content_block") or {}
            index = data.get("index")
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                chunks.append(self._chunk({"content": block["text"]}))
            elif kind == "thinking" and block.get("thinking"):
                chunks.append(self._chunk({"reasoning_content": block["thinking"]}))
            elif kind == "tool_use" and isinstance(index, int):
                call = self._tools[index] = len(self._tools)
                args = strictjson.encode(block["input"], ensure_ascii=False) if block.get("input") else ""
                chunks.append(
                    self._chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": call,
                                    "id": block.get("id"),
                                    "type": "function",
                                    "function": {"name": block.get("name"), "arguments": args},
                                }
                            ]
                        }
                    )
                )
        elif event == "content_block_delta":
            delta = data.get("delta") or {}
            kind = delta.get("type")
            if kind == "text_delta" and delta.get("text"):
                chunks.append(self._chunk({"content": delta["text"]}))
            elif kind == "thinking_delta" and delta.get("thinking"):
                chunks.append(self._chunk({"reasoning_content": delta["thinking"]}))
            elif kind == "input_json_delta" and delta.get("partial_json") and data.get("index") in self._tools:
                chunks.append(
                    self._chunk(
                        {
                            "tool_calls": [
                                {"index": self._tools[data["index"]], "function": {"arguments": delta["partial_json"]}}
                            ]
                        }
                    )
                )
        elif event == "message_delta":
            self._stop_reason = (data.get("delta") or {}).get("stop_reason", self._stop_reason)
            if isinstance(data.get("usage"), dict):
                # cumulative counts: they replace message_start's
                self._usage.update({k: v for k, v in data["usage"].items() if v is not None})
        elif event == "message_stop" and not self.finished:
            self.finished = True
            chunks.append(self._chunk({}, finish_reason(self._stop_reason)))
            if self.include_usage:
                chunks.append(
                    {
                        "id": self._id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.usage(),
                    }
                )
        return chunks

    def usage(self) -> dict[str, Any]:
        """
        The usage so far, OpenAI-shaped (L{openai_usage}).
        """
        return openai_usage(self._usage)


def anthropic_error_message(body: bytes) -> str:
    """
    The human message of an Anthropic error body
    (C{{"type": "error", "error": {"type": ..., "message": ...}}}), or,
    for any other body, its text (stripped, at most 500 characters).
    """
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict):
        error = value.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            return error["message"]
        if isinstance(error, str) and error:
            return error
        if isinstance(value.get("message"), str) and value["message"]:
            return value["message"]
    return body.decode("utf-8", "replace").strip()[:500]


def answer_chunks(answer: Any, include_usage: bool) -> list[dict[str, Any]]:
    """
    A whole OpenAI answer (a C{chat.completion} or a C{text_completion})
    as the chunks its stream would have carried: per choice its reasoning,
    its text and its tool calls, then its C{finish_reason}; then, with
    C{include_usage}, the usage chunk (C{choices: []}). For a remote that
    answers a stream request with one JSON answer (its C{content-type}
    C{application/json}, not C{text/event-stream}): the client gets the
    stream it asked for, in its surface's shape.

    @param include_usage: The request's C{stream_options.include_usage}.
    @raise ValueError: Not such an answer (no C{choices} list).
    """
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise ValueError("it is no chat completion or completion (no choices)")
    text = answer.get("object") == "text_completion"
    meta = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint") if k in answer}
    kind = "text_completion" if text else "chat.completion.chunk"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**meta, "object": kind, "choices": choices, **extra}

    chunks = []
    for choice in answer["choices"]:
        if not isinstance(choice, dict):
            continue
        index, finish = choice.get("index", 0), choice.get("finish_reason")
        if text:
            chunks.append(
                chunk(
                    [{"index": index, "text": str(choice.get("text") or ""), "logprobs": None, "finish_reason": None}]
                )
            )
            chunks.append(chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish}]))
            continue
        message = choice.get("message")
        if not isinstance(message, dict):
            message = {}
        if message.get("reasoning_content"):
            chunks.append(
                chunk(
                    [
                        {
                            "index": index,
                            "finish_reason": None,
                            "delta": {"role": "assistant", "reasoning_content": message["reasoning_content"]},
                        }
                    ]
                )
            )
        chunks.append(
            chunk(
                [
                    {
                        "index": index,
                        "finish_reason": None,
                        "delta": {"role": "assistant", "content": message.get("content") or ""},
                    }
                ]
            )
        )
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            chunks.append(
                chunk(
                    [
                        {
                            "index": index,
                            "finish_reason": None,
                            "delta": {
                                "tool_calls": [
                                    {**call, "index": i} for i, call in enumerate(calls) if isinstance(call, dict)
                                ]
                            },
                        }
                    ]
                )
            )
        chunks.append(chunk([{"index": index, "finish_reason": finish, "delta": {}}]))
    if include_usage and isinstance(answer.get("usage"), dict):
        chunks.append(chunk([], usage=answer["usage"]))
    return chunks
