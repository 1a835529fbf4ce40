"""
Answers, not only shapes (issue 37): a real instruct model
(SmolLM2-135M-Instruct, from its PyPI wheel) behind a real llama-server
child, asked through every surface. Greedy decoding makes the answer a
fact of the model: the same question gives the same text on every surface,
streamed or not, and it names the right city. A gateway that dropped a
character, reordered chunks, lost tool arguments or let a forced call run
past max_tokens fails here. In CI the model is required (never a skip).
"""

from __future__ import annotations

import codecs
import http.client
import json
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import pytest

from blazar import strictjson
from tests.integration.harness import Daemon, real_model

MODEL = "smollm"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."  # (without one SmolLM2's template puts its own, and it wanders)
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PARIS_WEATHER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
SESSION = "x-blazar-session"


@pytest.fixture(scope="module")
def smol(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("answers")
    (root / "models").mkdir()
    (root / "models" / f"{MODEL}.gguf").symlink_to(real_model())
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\n[models."{MODEL}"]\nparallel = 2\nctx_size = 2048\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "2"]\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def strict(data: bytes) -> Any:
    try:
        return strictjson.loads(data)
    except ValueError as e:
        raise AssertionError(f"not strict JSON ({e}): {data[:300]!r}") from None


def post(d: Daemon, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    status, _, data = d.request("POST", path, body, headers=headers)
    assert status == 200, (path, status, data[:500])
    return strict(data)


def raw_stream(d: Daemon, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    """
    A streamed answer's body, read a few bytes at a time and decoded as it
    comes (strict UTF-8: a character cut and never completed, or a byte
    that is not UTF-8, fails here).
    """
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        assert response.status == 200, (path, response.status, response.read()[:500])
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        text = []
        while piece := response.read(7):
            text.append(decoder.decode(piece))
        text.append(decoder.decode(b"", final=True))
        return "".join(text)
    finally:
        conn.close()


def sse_payloads(body: str) -> list[Any]:
    return [
        strict(line[6:].encode()) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


def ndjson(body: str) -> list[Any]:
    return [strict(line.encode()) for line in body.splitlines() if line.strip()]


# what each surface's stream says, joined; and its non-streamed answer's text
SURFACES: dict[str, tuple[str, Callable[[str], dict[str, Any]], Callable[[Any], str], Callable[[str], str]]] = {
    "openai chat": (
        "/v1/chat/completions",
        lambda prompt: {"messages": ASK, "max_tokens": 32, "temperature": 0},
        lambda a: a["choices"][0]["message"]["content"],
        lambda s: "".join((c["choices"][0]["delta"].get("content") or "") for c in sse_payloads(s) if c.get("choices")),
    ),
    "openai completions": (
        "/v1/completions",
        lambda prompt: {"prompt": prompt, "max_tokens": 32, "temperature": 0},
        lambda a: a["choices"][0]["text"],
        lambda s: "".join(c["choices"][0]["text"] for c in sse_payloads(s) if c.get("choices")),
    ),
    "ollama chat": (
        "/api/chat",
        lambda prompt: {"messages": ASK, "options": {"temperature": 0, "num_predict": 32}},
        lambda a: a["message"]["content"],
        lambda s: "".join(line["message"]["content"] for line in ndjson(s)),
    ),
    "ollama generate": (
        "/api/generate",
        lambda prompt: {"prompt": QUESTION, "system": SYSTEM, "options": {"temperature": 0, "num_predict": 32}},
        lambda a: a["response"],
        lambda s: "".join(line["response"] for line in ndjson(s)),
    ),
    "anthropic": (
        "/v1/messages",
        lambda prompt: {"system": SYSTEM, "messages": ASK[1:], "max_tokens": 32, "temperature": 0},
        lambda a: "".join(b["text"] for b in a["content"] if b["type"] == "text"),
        lambda s: "".join(e["delta"].get("text", "") for e in sse_payloads(s) if e["type"] == "content_block_delta"),
    ),
    "responses": (
        "/v1/responses",
        lambda prompt: {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 32, "temperature": 0},
        lambda a: "".join(
            c["text"] for o in a["output"] if o["type"] == "message" for c in o["content"] if c["type"] == "output_text"
        ),
        lambda s: "".join(e["delta"] for e in sse_payloads(s) if e["type"] == "response.output_text.delta"),
    ),
}


def rendered(d: Daemon, messages: list[dict[str, Any]]) -> str:
    """
    The model's own chat template applied to C{messages}, by its child
    (llama-server's C{/apply-template}): the prompt a completion needs to
    be asked what the chat is asked.
    """
    child = d.engine_for(f"{MODEL}:latest")
    argv = child.cmdline()
    port = argv[argv.index("--port") + 1]
    environ = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
    key = next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"LLAMA_API_KEY="))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/apply-template",
        json.dumps({"messages": messages}).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["prompt"])


