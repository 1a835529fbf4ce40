"""
OpenAI's legacy Completions (C{POST /v1/completions}) as clients expect it,
from what llama-server answers there.

Source: OpenAI's API reference, "Completions" (legacy). A completion is
C{{id, object: "text_completion", created, model, system_fingerprint,
choices: [{text, index, logprobs, finish_reason}], usage}}, and
C{choices[].logprobs} is C{null} or C{{tokens: [str], token_logprobs:
[float|null], top_logprobs: [{token: logprob}|null], text_offset: [int]}}.
The request's C{logprobs} is an integer N: the N most likely tokens at
each position, plus the sampled one (so up to N + 1 entries); C{text_offset}
counts characters from the start of the prompt; C{echo: true} puts the
prompt in front of the text (and its tokens in front of the logprobs, the
first with C{null}). A stream with C{stream_options.include_usage} ends with
one chunk whose C{choices} is C{[]} and whose C{usage} covers the request.

What the pinned llama-server does instead (tools/server, measured):
  - logprobs in the chat shape C{{content: [{id, token, bytes, logprob,
    top_logprobs: [{id, token, bytes, logprob}]}]}} (its own TODO says so);
  - C{echo: true} refused ("Only no echo is supported");
  - in a stream, each choice's last chunk carries its C{finish_reason} and
    the choice's C{usage} (and C{timings}) in one chunk, whatever
    C{include_usage} says; a stream of several prompts starts with
    C{data: null}.

So the engine is asked for C{n_probs} (its own name, which it also takes
for logprobs N) without C{echo}, and the answer is rebuilt here. Prompt
tokens that C{echo} returns come from the engine's C{/tokenize}
(C{with_pieces}); the engine cannot score a prompt, so their logprobs are
C{null}. Pure: no reactor, no I/O.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable

import attrs

from blazar import strictjson
from blazar.gateway.errors import BadRequest


class CompletionRequestError(BadRequest):
    """
    The request's C{logprobs} or C{echo} is malformed (answered as 400).

    @ivar param: The offending field.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


@attrs.frozen
class CompletionPlan:
    """
    What Blazar changes in a completion request and must undo in its reply.

    @ivar logprobs: The client's N, or L{None} when it asked for none.
    @ivar echo: The client asked for its prompt back.
    @ivar n: Choices per prompt (C{n}; the engine numbers choices
        prompt by prompt: choice C{i} answers prompt C{i // n}).
    @ivar include_usage: The stream ends with a usage chunk.
    @ivar engine_body: The body to send to the engine (the client's own
        object when nothing in it changes).
    """

    logprobs: int | None
    echo: bool
    n: int
    include_usage: bool
    engine_body: dict[str, Any]

    @property
    def rewrites(self) -> bool:
        """
        Whether every chunk of the reply is rebuilt (otherwise only the ones
        that carry C{usage} are).
        """
        return self.echo or self.logprobs is not None

    @property
    def needs_pieces(self) -> bool:
        """
        Whether the prompts' tokens must be fetched (L{prompt_text}): echoed
        logprobs list them, and a prompt given as token ids has no text
        until they are read back.
        """
        prompts = prompts_of(self.engine_body.get("prompt"))
        return (self.echo and self.logprobs is not None) or (
            self.rewrites and not all(isinstance(p, str) for p in prompts)
        )


def plan_completion(body: dict[str, Any]) -> CompletionPlan:
    """
    The plan for a C{/v1/completions} body (already validated as a JSON
    object with a C{prompt}).

    @raise CompletionRequestError: C{logprobs} is not a non-negative
        integer, or C{echo} is not a boolean.
    """
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise CompletionRequestError(
            "'logprobs' on /v1/completions is an integer: how many of the most likely tokens "
            "to return at each position (0 for the sampled token only)",
            "logprobs",
        )
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise CompletionRequestError("'echo' must be true or false", "echo")
    n = body.get("n")
    options = body.get("stream_options")
    if "logprobs" in body or "echo" in body:
        engine_body = {k: v for k, v in body.items() if k not in ("logprobs", "echo")}
    else:
        engine_body = body  # nothing to change: the same object
    if logprobs is not None:
        # the engine has no "sampled token only": ask for one, trim to N
        engine_body["n_probs"] = max(logprobs, 1)
    return CompletionPlan(
        logprobs=logprobs,
        echo=bool(echo),
        n=n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        engine_body=engine_body,
    )


def prompts_of(prompt: Any) -> list[Any]:
    """
    The prompts of a C{prompt} field, as the engine splits them: a string
    or an array of token ids is one prompt; any other array is one prompt
    per element.
    """
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return list(prompt)
    return [prompt]


