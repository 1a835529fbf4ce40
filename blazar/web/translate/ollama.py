"""
Ollama's wire format to and from the OpenAI format the engines speak.

Source: Ollama's API reference, C{docs/api.md} in ollama/ollama, and what the
official C{ollama} Python client parses (C{ollama/_types.py}). Pure functions
and one incremental state machine; no reactor, no I/O.

Shapes (Ollama side):
  - chat request: C{{model, messages:[{role, content, images?, tool_calls?,
    tool_name?, thinking?}], tools?, format?, options?, stream?, think?,
    keep_alive?}}
  - generate request: C{{model, prompt, suffix?, system?, raw?, format?,
    options?, stream?, think?, context? (ignored), keep_alive?}}
  - stream lines: C{{model, created_at, message|response, done:false}}, then
    one C{{..., done:true, done_reason, total_duration, load_duration,
    prompt_eval_count, prompt_eval_duration, eval_count, eval_duration}};
    durations are integer nanoseconds.
"""

from __future__ import annotations

import base64
import math
import time
from typing import Any, Callable, Iterable

import attrs

from blazar import strictjson
from blazar.gateway.call import OLLAMA_PLACEMENT
from blazar.gateway.defaults import ENGINE_FIELDS
from blazar.gateway.errors import BadRequest
from blazar.web.translate import keep_alive


class TranslationError(BadRequest):
    """
    The Ollama request cannot be translated; the message says which field
    and why (answered as 400).
    """


# Ollama option -> llama-server (OpenAI-compatible, plus llama.cpp's own
# sampling fields, which its /v1 endpoints accept): the one table of sampling
# parameters (a Modelfile's PARAMETER uses it too), plus stop and logit_bias
# (not Ollama's, but llama.cpp takes it: token id -> bias)
_OPTION_NAMES = {**ENGINE_FIELDS, "stop": "stop", "logit_bias": "logit_bias"}
_INTEGER_OPTIONS = {
    "num_predict",
    "num_ctx",
    "top_k",
    "seed",
    "repeat_last_n",
    "mirostat",
    "num_keep",
    "num_batch",
    "num_gpu",
    "num_thread",
    "main_gpu",
}
_NUMBER_OPTIONS = {
    "temperature",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "mirostat_tau",
    "mirostat_eta",
}

# honoured by a reload of the model with that placement (blazar.engines.supervisor.want_profile),
# for unscoped keys
PLACEMENT_OPTIONS = tuple(OLLAMA_PLACEMENT)
# Accepted and ignored: they size or place the engine, which the operator's
# config decides, or are obsolete. (num_ctx is not sent to the engine either:
# the surface hands it to the supervisor, which grows the child's context.)
_IGNORED_OPTIONS = {
    "num_batch",
    "use_mlock",
    "numa",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "penalize_newline",
    "tfs_z",
    "logits_all",
    "embedding_only",
    "rope_frequency_base",
    "rope_frequency_scale",
    "num_gqa",
}


def parse_keep_alive(value: Any) -> float | None:
    """
    Ollama's C{keep_alive} (L{keep_alive.parse_keep_alive}, the one
    parser every surface uses).

    @return: Seconds; negative means keep loaded forever; L{None} if absent.
    @raise TranslationError: Not a duration.
    """
    try:
        return keep_alive.parse_keep_alive(value)
    except ValueError as e:
        raise TranslationError(str(e)) from None


