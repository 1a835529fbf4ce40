"""
What Blazar does with each request field a client may send, one table per
surface: the leniency policy.

A client cannot know which optional fields a local server understands, so
every field the current references define is accepted: OpenAI's Chat
Completions, Completions, Embeddings and Responses, Anthropic's Messages and
Ollama's C{/api/chat}, C{/api/generate} and C{/api/embed}, plus llama.cpp's
own sampling extensions. A field is one of:

  - I{honoured}: it does what the reference says;
  - I{ignored}: it only describes the request (metadata, caching hints,
    service tiers, ...) or asks for something a local model cannot do
    without changing the answer's meaning (a built-in web search the model
    simply does not get); it is accepted and named in the response's
    C{x-blazar-ignored} header;
  - I{refused}: honouring it is impossible and ignoring it would silently
    change what the answer means (C{background: true}, audio output, ...):
    a 400 that names it. A refusal is a predicate on the value, so the
    harmless values of the same field pass (C{background: false}).

Fields no table knows (a future client release) are accepted and ignored,
listed the same way, never a 400. Pure: no reactor, no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from blazar.gateway.errors import BadRequest

# llama.cpp's own request fields (tools/server/server-schema.cpp of the
# pinned engine, names and aliases): forwarded to the engine, which honours them
LLAMACPP = frozenset(
    {
        "adaptive_decay",
        "adaptive_target",
        "backend_sampling",
        "cache_prompt",
        "chat_format",
        "chat_parser",
        "chat_template_kwargs",
        "continue_final_message",
        "dry_allowed_length",
        "dry_base",
        "dry_multiplier",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "dynatemp_exponent",
        "dynatemp_range",
        "generation_prompt",
        "grammar",
        "grammar_lazy",
        "grammar_triggers",
        "id_slot",
        "ignore_eos",
        "json_schema",
        "lora",
        "min_keep",
        "min_p",
        "mirostat",
        "mirostat_eta",
        "mirostat_tau",
        "n_cache_reuse",
        "n_cmpl",
        "n_discard",
        "n_indent",
        "n_keep",
        "n_predict",
        "n_probs",
        "parse_tool_calls",
        "post_sampling_probs",
        "preserved_tokens",
        "reasoning_budget_tokens",
        "reasoning_budget_message",
        "reasoning_control",
        "reasoning_format",
        "repeat_last_n",
        "repeat_penalty",
        "response_fields",
        "return_progress",
        "return_tokens",
        "samplers",
        "sse_ping_interval",
        "t_max_predict_ms",
        "t_max_prompt_ms",
        "thinking_budget_tokens",
        "timings_per_token",
        "top_k",
        "top_n_sigma",
        "typical_p",
        "xtc_probability",
        "xtc_threshold",
        "keep_alive",  # Blazar's own (Ollama's semantics), on every surface
    }
)


class MeaningChanged(BadRequest):
    """
    A field Blazar can neither honour nor ignore without changing what the
    answer means (400 naming it).

    @ivar field: The field's name.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message, field)


Refusal = Callable[[Any], "str | None"]


def _truthy(reason: str) -> Refusal:
    return lambda value: reason if value not in (None, False, 0, "", [], {}) else None


def _audio_out(value: Any) -> str | None:
    if isinstance(value, list) and "audio" in value:
        return 'audio output is not available from local text models; ask for modalities ["text"]'
    return None


def _functions(value: Any) -> str | None:
    if value:
        return "the deprecated functions/function_call fields are not served; send tools and tool_choice instead"
    return None


def _conversation(value: Any) -> str | None:
    if value is not None:
        return (
            "server-side conversation objects are not available; send the history in input, "
            "or chain turns with previous_response_id"
        )
    return None


def _prompt_template(value: Any) -> str | None:
    if value is not None:
        return "stored prompt templates are not available on this gateway; send instructions and input instead"
    return None


def _suffix(value: Any) -> str | None:
    if value not in (None, ""):
        return (
            "suffix (fill-in-the-middle) is served by Ollama's /api/generate on this gateway; "
            "send the same request there with prompt and suffix"
        )
    return None


def _template(value: Any) -> str | None:
    if value not in (None, ""):
        return (
            "a per-request prompt template is not available: the model's own chat template is used; "
            "send raw: true with a prompt you formatted yourself"
        )
    return None


def _dimensions(value: Any) -> str | None:
    if value is not None:
        return "dimensions (shortened embeddings) is not available; leave it out to get the model's own size"
    return None


#: surface -> (honoured, ignored, refused)
Policy = tuple[frozenset[str], frozenset[str], Mapping[str, Refusal]]

_CHAT_HONOURED = frozenset(
    {
        "model",
        "messages",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "parallel_tool_calls",
        "presence_penalty",
        "reasoning_effort",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "modalities",
        "prompt_cache_key",  # names the request's session (blazar.gateway.sessions)
    }
)
_CHAT_IGNORED = frozenset(
    {
        "metadata",
        "store",
        "user",
        "safety_identifier",
        "service_tier",
        "prompt_cache_retention",
        "verbosity",
        "prediction",
        "web_search_options",
    }
)