@attrs.frozen
class PromptText:
    """
    One prompt as the client sees it echoed.

    @ivar text: The prompt's text.
    @ivar tokens: Its tokens, as legacy logprobs name them (a token that is
        not whole UTF-8 is C{"bytes:\\xNN..."}, as OpenAI writes them);
        empty when they were not fetched.
    @ivar offsets: Each token's character offset in C{text}.
    """

    text: str
    tokens: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()


def prompt_text(prompt: Any, pieces: Iterable[Any] | None = None) -> PromptText:
    """
    A prompt's text and tokens.

    @param prompt: One prompt (L{prompts_of}): a string, or token ids.
    @param pieces: The C{tokens} of the engine's C{/tokenize} answer with
        C{with_pieces: true} (C{[{id, piece}]}, a piece being a string, or
        a list of byte values when it is not valid UTF-8 alone); L{None} if
        not fetched.
    """
    if pieces is None:
        return PromptText(prompt if isinstance(prompt, str) else "")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text, tokens, offsets = "", [], []
    for entry in pieces:
        piece = entry.get("piece") if isinstance(entry, dict) else None
        if isinstance(piece, str):
            raw, name = piece.encode("utf-8"), piece
        elif isinstance(piece, list):
            raw = bytes(b & 0xFF for b in piece if isinstance(b, int))
            name = _bytes_name(raw)
        else:
            continue
        offsets.append(len(text))
        tokens.append(name)
        text += decoder.decode(raw)
    text += decoder.decode(b"", final=True)
    if isinstance(prompt, str):
        text = prompt  # the client's own text, exactly
    return PromptText(text, tuple(tokens), tuple(offsets))


def legacy_logprobs(entries: Iterable[dict[str, Any]], top: int, offset: int) -> tuple[dict[str, list[Any]], int]:
    """
    The engine's chat-shaped logprobs as OpenAI's legacy ones.

    @param entries: C{logprobs.content} from the engine: C{[{id, token,
        bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}]}.
    @param top: The client's N: alternatives kept per position (the sampled
        token is always in C{top_logprobs}, so up to N + 1).
    @param offset: The character offset of the first token.
    @return: C{{tokens, token_logprobs, top_logprobs, text_offset}} and the
        offset after the last token.
    """
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        text = entry.get("token")
        text = text if isinstance(text, str) else ""
        name = token_name(entry)
        logprob = entry.get("logprob")
        alternatives: dict[str, Any] = {}
        for alt in (entry.get("top_logprobs") or [])[:top]:
            if isinstance(alt, dict):
                alternatives.setdefault(token_name(alt), alt.get("logprob"))
        alternatives.setdefault(name, logprob)
        out["tokens"].append(name)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)  # the engine's text for it, as it is in the choice's text
    return out, offset


def token_name(entry: dict[str, Any]) -> str:
    """
    A token as legacy logprobs name it: its text, or, when its bytes are not
    whole UTF-8 (the engine then writes C{""} or U+FFFD for them),
    C{"bytes:\\xNN..."}, as OpenAI writes such tokens.

    @param entry: An engine logprobs entry: C{{token, bytes, ...}}.
    """
    text = entry.get("token")
    text = text if isinstance(text, str) else ""
    raw = entry.get("bytes")
    if not isinstance(raw, list) or not all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return text
    data = bytes(raw)
    if data == text.encode("utf-8"):
        return text
    return _bytes_name(data)


