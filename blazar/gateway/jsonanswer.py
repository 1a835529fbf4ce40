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

import json
import secrets
import time
from typing import Any

from blazar.gateway.toolcalls import usage_of

COMPACT = (",", ":")
# chat fields /completion has no use for (the rest, sampling settings and
# llama.cpp's own, pass as the client sent them)
CHAT_ONLY = frozenset({
    "model", "messages", "response_format", "stream", "stream_options", "tools", "tool_choice",
    "parallel_tool_calls", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "n", "user",
    "metadata", "store", "chat_template_kwargs", "reasoning_effort", "reasoning_format", "modalities", "audio",
    "prediction", "service_tier", "web_search_options", "prompt_cache_key", "safety_identifier",
    "verbosity", "add_generation_prompt", "continue_final_message", "json_schema", "grammar", "prompt",
})


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
    body.update(prompt=prompt, json_schema=schema, stream=stream, cache_prompt=True,
                n_predict=limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else -1)
    top = top_logprobs(chat)
    if top is not None:
        body["n_probs"] = max(top, 1)  # (the engine sends none at 0)
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


def chat_completion(model: str, done: dict[str, Any], chat: dict[str, Any]) -> bytes:
    """
    A non-streamed C{/completion} answer as an OpenAI chat completion.
    """
    return json.dumps({
        "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": finish_of(done),
                     "message": {"role": "assistant", "content": str(done.get("content") or "")},
                     "logprobs": _logprobs(done, top_logprobs(chat))}],
        "usage": usage_of(done),
        **({"timings": done["timings"]} if isinstance(done.get("timings"), dict) else {}),
    }, ensure_ascii=False, separators=COMPACT, allow_nan=False).encode("utf-8")


class ChatFromCompletion:
    """
    A C{/completion} SSE stream as OpenAI's chat chunk stream: a role
    chunk, a chunk per piece of text (with its logprobs, if asked), the
    finishing chunk (with llama-server's C{timings}, as its chat stream
    has them), the usage chunk if asked (C{choices: []}).

    @ivar finished: The engine's last event (C{stop: true}) was seen.
    """

    def __init__(self, model: str, chat: dict[str, Any]) -> None:
        self._base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": model}
        options = chat.get("stream_options")
        self._usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._top = top_logprobs(chat)
        self._started = False
        self.finished = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if self._top is not None:
            choice["logprobs"] = extra.pop("logprobs", None)
        return {**self._base, "choices": [choice], **extra}

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """
        The chat chunks for one C{/completion} event.
        """
        if self.finished:
            return []
        out = []
        if not self._started:
            self._started = True
            out.append(self._chunk({"role": "assistant", "content": ""}))
        text = event.get("content")
        if isinstance(text, str) and text:
            out.append(self._chunk({"content": text}, logprobs=_logprobs(event, self._top)))
        if event.get("stop") is True:
            self.finished = True
            timings = event.get("timings")
            out.append(self._chunk({}, finish_of(event), **({"timings": timings} if isinstance(timings, dict) else {})))
            if self._usage:
                out.append({**self._base, "choices": [], "usage": usage_of(event)})
        return out


def encode(chunk: dict[str, Any]) -> bytes:
    """
    One chunk as an SSE event.
    """
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=COMPACT, allow_nan=False).encode("utf-8") \
        + b"\n\n"
