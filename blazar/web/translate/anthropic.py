"""
Anthropic's Messages API to and from the OpenAI format the engines speak.

Source: Anthropic's API reference (docs.anthropic.com, "Messages" and
"Streaming Messages"), and what the official C{anthropic} SDK accumulates
(C{anthropic/lib/streaming/_messages.py}). Pure functions and one
incremental state machine; no reactor, no I/O.

Stop sequences are matched here, not by the engine: llama-server's OpenAI
replies do not say which stop string ended a generation, and Anthropic's
C{stop_reason: "stop_sequence"} needs the string. Text that could be the
start of a stop sequence is held back until it is known not to be.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from blazar import strictjson
from blazar.gateway.errors import BadRequest


class AnthropicRequestError(BadRequest):
    """
    The request is invalid (answered as 400 C{invalid_request_error}).
    """


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise AnthropicRequestError(f"{where}: must be a string or an array of text blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise AnthropicRequestError(f'{where}.{i}: expected a text block {{"type": "text", "text": ...}}')
        parts.append(b["text"])
    return "\n\n".join(parts)


BILLING_HEADER = "x-anthropic-billing-header:"
"""
How Claude Code's per-request system block begins
(C{x-anthropic-billing-header: cc_version=2.1.332.0b8; ...}): its value
changes with every request, so kept in the prompt it would make every
turn's prompt differ from the last one's at its first tokens, and no
prompt cache could ever be reused (llama.cpp PR #20623).
"""


def _system_text(blocks: Any, where: str, ignored: list[str]) -> str:
    """
    A C{system} value (string or text blocks) as one string; blocks joined
    by a blank line. A Claude Code billing block (L{BILLING_HEADER}) is
    left out of the prompt, and noted as ignored.
    """
    if isinstance(blocks, list):
        if any(isinstance(b, dict) and "cache_control" in b for b in blocks):
            ignored.append("cache_control")
        billing = [
            b
            for b in blocks
            if isinstance(b, dict)
            and b.get("type") == "text"
            and isinstance(b.get("text"), str)
            and b["text"].startswith(BILLING_HEADER)
        ]
        if billing:
            ignored.append("system:x-anthropic-billing-header")
            blocks = [b for b in blocks if not any(b is x for x in billing)]
    elif isinstance(blocks, str) and blocks.startswith(BILLING_HEADER):
        ignored.append("system:x-anthropic-billing-header")
        blocks = blocks.partition("\n")[2].lstrip("\n")
    text = _text_of(blocks, where)
    return text


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise AnthropicRequestError(f"{where}.source: required")
    if source.get("type") == "base64":
        media = source.get("media_type")
        data = source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise AnthropicRequestError(f"{where}.source: base64 images need media_type and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise AnthropicRequestError(f'{where}.source.type: must be "base64" or "url"')


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for i, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "text":
                texts.append(str(b.get("text", "")))
            elif isinstance(b, dict) and b.get("type") == "image":
                texts.append("[image]")
            elif isinstance(b, dict) and b.get("type") == "search_result":
                texts.append("\n".join(str(c.get("text", "")) for c in b.get("content") or [] if isinstance(c, dict)))
            elif (
                isinstance(b, dict)
                and b.get("type") == "document"
                and isinstance(b.get("source"), dict)
                and isinstance(b["source"].get("data"), str)
                and b["source"].get("type") == "text"
            ):
                texts.append(b["source"]["data"])
            else:
                raise AnthropicRequestError(
                    f"{where}.content.{i}: expected text, image, search_result or text document blocks"
                )
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise AnthropicRequestError(f"{where}.content: must be a string or an array of blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return content


# content blocks of Anthropic's server tools (run by Anthropic, not here):
# history the local model cannot use, left out
SERVER_BLOCKS = frozenset(
    {
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
        "tool_search_tool_result",
    }
)


def messages_to_openai(messages: Any, ignored: list[str] | None = None) -> list[dict[str, Any]]:
    """
    Anthropic messages to OpenAI chat messages. C{tool_result} blocks
    become C{role: "tool"} messages placed before the rest of their user
    turn; C{tool_use} blocks become C{tool_calls} with JSON string arguments;
    C{role: "system"} messages (the C{mid-conversation-system} beta) stay
    where they are, as system messages.

    @param ignored: Gets the names of what was accepted but left out
        (server-tool blocks, C{cache_control}, unknown block types).
    @raise AnthropicRequestError: Naming the bad field as Anthropic does
        (C{messages.0.content.1.type}).
    """
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError("messages: must be a non-empty array")
    ignored = [] if ignored is None else ignored
    out: list[dict[str, Any]] = []
    tool_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise AnthropicRequestError(f"{where}: must be an object")
        role = m.get("role")
        if role == "system":
            text = _system_text(m.get("content"), f"{where}.content", ignored)
            out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise AnthropicRequestError(f'{where}.role: must be "user", "assistant" or "system"')
        content = m.get("content")
        if isinstance(content, str):
            if not content and not (role == "assistant" and i == len(messages) - 1):
                raise AnthropicRequestError(f"{where}.content: must not be empty")
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise AnthropicRequestError(f"{where}.content: must be a string or an array of blocks")
        if not content:
            raise AnthropicRequestError(f"{where}.content: must not be empty")
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        tool_results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            bwhere = f"{where}.content.{j}"
            if not isinstance(block, dict):
                raise AnthropicRequestError(f"{bwhere}: must be an object")
            kind = block.get("type")
            if "cache_control" in block:
                ignored.append("cache_control")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise AnthropicRequestError(f"{bwhere}.text: must be a string")
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image":
                if role != "user":
                    raise AnthropicRequestError(f"{bwhere}: images are only allowed in user turns")
                parts.append(_image_part(block, bwhere))
            elif kind == "tool_use":
                if role != "assistant":
                    raise AnthropicRequestError(f"{bwhere}: tool_use blocks belong to assistant turns")
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise AnthropicRequestError(f"{bwhere}: tool_use needs id and name")
                if not isinstance(block.get("input", {}), dict):
                    raise AnthropicRequestError(f"{bwhere}.input: must be an object")
                tool_ids.add(block["id"])
                arguments = strictjson.encode(block.get("input") or {}, ensure_ascii=False)
                tool_calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
            elif kind == "tool_result":
                if role != "user":
                    raise AnthropicRequestError(f"{bwhere}: tool_result blocks belong to user turns")
                if not isinstance(block.get("tool_use_id"), str):
                    raise AnthropicRequestError(f"{bwhere}.tool_use_id: required")
                if block["tool_use_id"] not in tool_ids:
                    raise AnthropicRequestError(
                        f"{bwhere}.tool_use_id: no tool_use block with id {block['tool_use_id']!r} "
                        "in an earlier assistant turn"
                    )
                tool_results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block["tool_use_id"],
                        "content": _tool_result_text(block, bwhere),
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not sent back to the model
            elif kind == "document":
                source = block.get("source")
                if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
                    parts.append({"type": "text", "text": source["data"]})
                else:
                    raise AnthropicRequestError(f"{bwhere}: only text documents are supported")
            elif kind == "search_result":
                texts = [
                    b.get("text", "")
                    for b in block.get("content") or []
                    if isinstance(b, dict) and isinstance(b.get("text"), str)
                ]
                parts.append({"type": "text", "text": "\n".join(texts)})
            elif not isinstance(kind, str):
                raise AnthropicRequestError(f"{bwhere}.type: required (a string)")
            else:
                # server tools' blocks, or a block type newer than Blazar
                ignored.append(f"content:{kind}"[:80])
        out.extend(tool_results)
        if role == "assistant":
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
        elif not parts and not tool_results:
            raise AnthropicRequestError(f"{where}.content: has no text, image or tool_result block")
        elif parts:
            if all(p["type"] == "text" for p in parts):
                out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
            else:
                out.append({"role": "user", "content": parts})
    if all(m["role"] == "system" for m in out):
        raise AnthropicRequestError("messages: needs at least one user or assistant message")
    return out


def tool_choice_to_openai(choice: Any) -> tuple[Any, bool | None]:
    """
    Anthropic C{tool_choice} to OpenAI's, plus C{parallel_tool_calls}
    (L{None}: leave the default).
    """
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise AnthropicRequestError("tool_choice: must be an object")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise AnthropicRequestError('tool_choice.name: required when type is "tool"')
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise AnthropicRequestError("tool_choice.type: must be auto, any, tool or none")


EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high", "xhigh": "high"}


def request_to_openai(
    body: dict[str, Any],
    *,
    counting: bool = False,
    ignored: list[str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """
    A C{/v1/messages} body to the child's streaming C{/v1/chat/completions}
    body (Blazar always streams from the child, so both reply modes share
    one translation).

    @param counting: For C{count_tokens}, which takes no C{max_tokens}.
    @param ignored: Gets the names of what was accepted but not honoured
        (server tools, C{cache_control}, ...), besides what
        L{blazar.web.translate.leniency} lists for the top level.
    @return: (engine body, stop sequences for L{AnthropicStream}).
    @raise AnthropicRequestError: Naming the bad field.
    """
    ignored = [] if ignored is None else ignored
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise AnthropicRequestError("model: Field required")
    out: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if not counting:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise AnthropicRequestError("max_tokens: Field required (an integer)")
        if max_tokens < 1:
            raise AnthropicRequestError("max_tokens: must be at least 1")
        out["max_tokens"] = max_tokens
    messages = messages_to_openai(body.get("messages"), ignored)
    system = body.get("system")
    if system is not None and system != "" and system != []:
        messages.insert(0, {"role": "system", "content": _system_text(system, "system", ignored)})
    out["messages"] = messages
    for key in ("temperature", "top_p", "top_k"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise AnthropicRequestError(f"{key}: must be a finite number")
            out[key] = value
    stops = body.get("stop_sequences")
    stops = [] if stops is None else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise AnthropicRequestError("stop_sequences: must be an array of non-empty strings")
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise AnthropicRequestError("tools: must be an array")
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise AnthropicRequestError(f"tools.{i}: must be an object")
            if t.get("type") not in (None, "custom"):
                # server tools (web search, an MCP toolset, ...) are not available locally
                ignored.append(f"tools:{t.get('name') or t.get('type')}"[:80])
                continue
            if not isinstance(t.get("name"), str):
                raise AnthropicRequestError(f"tools.{i}.name: Field required")
            if "cache_control" in t:
                ignored.append("cache_control")
            if "eager_input_streaming" in t:
                # a per-tool switch for how its input streams: Blazar streams every
                # tool's input the one way, asked or not
                ignored.append("tools.eager_input_streaming")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise AnthropicRequestError(f"tools.{i}.input_schema: Field required")
            converted.append(
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t.get("description", ""),
                        "parameters": schema,
                    },
                }
            )
        if converted:
            out["tools"] = converted
    choice, parallel = tool_choice_to_openai(body.get("tool_choice"))
    if isinstance(choice, dict) and "tools" in out:
        # {"type": "tool", "name": X}: offer only X, and require a call
        name = choice["function"]["name"]
        out["tools"] = [t for t in out["tools"] if t["function"]["name"] == name]
        if not out["tools"]:
            raise AnthropicRequestError(f"tool_choice.name: no tool named {name!r} in tools")
        choice = "required"
    if choice is not None and "tools" in out:
        out["tool_choice"] = choice
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    # llama.cpp's own sampling extension, passed through for clients that
    # send it (e.g. with the SDK's extra_body): token id -> bias
    if isinstance(body.get("logit_bias"), dict):
        out["logit_bias"] = body["logit_bias"]
    _reasoning(body, out)
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise AnthropicRequestError('output_config.format: must be {"type": "json_schema", "schema": {...}}')
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return out, list(stops)


def _reasoning(body: dict[str, Any], out: dict[str, Any]) -> None:
    """
    C{thinking} and C{output_config.effort} as the engine's reasoning
    switches: the chat template's C{enable_thinking}, llama-server's
    C{thinking_budget_tokens} and C{reasoning_effort} (each used by the
    engine where the model's template has it, harmless where not).
    """
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise AnthropicRequestError('thinking.type: must be "enabled", "adaptive" or "disabled"')
        assert isinstance(thinking, dict)
        out["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise AnthropicRequestError('thinking.budget_tokens: required (an integer) when type is "enabled"')
            out["thinking_budget_tokens"] = budget
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise AnthropicRequestError("output_config: must be an object")
    effort = (config or {}).get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise AnthropicRequestError('output_config.effort: must be "low", "medium", "high" or "max"')
        if out.get("chat_template_kwargs", {}).get("enable_thinking") is not False:
            out["reasoning_effort"] = EFFORTS[effort]


def stop_reason(finish: str | None) -> str:
    """
    OpenAI C{finish_reason} to Anthropic C{stop_reason}.
    """
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish or "", "end_turn")


@attrs.define
class AnthropicStream:
    """
    Turns the child's OpenAI chunks into Anthropic stream events, as
    C{(event type, payload)} pairs; C{payload["type"]} is the event type.

    Blocks are opened and closed one at a time with contiguous indices.
    Tool-call fragments for the open C{tool_use} block stream as
    C{input_json_delta}; fragments for other calls are held and sent as
    whole blocks after it.

    @ivar stopped: A stop sequence matched: the caller stops the engine.
    """

    message_id: str
    model: str
    stop_sequences: list[str] = attrs.field(factory=list)
    input_tokens: int = 0
    _index: int = -1
    _open: str | None = None  # "text" | "thinking" | "tool"
    _open_tool: int | None = None
    _held_tools: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    _tool_ids: dict[int, str] = attrs.field(factory=dict)
    _pending_text: str = ""
    _finish: str | None = None
    _stop_sequence: str | None = None
    _output_tokens: int = 0
    _cached_tokens: int = 0
    _usage_seen: bool = False
    _reason: str = "end_turn"
    stopped: bool = False
    content: list[dict[str, Any]] = attrs.field(factory=list)

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        """
        The C{message_start} event.
        """
        return [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.message_id,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                    },
                },
            )
        ]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open = None
        self._open_tool = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _begin(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self._index += 1
        self._open = kind
        self.content.append(dict(block))
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )
        return events

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = [] if self._open == "text" else self._flush_tools() + self._begin("text", {"type": "text", "text": ""})
        self.content[-1]["text"] += text
        events.append(
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": {"type": "text_delta", "text": text}},
            )
        )
        return events

    def _scan(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """
        Pass text through the stop-sequence matcher.
        """
        if not self.stop_sequences:
            return self._text(text)
        buffered = self._pending_text + text
        hits = [(buffered.find(s), s) for s in self.stop_sequences if s in buffered]
        if hits:
            at, seq = min(hits)
            self._pending_text = ""
            self._stop_sequence = seq
            self.stopped = True
            return self._text(buffered[:at])
        # hold back the longest tail that could start a stop sequence
        hold = 0
        for s in self.stop_sequences:
            for n in range(min(len(s) - 1, len(buffered)), 0, -1):
                if s.startswith(buffered[-n:]):
                    hold = max(hold, n)
                    break
        self._pending_text = buffered[len(buffered) - hold :] if hold else ""
        return self._text(buffered[: len(buffered) - hold])

    def _flush_tools(self) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        for index in sorted(self._held_tools):
            held = self._held_tools.pop(index)
            events += self._begin("tool", {"type": "tool_use", "id": held["id"], "name": held["name"], "input": {}})
            self.content[-1]["_json"] = held["arguments"]
            if held["arguments"]:
                events.append(
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": self._index,
                            "delta": {"type": "input_json_delta", "partial_json": held["arguments"]},
                        },
                    )
                )
        if events:
            events += self._close()
        return events

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """
        One child chunk in; zero or more events out.
        """
        if self.stopped:
            return []
        events: list[tuple[str, dict[str, Any]]] = []
        usage = chunk.get("usage")
        if usage:
            self._usage_seen = True
            self._output_tokens = int(usage.get("completion_tokens", 0) or 0)
            self.input_tokens = int(usage.get("prompt_tokens", self.input_tokens) or 0)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self._cached_tokens = min(int(cached or 0), self.input_tokens)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thinking = delta.get("reasoning_content")
            if thinking:
                if self._open != "thinking":
                    events += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.content[-1]["thinking"] += thinking
                events.append(
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": self._index,
                            "delta": {"type": "thinking_delta", "thinking": thinking},
                        },
                    )
                )
            if delta.get("content"):
                self._output_tokens += 0 if self._usage_seen else 1
                events += self._scan(delta["content"])
                if self.stopped:
                    return events
            for frag in delta.get("tool_calls") or []:
                index = int(frag.get("index", 0))
                fn = frag.get("function") or {}
                if frag.get("id"):
                    self._tool_ids[index] = frag["id"]
                if self._open == "tool" and self._open_tool == index:
                    args = fn.get("arguments") or ""
                    if args:
                        self.content[-1]["_json"] += args
                        events.append(
                            (
                                "content_block_delta",
                                {
                                    "type": "content_block_delta",
                                    "index": self._index,
                                    "delta": {"type": "input_json_delta", "partial_json": args},
                                },
                            )
                        )
                elif self._open_tool is None and not self._held_tools and fn.get("name"):
                    events += self._begin(
                        "tool",
                        {
                            "type": "tool_use",
                            "id": self._tool_ids.get(index) or f"toolu_{index}",
                            "name": fn["name"],
                            "input": {},
                        },
                    )
                    self.content[-1]["_json"] = fn.get("arguments") or ""
                    self._open_tool = index
                    if fn.get("arguments"):
                        events.append(
                            (
                                "content_block_delta",
                                {
                                    "type": "content_block_delta",
                                    "index": self._index,
                                    "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]},
                                },
                            )
                        )
                else:
                    held = self._held_tools.setdefault(index, {"id": "", "name": "", "arguments": ""})
                    held["id"] = held["id"] or self._tool_ids.get(index) or f"toolu_{index}"
                    held["name"] = held["name"] or fn.get("name") or ""
                    held["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """
        The closing events: the open block's stop, held tool blocks,
        C{message_delta} and C{message_stop}.
        """
        events: list[tuple[str, dict[str, Any]]] = []
        if self._pending_text:
            events += self._text(self._pending_text)
            self._pending_text = ""
        events += self._close()
        events += self._flush_tools()
        reason = "stop_sequence" if self._stop_sequence is not None else stop_reason(self._finish)
        if reason == "end_turn" and any(b["type"] == "tool_use" for b in self.content):
            reason = "tool_use"
        self._reason = reason
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": self._stop_sequence},
                    "usage": self._usage(),
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def total_tokens(self) -> int:
        """
        Prompt + output tokens of the answer (after L{finish}).
        """
        return self.input_tokens + self._output_tokens

    def message(self) -> dict[str, Any]:
        """
        The whole message, as a non-streaming reply (call after L{finish}).
        """
        content = []
        for block in self.content:
            block = dict(block)
            if block["type"] == "tool_use":
                raw = block.pop("_json", "")
                try:
                    value = strictjson.loads(raw) if raw else {}
                except ValueError:
                    value = {}
                block["input"] = value if isinstance(value, dict) else {}
            content.append(block)
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self._reason,
            "stop_sequence": self._stop_sequence,
            "usage": self._usage(),
        }

    def _usage(self) -> dict[str, int]:
        """
        Anthropic's usage: C{input_tokens} are the prompt tokens not read
        from the KV cache, C{cache_read_input_tokens} those that were (the
        engine's C{prompt_tokens_details.cached_tokens}); together, the
        prompt. (L{input_tokens} stays the whole prompt, for Blazar's own
        counting.)
        """
        return {
            "input_tokens": self.input_tokens - self._cached_tokens,
            "output_tokens": self._output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self._cached_tokens,
        }


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """
    One SSE event with an C{event:} line equal to the payload's type.
    """
    return b"event: " + event.encode("ascii") + b"\ndata: " + strictjson.compact(payload) + b"\n\n"
