"""
What a scoped API key may learn about models: the scope check, which comes
before everything else that depends on the model, and what of an answer
such a key may see.

A scoped key (C{models = [...]} in its C{[[keys]]} table) is told nothing
about the models outside its scope. A model it may not use is answered as
one that does not exist, by the same code path: the surface's 404, whose
list of models holds only those it may use, before any check that looks at
the model (its purpose, its context, its engine) and without resolving the
name. No answer to it holds a file path: L{redact} cuts them from engine
and GGUF error text, and C{/api/show} leaves them out. Admin (unscoped)
keys and a gateway without keys see everything.

This is the pipeline's first step (scope, then purpose, preflight,
admission); every surface calls L{resolve_in_scope}, directly or through
L{blazar.gateway.engine_proxy.EngineProxy.check_scope}.
"""

from __future__ import annotations

from typing import Any

from blazar.config import KeyConfig
from blazar.gateway.context import RequestContext, key_of
from blazar.models.registry import ModelEntry, ModelNotFound, ModelRegistry
from blazar.names import name_key, strip_dirs


def in_scope(key: KeyConfig | None, name: object) -> bool:
    """
    Whether C{key} may use the model named C{name}, spelled as a client
    spells it (C{"qwen"}, C{"Qwen:latest"}): every model for an unscoped
    key or no key; for a scoped key, only the names in its C{models}.
    """
    if key is None or key.admin:
        return True
    if not isinstance(name, str):
        return False
    return any(_same_model(m, name) for m in key.models)


def _same_model(scoped: str, name: str) -> bool:
    """
    Whether a scope's name C{scoped} and a client's C{name} are one model:
    the same L{name_key}; or, for a remote's model whose id is no Ollama
    name (C{peer:qwen3:8b}, C{router:meta/llama}), the remote's name in any
    case and the model's exactly.
    """
    try:
        return name_key(scoped) == name_key(name)
    except ValueError:
        remote, _, model = scoped.partition(":")
        other, _, asked = name.partition(":")
        return bool(model) and remote.casefold() == other.casefold() and model == asked


def may_use(context: RequestContext | None, name: object) -> bool:
    """
    Whether the request's key may use the model named C{name}
    (L{in_scope}).
    """
    return in_scope(key_of(context), name)


def is_scoped(context: RequestContext | None) -> bool:
    """
    Whether the request came with a key scoped to some models.
    """
    key = key_of(context)
    return key is not None and not key.admin


def visible(context: RequestContext | None, names: list[str]) -> list[str]:
    """
    The model names of C{names} that the request's key may see, in order.
    """
    key = key_of(context)
    return [n for n in names if in_scope(key, n)]


def visible_entries(context: RequestContext | None, entries: list[ModelEntry]) -> list[str]:
    """
    The names of C{entries} the request's key may see, in order: by
    L{in_scope}, and a remote's model only as its scope spells it (a
    remote's ids are case-sensitive).
    """
    key = key_of(context)
    scoped = key is not None and not key.admin
    models = key.models if key is not None else ()
    return [
        e.name
        for e in entries
        if in_scope(key, e.name)
        and not (scoped and e.remote is not None and not any(_is_remote_model(m, e) for m in models))
    ]


async def resolve_in_scope(context: RequestContext | None, registry: ModelRegistry, name: object) -> ModelEntry:
    """
    The model the request names, if its key may use it; then the key's rate
    limits (rpm, tpm, daily_tokens), once per request. Call it before
    anything else that looks at the model.

    For a scoped key, a name outside its scope is not resolved: the
    registry is rescanned (as for a name that is not found) and the answer
    is the L{ModelNotFound} a name that does not exist gets, listing only
    the models the key may use.

    @param name: The C{model} field as the client sent it.
    @raise ModelNotFound: No such model, or one the key may not use; its
        C{available} is what the key may see.
    @raise blazar.gateway.quota.QuotaExceeded: Over a rate limit.
    """
    spelled = name if isinstance(name, str) else str(name)
    if not may_use(context, name):
        entries = await registry.refresh()
        raise ModelNotFound(spelled, visible_entries(context, entries))
    try:
        entry = await registry.resolve(name)
    except ModelNotFound as e:
        raise ModelNotFound(e.name, visible(context, e.available)) from None
    key = key_of(context)
    if (
        entry.remote is not None
        and key is not None
        and not key.admin
        and not any(_is_remote_model(m, entry) for m in key.models)
    ):
        # a remote's ids are case-sensitive (peer:Tiny may be another model than peer:tiny): exactly as scoped
        entries = await registry.refresh()
        raise ModelNotFound(spelled, visible_entries(context, entries))
    if context is None:
        return entry
    context.model = entry.name
    rates = context.rates
    if rates is not None:
        context.rates = None
        await rates()
    return entry


def _is_remote_model(scoped: str, entry: ModelEntry) -> bool:
    """
    Whether a scope's name C{scoped} is remote model C{entry}: the remote's
    name in any case, the model's exactly.
    """
    remote, _, model = scoped.partition(":")
    return remote.casefold() == (entry.remote or "").casefold() and model == entry.remote_model


def redact(context: RequestContext | None, text: str) -> str:
    """
    C{text} (an error message: the engine's, a GGUF reader's, the
    supervisor's) as the request's key may see it: for a scoped key, every
    absolute file path cut to its last component; for others, unchanged.
    """
    if not is_scoped(context):
        return text
    return strip_dirs(text)


def redact_value(context: RequestContext | None, value: Any) -> Any:
    """
    L{redact} over the strings in C{value} (GGUF metadata: strings, numbers,
    lists of them, L{None}).
    """
    if not is_scoped(context):
        return value
    if isinstance(value, str):
        return redact(context, value)
    if isinstance(value, list):
        return [redact_value(context, v) for v in value]
    if isinstance(value, dict):
        return {k: redact_value(context, v) for k, v in value.items()}
    return value