def test_the_same_question_gets_the_same_answer_on_every_surface(smol: Daemon) -> None:
    post(smol, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 1})  # the child is up
    prompt = rendered(smol, ASK)
    answers: dict[str, str] = {}
    for name, (path, body, whole, streamed) in SURFACES.items():
        asked = {"model": MODEL, **body(prompt)}
        answers[name] = whole(post(smol, path, {**asked, "stream": False}))
        answers[name + ", streamed"] = streamed(raw_stream(smol, path, {**asked, "stream": True}))
    expected = answers["openai chat"]
    assert "Paris" in expected, answers
    assert {name: text for name, text in answers.items() if text.strip() != expected.strip()} == {}, answers


WEATHER_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": (
        "/v1/chat/completions",
        {
            "messages": PARIS_WEATHER,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather now in a city",
                        "parameters": WEATHER,
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    "ollama": (
        "/api/chat",
        {
            "messages": PARIS_WEATHER,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather now in a city",
                        "parameters": WEATHER,
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    "anthropic": (
        "/v1/messages",
        {
            "system": PARIS_WEATHER[0]["content"],
            "messages": PARIS_WEATHER[1:],
            "tools": [{"name": "get_weather", "description": "The weather now in a city", "input_schema": WEATHER}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        },
    ),
    "responses": (
        "/v1/responses",
        {
            "instructions": PARIS_WEATHER[0]["content"],
            "input": PARIS_WEATHER[1]["content"],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "The weather now in a city",
                    "parameters": WEATHER,
                }
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
    ),
}


def tool_arguments(surface: str, answer: Any) -> list[Any]:
    if surface == "openai":
        return [strictjson.loads(c["function"]["arguments"]) for c in answer["choices"][0]["message"]["tool_calls"]]
    if surface == "ollama":
        return [c["function"]["arguments"] for c in answer["message"]["tool_calls"]]
    if surface == "anthropic":
        return [b["input"] for b in answer["content"] if b["type"] == "tool_use"]
    return [strictjson.loads(o["arguments"]) for o in answer["output"] if o["type"] == "function_call"]


def limited(surface: str, n: int) -> dict[str, Any]:
    if surface == "ollama":
        return {"options": {"temperature": 0, "num_predict": n}, "stream": False}
    if surface == "responses":
        return {"max_output_tokens": n, "temperature": 0}
    return {"max_tokens": n, "temperature": 0}


def test_forced_calls_name_what_was_asked_and_keep_to_max_tokens(smol: Daemon) -> None:
    for surface, (path, body) in WEATHER_TOOLS.items():
        answer = post(smol, path, {"model": MODEL, **body, **limited(surface, 64)})
        arguments = tool_arguments(surface, answer)
        assert arguments == [{"city": "Paris"}], (surface, answer)
        jsonschema.validate(arguments[0], WEATHER)
        # too few tokens for the call: the surface's length stop, within the limit, no call
        answer = post(smol, path, {"model": MODEL, **body, **limited(surface, 4 if surface != "responses" else 16)})
        if surface == "openai":
            assert answer["choices"][0]["finish_reason"] == "length", answer
            assert not answer["choices"][0]["message"].get("tool_calls") and answer["usage"]["completion_tokens"] <= 4
        elif surface == "ollama":
            assert answer["done_reason"] == "length" and not answer["message"].get("tool_calls"), answer
            assert answer["eval_count"] <= 4, answer
        elif surface == "anthropic":
            assert answer["stop_reason"] == "max_tokens", answer
            assert not [b for b in answer["content"] if b["type"] == "tool_use"], answer
            assert answer["usage"]["output_tokens"] <= 4, answer
        else:
            assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] <= 16, answer
            assert not [o for o in answer["output"] if o["type"] == "function_call"], answer


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_json_answers_match_their_schema(smol: Daemon) -> None:
    ask = [{"role": "user", "content": "Name the capital of France and its country as JSON."}]
    answer = post(
        smol,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": ask,
            "max_tokens": 64,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
        },
    )
    jsonschema.validate(strictjson.loads(answer["choices"][0]["message"]["content"]), CITY)
    answer = post(
        smol,
        "/api/chat",
        {
            "model": MODEL,
            "messages": ask,
            "format": CITY,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 64},
        },
    )
    made = strictjson.loads(answer["message"]["content"])
    jsonschema.validate(made, CITY)
    assert "Paris" in made["city"], made
    text = raw_stream(
        smol,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": ask,
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        },
    )
    streamed = "".join((c["choices"][0]["delta"].get("content") or "") for c in sse_payloads(text) if c.get("choices"))
    jsonschema.validate(strictjson.loads(streamed), CITY)