def _image_url(data: Any) -> dict[str, Any]:
    if not isinstance(data, str):
        raise TranslationError("images must be base64-encoded strings")
    try:
        head = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=False)
    except (ValueError, TypeError):
        raise TranslationError("images must be base64-encoded strings") from None
    mime = "image/jpeg"
    if head.startswith(b"\x89PNG"):
        mime = "image/png"
    elif head.startswith(b"GIF8"):
        mime = "image/gif"
    elif head[8:12] == b"WEBP":
        mime = "image/webp"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _arguments_json(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return strictjson.encode(arguments if arguments is not None else {}, ensure_ascii=False)


def messages_to_openai(messages: Any) -> list[dict[str, Any]]:
    """
    Ollama chat messages to OpenAI's: C{images} become image content parts,
    C{tool_calls} get ids and string arguments, C{role: "tool"} messages are
    linked to the call they answer (by C{tool_name}, else in order).

    @raise TranslationError: Malformed messages.
    """
    if not isinstance(messages, list):
        raise TranslationError("messages must be an array of {role, content} objects")
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (call id, function name) awaiting a tool reply
    counter = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TranslationError(f"messages[{i}] must be an object with a string role")
        role = m["role"]
        content = m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise TranslationError(f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": role, "content": content}
        images = m.get("images")
        if images:
            if not isinstance(images, list):
                raise TranslationError(f"messages[{i}].images must be an array of base64 strings")
            msg["content"] = ([{"type": "text", "text": content}] if content else []) + [
                _image_url(img) for img in images
            ]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise TranslationError(f"messages[{i}].tool_calls must be an array")
            converted = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise TranslationError(f"messages[{i}].tool_calls[] must be {{function: {{name, arguments}}}}")
                call_id = call.get("id") or f"call_{counter}"
                counter += 1
                pending.append((call_id, fn["name"]))
                converted.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": _arguments_json(fn.get("arguments"))},
                    }
                )
            msg["tool_calls"] = converted
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
                msg["tool_call_id"] = match[0]
            elif m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def options_to_openai(options: Any) -> dict[str, Any]:
    """
    Ollama C{options} to sampling fields; C{num_predict} becomes
    C{max_tokens} (negative: no limit).

    @raise TranslationError: C{options} is not an object.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TranslationError("options must be an object")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in _INTEGER_OPTIONS:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TranslationError(f"options.{key} must be an integer, got {value!r}")
        elif key in _NUMBER_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TranslationError(f"options.{key} must be a number, got {value!r}")
        if key == "num_predict":
            if value >= 0:
                out["max_tokens"] = value
        elif key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TranslationError("options.stop must be a string or an array of strings")
            out["stop"] = value
        elif key == "logit_bias":
            if not isinstance(value, dict):
                raise TranslationError("options.logit_bias must be an object of token id -> bias")
            out["logit_bias"] = value
        elif key in _OPTION_NAMES:
            out[_OPTION_NAMES[key]] = value
    return out


def format_to_openai(fmt: Any) -> dict[str, Any] | None:
    """
    Ollama C{format} (C{"json"} or a JSON schema object) to OpenAI's
    C{response_format}.

    @raise TranslationError: Anything else.
    """
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise TranslationError('format must be "json" or a JSON schema object')


def _common(body: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = options_to_openai(body.get("options"))
    response_format = format_to_openai(body.get("format"))
    if response_format is not None:
        request["response_format"] = response_format
    think = body.get("think")
    if think is not None:
        enabled = bool(think) if not isinstance(think, str) else think not in ("", "false", "none")
        request["chat_template_kwargs"] = {"enable_thinking": enabled}
        if isinstance(think, str) and think in ("low", "medium", "high"):
            request["reasoning_effort"] = think
    return request


def chat_to_openai(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """
    An C{/api/chat} body to the child's C{/v1/chat/completions} body.

    @raise TranslationError: Naming the bad field.
    """
    request = _common(body)
    request["messages"] = messages_to_openai(body.get("messages"))
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise TranslationError('tools must be an array of {type: "function", function: {...}}')
        request["tools"] = tools
        # (not in Ollama's API: the OpenAI field, so that a call can be forced
        # here too, under the tools' grammar: blazar.gateway.toolcalls)
        if body.get("tool_choice") is not None:
            request["tool_choice"] = body["tool_choice"]
        if isinstance(body.get("parallel_tool_calls"), bool):
            request["parallel_tool_calls"] = body["parallel_tool_calls"]
    request["stream"] = stream
    if stream:
        request["stream_options"] = {"include_usage": True}
    return request


def generate_to_openai(body: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    """
    An C{/api/generate} body to the child's request: C{raw} prompts go to
    C{/v1/completions} as they are; others are one user message (with
    C{system}) through the model's chat template; C{suffix} asks the
    engine's fill-in-the-middle endpoint C{/infill}.

    @return: (engine path, engine body).
    @raise TranslationError: Naming the bad field.
    """
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise TranslationError("prompt must be a string")
    if body.get("raw") is not None and not isinstance(body.get("raw"), bool):
        raise TranslationError("raw must be true or false")
    request = _common(body)
    suffix = body.get("suffix")
    if body.get("images") and (suffix or body.get("raw")):
        # (the prompt goes to the engine as it is: no message an image could be a part of)
        raise TranslationError(
            f"images cannot be sent with {'suffix' if suffix else 'raw: true'}: send them "
            "with a plain prompt (or in /api/chat messages)"
        )
    if suffix:
        if not isinstance(suffix, str):
            raise TranslationError("suffix must be a string")
        request.update({"input_prefix": prompt, "input_suffix": suffix, "prompt": ""})
        if "max_tokens" in request:
            request["n_predict"] = request.pop("max_tokens")
        request["stream"] = stream
        return "/infill", request
    if body.get("raw"):
        request["prompt"] = prompt
        path = "/v1/completions"
    else:
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if system:
            if not isinstance(system, str):
                raise TranslationError("system must be a string")
            messages.append({"role": "system", "content": system})
        user: dict[str, Any] = {"role": "user", "content": prompt}
        images = body.get("images")
        if images:
            user["images"] = images
        messages.append(user)
        request["messages"] = messages_to_openai(messages)
        path = "/v1/chat/completions"
    request["stream"] = stream
    if stream:
        request["stream_options"] = {"include_usage": True}
    return path, request


def created_at(now: float) -> str:
    """
    RFC 3339 UTC with nanoseconds, as Ollama writes C{created_at}
    (e.g. C{2026-12-01T05:19:00.123456789Z}).
    """
    global _second
    ns = int(now * 1e9)
    seconds, frac = divmod(ns, 1_000_000_000)
    second, text = _second
    if seconds != second:  # (a stream's lines share their second: formatted once a second)
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second = (seconds, text)
    return f"{text}.{frac:09d}Z"


_second: tuple[int | None, str] = (None, "")  # the last second created_at formatted, and its text


def _tool_calls_from_fragments(fragments: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    calls = []
    for index in sorted(fragments):
        f = fragments[index]
        calls.append({"function": {"index": index, "name": f["name"], "arguments": parse_arguments(f["arguments"])}})
    return calls


def parse_arguments(text: Any) -> dict[str, Any]:
    """
    Tool-call arguments as an object, as Ollama's clients require: a JSON
    object string is parsed; anything else is wrapped so it is never lost.
    """
    if isinstance(text, dict):
        return text
    if not text:
        return {}
    try:
        value = strictjson.loads(text)
    except (TypeError, ValueError):
        return {"__arguments": text}
    return value if isinstance(value, dict) else {"__arguments": value}


@attrs.define
class Timing:
    """
    Gateway-side clock readings for one request, in seconds (monotonic).

    @ivar started: When the request arrived.
    @ivar loaded: When a ready engine was in hand (load time = loaded - started).
    @ivar first_token: When the engine's first streamed chunk arrived, if
        seen (streamed replies).
    """

    started: float
    loaded: float
    first_token: float | None = None


def final_fields(
    usage: dict[str, Any] | None,
    timings: dict[str, Any] | None,
    timing: Timing,
    now: float,
    done_reason: str,
) -> dict[str, Any]:
    """
    The counters of a C{done: true} object, integers (durations in ns).
    C{prompt_eval_duration} and C{eval_duration} are the child's own
    C{timings} (C{prompt_ms}, C{predicted_ms}) where it sent them, else
    Blazar's measurement: engine in hand to first token, first token to
    now (all of it C{eval_duration} when no first token was seen).
    """
    usage = usage or {}
    timings = timings or {}
    prompt_n = timings.get("prompt_n", usage.get("prompt_tokens", 0))
    predicted_n = timings.get("predicted_n", usage.get("completion_tokens", 0))
    first = timing.first_token if timing.first_token is not None else timing.loaded
    prompt_ms = timings.get("prompt_ms")
    predicted_ms = timings.get("predicted_ms")
    return {
        "done": True,
        "done_reason": done_reason,
        "total_duration": int((now - timing.started) * 1e9),
        "load_duration": int((timing.loaded - timing.started) * 1e9),
        "prompt_eval_count": int(usage.get("prompt_tokens", prompt_n) or 0),
        "prompt_eval_duration": int(
            float(prompt_ms) * 1e6 if isinstance(prompt_ms, (int, float)) else (first - timing.loaded) * 1e9
        ),
        "eval_count": int(usage.get("completion_tokens", predicted_n) or 0),
        "eval_duration": int(
            float(predicted_ms) * 1e6 if isinstance(predicted_ms, (int, float)) else (now - first) * 1e9
        ),
    }


def _done_reason(finish: str | None) -> str:
    if finish == "length":
        return "length"
    return "stop"


@attrs.define
class OllamaStream:
    """
    Turns the child's OpenAI chunks (parsed JSON objects, in order) into
    Ollama NDJSON lines.

    Text goes out as it comes. Tool-call fragments are gathered per
    C{index} and sent as whole calls with object arguments when the choice
    finishes. The last line is the single C{done: true} object.

    @ivar kind: C{"chat"} (lines carry C{message}) or C{"generate"}
        (lines carry C{response}).
    @ivar model: The name the client asked for.
    """

    kind: str
    model: str
    timing: Timing
    clock: Callable[[], float]
    _fragments: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    _finish: str | None = None
    _usage: dict[str, Any] | None = None
    _timings: dict[str, Any] | None = None
    done: bool = False

    def _line(
        self, content: str = "", thinking: str = "", tool_calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": created_at(self.clock())}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        line["done"] = False
        return line

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """
        One child chunk in; zero or more Ollama lines out.
        """
        out: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if chunk.get("timings"):
            self._timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            if self.kind == "generate" and "text" in choice:
                text = choice.get("text") or ""
                if text:
                    out.append(self._line(text))
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            thinking = delta.get("reasoning_content") or ""
            if content or thinking:
                out.append(self._line(content, thinking))
            for frag in delta.get("tool_calls") or []:
                index = frag.get("index", 0)
                slot = self._fragments.setdefault(index, {"name": "", "arguments": ""})
                fn = frag.get("function") or {}
                if fn.get("name"):
                    slot["name"] = fn["name"]
                if fn.get("arguments"):
                    slot["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                if self._fragments:
                    out.append(self._line(tool_calls=_tool_calls_from_fragments(self._fragments)))
                    self._fragments = {}
        return out

    def finish(self) -> dict[str, Any]:
        """
        The final C{done: true} line (call once, after the child's
        C{[DONE]}).
        """
        self.done = True
        line = self._line()
        line.update(final_fields(self._usage, self._timings, self.timing, self.clock(), _done_reason(self._finish)))
        return line


def infill_line(chunk: dict[str, Any], stream: OllamaStream) -> list[dict[str, Any]]:
    """
    One chunk of llama-server's native C{/infill} stream (C{{content,
    stop, timings?, tokens_predicted?}}) as Ollama generate lines.
    """
    out = []
    if chunk.get("content"):
        out.append(stream._line(chunk["content"]))
    if chunk.get("stop"):
        stream._timings = chunk.get("timings")
        stream._usage = {
            "prompt_tokens": chunk.get("tokens_evaluated", 0),
            "completion_tokens": chunk.get("tokens_predicted", 0),
        }
        stream._finish = "length" if chunk.get("stop_type") == "limit" else "stop"
    return out


def chat_reply(reply: dict[str, Any], model: str, timing: Timing, now: float) -> dict[str, Any]:
    """
    A non-streaming child reply (C{chat.completion}) as one Ollama object.
    """
    choice = (reply.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    out_message: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out_message["thinking"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out_message["tool_calls"] = [
            {
                "function": {
                    "index": i,
                    "name": c["function"]["name"],
                    "arguments": parse_arguments(c["function"].get("arguments")),
                }
            }
            for i, c in enumerate(message["tool_calls"])
        ]
    out = {"model": model, "created_at": created_at(now), "message": out_message}
    out.update(
        final_fields(reply.get("usage"), reply.get("timings"), timing, now, _done_reason(choice.get("finish_reason")))
    )
    return out


def generate_reply(reply: dict[str, Any], model: str, timing: Timing, now: float) -> dict[str, Any]:
    """
    A non-streaming child reply (chat completion, completion or infill) as
    one Ollama generate object.
    """
    usage: dict[str, Any] | None
    if "content" in reply and "choices" not in reply:  # /infill
        text = reply.get("content") or ""
        usage = {
            "prompt_tokens": reply.get("tokens_evaluated", 0),
            "completion_tokens": reply.get("tokens_predicted", 0),
        }
        finish = "length" if reply.get("stop_type") == "limit" else "stop"
        thinking = ""
        timings = reply.get("timings")
    else:
        choice = (reply.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = choice.get("text") if "text" in choice else message.get("content")
        text = text or ""
        thinking = message.get("reasoning_content") or ""
        usage, timings, finish = reply.get("usage"), reply.get("timings"), choice.get("finish_reason")
    out: dict[str, Any] = {"model": model, "created_at": created_at(now), "response": text}
    if thinking:
        out["thinking"] = thinking
    out.update(final_fields(usage, timings, timing, now, _done_reason(finish)))
    return out


def embed_input(body: dict[str, Any]) -> list[str]:
    """
    C{/api/embed}'s C{input} as a list of strings.

    @raise TranslationError: Missing or not strings.
    """
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise TranslationError("input must be a string or a non-empty array of strings")


def embed_reply(reply: dict[str, Any], model: str, timing: Timing, now: float) -> dict[str, Any]:
    """
    The child's C{/v1/embeddings} reply as C{/api/embed}'s, vectors in input
    order.
    """
    data = sorted(reply.get("data") or [], key=lambda d: d.get("index", 0))
    usage = reply.get("usage") or {}
    return {
        "model": model,
        "embeddings": [d["embedding"] for d in data],
        "total_duration": int((now - timing.started) * 1e9),
        "load_duration": int((timing.loaded - timing.started) * 1e9),
        "prompt_eval_count": int(usage.get("prompt_tokens", 0) or 0),
    }


def ndjson(lines: Iterable[dict[str, Any]]) -> bytes:
    """
    Objects as NDJSON bytes, one compact line each.
    """
    return b"".join(strictjson.compact(line) + b"\n" for line in lines)


def ignored_options(options: Any) -> list[str]:
    """
    The C{options} keys accepted but not honoured (they size or place the
    engine, which the operator's config decides, or are obsolete or
    unknown), as C{options.KEY} names for C{x-blazar-ignored}.
    """
    if not isinstance(options, dict):
        return []
    honoured = set(_OPTION_NAMES) | {"num_predict", "stop", "logit_bias", "num_ctx", *PLACEMENT_OPTIONS}
    return [f"options.{key}"[:80] for key in options if key not in honoured]
