"""
The canonical call: what a surface decoded from its JSON, in one frozen
object (L{Call}) the pipeline (L{blazar.gateway.pipeline}) runs. A surface
builds one per request, whole, and never orchestrates the steps itself;
what the pipeline's steps make of it (the model's entry and lane, a body
they change) is the pipeline's own L{Run}.
"""

from __future__ import annotations

import enum
from typing import Any, Awaitable, Callable, Generic, TypeVar

import attrs

from blazar.gateway.admission import WorkClass
from blazar.gateway.priority import Priority
from blazar.models.registry import ModelEntry

T = TypeVar("T")

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


@attrs.frozen
class Asked:
    """
    What a client asked beside its body (its request's headers), decoded
    once by the surface: the gateway reads these, never the headers.

    @ivar priority: The admission tier (C{x-blazar-priority}, else GIE's
        C{x-gateway-inference-objective}).
    @ivar deadline: Seconds the request may wait for a slot
        (C{x-blazar-deadline-ms}, else GIE's C{x-slo-ttft-ms}), or L{None}.
    @ivar session: The session it names (C{x-blazar-session}, GIE's
        C{x-session-id}, an agent's session header, else its body's hint:
        L{blazar.gateway.sessions.session_name}), or L{None}.
    @ivar fairness: The fairness id it names within its API key (GIE's
        C{x-gateway-inference-fairness-id}: its own flow in admission's
        weighted fair queuing), or L{None}.
    @ivar ignored: Header names whose values were not honoured, for
        C{x-blazar-ignored} (the pipeline notes them).
    """

    priority: Priority = Priority.NORMAL
    deadline: float | None = None
    session: str | None = None
    fairness: str | None = None
    ignored: tuple[str, ...] = ()


@attrs.frozen
class Call:
    """
    One request as its surface decoded it, built whole.

    @ivar surface: C{"openai"}, C{"responses"}, C{"anthropic"} or
        C{"ollama"} (log lines, C{x-blazar-ignored}).
    @ivar kind: The L{CallKind}.
    @ivar model: The model as the client spelled it.
    @ivar path: The engine path (C{/v1/chat/completions}, C{/infill}, ...).
    @ivar body: The OpenAI-shaped body the engine gets; the pipeline's
        steps may change it (system-message placement, L{rewrite}): the
        surface hands it over.
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
        the L{Run}'s C{body} (set its C{raw} to L{None} when it does).
    @ivar asked: What the client asked beside its body (L{Asked}).
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
    rewrite: Callable[[Run], Awaitable[None]] | None = None
    on_send: Callable[[bool], Callable[[], None] | None] | None = None
    asked: Asked = Asked()
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


class Decoded(Generic[T]):
    """
    An attribute of a L{Run} that reads the same-named one of its L{Call}:
    what the pipeline's steps never change.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, run: Any, owner: Any = None) -> T:
        return getattr(run.call, self._name)


@attrs.define
class Run:
    """
    A L{Call} as the pipeline runs it: the surface's call, as decoded, and
    what the steps make of it.

    @ivar call: The surface's call.
    @ivar body: The body the engine gets (C{call.body} until a step
        replaces it).
    @ivar raw: C{body} encoded, or L{None}: the pipeline encodes it.
    @ivar ctx_size: The context per slot (the call's, or the model's own
        C{num_ctx}).
    @ivar max_tokens: The output limit the preflight checks (the call's,
        or the model's own C{num_predict}).
    @ivar content_type: Of C{raw}, as the engine gets it.
    @ivar audio: A transcription's upload until the audio step converted it.
    @ivar entry: The model, resolved once by the scope step (L{None}
        before it, or on a pipeline without a registry).
    @ivar lane: The command lane that serves it (L{blazar.config.CommandLane}),
        or L{None}: llama.cpp.
    @ivar on_send: C{call.on_send}, or what the surface's glue wrapped it
        in (L{Run.of}).
    @ivar headers: The response headers the steps decided so far
        (C{x-blazar-cache}, C{x-blazar-queue-ms}, an enforced refusal's
        C{x-blazar-sentinel}), in the order decided:
        the reply carries them, and so does a failure
        (L{blazar.gateway.pipeline.Opened.headers}).
    """

    call: Call
    body: dict[str, Any]
    raw: bytes | None
    ctx_size: int | None
    max_tokens: int | None
    content_type: str
    audio: bytes | None
    entry: ModelEntry | None = None
    lane: Any = None
    headers: dict[bytes, bytes] = attrs.Factory(dict)
    on_send: Callable[[bool], Callable[[], None] | None] | None = None

    @classmethod
    def of(cls, call: Call, on_send: Callable[[bool], Callable[[], None] | None] | None = None) -> Run:
        """
        The run of C{call}, before any step.

        @param on_send: What the run calls instead of C{call.on_send} (a
            wrapper of it: L{blazar.web.client.opened}), if given.
        """
        return cls(
            call,
            call.body,
            call.raw,
            call.ctx_size,
            call.max_tokens,
            call.content_type,
            call.audio,
            on_send=on_send if on_send is not None else call.on_send,
        )

    # what the steps never change: the surface's call, as decoded
    surface = Decoded[str]()
    kind = Decoded[CallKind]()
    model = Decoded[str]()
    path = Decoded[str]()
    stream = Decoded[bool]()
    keep_alive = Decoded["float | None"]()
    profile = Decoded["dict[str, Any] | None"]()
    work = Decoded[WorkClass]()
    names = Decoded["tuple[str, str]"]()
    counting = Decoded[Counting]()
    rewrite = Decoded["Callable[[Run], Awaitable[None]] | None"]()
    asked = Decoded[Asked]()
    audio_fields = Decoded["dict[str, str] | None"]()
    images = Decoded["list[bytes] | None"]()
    client_stream = Decoded["bool | None"]()
    embedding = Decoded[bool]()


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