def cached(surface: str, answer: Any) -> int:
    if surface == "openai":
        return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if surface == "anthropic":
        return int(answer["usage"].get("cache_read_input_tokens") or 0)
    return int((answer["usage"].get("input_tokens_details") or {}).get("cached_tokens") or 0)


def test_a_second_turn_reuses_the_first_turns_cache_also_after_an_unload(smol: Daemon) -> None:
    first = [{"role": "user", "content": "My name is Ada and I live in Paris. Please remember both."}]
    for surface, path in (("openai", "/v1/chat/completions"), ("anthropic", "/v1/messages")):
        headers = {SESSION: f"real-{surface}"}
        one = post(smol, path, {"model": MODEL, "messages": first, "max_tokens": 24, "temperature": 0}, headers)
        said = one["choices"][0]["message"]["content"] if surface == "openai" else one["content"][0]["text"]
        turn = [*first, {"role": "assistant", "content": said}, {"role": "user", "content": "Where do I live?"}]
        two = post(smol, path, {"model": MODEL, "messages": turn, "max_tokens": 24, "temperature": 0}, headers)
        assert cached(surface, two) >= 20, (surface, two)  # the whole first turn, from its slot
        # the model unloaded (its slots saved to the KV bank) and loaded again: still reused
        status, _, data = smol.request("POST", "/api/generate", {"model": MODEL, "keep_alive": 0})
        assert status == 200, data
        again = [*turn, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And my name?"}]
        three = post(smol, path, {"model": MODEL, "messages": again, "max_tokens": 24, "temperature": 0}, headers)
        assert cached(surface, three) >= cached(surface, two), (surface, three)
    # Responses: the second turn by previous_response_id
    one = post(
        smol,
        "/v1/responses",
        {"model": MODEL, "input": first[0]["content"], "max_output_tokens": 24, "temperature": 0},
        {SESSION: "real-responses"},
    )
    two = post(
        smol,
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Where do I live?",
            "previous_response_id": one["id"],
            "max_output_tokens": 24,
            "temperature": 0,
        },
        {SESSION: "real-responses"},
    )
    assert cached("responses", two) >= 20, two
    # (Ollama's answers carry no count of cached tokens: its surface is not asked here)


def test_non_ascii_streams_as_it_is_answered(smol: Daemon) -> None:
    ask = [{"role": "user", "content": "Write these words exactly: café, naïve, 東京, 北京, 😀, 🚀."}]
    body = {"model": MODEL, "messages": ask, "max_tokens": 48, "temperature": 0}
    whole = post(smol, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert any(ord(c) > 0x7F for c in whole), whole
    assert any(ord(c) > 0xFFFF or 0x4E00 <= ord(c) <= 0x9FFF for c in whole), whole  # CJK or emoji
    streamed = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in sse_payloads(raw_stream(smol, "/v1/chat/completions", {**body, "stream": True}))
        if c.get("choices")
    )
    assert streamed == whole
    lines = ndjson(
        raw_stream(
            smol,
            "/api/chat",
            {"model": MODEL, "messages": ask, "stream": True, "options": {"temperature": 0, "num_predict": 48}},
        )
    )
    assert "".join(line["message"]["content"] for line in lines) == whole
    events = sse_payloads(raw_stream(smol, "/v1/messages", {**body, "stream": True}))
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == whole
