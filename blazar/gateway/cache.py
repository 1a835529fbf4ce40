"""
The semantic cache's decisions and its in-memory index (issue 26, part 2),
with no reactor and no I/O: which chat calls it may answer, what is
embedded, which answers may be reused for which call, and the index of
L2-normalized prompt vectors the lookup searches.

What a hit needs:
 - a chat call (L{blazar.gateway.call.CallKind.CHAT}) that is not
   streamed and carries no C{tools}, C{functions} or C{response_format}
   (those bypass the cache both ways: no lookup, no store: L{bypass});
 - the same I{scope} (L{scope_of}): the same canonical chat model, the same
   API key (by name; C{""} without keys), the same lane, and the same
   request in every other respect: every field but the few that cannot
   change the answer (L{UNHASHED}: an answer made at temperature 0 is not
   the answer to a request at temperature 1.5, nor one of 16 tokens to a
   request for 512), and every message exactly, the last user turn's text
   aside (its images, audio and files are hashed too);
 - a cosine similarity of at least the threshold between the embeddings of
   the two last user turns' texts (L{prompt_text}). Only that text is
   embedded: the context before it must be identical (in the scope), and
   embedded with it, a long shared context (an agent's system prompt)
   would make any two questions look alike.
 - an entry younger than C{ttl_secs}.

Entries are grouped by scope, and each scope's vectors are in a usearch
index (HNSW, cosine: L{Scope}); the cache as a whole holds at most its
C{max_entries} rows (default 10 000). The index is approximate, and that
costs only reuse, never correctness: the candidate it finds is checked
by its exact cosine against the threshold, so an approximation can make
a miss, never a hit that should not be. The rows live in SQLite
(L{blazar.store}, C{cache_entries}); the index is rebuilt from them at
start.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Iterable

import attrs
import numpy as np
import numpy.typing as npt
from usearch.index import Index

from blazar import strictjson
from blazar.gateway.remotewire import answer_chunks

Vector = npt.NDArray[np.float32]

# request fields that cannot change the answer: left out of the scope (every other field is in it)
UNHASHED = (
    "model",
    "messages",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "keep_alive",
    "prompt_cache_key",
    "safety_identifier",
)
# request fields that make a call bypass the cache both ways
BYPASS = ("tools", "functions", "response_format", "grammar", "json_schema")

HIT = "hit"
MISS = "miss"
BYPASSED = "bypass"  # enabled for the call, but a stream, tools or a response format (L{bypass})
FAILED = "error"  # enabled, but the prompt could not be embedded: the call went on uncached
HEADER = b"x-blazar-cache"


def enabled_for(enabled: bool, model: bool | None, key: bool | None) -> bool:
    """
    Whether a call uses the cache: the key's C{cache} if it says, else its
    model's, else C{[cache] enabled}.
    """
    return next(choice for choice in (key, model, enabled) if choice is not None)


def reissued(answer: bytes, id_: str, created: int) -> bytes:
    """
    A stored chat completion as a hit answers it: under a new C{id} and
    C{created} (UNIX seconds), so no two answers share an id; the rest (its
    text, its C{usage} as the engine counted it then) as it was made.
    """
    try:
        parsed = json.loads(answer)
    except ValueError:
        return answer
    if not isinstance(parsed, dict):
        return answer
    parsed["id"], parsed["created"] = id_, created
    return strictjson.encode(parsed, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def as_chunks(answer: bytes) -> list[dict[str, Any]]:
    """
    A stored chat completion as the chunks of the stream an engine would
    have sent for it (reasoning, text, the finish, then the usage), for a
    surface that reads a stream to make a whole answer (Anthropic
    Messages, the Responses API); L{answer_chunks} makes them.

    @return: The chunks; none if C{answer} is not a chat completion.
    """
    try:
        return answer_chunks(json.loads(answer), include_usage=True)
    except ValueError:  # not JSON, or no choices
        return []


class StreamedAnswer:
    """
    The chat completion a stream of chunks makes (text, reasoning, finish
    reason and usage; one choice), so an answer the engine streamed for a
    surface that answers whole can be stored as a non-streamed one.
    """

    def __init__(self) -> None:
        self._meta: dict[str, Any] = {}
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._other = False  # a tool call, a second choice, logprobs: not a plain answer

    def feed(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model"):
            if key in chunk and key not in self._meta:
                self._meta[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0 or choice.get("logprobs"):
                self._other = True
                continue
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or delta.get("function_call"):
                self._other = True
            if isinstance(delta.get("content"), str):
                self._content.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                self._reasoning.append(delta["reasoning_content"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    def completion(self) -> bytes | None:
        """
        The OpenAI chat completion, JSON; L{None} for a stream that did not
        finish, or carried more than one plain answer.
        """
        if self._finish is None or self._other:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        answer: dict[str, Any] = {
            **self._meta,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish}],
        }
        if self._usage is not None:
            answer["usage"] = self._usage
        return strictjson.encode(answer, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def storable(answer: bytes) -> bool:
    """
    Whether an engine's answer is one to keep: a chat completion with
    choices, each with a message and a finish reason.
    """
    try:
        parsed = json.loads(answer)
    except ValueError:
        return False
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, dict) and isinstance(c.get("message"), dict) and c.get("finish_reason") for c in choices)
    )


def bypass(body: dict[str, Any], stream: bool) -> str | None:
    """
    Why a chat call bypasses the cache (no lookup and no store), or
    L{None} if it may use it.

    @param body: The OpenAI-shaped chat body.
    @param stream: Whether the answer is streamed.
    @return: C{"stream"}, the first L{BYPASS} field present, C{"n"} for
        more than one choice, C{"no_user_turn"}, or L{None}.
    """
    if stream or body.get("stream") is True:
        return "stream"
    for field in BYPASS:
        if body.get(field) not in (None, [], {}):
            return field
    if body.get("n") not in (None, 1):
        return "n"
    if prompt_text(body) is None:
        return "no_user_turn"
    return None


def _last_user(body: dict[str, Any]) -> tuple[list[Any], int] | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=None)
    return None if last is None else (messages, last)


def prompt_text(body: dict[str, Any]) -> str | None:
    """
    What is embedded: the last user turn's text (its text parts, joined
    by newlines). What comes before it and its other parts are matched
    exactly instead (L{scope_of}).

    @return: The text, or L{None} if there is no user turn.
    """
    found = _last_user(body)
    if found is None:
        return None
    messages, last = found
    content = messages[last].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"] if isinstance(p, dict) else p
            for p in content
            if (isinstance(p, dict) and isinstance(p.get("text"), str)) or isinstance(p, str)
        )
    return ""


def scope_of(model: str, key: str, lane: str, body: dict[str, Any]) -> str:
    """
    The exact-match part of a hit: a hex sha256 over the canonical chat
    model, the key's name, the lane, every field of the request but
    L{UNHASHED}, and the messages with the last user turn's text taken out
    (its other parts, its name, and every other message, tool calls and
    results included, as they are).
    """
    found = _last_user(body)
    messages: list[Any] = list(found[0]) if found is not None else []
    if found is not None:
        turn = dict(messages[found[1]])
        content = turn.get("content")
        if isinstance(content, list):
            turn["content"] = [
                p
                for p in content
                if not (
                    isinstance(p, str)
                    or (isinstance(p, dict) and isinstance(p.get("text"), str) and p.get("type", "text") == "text")
                )
            ]
        else:
            turn.pop("content", None)
        messages[found[1]] = turn
    parts = {
        "model": model,
        "key": key,
        "lane": lane,
        "messages": messages,
        "fields": {k: v for k, v in body.items() if k not in UNHASHED},
    }
    return hashlib.sha256(strictjson.encode(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def normalized(values: Iterable[float]) -> Vector | None:
    """
    An embedding as a unit float32 vector, or L{None} if it has no length
    (or is not finite).
    """
    vector = np.asarray(list(values), dtype=np.float32)
    if vector.ndim != 1 or vector.size == 0 or not np.all(np.isfinite(vector)):
        return None
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:
        return None
    return (vector / norm).astype(np.float32)


def embedding_of(answer: Any) -> Vector | None:
    """
    The first embedding of an OpenAI C{/v1/embeddings} answer (or
    llama-server's native list form), normalized; L{None} if it has none.
    """
    if isinstance(answer, dict):
        data = answer.get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict):
            values = data[0].get("embedding")
            if isinstance(values, list) and values and isinstance(values[0], list):
                values = values[0]  # llama-server's per-token form, pooled none: the first
            return normalized(values) if isinstance(values, list) else None
    if isinstance(answer, list) and answer and isinstance(answer[0], dict):
        values = answer[0].get("embedding")
        if isinstance(values, list) and values and isinstance(values[0], list):
            values = values[0]
        return normalized(values) if isinstance(values, list) else None
    return None


def to_blob(vector: Vector) -> bytes:
    """
    A vector as SQLite stores it: float32, little-endian.
    """
    return vector.astype("<f4").tobytes()


def from_blob(blob: bytes) -> Vector:
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)


@attrs.frozen
class Entry:
    """
    One cached answer.

    @ivar id: Its row id in C{cache_entries}.
    @ivar scope: L{scope_of} the call it answered.
    @ivar created: UNIX seconds.
    @ivar vector: The prompt's unit vector.
    @ivar answer: The OpenAI chat completion, JSON bytes.
    """

    id: int
    scope: str
    created: float
    vector: Vector = attrs.field(eq=False)
    answer: bytes


class Scope:
    """
    The entries of one scope, their vectors in a usearch index (cosine,
    float32) keyed by entry id. Entries another embedding model made (of
    other dimensions) stay listed but are not searched: a lookup with
    vectors of the model now configured finds only its own.
    """

    CANDIDATES = 8  # nearest entries asked for first; more only if all are expired

    def __init__(self) -> None:
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._index: Index | None = None

    def add(self, entry: Entry) -> None:
        self.entries[entry.id] = entry
        dimensions = entry.vector.shape[0]
        if self._index is None or self._index.ndim != dimensions:
            # the first entry, or a new embedding model: an index of its dimensions
            self._index = Index(ndim=dimensions, metric="cos", dtype="f32")
            for other in self.entries.values():
                if other.vector.shape[0] == dimensions:
                    self._index.add(other.id, other.vector)
            return
        self._index.add(entry.id, entry.vector)

    def drop(self, id_: int) -> None:
        entry = self.entries.pop(id_, None)
        if entry is not None and self._index is not None and entry.vector.shape[0] == self._index.ndim:
            self._index.remove(id_)

    def best(self, vector: Vector, since: float) -> tuple[float, Entry] | None:
        """
        The live entry (created at or after C{since}) nearest to the unit
        vector C{vector} in the index, with its exact cosine similarity.
        """
        index = self._index
        if index is None or len(index) == 0 or index.ndim != vector.shape[0]:
            return None
        count = min(self.CANDIDATES, len(index))
        while True:
            matches = index.search(vector, count)
            for key in matches.keys:
                entry = self.entries.get(int(key))
                if entry is not None and entry.created >= since:
                    return float(np.dot(entry.vector, vector)), entry
            if count >= len(index):
                return None
            count = len(index)  # the nearest were all expired (the purge has not run yet): every one


class SemanticIndex:
    """
    Every live cache entry, by scope, at most C{max_entries} of them (the
    oldest go first), mirroring the C{cache_entries} rows.
    """

    def __init__(self) -> None:
        self._scopes: dict[str, Scope] = {}
        self._order: OrderedDict[int, str] = OrderedDict()  # id -> scope, oldest first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, id_: object) -> bool:
        return id_ in self._order

    def add(self, entry: Entry, max_entries: int) -> list[int]:
        """
        Add C{entry}; drop the oldest beyond C{max_entries}.

        @return: The ids dropped.
        """
        self._scopes.setdefault(entry.scope, Scope()).add(entry)
        self._order[entry.id] = entry.scope
        dropped = []
        while len(self._order) > max(max_entries, 0):
            id_, _ = next(iter(self._order.items()))
            self.drop(id_)
            dropped.append(id_)
        return dropped

    def drop(self, id_: int) -> None:
        scope = self._order.pop(id_, None)
        if scope is None:
            return
        entries = self._scopes[scope]
        entries.drop(id_)
        if not entries.entries:
            del self._scopes[scope]

    def purge(self, before: float) -> list[int]:
        """
        Drop every entry created before C{before}; the ids dropped.
        """
        gone = [id_ for id_, scope in self._order.items() if self._scopes[scope].entries[id_].created < before]
        for id_ in gone:
            self.drop(id_)
        return gone

    def lookup(
        self,
        scope: str,
        vector: Vector,
        now: float,
        ttl: float,
        threshold: float,
    ) -> tuple[float, Entry | None]:
        """
        The answer for a call of C{scope} whose prompt embeds to the unit
        vector C{vector}: the most similar entry of the same scope made
        within C{ttl} seconds of C{now}, if its cosine similarity is at
        least C{threshold}.

        @return: The best similarity found (C{-1.0}: none in the scope)
            and the entry, or L{None} below the threshold.
        """
        entries = self._scopes.get(scope)
        found = entries.best(vector, now - ttl) if entries is not None else None
        if found is None:
            return -1.0, None
        similarity, entry = found
        return similarity, entry if similarity >= threshold else None
