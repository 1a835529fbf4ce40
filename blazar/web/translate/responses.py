"""
OpenAI's Responses API to and from the chat-completions format the engines
speak.

Source: OpenAI's API reference ("Responses": create, the streaming events
C{response.*}) and what the official C{openai} SDK accumulates
(C{openai/lib/streaming/responses/}). Pure functions and one incremental
state machine; no reactor, no I/O.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs

from blazar import strictjson
from blazar.gateway.errors import BadRequest
from blazar.web.translate import leniency


class ResponsesRequestError(BadRequest):
    """
    The request is invalid (400 C{invalid_request_error}); C{param} names
    the field.
    """


# built-in tools OpenAI runs itself: a local model gets none of them
BUILT_IN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "computer",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
# what a namespace's function names become for the engine: NS + SEP + NAME
NAMESPACE_SEP = "__"
# output items of built-in tools, in history: the local model cannot use them
BUILT_IN_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "item_reference",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)


@attrs.define
class ToolNames:
    """
    How the tools offered to the engine map back to what the client sent:
    engine function name -> (namespace or L{None}, the client's name,
    C{"function"} or C{"custom"}).
    """

    names: dict[str, tuple[str | None, str, str]] = attrs.field(factory=dict)

    def engine_name(self, name: str, namespace: str | None) -> str:
        return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name

    def client(self, engine_name: str) -> tuple[str | None, str, str]:
        return self.names.get(engine_name, (None, engine_name, "function"))


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "developer"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _content_text(content: Any, where: str) -> Any:
    """
    A message item's content as chat content: a string, or parts.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError(f"{where}.content: must be a string or an array of content parts", where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}.content[{i}]"
        if not isinstance(part, dict):
            raise ResponsesRequestError(f"{at}: must be an object", at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise ResponsesRequestError(f"{at}.text: must be a string", at)
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
                raise ResponsesRequestError(
                    f"{at}.image_url: must be a data: or http(s) URL (file_id is not supported)", at
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            raise ResponsesRequestError(f"{at}.type: {kind!r} is not supported", at)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """
    The request's C{input} as a list of items (a string is one user message).

    @raise ResponsesRequestError: Not a string or an array.
    """
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ResponsesRequestError("input: must be a string or an array of input items", "input")
    return raw


def items_to_messages(
    items: list[dict[str, Any]],
    where: str = "input",
    ignored: list[str] | None = None,
) -> list[dict[str, Any]]:
    """
    Input items as chat messages: C{message} items (roles user, assistant,
    system, developer — kept in place), C{function_call} (a namespaced one
    as C{NS__NAME}), C{custom_tool_call} (arguments C{{"input": ...}}) and
    their outputs; C{reasoning} items are history the engine does not take
    back, built-in tools' items are left out (named in C{ignored}).

    @raise ResponsesRequestError: Naming the item's index.
    """
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"{at}: must be an object", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            raw_role = item.get("role")
            role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
            if role is None:
                raise ResponsesRequestError(f"{at}.role: must be user, assistant, system or developer", at)
            messages.append({"role": role, "content": _content_text(item.get("content"), at)})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if kind == "custom_tool_call":
                raw_input = item.get("input")
                arguments: Any = None
                if isinstance(raw_input, str):
                    arguments = strictjson.encode({"input": raw_input}, ensure_ascii=False)
            else:
                arguments = item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise ResponsesRequestError(
                    f"{at}: a {kind} needs string call_id, name and "
                    f"{'input' if kind == 'custom_tool_call' else 'arguments'}",
                    at,
                )
            namespace = item.get("namespace")
            if isinstance(namespace, str) and namespace:
                name = f"{namespace}{NAMESPACE_SEP}{name}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ResponsesRequestError(f"{at}.call_id: must be a string", at)
            if not isinstance(output, str):
                output = _content_text(output, at) if isinstance(output, list) else None
                if not isinstance(output, str):
                    raise ResponsesRequestError(f"{at}.output: must be a string or text parts", at)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str):
            # built-in tools' items, or an item type newer than Blazar
            if ignored is not None:
                ignored.append(f"input:{kind}"[:80])
            continue
        else:
            raise ResponsesRequestError(f"{at}.type: required (a string)", at)
    return messages


def _check_metadata(metadata: Any) -> None:
    """
    OpenAI's limits: an object of at most 16 string values (keys up to 64
    characters, values up to 512).
    """
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise ResponsesRequestError(
            "metadata: must be an object of at most 16 string values (keys up to 64 characters, values up to 512)",
            "metadata",
        )


def _function(tool: dict[str, Any], at: str, engine_name: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ResponsesRequestError(f"{at}.name: required", at)
    if tool.get("type") == "custom":
        parameters: Any = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    else:
        parameters = tool.get("parameters") or {"type": "object"}
    function: dict[str, Any] = {"name": engine_name, "parameters": parameters}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool) and tool.get("type") != "custom":
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _claim(names: ToolNames, engine_name: str, client: tuple[str | None, str, str], at: str) -> None:
    """
    Record that the engine's C{engine_name} is the client's tool C{client}.

    @raise ResponsesRequestError: Another offered tool has that engine name
        (a call could not be told apart).
    """
    if engine_name in names.names:
        raise ResponsesRequestError(
            f"{at}.name: {engine_name!r} is offered twice (a namespace's tools are offered as "
            f"NAMESPACE{NAMESPACE_SEP}NAME); rename one",
            at,
        )
    names.names[engine_name] = client


def _tools(body: dict[str, Any], names: ToolNames, ignored: list[str]) -> list[dict[str, Any]] | None:
    """
    The function tools the engine is offered: function and custom tools,
    and those inside namespaces (as C{NS__NAME}); built-in tools are left
    out and named in C{ignored}.
    """
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ResponsesRequestError("tools: must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ResponsesRequestError(f"{at}: must be an object", at)
        kind = tool.get("type")
        if kind in ("function", "custom"):
            out.append(_function(tool, at, tool.get("name") or ""))
            _claim(names, tool["name"], (None, tool["name"], kind), at)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace or not isinstance(tool.get("tools"), list):
                raise ResponsesRequestError(f"{at}: a namespace needs a name and tools", at)
            for j, inner in enumerate(tool["tools"]):
                inner_at = f"{at}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type", "function") not in ("function", "custom"):
                    ignored.append(f"tools:{namespace}.{inner.get('type') if isinstance(inner, dict) else '?'}"[:80])
                    continue
                engine_name = names.engine_name(str(inner.get("name") or ""), namespace)
                function = _function(inner, inner_at, engine_name)
                if isinstance(tool.get("description"), str) and tool["description"]:
                    described = function["function"].get("description", "")
                    function["function"]["description"] = f"{tool['description']}\n\n{described}".strip()
                out.append(function)
                _claim(names, engine_name, (namespace, inner["name"], inner.get("type", "function")), inner_at)
        elif isinstance(kind, str):
            ignored.append(f"tools:{kind}"[:80])
        else:
            raise ResponsesRequestError(f"{at}.type: required (a string)", at)
    return out


def _tool_choice(value: Any, ignored: list[str]) -> Any:
    """
    C{tool_choice} as the chat form: a string, or a named function (a
    namespaced or custom one by its engine name), or
    C{("allowed", mode, names)} for C{allowed_tools}.
    """
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") in ("function", "custom") and isinstance(value.get("name"), str):
        name = value["name"]
        if isinstance(value.get("namespace"), str) and value["namespace"]:
            name = f"{value['namespace']}{NAMESPACE_SEP}{name}"
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        mode = value.get("mode", "auto")
        allowed = value.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise ResponsesRequestError(
                'tool_choice: allowed_tools needs mode "auto" or "required" and a tools array', "tool_choice"
            )
        return ("allowed", mode, [t.get("name") for t in allowed if isinstance(t, dict)])
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        ignored.append(f"tool_choice:{value['type']}"[:80])  # a built-in tool: not available here
        return "auto"
    raise ResponsesRequestError(
        'tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ResponsesRequestError("text: must be an object", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ResponsesRequestError("text.format.schema: required for json_schema", "text.format")
        if fmt.get("name") is not None and not isinstance(fmt["name"], str):
            raise ResponsesRequestError("text.format.name: must be a string", "text.format")
        schema: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if isinstance(fmt.get("strict"), bool):
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesRequestError("text.format.type: must be text, json_object or json_schema", "text.format")


EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def request_to_chat(
    body: dict[str, Any],
    history: list[dict[str, Any]] = (),  # type: ignore[assignment]
    ignored: list[str] | None = None,
    names: ToolNames | None = None,
) -> dict[str, Any]:
    """
    The chat-completions body for a Responses request; C{history} are the
    earlier turns' items (from C{previous_response_id}), oldest first. The
    child always streams (with usage), so both reply modes share one
    translator.

    @param ignored: Gets the names of what was accepted but not honoured
        (the leniency policy's, plus built-in tools and their items).
    @param names: Gets how the engine's tool names map back to the
        client's (namespaces, custom tools).
    @raise ResponsesRequestError: A malformed field, or one whose meaning
        Blazar cannot keep (named; never dropped silently).
    """
    ignored = [] if ignored is None else ignored
    names = ToolNames() if names is None else names
    try:
        ignored += leniency.screen("responses", body)
    except leniency.MeaningChanged as e:
        raise ResponsesRequestError(str(e), e.field) from None
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ResponsesRequestError("model: required (a model name, see GET /v1/models)", "model")
    for key in ("stream", "store", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ResponsesRequestError(f"{key}: must be true or false", key)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise ResponsesRequestError("previous_response_id: must be a response id (resp_...)", "previous_response_id")
    _check_metadata(body.get("metadata"))
    reasoning = body.get("reasoning")
    if reasoning is not None and (
        not isinstance(reasoning, dict)
        or not all(
            v is None or isinstance(v, str)
            for k, v in reasoning.items()
            if k in ("effort", "summary", "generate_summary")
        )
    ):
        raise ResponsesRequestError('reasoning: must be an object like {"effort": "low"}', "reasoning")
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise ResponsesRequestError(
            'reasoning.effort: must be "none", "minimal", "low", "medium", "high" or "xhigh"', "reasoning"
        )
    if body.get("logit_bias") is not None and not isinstance(body["logit_bias"], dict):
        raise ResponsesRequestError("logit_bias: must be an object of token id -> bias", "logit_bias")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ResponsesRequestError("instructions: must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += items_to_messages(list(history), "previous_response_id")
    messages += items_to_messages(input_items(body), "input", ignored)
    if not any(m["role"] not in ("system", "developer") for m in messages):
        raise ResponsesRequestError("input: needs at least one item", "input")
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tools = _tools(body, names, ignored)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), ignored)
    if isinstance(choice, tuple):
        _, mode, allowed = choice
        allowed_names = {names.engine_name(str(n), None) for n in allowed} | {
            engine for engine, (_, client, _) in names.names.items() if client in allowed
        }
        chat["tools"] = tools = [t for t in tools or [] if t["function"]["name"] in allowed_names]
        if not tools:
            chat.pop("tools")
        choice = mode if tools else None
    if choice == "required" and not tools:
        raise ResponsesRequestError('tool_choice: "required" needs at least one tool in tools', "tool_choice")
    if isinstance(choice, dict):
        # llama-server has no named tool_choice: offer only that tool, and
        # require a call (as the Anthropic surface does)
        name = choice["function"]["name"]
        named = [t for t in tools or [] if t["function"]["name"] == name]
        if not named:
            raise ResponsesRequestError(f"tool_choice: no function tool named {name!r} in tools", "tool_choice")
        chat["tools"], choice = named, "required"
    if choice is not None and chat.get("tools"):
        chat["tool_choice"] = choice
    elif choice == "none":
        chat["tool_choice"] = "none"
    if isinstance(body.get("parallel_tool_calls"), bool) and chat.get("tools"):
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ResponsesRequestError("max_output_tokens: must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = limit
    for key in ("temperature", "top_p", "seed"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ResponsesRequestError(f"{key}: must be a number", key)
            chat[key] = value
    if isinstance(body.get("logit_bias"), dict):
        chat["logit_bias"] = body["logit_bias"]
    if effort is not None:
        chat["reasoning_effort"] = EFFORTS[effort]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    A stored response's output items as input items for the next turn.
    """
    items: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []) if p.get("type") == "output_text")
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            call = {
                "type": "function_call",
                "call_id": item["call_id"],
                "name": item["name"],
                "arguments": item["arguments"],
            }
            if item.get("namespace"):
                call["namespace"] = item["namespace"]
            items.append(call)
        elif item.get("type") == "custom_tool_call":
            items.append(
                {"type": "custom_tool_call", "call_id": item["call_id"], "name": item["name"], "input": item["input"]}
            )
    return items


@attrs.define
class _Item:
    kind: str
    item_id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


def _call_item(item: _Item, name: str, custom: bool, value: str, status: str) -> dict[str, Any]:
    """
    The output item of a tool call: a C{custom_tool_call} with C{value} as
    its C{input} (C{custom}), else a C{function_call} with C{value} as its
    C{arguments}; C{name} as the client named the tool.
    """
    return {
        "type": "custom_tool_call" if custom else "function_call",
        "id": item.item_id,
        "call_id": item.call_id,
        "name": name,
        "input" if custom else "arguments": value,
        "status": status,
    }


@attrs.define
class ResponsesStream:
    """
    Turns the child's chat-completion chunks (parsed JSON, in order) into
    Responses streaming events (C{(type, payload)} pairs, C{sequence_number}
    rising by one from 0) and the final response object.

    @ivar response: The response object as it stands (C{output} complete
        after L{finish}).
    """

    response: dict[str, Any]
    names: ToolNames = attrs.field(factory=ToolNames)
    sequence: int = 0
    _open: _Item | None = None
    _items: list[dict[str, Any]] = attrs.field(factory=list)
    _calls: dict[int, _Item] = attrs.field(factory=dict)
    _finish: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False

    def _event(self, kind: str, **payload: Any) -> tuple[str, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return kind, event

    def _item_event(self, kind: str, item: _Item, **payload: Any) -> tuple[str, dict[str, Any]]:
        """
        An event about C{item}: its C{item_id} and C{output_index}, then
        C{payload}.
        """
        return self._event(kind, item_id=item.item_id, output_index=item.index, **payload)

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        self.response["status"] = "in_progress"
        snapshot = {**self.response, "output": []}
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        events = []
        # an answer the token limit cut is incomplete, as an item too
        status = "incomplete" if self._finish == "length" else "completed"
        if item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
            full = {"type": "message", "id": item.item_id, "status": status, "role": "assistant", "content": [part]}
            events.append(
                self._item_event("response.output_text.done", item, content_index=0, text=item.text, logprobs=[])
            )
            events.append(self._item_event("response.content_part.done", item, content_index=0, part=part))
        elif item.kind == "reasoning":
            full = {
                "type": "reasoning",
                "id": item.item_id,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": item.text}],
                "status": status,
            }
            events.append(self._item_event("response.reasoning_text.done", item, content_index=0, text=item.text))
        else:
            namespace, name, kind = self.names.client(item.name)
            if kind == "custom":
                try:
                    parsed = strictjson.loads(item.text) if item.text else {}
                except ValueError:
                    parsed = item.text
                value = parsed.get("input") if isinstance(parsed, dict) else parsed
                text = value if isinstance(value, str) else item.text
                full = _call_item(item, name, True, text, status)
                events.append(self._item_event("response.custom_tool_call_input.done", item, input=text))
            else:
                full = _call_item(item, name, False, item.text, status)
                events.append(
                    self._item_event("response.function_call_arguments.done", item, name=name, arguments=item.text)
                )
            if namespace is not None:
                full["namespace"] = namespace
        self._items.append(full)
        events.append(self._event("response.output_item.done", output_index=item.index, item=full))
        return events

    def _open_item(self, kind: str, call_id: str = "", name: str = "") -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = self._open = _Item(kind, new_id(prefix), len(self._items), call_id=call_id, name=name)
        if kind == "message":
            added = {"type": "message", "id": item.item_id, "status": "in_progress", "role": "assistant", "content": []}
        elif kind == "reasoning":
            added = {"type": "reasoning", "id": item.item_id, "summary": [], "content": [], "status": "in_progress"}
        else:
            namespace, client_name, tool_kind = self.names.client(name)
            added = _call_item(item, client_name, tool_kind == "custom", "", "in_progress")
            if namespace is not None:
                added["namespace"] = namespace
        events.append(self._event("response.output_item.added", output_index=item.index, item=added))
        if kind == "message":
            events.append(
                self._item_event(
                    "response.content_part.added",
                    item,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        return events

    def _text_delta(self, kind: str, event: str, text: str, **extra: Any) -> list[tuple[str, dict[str, Any]]]:
        """
        The events for C{text} of an item of C{kind} (C{"reasoning"} or
        C{"message"}): the open item closed and one of C{kind} opened if
        it is of another kind, then the delta C{event} (C{extra} fields
        last).
        """
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._open_item(kind)
        assert self._open is not None
        self._open.text += text
        events.append(self._item_event(event, self._open, content_index=0, delta=text, **extra))
        return events

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """
        Events for one child chunk.
        """
        events: list[tuple[str, dict[str, Any]]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                events += self._text_delta("reasoning", "response.reasoning_text.delta", reasoning)
            text = delta.get("content")
            if isinstance(text, str) and text:
                events += self._text_delta("message", "response.output_text.delta", text, logprobs=[])
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                function = call.get("function") or {}
                item = self._calls.get(index)
                if item is None:
                    events += self._open_item(
                        "function_call", call.get("id") or new_id("call"), function.get("name") or ""
                    )
                    assert self._open is not None
                    item = self._calls[index] = self._open
                elif item is not self._open:
                    continue  # fragments of a call already closed: cannot happen in order
                if function.get("name") and not item.name:
                    item.name = function["name"]
                fragment = function.get("arguments")
                if isinstance(fragment, str) and fragment:
                    item.text += fragment
                    if self.names.client(item.name)[2] != "custom":  # a custom tool's input comes whole
                        events.append(self._item_event("response.function_call_arguments.delta", item, delta=fragment))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """
        Close the open item; the terminal C{response.completed} or
        C{response.incomplete} event.
        """
        events = self._close()
        self.done = True
        self.response["output"] = self._items
        usage = self.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.response["usage"] = {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "input_tokens_details": {"cached_tokens": int(cached)},
            "output_tokens": int(usage.get("completion_tokens") or 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": int(usage.get("total_tokens") or 0),
        }
        if self._finish == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.response))
        else:
            self.response["status"] = "completed"
            events.append(self._event("response.completed", response=self.response))
        return events

    def fail(self, message: str, code: str = "server_error") -> list[tuple[str, dict[str, Any]]]:
        """
        The terminal C{response.failed} event (the child failed mid-way,
        or the finished response could not be stored: C{code}
        C{store_unavailable}).
        """
        self.done = True
        self.response["status"] = "failed"
        self.response["output"] = self._items
        self.response["error"] = {"code": code, "message": message}
        return [self._event("response.failed", response=self.response)]

    @property
    def output_text(self) -> str:
        return "".join(p["text"] for i in self._items if i["type"] == "message" for p in i["content"])


def response_object(body: dict[str, Any], model: str, created_at: int, previous: str | None) -> dict[str, Any]:
    """
    The response object's fixed fields, as OpenAI's reference lists them.
    """
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True) is True,
        "temperature": body.get("temperature", 1.0),
        "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def dump(value: Any) -> bytes:
    """
    C{value} as UTF-8 JSON; with C{\\u} escapes if it holds a lone
    surrogate echoed from a request (never a 500 for it).
    """
    try:
        return strictjson.encode(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return strictjson.encode(value).encode("ascii")


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    """
    One Server-Sent Event: C{event:} equal to the payload's type, its
    data compact JSON.
    """
    try:
        data = strictjson.compact(payload)
    except UnicodeEncodeError:  # a lone surrogate echoed from a request: escaped (as L{dump} does)
        data = strictjson.encode(payload, separators=(",", ":")).encode("ascii")
    return b"event: " + kind.encode("ascii") + b"\ndata: " + data + b"\n\n"
