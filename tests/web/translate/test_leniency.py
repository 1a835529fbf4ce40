"""
The leniency policy, as a table: every field the references define, per
surface, is accepted (honoured or ignored and named), except the listed
meaning-changing values, each a 400 naming its field; unknown fields are
ignored and named, never refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blazar.gateway.ignored import header_value
from blazar.web.translate import leniency

SURFACES_DOC = Path(__file__).resolve().parents[3] / "docs" / "surfaces.md"

# A plausible value for every documented field of each surface (the harmless
# value for the refusable ones); the refusing values are in REFUSED below.
_LLAMACPP_SAMPLE: dict[str, Any] = {name: 1 for name in leniency.LLAMACPP}
SAMPLES: dict[str, dict[str, Any]] = {
    "chat": {
        **_LLAMACPP_SAMPLE,
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "frequency_penalty": 0.0,
        "logit_bias": {"1": 0},
        "logprobs": False,
        "max_completion_tokens": 5,
        "max_tokens": 5,
        "n": 1,
        "parallel_tool_calls": True,
        "presence_penalty": 0.0,
        "reasoning_effort": "low",
        "response_format": {"type": "text"},
        "seed": 1,
        "stop": ["x"],
        "stream": False,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "top_p": 1.0,
        "modalities": ["text"],
        "metadata": {"a": "b"},
        "store": False,
        "user": "u",
        "safety_identifier": "s",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "x"},
        "web_search_options": {},
        "audio": None,
        "functions": None,
        "function_call": None,
    },
    "completion": {
        **_LLAMACPP_SAMPLE,
        "model": "m",
        "prompt": "hi",
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": None,
        "max_tokens": 5,
        "n": 1,
        "presence_penalty": 0.0,
        "seed": 1,
        "stop": None,
        "stream": False,
        "stream_options": {"include_usage": True},
        "temperature": 1.0,
        "top_p": 1.0,
        "echo": False,
        "user": "u",
        "best_of": 1,
        "suffix": None,
    },
    "embedding": {
        **_LLAMACPP_SAMPLE,
        "model": "m",
        "input": "hi",
        "encoding_format": "float",
        "user": "u",
        "dimensions": None,
    },
    "responses": {
        "model": "m",
        "input": "hi",
        "instructions": "be brief",
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "max_output_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "metadata": {"a": "b"},
        "store": False,
        "previous_response_id": None,
        "stream": False,
        "seed": 1,
        "logit_bias": {},
        "keep_alive": "5m",
        "background": False,
        "user": "u",
        "truncation": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "service_tier": "auto",
        "include": ["reasoning.encrypted_content"],
        "stream_options": {"include_obfuscation": False},
        "client_metadata": {"x": "y"},
        "max_tool_calls": 3,
        "top_logprobs": 0,
        "context_management": [{"type": "compaction"}],
        "conversation": None,
        "prompt": None,
    },
    "anthropic": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "system": "s",
        "stop_sequences": ["x"],
        "stream": False,
        "temperature": 1.0,
        "top_k": 5,
        "top_p": 1.0,
        "tools": [],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "low"},
        "keep_alive": "5m",
        "logit_bias": {},
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "context_management": {"edits": []},
        "container": "c",
        "mcp_servers": [],
        "inference_geo": "us",
    },
    "ollama_chat": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "format": "json",
        "options": {},
        "stream": False,
        "keep_alive": "5m",
        "think": False,
        "logprobs": False,
        "top_logprobs": 0,
        "truncate": True,
        "shift": True,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    },
    "ollama_generate": {
        "model": "m",
        "prompt": "hi",
        "suffix": "",
        "images": [],
        "format": "json",
        "options": {},
        "system": "s",
        "stream": False,
        "raw": False,
        "keep_alive": "5m",
        "think": False,
        "context": [1],
        "logprobs": False,
        "top_logprobs": 0,
        "truncate": True,
        "shift": True,
        "template": "",
        "width": 64,
        "height": 64,
        "steps": 1,
    },
    "ollama_embed": {
        "model": "m",
        "input": "hi",
        "prompt": "hi",
        "options": {},
        "keep_alive": "5m",
        "truncate": True,
        "dimensions": None,
    },
}

# (surface, field, a value that would change the answer's meaning)
REFUSED = [
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("completion", "suffix", "tail"),
    ("embedding", "dimensions", 256),
    ("responses", "background", True),
    ("responses", "conversation", "conv_123"),
    ("responses", "prompt", {"id": "pmpt_123"}),
    ("ollama_generate", "template", "{{ .Prompt }}"),
    ("ollama_embed", "dimensions", 256),
]


@pytest.mark.parametrize("surface", sorted(leniency.POLICIES))
def test_every_documented_field_has_a_sample(surface: str) -> None:
    assert set(SAMPLES[surface]) == set(leniency.documented(surface))


@pytest.mark.parametrize("surface", sorted(leniency.POLICIES))
def test_every_documented_field_is_accepted(surface: str) -> None:
    honoured, ignored, _ = leniency.POLICIES[surface]
    for field, value in SAMPLES[surface].items():
        names = leniency.screen(surface, {field: value})
        if field in ignored or field not in honoured:
            assert names == [field], field
        else:
            assert all(n.startswith(field + ".") for n in names), (field, names)
    # and all of them at once: the ignored ones listed, in order
    names = leniency.screen(surface, SAMPLES[surface])
    assert [n for n in names if "." not in n] == [f for f in SAMPLES[surface] if f in ignored or f not in honoured]


@pytest.mark.parametrize(("surface", "field", "value"), REFUSED)
def test_meaning_changing_values_are_refused_by_name(surface: str, field: str, value: Any) -> None:
    with pytest.raises(leniency.MeaningChanged) as caught:
        leniency.screen(surface, {**SAMPLES[surface], field: value})
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize("surface", sorted(leniency.POLICIES))
def test_unknown_fields_are_ignored_never_refused(surface: str) -> None:
    body = {**SAMPLES[surface], "a_field_from_2027": {"x": 1}, "another": None}
    names = leniency.screen(surface, body)
    assert names[-2:] == ["a_field_from_2027", "another"]


def test_nested_extras_are_named() -> None:
    assert leniency.screen("chat", {"stream_options": {"include_usage": True, "include_obfuscation": True}}) == [
        "stream_options.include_obfuscation"
    ]
    assert leniency.screen("anthropic", {"thinking": {"type": "adaptive", "display": "omitted"}}) == [
        "thinking.display"
    ]
    assert leniency.screen("responses", {"reasoning": {"summary": "auto", "effort": None}}) == []


def test_header_value_is_bounded_ascii() -> None:
    assert header_value(["metadata", "store", "metadata"]) == b"metadata,store"
    value = header_value([f"field_{i}" for i in range(500)], limit=100)
    assert len(value) <= 110 and value.endswith(b",...")
    assert header_value(["bad\r\nheader", "é"]) == b"badheader"


def test_docs_document_every_refused_and_ignored_field() -> None:
    text = SURFACES_DOC.read_text()
    section = text[text.index("## Leniency") :]
    section = section[: section.index("\n## ", 4)]
    for surface, (_, ignored, refused) in leniency.POLICIES.items():
        for field in sorted(ignored | set(refused)):
            assert f"`{field}`" in section, (surface, field)
