"""
Model names, following Ollama's C{name:tag} rules.

A name is C{[namespace/]model[:tag]}; a bare name means C{name:latest}.
Matching is case-insensitive, as Ollama's is, but the spelling a client used
is what Blazar echoes back.
"""

from __future__ import annotations

import re

_PART = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
# a registry host, which may carry a port (127.0.0.1:5000/ns/model:tag), as Ollama's names allow
_HOST = rf"{_PART}(?::\d{{1,5}})?/(?={_PART}/)"
_NAME = re.compile(rf"^(?:{_HOST})?(?:{_PART}/)*{_PART}(?::[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,127}})?$")
DEFAULT_TAG = "latest"


def canonical_name(name: str) -> str:
    """
    The canonical C{model:tag} form of C{name}.

    >>> canonical_name("qwen2.5")
    'qwen2.5:latest'

    @raise ValueError: C{name} is empty or has characters Ollama's names do
        not allow (allowed: letters, digits, C{_ . -}, C{/} between parts,
        one C{:} before the tag).
    """
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 350:
        raise ValueError(
            f"invalid model name {name!r}: use [namespace/]model[:tag] with letters, digits, '_', '.', '-'"
        )
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"{name}:{DEFAULT_TAG}"
    return name


def name_key(name: str) -> str:
    """
    The lookup key for C{name}: canonical and case-folded.

    @raise ValueError: As L{canonical_name}.
    """
    return canonical_name(name).casefold()


# An absolute file path (POSIX, C{~/...} or C{C:\\...}) and its last
# component. It must start a word, so model names such as
# C{hf.co/user/repo:tag} and URLs (C{http://host/a/b}) are left alone.
_PATH = re.compile(r"(?<![\w.~/\\-])(?:~|[A-Za-z]:)?(?:[/\\][^/\\\s'\"`]+)+[/\\]([^/\\\s'\"`]+)")


def strip_dirs(text: str) -> str:
    """
    C{text} with every absolute file path cut to its last component (what
    a client that must not learn the daemon's layout may see).
    """
    return _PATH.sub(lambda m: m.group(1), text)


#: a remote model's name after NAME:, at most (its metrics series carry it)
MAX_REMOTE_MODEL = 200


def fair_remote_model(name: str) -> bool:
    """
    Whether C{name} may be a remote's model name (C{[[remotes]]}):
    printable, no white space, at most L{MAX_REMOTE_MODEL} characters.
    Otherwise any spelling: a remote's ids are its own (case-sensitive,
    with C{/} for OpenRouter's, C{:} for Ollama's tags).
    """
    return 0 < len(name) <= MAX_REMOTE_MODEL and name.isprintable() and not any(c.isspace() for c in name)