def _bytes_name(data: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _echoed_logprobs(prompt: PromptText) -> dict[str, list[Any]]:
    """
    The legacy logprobs of an echoed prompt: its tokens and offsets, with
    C{null} where the engine gives no number.
    """
    return {
        "tokens": list(prompt.tokens),
        "token_logprobs": [None] * len(prompt.tokens),
        "top_logprobs": [None] * len(prompt.tokens),
        "text_offset": list(prompt.offsets),
    }


def _joined(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: first[k] + second[k] for k in first}


def _engine_entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [e for e in content if isinstance(e, dict)] if isinstance(content, list) else []


def _prompt_for(plan: CompletionPlan, prompts: list[PromptText], index: Any) -> PromptText:
    i = index // plan.n if isinstance(index, int) and not isinstance(index, bool) else 0
    return prompts[i] if 0 <= i < len(prompts) else PromptText("")


def completion_reply(reply: dict[str, Any], plan: CompletionPlan, prompts: list[PromptText]) -> dict[str, Any]:
    """
    A non-streamed engine reply as OpenAI's legacy completion.

    @param prompts: One per prompt (L{prompts_of}), by L{prompt_text}.
    """
    if not plan.rewrites:
        return reply
    choices = []
    for choice in reply.get("choices") or []:
        if not isinstance(choice, dict):
            choices.append(choice)
            continue
        choice = dict(choice)
        prompt = _prompt_for(plan, prompts, choice.get("index"))
        if plan.logprobs is not None:
            logprobs, _ = legacy_logprobs(_engine_entries(choice), plan.logprobs, len(prompt.text))
            if plan.echo:
                logprobs = _joined(_echoed_logprobs(prompt), logprobs)
            choice["logprobs"] = logprobs
        if plan.echo:
            text = choice.get("text")
            choice["text"] = prompt.text + (text if isinstance(text, str) else "")
        choices.append(choice)
    return {**reply, "choices": choices}


_ENVELOPE = ("id", "object", "created", "model", "system_fingerprint")


class CompletionStream:
    """
    An engine's C{/v1/completions} stream, chunk by chunk, as OpenAI's: a
    choice's first chunk is preceded by its echoed prompt, logprobs are
    legacy, usage leaves the choices' chunks and comes once, summed, in a
    chunk with C{choices: []} just before C{[DONE]} (when the plan's
    C{include_usage} asks for it).
    """

    def __init__(self, plan: CompletionPlan, prompts: list[PromptText]) -> None:
        self._plan = plan
        self._prompts = prompts
        self._offsets: dict[Any, int] = {}
        self._usage: dict[str, Any] | None = None
        self._envelope: dict[str, Any] = {"object": "text_completion"}

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """
        The chunks the client gets for one engine chunk (an error chunk, or
        anything without C{choices}, passes unchanged).
        """
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return [chunk]
        out: list[dict[str, Any]] = []
        chunk = dict(chunk)
        self._envelope = {k: chunk[k] for k in _ENVELOPE if k in chunk}
        usage = chunk.pop("usage", None)
        if isinstance(usage, dict):
            self._add_usage(usage)
        kept = []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            choice = dict(choice)
            index = choice.get("index")
            prompt = _prompt_for(self._plan, self._prompts, index)
            if index not in self._offsets:
                self._offsets[index] = len(prompt.text)
                if self._plan.echo:
                    out.append(
                        {
                            **self._envelope,
                            "choices": [
                                {
                                    "text": prompt.text,
                                    "index": index,
                                    "finish_reason": None,
                                    "logprobs": _echoed_logprobs(prompt) if self._plan.logprobs is not None else None,
                                }
                            ],
                        }
                    )
            if self._plan.logprobs is not None:
                entries = _engine_entries(choice)
                if entries:
                    choice["logprobs"], self._offsets[index] = legacy_logprobs(
                        entries, self._plan.logprobs, self._offsets[index]
                    )
                else:
                    choice["logprobs"] = None
            kept.append(choice)
        if kept or not out:
            chunk["choices"] = kept
            out.append(chunk)
        return out

    def _add_usage(self, usage: dict[str, Any]) -> None:
        if self._usage is None:
            self._usage = {}
        for key, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                self._usage[key] = self._usage.get(key, 0) + value
            elif isinstance(value, dict):
                inner = self._usage.setdefault(key, {})
                if isinstance(inner, dict):
                    for k, v in value.items():
                        if isinstance(v, int) and not isinstance(v, bool):
                            inner[k] = inner.get(k, 0) + v

    def done(self) -> list[dict[str, Any]]:
        """
        The chunks that go just before C{[DONE]}: the usage chunk, if asked
        for and the engine reported usage.
        """
        if not self._plan.include_usage or self._usage is None:
            return []
        return [{**self._envelope, "choices": [], "usage": self._usage}]

    def event(self, payload: bytes) -> list[bytes]:
        """
        L{chunk} on one SSE C{data} payload (C{[DONE]} gets L{done} first),
        as compact JSON payloads, the way the engine writes them.
        """
        if payload == b"[DONE]":
            return [dumps(c) for c in self.done()] + [payload]
        try:
            chunk = strictjson.parse(payload)
        except (ValueError, UnicodeDecodeError):
            return [payload]
        if chunk is None:
            return []  # the engine opens a stream of several prompts with "data: null"
        if not isinstance(chunk, dict):
            return [payload]
        return [dumps(c) for c in self.chunk(chunk)]


def dumps(value: Any) -> bytes:
    """
    Compact JSON, UTF-8, as llama-server writes it (so the model renamer's
    byte match still finds C{"model":"..."}).
    """
    return strictjson.compact(value)
