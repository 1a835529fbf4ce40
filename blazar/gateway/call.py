"""
The canonical call: what a surface decoded from its JSON, in one object
the pipeline (L{blazar.gateway.pipeline}) runs. A surface builds one per
request and never orchestrates the steps itself.
"""

from __future__ import annotations

import enum
from typing import Any, Awaitable, Callable

import attrs

from blazar.gateway.admission import WorkClass
from blazar.models.registry import ModelEntry


# Ollama's placement options and the model profile keys they set (blazar.config.PROFILE_KEYS)
OLLAMA_PLACEMENT = {"num_gpu": "gpu_layers", "main_gpu": "main_gpu", "num_thread": "threads", "use_mmap": "use_mmap"}


class CallKind(enum.Enum):
    """
    What the engine is asked to do; decides the purpose check and how the
    prompt is counted.
    """

    CHAT = "chat"
    COMPLETION = "completion"
    INFILL = "infill"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    TRANSCRIBE = "transcribe"  # speech to text (and translation): the whisper lane
    IMAGE = "image"  # image generation and edits: the sdcpp lane


class Counting(enum.Enum):
    """
    Whether the pipeline counts the prompt's tokens for the surface (a
    count the context preflight made is reused, never asked twice).
    """

    NEVER = "never"
    ALWAYS = "always"
    IF_READY = "if_ready"
    """Only when a ready child answers at once (a cold load is not waited
    for twice)."""


@attrs.define
class Call:
    """
    One request as the pipeline runs it.

    @ivar surface: C{"openai"}, C{"responses"}, C{"anthropic"} or
        C{"ollama"} (log lines, C{x-blazar-ignored}).
    @ivar kind: The L{CallKind}.
    @ivar model: The model as the client spelled it.
    @ivar entry: The model, resolved once by the scope step (L{None}
        before it, or on a pipeline without a registry).
    @ivar path: The engine path (C{/v1/chat/completions}, C{/infill}, ...).
    @ivar body: The OpenAI-shaped body the engine gets; the pipeline's
        steps may change it (system-message placement, L{rewrite}).
    @ivar raw: C{body} encoded, if the surface has it (the client's own
        bytes, when nothing changed); L{None}: the pipeline encodes it,
        once, after every step that may change it.
    @ivar stream: Whether the engine streams its answer.
    @ivar keep_alive: Seconds to keep the child after this request
        (L{None}: the model's default; 0 unloads it).
    @ivar ctx_size: The context per slot the request asks for (Ollama's
        C{num_ctx}), or L{None}.
    @ivar max_tokens: The output limit the context preflight checks, or
        L{None} (no preflight).
    @ivar work: The L{WorkClass} admission queues it in.
    @ivar names: What the client's API calls the output limit and the
        prompt, for the preflight's message (C{("max_output_tokens",
        "input")} on the Responses API, C{("num_predict", "messages")} on
        Ollama's).
    @ivar counting: Whether the surface needs the prompt's token count
        (L{Reply.prompt_tokens}).
    @ivar rewrite: A surface's step after placement and before the
        preflight (e.g. the OpenAI surface's engine fixes); it may replace
        C{body} (set C{raw} to L{None} when it does).
    @ivar on_send: Called with whether the model must be loaded first,
        right before the pipeline waits for a child: a streaming surface
        writes its headers (and starts keep-alive pings) there; it returns
        what stops those pings once the child answered, or L{None}.
    """

    surface: str
    kind: CallKind
    model: str
    path: str
    body: dict[str, Any]
    raw: bytes | None = None
    stream: bool = False
    keep_alive: float | None = None
    ctx_size: int | None = None
    # the placement the request asks for, as profile keys (Ollama's options: OLLAMA_PLACEMENT)
    profile: dict[str, Any] | None = None
    max_tokens: int | None = None
    work: WorkClass = WorkClass.INTERACTIVE
    names: tuple[str, str] = ("max_tokens", "messages")
    counting: Counting = Counting.NEVER
    rewrite: Callable[[Call], Awaitable[None]] | None = None
    on_send: Callable[[bool], Callable[[], None] | None] | None = None
    entry: ModelEntry | None = None
    session_hint: str | None = None
    lane: Any = None  # the command lane that serves it (blazar.config.CommandLane), or None: llama.cpp
    content_type: str = "application/json"  # of raw, as the engine gets it
    audio: bytes | None = None  # a transcription's upload, as the client sent it (the audio step converts it)
    audio_fields: dict[str, str] | None = None  # whisper-server's form fields beside the converted file
    images: list[bytes] | None = None  # an image edit's uploads (their sizes are checked before admission)
    # whether the client gets a stream, where that is not C{stream} (Anthropic Messages and the Responses
    # API read the engine's stream to make a whole answer too): the semantic cache's bypass; None: C{stream}
    client_stream: bool | None = None

    @property
    def embedding(self) -> bool:
        return self.kind is CallKind.EMBEDDING


def max_tokens_of(body: dict[str, Any]) -> int | None:
    """
    The output limit of an OpenAI-shaped body (C{max_completion_tokens},
    else C{max_tokens}), if it is a non-negative integer; anything else is
    the engine's to refuse.
    """
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
