"""
Chat Completions logprobs on a streamed request with tools, which the
pinned llama-server refuses with 400 ("logprobs is not supported with tools
+ stream", tools/server/server-common.cpp).

Why it refuses: with tools, its chat parser holds text back while it could
still be the start of a tool call, and a token whose text is held produces
no chunk, so its logprobs are never sent; text released later comes in one
chunk with only the last token's logprobs, and a token that starts a tool
call puts its logprobs on the tool-call chunk. Its logprobs would no longer
line up with the text.

What Blazar does: the engine gets the request without C{logprobs} and
C{top_logprobs} but with C{n_probs} (llama.cpp's own field, which that check
does not look at), so every chunk it sends for a token carries that token's
logprobs in OpenAI's chat shape (C{{content: [{id, token, bytes, logprob,
top_logprobs}]}}). Then, chunk by chunk:
  - a content chunk whose text is its tokens' text (up to how many U+FFFD
    stand for bytes that are not UTF-8) keeps them
    (C{top_logprobs} cut to the client's count), with C{refusal: null}, as
    OpenAI's chat chunk has it;
  - any other chunk (the role chunk, tool-call chunks, reasoning chunks,
    the finishing chunk, content whose tokens were held back and lost) gets
    C{logprobs: null}.
Pure: no reactor, no I/O.

Source: OpenAI's API reference, "The chat completion chunk object":
C{choices[].logprobs} is C{null} or C{{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}] | null, refusal: ... | null}}.
"""

from __future__ import annotations

import json
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


def engine_body(body: dict[str, Any], top: int) -> dict[str, Any]:
    """
    The body the engine gets instead: C{logprobs} and C{top_logprobs} out,
    C{n_probs} in (at least 1: the engine sends no logprobs at 0).
    """
    out = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    out["n_probs"] = max(top, 1)
    return out


_REPLACED = re.compile("\ufffd+")


def _same_text(tokens: str, content: str) -> bool:
    """
    Whether C{content} is the text of C{tokens}, up to how bytes that are
    not UTF-8 were replaced: the engine's parser and its token text can
    write a different number of U+FFFD for the same bytes.
    """
    return tokens == content or _REPLACED.sub("\ufffd", tokens) == _REPLACED.sub("\ufffd", content)


def _entry(entry: dict[str, Any], top: int) -> dict[str, Any]:
    kept = dict(entry)
    alternatives = entry.get("top_logprobs")
    kept["top_logprobs"] = list(alternatives[:top]) if isinstance(alternatives, list) else []
    return kept


class ToolStreamLogprobs:
    """
    Puts OpenAI's C{logprobs} on each chunk of such a stream (see the
    module's docstring).

    @ivar filled: Content chunks that got their logprobs.
    @ivar unfilled: Content chunks that got C{null} (their tokens were not
        all sent by the engine).
    """

    def __init__(self, top: int) -> None:
        self._top = top
        self.filled = 0
        self.unfilled = 0

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """
        One engine chunk with its C{logprobs} set.
        """
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return chunk
        out = []
        for choice in choices:
            if isinstance(choice, dict):
                choice = {**choice, "logprobs": self._logprobs(choice)}
            out.append(choice)
        return {**chunk, "choices": out}

    def _logprobs(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        content = delta.get("content")
        if not isinstance(content, str) or not content or delta.get("tool_calls"):
            return None
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if (
            isinstance(entries, list) and entries
            and all(isinstance(e, dict) and isinstance(e.get("token"), str) for e in entries)
            and _same_text("".join(e["token"] for e in entries), content)
        ):
            self.filled += 1
            return {"content": [_entry(e, self._top) for e in entries], "refusal": None}
        self.unfilled += 1
        return None

    def event(self, payload: bytes) -> list[bytes]:
        """
        L{chunk} on one SSE C{data} payload (C{[DONE]} and anything that is
        not a JSON object pass unchanged).
        """
        if payload == b"[DONE]":
            return [payload]
        try:
            chunk = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return [payload]
        if not isinstance(chunk, dict):
            return [payload]
        return [dumps(self.chunk(chunk))]
