"""
System and developer messages anywhere in a conversation, rendered so the
model's chat template takes them and the prompt's prefix stays the same
from one turn to the next.

Clients put system (and OpenAI C{developer}) messages between turns: Claude
Code's mid-conversation reminders, Codex's developer messages. They are kept
where they are, in order, never hoisted to the top (that would change the
prompt's prefix on every turn and defeat the engine's prompt cache). Many chat
templates accept a system message only first; for those (found once per model
by asking the engine to render a probe, see L{PROBE}) a non-leading one is
rendered in place as a user-side block, C{<system-reminder>...</system-reminder>},
merged into the user message before it (or the one after it) so that roles
still alternate.

Pure: no reactor, no I/O.
"""

from __future__ import annotations

from typing import Any

SYSTEM_ROLES = ("system", "developer")
MARK = "blazar-probe-mid-system-7f3a"

#: What the engine is asked to render (C{/apply-template}) to learn whether
#: its template takes a system message after the first user turn.
PROBE = {
    "messages": [
        {"role": "system", "content": "blazar-probe-first"},
        {"role": "user", "content": "blazar-probe-user-1"},
        {"role": "assistant", "content": "blazar-probe-assistant"},
        {"role": "system", "content": MARK},
        {"role": "user", "content": "blazar-probe-user-2"},
    ]
}


def probe_accepts(prompt: Any) -> bool:
    """
    Whether the engine's rendering of L{PROBE} kept the mid-conversation
    system message in its place (some templates drop it silently).
    """
    if not isinstance(prompt, str):
        return False
    at = prompt.find(MARK)
    return prompt.find("blazar-probe-assistant") < at < prompt.find("blazar-probe-user-2")


def needs_placement(messages: Any) -> bool:
    """
    Whether C{messages} has a C{developer} message, or a system message
    after the first non-system one, or more than one leading system
    message: the cases L{place} may change. Cheap, for the request path.
    """
    if not isinstance(messages, list):
        return False
    leading = True
    count = 0
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "developer":
            return True
        if role == "system":
            count += 1
            if not leading or count > 1:
                return True
        else:
            leading = False
    return False


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def reminder(content: Any) -> str:
    """
    A system message's text as the user-side block it becomes.
    """
    return f"<system-reminder>\n{_text(content)}\n</system-reminder>"


def _join(first: Any, second: Any) -> Any:
    """
    Two user contents as one (strings, or parts lists).
    """
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"
    parts: list[Any] = []
    for content in (first, second):
        if isinstance(content, str):
            if content:
                parts.append({"type": "text", "text": content})
        elif isinstance(content, list):
            parts.extend(content)
    return parts


def place(messages: list[dict[str, Any]], mid_system_ok: bool) -> list[dict[str, Any]]:
    """
    C{messages} (OpenAI chat messages) as the model's template takes them.

    Leading system/developer messages become one system message (their
    texts joined by a blank line). Later ones stay in place: as system
    messages if C{mid_system_ok}, else as L{reminder} blocks merged into
    the user message before them, or — after an assistant or tool turn —
    into the user message that follows. The result depends only on the
    messages themselves, so the same history renders to the same bytes on
    every turn.
    """
    out: list[dict[str, Any]] = []
    leading: list[str] = []
    standalone = False  # out[-1] is a user message made of reminders only
    seen_other = False
    for m in messages:
        role = m.get("role")
        if role in SYSTEM_ROLES and not seen_other:
            leading.append(_text(m.get("content")))
            continue
        if not seen_other:
            seen_other = True
            if leading:
                out.append({"role": "system", "content": "\n\n".join(leading)})
        if role in SYSTEM_ROLES:
            if mid_system_ok:
                out.append({**m, "role": "system"})
                standalone = False
                continue
            block = reminder(m.get("content"))
            if out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": _join(out[-1].get("content"), block)}
            else:
                out.append({"role": "user", "content": block})
                standalone = True
            continue
        if role == "user" and standalone:
            out[-1] = {**out[-1], "content": _join(out[-1]["content"], m.get("content"))}
            standalone = False
            continue
        standalone = False
        out.append(m)
    if not seen_other and leading:
        out.append({"role": "system", "content": "\n\n".join(leading)})
    return out
