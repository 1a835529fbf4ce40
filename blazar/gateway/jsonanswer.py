"""
JSON answers without the engine's chat parser (issue 35).

A chat that asks for JSON (OpenAI C{response_format} C{json_object} or
C{json_schema}; Ollama's C{format}, Anthropic's C{output_config.format} and
the Responses C{text.format} arrive translated to it) and offers no tools is
decoded by llama-server under the schema's grammar. Through
C{/v1/chat/completions}, its chat parser then reads the text back against
the same schema, and refuses text it cannot parse (text that is not UTF-8,
which random weights write, or JSON cut by C{max_tokens} inside the code
fence its grammar allows): a 500 instead of an answer, or a stream that
ends without the text it held back.

So the gateway renders the prompt with the model's template
(C{/apply-template}) and has C{/completion} decode it under the schema
(the engine's own grammar for it): the text is the model's, whole, streamed
as it comes, and the sentinel judges it against the schema. This module is
the pure part: the C{/completion} request, and its answer as an OpenAI chat
completion or chunk stream (L{ChatFromCompletion}), which every surface
already translates. Models whose template reasons (a C{<think>} block
before the answer) stay on the chat path: C{/completion}'s grammar would
forbid the reasoning.

llama-server's C{/completion}: request C{{prompt, json_schema, n_predict,
stream, n_probs, ...sampling}}; answer (or each SSE event) C{{content,
stop, stop_type ("eos" | "limit" | "word"), tokens_predicted,
tokens_evaluated, timings, completion_probabilities: [{id, token, bytes,
logprob, top_logprobs}]}}.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from blazar import strictjson
from blazar.gateway.toolcalls import usage_of

COMPACT = (",", ":")
# chat fields /completion has no use for (the rest, sampling settings and
# llama.cpp's own, pass as the client sent them)
CHAT_ONLY = frozenset(
    {
        "model",
        "messages",
        "response_format",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "n",
        "user",
        "metadata",
        "store",
        "chat_template_kwargs",
        "reasoning_effort",
        "reasoning_format",
        "modalities",
        "audio",
        "prediction",
        "service_tier",
        "web_search_options",
        "prompt_cache_key",
        "safety_identifier",
        "verbosity",
        "add_generation_prompt",
        "continue_final_message",
        "json_schema",
        "grammar",
        "prompt",
    }
)


def json_format(chat: dict[str, Any]) -> dict[str, Any] | None:
    """
    The JSON schema a chat body's C{response_format} asks its answer to
    follow (C{json_object}: any object), or L{None} when it asks for no
    JSON.
    """
    fmt = chat.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        schema = fmt.get("schema")
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
    else:
        return None
    return schema if isinstance(schema, dict) and schema else {"type": "object"}


def top_logprobs(chat: dict[str, Any]) -> int | None:
    """
    How many alternatives per token the chat asks for (C{logprobs: true},
    C{top_logprobs}), or L{None} when it asks for no logprobs.
    """
    if chat.get("logprobs") is not True:
        return None
    top = chat.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0


def completion_request(chat: dict[str, Any], prompt: str, schema: dict[str, Any], stream: bool) -> dict[str, Any]:
    """
    llama-server's C{/completion} request for a chat's JSON answer: the
    rendered C{prompt}, C{schema}, the client's C{max_tokens} (C{n_predict};
    none: until the grammar ends), its sampling settings (every field that
    is not the chat's own), and C{n_probs} when it asked for logprobs.
    """
    body = {k: v for k, v in chat.items() if k not in CHAT_ONLY}
    limit = chat.get("max_completion_tokens", chat.get("max_tokens"))
    body.update(
        prompt=prompt,
        json_schema=schema,
        stream=stream,
        cache_prompt=True,
        n_predict=limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else -1,
    )
    top = top_logprobs(chat)
    if top is not None:
        body["n_probs"] = max(top, 1)  # (the engine sends none at 0)
    n = chat.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        body["n_cmpl"] = n  # several answers: a list of them, each event with its index
    return body


def finish_of(done: dict[str, Any]) -> str:
    """
    OpenAI's C{finish_reason} for a C{/completion} answer.
    """
    return "length" if done.get("stop_type") == "limit" else "stop"


def _logprobs(done: dict[str, Any], top: int | None) -> dict[str, Any] | None:
    """
    OpenAI's chat C{logprobs} from a C{/completion} answer's
    C{completion_probabilities} (the same entries; alternatives cut to the
    client's count).
    """
    if top is None:
        return None
    entries = done.get("completion_probabilities")
    if not isinstance(entries, list):
        return {"content": [], "refusal": None}
    out = []
    for entry in entries:
        if isinstance(entry, dict):
            alternatives = entry.get("top_logprobs")
            out.append({**entry, "top_logprobs": list(alternatives[:top]) if isinstance(alternatives, list) else []})
    return {"content": out, "refusal": None}


def results_of(done: Any) -> list[dict[str, Any]]:
    """
    The answers in a C{/completion} answer: one object, or (asked with
    C{n_cmpl}) a list of them, in C{index} order.
    """
    found = done if isinstance(done, list) else [done]
    return sorted((r for r in found if isinstance(r, dict)), key=lambda r: int(r.get("index") or 0))


def usage_all(done: Any) -> dict[str, Any]:
    """
    OpenAI C{usage} of a C{/completion} answer with one or several
    answers: the prompt once, the completions' tokens together.
    """
    results = results_of(done)
    usage = usage_of(results[0] if results else {})
    completion = sum(usage_of(r)["completion_tokens"] for r in results)
    return {**usage, "completion_tokens": completion, "total_tokens": usage["prompt_tokens"] + completion}


def chat_completion(model: str, done: Any, chat: dict[str, Any]) -> bytes:
    """
    A non-streamed C{/completion} answer (one, or several with C{n}) as an
    OpenAI chat completion.
    """
    results = results_of(done)
    top = top_logprobs(chat)
    timings = results[0].get("timings") if results else None
    return strictjson.encode(
        {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": i,
                    "finish_reason": finish_of(r),
                    "message": {"role": "assistant", "content": str(r.get("content") or "")},
                    "logprobs": _logprobs(r, top),
                }
                for i, r in enumerate(results)
            ],
            "usage": usage_all(results),
            **({"timings": timings} if isinstance(timings, dict) else {}),
        },
        ensure_ascii=False,
        separators=COMPACT,
    ).encode("utf-8")


class ChatFromCompletion:
    """
    A C{/completion} SSE stream as OpenAI's chat chunk stream: a role
    chunk, a chunk per piece of text (with its logprobs, if asked), the
    finishing chunk (with llama-server's C{timings}, as its chat stream
    has them), the usage chunk if asked (C{choices: []}).

    @ivar finished: The engine's last event (C{stop: true}) was seen.
    """

    def __init__(self, model: str, chat: dict[str, Any]) -> None:
        self._base = {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        options = chat.get("stream_options")
        self._usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._top = top_logprobs(chat)
        n = chat.get("n")
        self._n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        self._started: set[int] = set()
        self._ended: dict[int, dict[str, Any]] = {}  # index -> its last event
        self.finished = False

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        logprobs = extra.pop("logprobs", None)
        if self._top is not None:
            choice["logprobs"] = logprobs
        return {**self._base, "choices": [choice], **extra}

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """
        The chat chunks for one C{/completion} event (its C{index}: which
        of C{n} answers).
        """
        index = event.get("index")
        index = index if isinstance(index, int) and 0 <= index < self._n else 0
        if self.finished or index in self._ended:
            return []
        out = []
        if index not in self._started:
            self._started.add(index)
            out.append(self._chunk(index, {"role": "assistant", "content": ""}))
        text = event.get("content")
        if isinstance(text, str) and text:
            out.append(self._chunk(index, {"content": text}, logprobs=_logprobs(event, self._top)))
        if event.get("stop") is True:
            self._ended[index] = event
            timings = event.get("timings")
            out.append(
                self._chunk(index, {}, finish_of(event), **({"timings": timings} if isinstance(timings, dict) else {}))
            )
            if len(self._ended) == self._n:
                self.finished = True
                if self._usage:
                    out.append({**self._base, "choices": [], "usage": usage_all(list(self._ended.values()))})
        return out


def encode(chunk: dict[str, Any]) -> bytes:
    """
    One chunk as an SSE event.
    """
    return b"data: " + strictjson.encode(chunk, ensure_ascii=False, separators=COMPACT).encode("utf-8") + b"\n\n"
