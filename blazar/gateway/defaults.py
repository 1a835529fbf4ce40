"""
A model's own defaults, applied to every call that reaches it, whatever the
surface: the Modelfile layers of a model of the Ollama store (its C{system}
prompt, its C{messages}, its C{parameters}), as Ollama applies them
(C{server/routes.go}: the model's options under the request's, its system
prompt when the request has none, its messages before the request's).

 - C{parameters} are defaults for what the request did not set, as the
   engine's fields: C{temperature}, C{top_p}, C{top_k}, C{min_p},
   C{typical_p}, C{seed}, C{stop}, C{repeat_penalty}, C{repeat_last_n},
   C{presence_penalty}, C{frequency_penalty}, C{mirostat}, C{mirostat_tau},
   C{mirostat_eta}, C{num_keep} (C{n_keep}), C{num_predict} (C{max_tokens};
   C{n_predict} on C{/infill}; a negative one is no limit), and C{num_ctx}
   (the context the call asks for, L{Run.ctx_size}; the child is started
   with it in the first place: L{blazar.models.modelfile.model_settings}).
   The load-time ones (C{num_gpu}, C{num_thread}, ...) are the model's
   settings, not a call's.
 - C{system}: a chat with no system message of its own gets the model's
   first (an Ollama C{/api/generate} with C{system} has one).
 - C{messages}: a chat's history starts with the model's, after its system
   messages.

The model's Go C{template} is not applied: llama-server renders a chat with
the GGUF's own (Jinja) chat template, which Blazar keeps. Raw prompts
(C{/v1/completions}, C{raw: true}) and fill-in-the-middle get the
parameters only, as on Ollama. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from blazar.gateway.call import CallKind, Run, max_tokens_of

# a model parameter -> the engine's field (llama-server's OpenAI endpoints take llama.cpp's samplers too):
# the one table; Ollama's request options use it too (blazar.web.translate.ollama)
ENGINE_FIELDS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "num_keep": "n_keep",
}
_INTEGERS = {"top_k", "seed", "repeat_last_n", "mirostat", "num_keep", "num_predict", "num_ctx"}
_SYSTEM_ROLES = ("system", "developer")
_SAMPLED = (CallKind.CHAT, CallKind.COMPLETION, CallKind.INFILL)


def _number(name: str, value: Any) -> int | float | None:
    """
    A parameter's value as the engine takes it, or L{None} if it is of the
    wrong kind (a model's file is what it is: a bad value is left out).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if name in _INTEGERS:
        return int(value) if float(value).is_integer() else None
    return value


def _stops(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _unset(body: Mapping[str, Any], *fields: str) -> bool:
    return all(body.get(f) is None for f in fields)


def model_context(call: Run) -> None:
    """
    The model's C{num_ctx} as the context C{call} asks for, when it asks
    for none (Ollama's C{options.num_ctx} sets L{Run.ctx_size}).
    """
    layers = call.entry.ollama if call.entry is not None else None
    if layers is None or call.ctx_size is not None:
        return
    num_ctx = _number("num_ctx", layers.parameters.get("num_ctx"))
    if isinstance(num_ctx, int) and num_ctx > 0:
        call.ctx_size = num_ctx


def apply_model_defaults(call: Run) -> bool:
    """
    The defaults step (see the module docstring) on C{call}, whose model
    is resolved (L{Run.entry}); C{call.body} is changed in place and
    L{Run.max_tokens} follows a C{num_predict} that became the limit.

    @return: Whether C{call.body} changed (its encoding is then stale).
    """
    model_context(call)
    layers = call.entry.ollama if call.entry is not None else None
    if layers is None or call.kind not in _SAMPLED:
        return False
    body = call.body
    changed = False
    for name, value in layers.parameters.items():
        field = ENGINE_FIELDS.get(name)
        if field is not None:
            number = _number(name, value)
            if number is not None and _unset(body, field):
                body[field] = number
                changed = True
        elif name == "stop":
            stops = _stops(value)
            if stops is not None and _unset(body, "stop"):
                body["stop"] = stops
                changed = True
        elif name == "num_predict":
            limit = _number(name, value)
            if (
                isinstance(limit, int)
                and limit >= 0
                and _unset(body, "max_tokens", "max_completion_tokens", "n_predict")
            ):
                body["n_predict" if call.kind is CallKind.INFILL else "max_tokens"] = limit
                changed = True
                if call.kind is not CallKind.INFILL and call.max_tokens is None:
                    call.max_tokens = max_tokens_of(body)
    if call.kind is CallKind.CHAT:
        changed = _conversation(body, layers.system, layers.messages) or changed
    return changed


def _conversation(body: dict[str, Any], system: str | None, messages: list[Any]) -> bool:
    """
    The model's system prompt (when the chat has no system message) and
    its messages (after the chat's leading system messages) in
    C{body["messages"]}.
    """
    chat = body.get("messages")
    if not isinstance(chat, list):
        return False
    history = [
        {"role": m["role"], "content": m.get("content") or ""}
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content") or "", str)
    ]
    has_system = any(isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES for m in chat)
    lead = 0
    while lead < len(chat) and isinstance(chat[lead], dict) and chat[lead].get("role") in _SYSTEM_ROLES:
        lead += 1
    head = [] if has_system or not system else [{"role": "system", "content": system}]
    if not head and not history:
        return False
    body["messages"] = [*head, *chat[:lead], *history, *chat[lead:]]
    return True
