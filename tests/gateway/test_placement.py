"""
System and developer messages anywhere: kept in place, merged into user
turns as <system-reminder> blocks for templates that take a system message
only first, and the same history always gives the same messages.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from blazar.gateway import placement


def msgs(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"role": r, "content": c} for r, c in pairs]


def test_nothing_to_do_for_one_leading_system_message() -> None:
    assert not placement.needs_placement(msgs(("system", "s"), ("user", "u"), ("assistant", "a")))
    assert placement.needs_placement(msgs(("user", "u"), ("system", "s")))
    assert placement.needs_placement(msgs(("developer", "d"), ("user", "u")))
    assert placement.needs_placement(msgs(("system", "a"), ("system", "b"), ("user", "u")))


def test_mid_system_kept_in_place_when_the_template_takes_it() -> None:
    out = placement.place(
        msgs(("developer", "d1"), ("system", "d2"), ("user", "u"), ("system", "late"), ("assistant", "a")),
        mid_system_ok=True,
    )
    assert out == msgs(("system", "d1\n\nd2"), ("user", "u"), ("system", "late"), ("assistant", "a"))


def test_mid_system_merged_into_the_user_turn_before_it() -> None:
    out = placement.place(msgs(("user", "say hi"), ("system", "env"), ("assistant", "hi")), mid_system_ok=False)
    assert out == msgs(("user", "say hi\n\n<system-reminder>\nenv\n</system-reminder>"), ("assistant", "hi"))


def test_mid_system_after_an_assistant_turn_joins_the_next_user_turn() -> None:
    out = placement.place(
        msgs(("user", "u1"), ("assistant", "a"), ("system", "note"), ("user", "u2")), mid_system_ok=False
    )
    assert out == msgs(
        ("user", "u1"), ("assistant", "a"), ("user", "<system-reminder>\nnote\n</system-reminder>\n\nu2")
    )


def test_parts_content_is_joined_as_parts() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    out = placement.place(
        [{"role": "user", "content": [image]}, {"role": "system", "content": [{"type": "text", "text": "x"}]}],
        mid_system_ok=False,
    )
    assert out == [
        {"role": "user", "content": [image, {"type": "text", "text": "<system-reminder>\nx\n</system-reminder>"}]}
    ]


def test_probe_reading() -> None:
    rendered = "blazar-probe-first blazar-probe-user-1 blazar-probe-assistant {} blazar-probe-user-2"
    assert placement.probe_accepts(rendered.format(placement.MARK))
    assert not placement.probe_accepts(rendered.format(""))  # dropped silently
    assert not placement.probe_accepts(placement.MARK + rendered.format(""))  # hoisted to the top
    assert not placement.probe_accepts(None)


roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
conversation = st.lists(st.tuples(roles, st.text(alphabet="abc", max_size=3)), min_size=1, max_size=12)


@given(conversation, st.booleans())
def test_same_history_same_messages_and_turns_extend_the_prefix(pairs: list[tuple[str, str]], ok: bool) -> None:
    messages = msgs(*pairs)
    assert placement.place(messages, ok) == placement.place(msgs(*pairs), ok)
    # a later turn appends the assistant's answer and more: everything placed
    # before that answer is placed the same way
    for cut, (role, _) in enumerate(pairs):
        if role == "assistant" and cut > 0:
            earlier = placement.place(messages[:cut], ok)
            later = placement.place(messages, ok)
            assert later[: len(earlier)] == earlier, (cut, earlier, later)


@given(conversation)
def test_no_system_message_after_the_first_when_the_template_refuses_them(pairs: list[tuple[str, str]]) -> None:
    out = placement.place(msgs(*pairs), mid_system_ok=False)
    assert all(m["role"] != "system" for m in out[1:])
    assert all(m["role"] != "developer" for m in out)
    # nothing is lost: every system text is still there, in order
    texts = [c for r, c in pairs if r in ("system", "developer") and c]
    rendered = "\x00".join(str(m["content"]) for m in out)
    at = 0
    for text in texts:
        at = rendered.find(text, at)
        assert at >= 0
