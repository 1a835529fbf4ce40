"""
Chat Completions logprobs on a streamed request with tools, which the
pinned llama-server refuses with 400 ("logprobs is not supported with tools
+ stream", tools/server/server-common.cpp).

Why it refuses: with tools, its chat parser holds text back while it could
still be the start of a tool call, and a token whose text is held produces
no chunk, so its logprobs are never sent (C{send_partial_response} makes no
event when the parsed message did not change); text released later comes in
one chunk with only the last token's logprobs. Asked with C{n_probs}
instead, the stream's chunks carry logprobs, but those of held text are
lost (issue 35: content chunks with C{logprobs: null}).

What Blazar does: the engine is asked for the whole answer (not streamed,
where it gives every generated token's logprobs), and the client gets the
stream of that answer (L{stream_of}): the role chunk, a chunk per content
token with that token's logprobs (C{top_logprobs} cut to the client's
count, C{refusal: null}), the reasoning, a chunk per tool call, the
finishing chunk (with llama-server's C{timings}), the usage chunk if asked.
Tokens that are not the content's (the tool-call markup the engine parsed
away) have no logprobs, as OpenAI's tool-call chunks have none. The price:
the first chunk comes when the answer is done.
Pure: no reactor, no I/O.

Source: OpenAI's API reference, "The chat completion chunk object":
C{choices[].logprobs} is C{null} or C{{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}] | null, refusal: ... | null}}.
"""

from __future__ import annotations

import re
from typing import Any

from blazar.web.translate.completions import dumps


def tool_stream_logprobs(body: dict[str, Any]) -> int | None:
    """
    For a chat body the engine would refuse (C{logprobs: true}, a non-empty
    C{tools} array, C{stream: true}): how many alternatives the client wants
    per token (C{top_logprobs}, 0 when absent). L{None} for any other body.
    """
    tools = body.get("tools")
    if body.get("logprobs") is not True or body.get("stream") is not True:
        return None
    if not isinstance(tools, list) or not tools:
        return None
    top = body.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0


def whole_body(body: dict[str, Any]) -> dict[str, Any]:
    """
    The body the engine gets instead: the same request, not streamed.
    """
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


_REPLACED = re.compile("\ufffd+")


def _normal(text: str) -> str:
    """
    C{text} with each run of U+FFFD as one: the engine's parser and its
    token text can write a different number of them for the same bytes.
    """
    return _REPLACED.sub("\ufffd", text)


def _entry(entry: dict[str, Any], top: int) -> dict[str, Any]:
    kept = dict(entry)
    alternatives = entry.get("top_logprobs")
    kept["top_logprobs"] = list(alternatives[:top]) if isinstance(alternatives, list) else []
    return kept


def content_pieces(content: str, entries: list[Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """
    C{content} cut into pieces, each with the logprobs entries of its
    tokens: one piece per token while the tokens' text spells the content;
    where it does not (U+FFFD runs of another length), the rest of the
    content in one piece with the entries that spell it (up to those runs).
    Entries after the content (tool-call markup) are left out.
    """
    pieces: list[tuple[str, list[dict[str, Any]]]] = []
    pos = 0
    tokens = [e for e in entries if isinstance(e, dict) and isinstance(e.get("token"), str)]
    pending: list[dict[str, Any]] = []  # tokens with no text of their own (part of a character)
    for i, e in enumerate(tokens):
        token = e["token"]
        if pos >= len(content):
            if token or not pieces:
                break
            pieces[-1][1].append(e)  # (the bytes of a character the answer ends inside)
            continue
        if not token:
            pending.append(e)
            continue
        if content.startswith(token, pos):
            pieces.append((token, pending + [e]))
            pending = []
            pos += len(token)
            continue
        # the rest, with the entries whose text (U+FFFD runs as one) it begins with
        rest, spelled = _normal(content[pos:]), ""
        kept: list[dict[str, Any]] = pending
        for later in tokens[i:]:
            candidate = _normal(spelled + later["token"])
            if not rest.startswith(candidate):
                break
            spelled, kept = candidate, kept + [later]
        pieces.append((content[pos:], kept))
        pos = len(content)
        break
    if pos < len(content):
        pieces.append((content[pos:], pending))
    return pieces


def stream_of(answer: dict[str, Any], top: int, include_usage: bool) -> list[dict[str, Any]]:
    """
    A whole chat completion (the engine's, asked with C{logprobs}) as the
    chunks of its stream (see the module's docstring), every choice of it
    (C{n}) in turn.

    @param top: How many alternatives per token the client asked for.
    """
    base: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint") if k in answer}
    base["object"] = "chat.completion.chunk"
    choices = answer.get("choices")
    out = []
    for position, choice in enumerate(choices if isinstance(choices, list) and choices else [{}]):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index") if isinstance(choice.get("index"), int) else position
        found = choice.get("message")
        message: dict[str, Any] = found if isinstance(found, dict) else {}

        def chunk(
            delta: dict[str, Any], logprobs: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
        ) -> dict[str, Any]:
            return {
                **base,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }

        out.append(chunk({"role": "assistant", "content": None}))
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out.append(chunk({"reasoning_content": reasoning}))
        content = message.get("content")
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(content, str) and content:
            for text, kept in content_pieces(content, entries if isinstance(entries, list) else []):
                out.append(chunk({"content": text}, {"content": [_entry(e, top) for e in kept], "refusal": None}))
        for i, call in enumerate(message.get("tool_calls") or []):
            if isinstance(call, dict):
                out.append(chunk({"tool_calls": [{"index": i, **call}]}))
        timings = answer.get("timings")
        out.append(
            chunk(
                {},
                None,
                choice.get("finish_reason") or "stop",
                **({"timings": timings} if isinstance(timings, dict) and position == 0 else {}),
            )
        )
    if include_usage and isinstance(answer.get("usage"), dict):
        out.append({**base, "choices": [], "usage": answer["usage"]})
    return out


def encode(chunks: list[dict[str, Any]]) -> bytes:
    """
    Chunks as SSE events, then C{[DONE]}.
    """
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
