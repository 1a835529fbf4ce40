"""
Forced tool calls that always parse (issue 21).

When a client forces a call — OpenAI C{tool_choice: "required"} or a
named function (the other surfaces' equivalents arrive translated to
those) — the pipeline does not leave the call's syntax to the model. It
renders the prompt with the model's own template, tools included
(llama-server's C{/apply-template}), and has the engine decode the
answer under a JSON schema built from the offered tools (C{/completion}
with C{json_schema}): one object C{{"name": <an offered name>,
"arguments": <that tool's parameters>}}, or an array of them when
parallel calls are allowed. The answer is then written back as an
OpenAI chat completion with C{tool_calls} (or its SSE stream), which
every surface already translates.

The grammar is compact JSON with strings and arrays bounded so that the
whole call fits in the answer's token budget: a model that never closes a
string (random weights do not) still ends with valid JSON.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import attrs

from blazar import strictjson
from blazar.gateway.grammar import DEADLINE, Grammar, Unsupported, literal, min_chars

MAX_CALLS = 4  # parallel calls at most, when allowed
DEFAULT_BUDGET = 1024  # tokens for a call when the client set no limit
MIN_STRING = 8
# as llama-server writes JSON: the surfaces put the client's model name back
# by replacing the exact bytes "model":"<name>" (blazar.web.sse.ModelRenamer)
COMPACT = (",", ":")


@attrs.frozen
class Forced:
    """
    A forced call: the offered function tools it may use (all of them for
    C{required}, the named one otherwise) and whether several may come.
    """

    tools: tuple[dict[str, Any], ...]
    parallel: bool
    named: bool = False  # one tool by name (else: any of them, "required")


class ToolChoiceError(ValueError):
    """
    A forced call that cannot be made: it names a tool that is not
    offered, or no function tool is offered.
    """


def forced_call(body: dict[str, Any]) -> Forced | None:
    """
    The forced call an OpenAI chat body asks for, if any.

    @raise ToolChoiceError: A named tool that is not among C{tools}.
    """
    choice = body.get("tool_choice")
    tools = [
        t
        for t in body.get("tools") or []
        if isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if choice == "required":
        if not tools:
            raise ToolChoiceError('tool_choice is "required" but no function tool is offered')
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names {name!r}, which is not among the offered tools")
    else:
        return None
    parallel = body.get("parallel_tool_calls", True) is not False
    return Forced(tuple(chosen), parallel, named=choice != "required")


def _strings(schema: Any) -> int:
    """
    How many strings without a bound of their own C{schema} holds.
    """
    if isinstance(schema, list):
        return sum(_strings(s) for s in schema)
    if not isinstance(schema, dict):
        return 0
    closed = any(k in schema for k in ("maxLength", "enum", "const"))
    own = 1 if schema.get("type") == "string" and not closed else 0
    return own + sum(_strings(v) for k, v in schema.items() if k not in ("enum", "const", "default", "examples"))


def plan(forced: Forced, budget: int) -> tuple[int, int, int]:
    """
    C{(strings, syntax, calls)}: the unbounded strings of the largest
    tool, the tokens one call's own syntax may take (every character a
    token), and how many calls fit in C{budget} (1 without parallel calls).
    """
    strings = max(_strings(t["function"].get("parameters") or {}) for t in forced.tools)
    syntax = max(48 + len(strictjson.encode(t["function"].get("parameters") or {})) // 2 for t in forced.tools)
    per_call = syntax + 6 * MIN_STRING * strings
    calls = max(1, min(MAX_CALLS, budget // per_call)) if forced.parallel else 1
    return strings, syntax, calls


def expressible(forced: Forced, deadline: float | None = None) -> tuple[Forced, list[str]]:
    """
    C{forced} without the tools whose parameters a grammar cannot express,
    when any tool will do (C{required}): they cannot be called correctly,
    so they are not offered to the grammar; the model still sees them.
    A named tool is kept (and refused later, by L{call_grammar}).

    @return: The call, and each dropped tool's name and construct.
    """
    if forced.named:
        return forced, []
    kept, dropped = [], []
    for tool in forced.tools:
        try:
            Grammar(tool["function"].get("parameters") or {}, MIN_STRING, deadline=deadline).value(
                tool["function"].get("parameters") or {"type": "object", "properties": {}}, "#"
            )
        except Unsupported as e:
            dropped.append(f"{tool['function']['name']}: {e}")
            continue
        kept.append(tool)
    if not kept:
        return forced, []  # none can be called: call_grammar names the first
    return attrs.evolve(forced, tools=tuple(kept)), dropped


def needed_tokens(forced: Forced) -> int:
    """
    The fewest tokens one call can need: a forced call with no
    C{max_tokens} of the client's is given at least these. The client's
    own limit is a limit: a call that does not fit it ends cut short
    (L{cut_short}).
    """
    strings, syntax, _ = plan(forced, 0)
    least = max(min_chars(t["function"].get("parameters") or {}) for t in forced.tools)
    return syntax + 6 * MIN_STRING * strings + 6 * least


class ToolSchemaError(ValueError):
    """
    A tool whose parameters the grammar cannot express: the message names
    the tool and the construct.
    """


def call_grammar(forced: Forced, budget: int, deadline: float | None = None) -> str:
    """
    The GBNF grammar of the answer (L{blazar.gateway.grammar}): one call
    C{{"name":..., "arguments":...}} of an offered tool, or with parallel
    calls an array of 1 to L{MAX_CALLS}; strings without a bound get one
    that fits C{budget} tokens.

    @raise ToolSchemaError: A tool's parameters use what it cannot express.
    """
    strings, syntax, calls = plan(forced, budget)
    # a character is at most 6 tokens (a \\uXXXX escape, or 4 bytes of
    # UTF-8 with byte tokens)
    cap = max(MIN_STRING, (budget - syntax * calls) // max(1, 6 * strings * calls))
    g = Grammar(None, cap, deadline=deadline)
    options = []
    for tool in forced.tools:
        fn = tool["function"]
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        g.use_root(parameters)
        try:
            arguments = g.value(parameters, "#")
        except Unsupported as e:
            raise ToolSchemaError(
                f"tool {fn['name']!r}: its parameters use {e}, which a grammar cannot express for a forced call"
            ) from None
        options.append(g.rule("call", f'"{{\\"name\\":" {literal(fn["name"])} ",\\"arguments\\":" {arguments} "}}"'))
    one = options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"
    root = f'"[" {one} ("," {one}){{0,{calls - 1}}} "]"' if forced.parallel else one
    return g.text(root)


def completion_body(
    chat: dict[str, Any],
    prompt: str,
    forced: Forced,
    budget: int,
    deadline: float | None = None,
) -> dict[str, Any]:
    """
    llama-server's C{/completion} request for the call: the rendered
    C{prompt}, the schema, and the chat request's sampling settings.
    """
    body: dict[str, Any] = {
        "prompt": prompt,
        "grammar": call_grammar(forced, budget, deadline),
        "n_predict": budget,
        "stream": False,
        "cache_prompt": True,
    }
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "logit_bias",
        "mirostat",
        "typical_p",
    ):
        if key in chat:
            body[key] = chat[key]
    return body


def thd_prepare(
    chat: dict[str, Any],
    forced: Forced,
    budget: int | None,
    seconds: float = DEADLINE,
) -> tuple[Forced, list[str], int, dict[str, Any]]:
    """
    The grammar work of a forced call, in a thread (it is CPU work that
    grows with the tools' schemas): the tools a grammar can express
    (L{expressible}), the token budget (the client's limit, else what one
    call needs at least), and the C{/completion} body without its prompt.
    Bounded: the grammar's walk stops after C{seconds} or its node budget
    (L{blazar.gateway.grammar.Grammar}). Touches no Twisted object.

    @param budget: The client's C{max_tokens}, or L{None}.
    @return: C{(forced, dropped, budget, body)}.
    @raise ToolSchemaError: A tool the grammar cannot express, or too
        large a schema.
    """
    deadline = time.monotonic() + seconds
    forced, dropped = expressible(forced, deadline)
    if budget is None:
        budget = max(DEFAULT_BUDGET, needed_tokens(forced))
    return forced, dropped, budget, completion_body(chat, "", forced, budget, deadline)


def parse_calls(content: str, forced: Forced) -> list[tuple[str, dict[str, Any]]]:
    """
    The calls in the constrained answer: C{(name, arguments)} each.

    @raise ValueError: The answer is not the schema's JSON (cut short).
    """
    value = strictjson.loads(content)
    items = value if isinstance(value, list) else [value]
    names = {t["function"]["name"] for t in forced.tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names or not isinstance(item.get("arguments"), dict):
            raise ValueError(f"not a call of an offered tool: {item!r:.200}")
        calls.append((item["name"], item["arguments"]))
    if not calls:
        raise ValueError("no call")
    return calls if forced.parallel else calls[:1]


def cut_short(done: Any, budget: int) -> bool:
    """
    Whether llama-server's C{/completion} answer C{done} stopped at its
    token budget (C{stop_type} C{"limit"}, or as many tokens as C{budget}):
    a forced call that did not fit the client's C{max_tokens}.
    """
    if not isinstance(done, dict):
        return False
    predicted = done.get("tokens_predicted")
    return done.get("stop_type") == "limit" or (isinstance(predicted, int) and predicted >= budget)


def usage_of(done: dict[str, Any]) -> dict[str, Any]:
    """
    OpenAI C{usage} from a C{/completion} answer.
    """
    timings = done.get("timings") or {}
    prompt = int(done.get("tokens_evaluated") or (timings.get("prompt_n", 0) + timings.get("cache_n", 0)) or 0)
    completion = int(done.get("tokens_predicted") or timings.get("predicted_n") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(timings.get("cache_n") or 0)},
    }


def tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": strictjson.encode(arguments, ensure_ascii=False, separators=COMPACT),
            },
        }
        for name, arguments in calls
    ]


def chat_completion(
    model: str,
    calls: list[dict[str, Any]],
    usage: dict[str, Any],
    finish: str = "tool_calls",
) -> bytes:
    """
    A non-streamed OpenAI chat completion carrying C{calls}; with none (a
    call cut short by the client's C{max_tokens}: C{finish} C{"length"}),
    empty content: half a call is not a call.
    """
    message: dict[str, Any] = (
        {"role": "assistant", "content": None, "tool_calls": calls} if calls else {"role": "assistant", "content": ""}
    )
    return strictjson.encode(
        {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": usage,
        },
        ensure_ascii=False,
        separators=COMPACT,
    ).encode("utf-8")


def chat_stream(
    model: str,
    calls: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    timings: dict[str, Any] | None = None,
    finish: str = "tool_calls",
) -> bytes:
    """
    The same answer as an OpenAI SSE stream: a role chunk, one chunk per
    call (C{index}, C{id}, C{type} and the whole C{function}), the finish
    chunk (with llama-server's C{timings}), the usage chunk if asked for
    (C{choices: []}), C{[DONE]}.
    """
    base = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return (
            b"data: "
            + strictjson.encode({**base, "choices": choices, **extra}, ensure_ascii=False, separators=COMPACT).encode(
                "utf-8"
            )
            + b"\n\n"
        )

    out = [event([{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}])]
    for i, call in enumerate(calls):
        out.append(event([{"index": 0, "finish_reason": None, "delta": {"tool_calls": [{"index": i, **call}]}}]))
    # llama-server's timings ride on its last chunk (the surfaces read them)
    out.append(event([{"index": 0, "delta": {}, "finish_reason": finish}], **({"timings": timings} if timings else {})))
    if usage is not None:
        out.append(event([], usage=usage))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