POLICIES: dict[str, Policy] = {
    # OpenAI POST /v1/chat/completions
    "chat": (
        _CHAT_HONOURED | LLAMACPP,
        _CHAT_IGNORED,
        {
            "modalities": _audio_out,
            "audio": _truthy("audio output is not available from local text models; leave audio out"),
            "functions": _functions,
            "function_call": _functions,
        },
    ),
    # OpenAI POST /v1/completions (legacy)
    "completion": (
        frozenset(
            {
                "model",
                "prompt",
                "frequency_penalty",
                "logit_bias",
                "logprobs",
                "max_tokens",
                "n",
                "presence_penalty",
                "seed",
                "stop",
                "stream",
                "stream_options",
                "temperature",
                "top_p",
                "echo",
            }
        )
        | LLAMACPP,
        frozenset({"user", "best_of"}),
        {"suffix": _suffix},
    ),
    # OpenAI POST /v1/embeddings
    "embedding": (
        frozenset({"model", "input", "encoding_format"}) | LLAMACPP,
        frozenset({"user"}),
        {"dimensions": _dimensions},
    ),
    # OpenAI POST /v1/responses
    "responses": (
        frozenset(
            {
                "model",
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "max_output_tokens",
                "temperature",
                "top_p",
                "text",
                "reasoning",
                "metadata",
                "store",
                "previous_response_id",
                "stream",
                "seed",
                "logit_bias",
                "keep_alive",
                "background",
                "prompt_cache_key",  # names the request's session (blazar.gateway.sessions)
            }
        ),
        frozenset(
            {
                "user",
                "truncation",
                "safety_identifier",
                "prompt_cache_retention",
                "service_tier",
                "include",
                "stream_options",
                "client_metadata",
                "max_tool_calls",
                "top_logprobs",
                "context_management",
            }
        ),
        {
            "background": _truthy(
                "background responses are not available; send the request without "
                "background and keep the connection (or stream)"
            ),
            "conversation": _conversation,
            "prompt": _prompt_template,
        },
    ),
    # Anthropic POST /v1/messages (and count_tokens)
    "anthropic": (
        frozenset(
            {
                "model",
                "messages",
                "max_tokens",
                "system",
                "stop_sequences",
                "stream",
                "temperature",
                "top_k",
                "top_p",
                "tools",
                "tool_choice",
                "thinking",
                "output_config",
                "keep_alive",
                "logit_bias",
            }
        ),
        frozenset(
            {
                "metadata",
                "service_tier",
                "context_management",
                "container",
                "mcp_servers",
                "inference_geo",
            }
        ),
        {},
    ),
    # Ollama POST /api/chat
    "ollama_chat": (
        frozenset(
            {
                "model",
                "messages",
                "tools",
                "format",
                "options",
                "stream",
                "keep_alive",
                "think",
                "tool_choice",
                "parallel_tool_calls",  # Blazar's: a forced call (blazar.gateway.toolcalls)
            }
        ),
        frozenset({"logprobs", "top_logprobs", "truncate", "shift"}),
        {},
    ),
    # Ollama POST /api/generate
    "ollama_generate": (
        frozenset(
            {
                "model",
                "prompt",
                "suffix",
                "images",
                "format",
                "options",
                "system",
                "stream",
                "raw",
                "keep_alive",
                "think",
            }
        ),
        frozenset(
            {"logprobs", "top_logprobs", "truncate", "shift", "context", "width", "height", "steps"}
        ),  # Ollama's image fields, on a text model
        {"template": _template},
    ),
    # Ollama POST /api/embed and /api/embeddings
    "ollama_embed": (
        frozenset({"model", "input", "prompt", "options", "keep_alive"}),
        frozenset({"truncate"}),
        {"dimensions": _dimensions},
    ),
}

#: the nested fields whose unknown keys are ignored visibly, per surface
_NESTED: dict[str, dict[str, frozenset[str]]] = {
    "chat": {"stream_options": frozenset({"include_usage"})},
    "completion": {"stream_options": frozenset({"include_usage"})},
    "responses": {"reasoning": frozenset({"effort", "summary", "generate_summary"}), "text": frozenset({"format"})},
    "anthropic": {"output_config": frozenset({"effort", "format"}), "thinking": frozenset({"type", "budget_tokens"})},
}


def screen(surface: str, body: Mapping[str, Any]) -> list[str]:
    """
    Apply the leniency policy to a decoded request body.

    @param surface: A key of L{POLICIES}.
    @return: The fields accepted but not honoured, in the body's order
        (top-level names; nested ones as C{parent.child}).
    @raise MeaningChanged: A field that cannot be honoured without
        changing the answer's meaning, named.
    """
    honoured, ignored, refused = POLICIES[surface]
    nested = _NESTED.get(surface, {})
    out: list[str] = []
    for name, value in body.items():
        check = refused.get(name)
        if check is not None:
            reason = check(value)
            if reason is not None:
                raise MeaningChanged(name, f"{name}: {reason}")
        if name in honoured:
            known = nested.get(name)
            if known is not None and isinstance(value, dict):
                out += [f"{name}.{k}" for k in value if k not in known]
            continue
        out.append(name)
    return out


def documented(surface: str) -> frozenset[str]:
    """
    Every field the policy of C{surface} names (for the table tests).
    """
    honoured, ignored, refused = POLICIES[surface]
    return honoured | ignored | frozenset(refused)
