"""
The OpenAI surface's leniency step: what the engine gets.
"""

from __future__ import annotations

from typing import Any

import pytest

from blazar.web.openai import BadRequest, lenient

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_ignored_fields_are_not_sent_to_the_engine() -> None:
    body = chat(metadata={str(i): "x" for i in range(30000)}, user="u", a_new_field=1, top_k=5)
    ignored, changed = lenient("chat", body)
    assert changed and ignored == ["metadata", "user", "a_new_field"]
    assert body == chat(top_k=5)


def test_nothing_to_change() -> None:
    body = chat(temperature=0.1)
    assert lenient("chat", body) == ([], False)


def test_named_tool_choice_offers_only_that_tool_and_requires_a_call() -> None:
    body = chat(tools=[F, G], tool_choice={"type": "function", "function": {"name": "g"}})
    lenient("chat", body)
    assert body["tools"] == [G] and body["tool_choice"] == "required"


def test_allowed_tools() -> None:
    body = chat(
        tools=[F, G],
        tool_choice={
            "type": "allowed_tools",
            "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
        },
    )
    lenient("chat", body)
    assert body["tools"] == [F] and body["tool_choice"] == "required"
    body = chat(tools=[F], tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}})
    lenient("chat", body)
    assert "tools" not in body and "tool_choice" not in body


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": {"name": "ghost"}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}},
        {"type": "custom", "custom": {"name": "x"}},
        {"type": "sometimes"},
    ],
)
def test_tool_choices_that_cannot_be_honoured_are_400(choice: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as caught:
        lenient("chat", chat(tools=[F], tool_choice=choice))
    assert caught.value.param == "tool_choice"


def test_built_in_tools_leave_and_take_their_choice_with_them() -> None:
    body = chat(
        tools=[{"type": "custom", "custom": {"name": "x"}}], tool_choice={"type": "custom", "custom": {"name": "x"}}
    )
    ignored, _ = lenient("chat", body)
    assert ignored == ["tools:custom"] and "tools" not in body and "tool_choice" not in body
