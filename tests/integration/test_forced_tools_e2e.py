"""
Forced tool calls always parse, and the sentinel (issue 21), on a real llama-server
child and the random-weight model: plain requests (no logit_bias tricks),
many seeds, every surface, streamed and not. Each call names an offered
tool and its arguments validate against that tool's parameters
(jsonschema).
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any, Iterator, Sequence, cast

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import ToolChoiceParam, ToolParam
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolParam,
)
from openai.types.shared_params import FunctionDefinition

from blazar.models.testmodel import THINKING_CHAT_TEMPLATE, make_test_model
from tests.integration.harness import Daemon

SEEDS = range(1, 51)
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "units": {"type": "string", "enum": ["metric", "imperial"]},
        },
        "required": ["city", "units"],
    },
}
TIME: dict[str, Any] = {
    "name": "get_time",
    "description": "The time now",
    "parameters": {"type": "object", "properties": {}},
}
SCHEMAS = {WEATHER["name"]: WEATHER["parameters"], TIME["name"]: TIME["parameters"]}
# sent through both SDKs, so typed as neither
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("forced")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    make_test_model(models / "big.gguf", seed=4, context_length=65536)  # Claude Code's tools: ~32k tokens
    make_test_model(models / "thinker.gguf", seed=5, chat_template=THINKING_CHAT_TEMPLATE)
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\naudit_log = "{root / "audit.jsonl"}"\nsentinel_stall_secs = 1\n'
            '[models."tiny"]\nparallel = 2\n'
            '[models."strict"]\npath = "tiny.gguf"\nparallel = 1\nsentinel_enforce = true\n'
            '[models."big"]\nctx_size = 40960\nparallel = 1\n'
            '[models."thinker"]\nparallel = 1\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


def check(name: str, arguments: Any) -> None:
    assert name in SCHEMAS, name
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(value, dict), arguments
    jsonschema.validate(value, SCHEMAS[name])


def openai_tools(*tools: dict[str, Any]) -> list[ChatCompletionToolParam]:
    return [{"type": "function", "function": cast(FunctionDefinition, t)} for t in tools]


def test_openai_forced_calls_parse(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="none")
    for seed in SEEDS:
        choices: tuple[ChatCompletionToolChoiceOptionParam, ...] = (
            "required",
            {"type": "function", "function": {"name": "get_weather"}},
        )
        for choice in choices:
            reply = client.chat.completions.create(
                model="tiny",
                messages=ASK,
                tools=openai_tools(WEATHER, TIME),
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=200,
                seed=seed,
            )
            choice0 = reply.choices[0]
            assert choice0.finish_reason == "tool_calls", reply
            calls: Sequence[ChatCompletionMessageFunctionToolCall] = cast(
                list[ChatCompletionMessageFunctionToolCall], choice0.message.tool_calls or []
            )
            assert len(calls) == 1, calls
            check(calls[0].function.name, calls[0].function.arguments)
            if isinstance(choice, dict):
                assert calls[0].function.name == "get_weather"
        # streamed, through the SDK's helper
        with client.beta.chat.completions.stream(
            model="tiny",
            messages=ASK,
            tools=openai_tools(WEATHER),
            tool_choice="required",
            max_tokens=200,
            seed=seed,
        ) as stream:
            final = stream.get_final_completion()
        calls = final.choices[0].message.tool_calls or []
        assert calls and all(c.id and c.type == "function" for c in calls), final
        for call in calls:
            check(call.function.name, call.function.arguments)


def test_parallel_calls_and_a_tool_without_arguments(daemon: Daemon) -> None:
    for seed in range(1, 11):
        status, reply = daemon.post_json(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": ASK,
                "tools": openai_tools(WEATHER, TIME),
                "tool_choice": "required",
                "parallel_tool_calls": True,
                "max_tokens": 300,
                "seed": seed,
            },
        )
        assert status == 200, reply
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert 1 <= len(calls) <= 4 and len({c["id"] for c in calls}) == len(calls), calls
        for call in calls:
            check(call["function"]["name"], call["function"]["arguments"])
        status, reply = daemon.post_json(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": ASK,
                "tools": openai_tools(TIME),
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "max_tokens": 50,
                "seed": seed,
            },
        )
        assert status == 200, reply
        assert [json.loads(c["function"]["arguments"]) for c in reply["choices"][0]["message"]["tool_calls"]] in (
            [{}],
            [{}, {}],
            [{}, {}, {}],
            [{}, {}, {}, {}],
        ), reply


def test_openai_stream_fragments_follow_the_rules(daemon: Daemon) -> None:
    events = [
        data
        for data, _ in daemon.stream(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": ASK,
                "tools": openai_tools(WEATHER),
                "tool_choice": "required",
                "max_tokens": 200,
                "seed": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    fragments = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert fragments and all(isinstance(f["index"], int) and f["id"] and f["type"] == "function" for f in fragments)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["model"] == "tiny" for c in chunks)


def test_anthropic_forced_calls_parse(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key="none")
    tools: list[ToolParam] = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in (WEATHER, TIME)
    ]
    for seed in SEEDS:
        tool_choices: tuple[ToolChoiceParam, ...] = ({"type": "any"}, {"type": "tool", "name": "get_weather"})
        for choice in tool_choices:
            message = client.messages.create(
                model="tiny",
                max_tokens=200,
                messages=ASK,
                tools=tools,
                tool_choice=choice,
                extra_body={"seed": seed},
            )
            uses = [b for b in message.content if b.type == "tool_use"]
            assert uses and message.stop_reason == "tool_use", message
            for block in uses:
                check(block.name, block.input)
        with client.messages.stream(
            model="tiny",
            max_tokens=200,
            messages=ASK,
            tools=tools,
            tool_choice={"type": "any"},
            extra_body={"seed": seed},
        ) as stream:
            final = stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        assert uses and final.stop_reason == "tool_use", final
        for block in uses:
            check(block.name, block.input)


def test_responses_forced_calls_parse(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="none")
    tools = [{"type": "function", **t} for t in (WEATHER, TIME)]
    for seed in SEEDS:
        for stream in (False, True):
            kwargs: dict[str, Any] = dict(
                model="tiny",
                input="What is the weather in Paris?",
                tools=tools,
                tool_choice="required",
                max_output_tokens=200,
                extra_body={"seed": seed},
            )
            if stream:
                with client.responses.stream(**kwargs) as events:
                    response = events.get_final_response()
            else:
                response = client.responses.create(**kwargs)
            calls = [item for item in response.output if item.type == "function_call"]
            assert calls, response
            for call in calls:
                check(call.name, call.arguments)


def test_ollama_forced_calls_parse(daemon: Daemon) -> None:
    """
    Ollama's API has no tool_choice; Blazar takes the OpenAI field on
    /api/chat too, so a forced call is possible there as well.
    """
    for seed in SEEDS:
        for stream in (False, True):
            status, _, data = daemon.request(
                "POST",
                "/api/chat",
                {
                    "model": "tiny",
                    "messages": ASK,
                    "tools": openai_tools(WEATHER),
                    "stream": stream,
                    "tool_choice": "required",
                    "options": {"seed": seed, "num_predict": 200},
                },
            )
            assert status == 200, data
            lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
            assert lines[-1]["done"] is True, lines[-1]
            calls = [c for line in lines for c in (line.get("message") or {}).get("tool_calls") or []]
            assert calls, lines
            for call in calls:
                assert isinstance(call["function"]["arguments"], dict)
                check(call["function"]["name"], call["function"]["arguments"])


def test_a_schema_the_grammar_cannot_express_is_a_400(daemon: Daemon) -> None:
    bad = {"name": "odd", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}
    status, reply = daemon.post_json(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": ASK,
            "tools": openai_tools(bad),
            "tool_choice": "required",
            "max_tokens": 20,
        },
    )
    assert status == 400, reply
    assert "odd" in reply["error"]["message"] and reply["error"]["param"] == "tools", reply
    status, reply = daemon.post_json(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": ASK,
            "tools": openai_tools(WEATHER),
            "max_tokens": 20,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert status == 400 and "nope" in reply["error"]["message"], reply


# -- the sentinel -----------------------------------------------------------------


def end_at_once() -> dict[str, int]:
    from blazar.models.testmodel import vocabulary

    ids = {tok: i for i, tok in enumerate(vocabulary()[0])}
    return {str(ids["<|im_end|>"]): 100}


def sentinel_metric(daemon: Daemon, model: str, code: str) -> float:
    import re

    status, _, text = daemon.request("GET", "/metrics")
    found = re.search(rf'blazar_sentinel_total{{code="{code}",model="{model}"}} ([\d.]+)', text.decode())
    return float(found.group(1)) if found else 0.0


def counted_after_stream(daemon: Daemon, model: str, code: str, want: float) -> float:
    """
    The sentinel count once a stream's request has ended: it is counted when
    the request finishes, which can be just after the client read [DONE] (the
    engine's [DONE] is relayed before its body closes). Waits up to 5 s for
    C{want}, then returns what it reads.
    """
    deadline = time.monotonic() + 5
    while sentinel_metric(daemon, model, code) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return sentinel_metric(daemon, model, code)


def test_the_sentinel_names_what_was_wrong(daemon: Daemon) -> None:
    before = {c: sentinel_metric(daemon, "tiny:latest", c) for c in ("truncated", "format_invalid", "empty")}
    status, headers, body = daemon.request(
        "POST", "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 2}
    )
    assert status == 200 and headers.get("x-blazar-sentinel") == "truncated", (headers, body)
    status, headers, body = daemon.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": ASK,
            "max_tokens": 1,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
    )
    flagged = headers.get("x-blazar-sentinel", "").split(",")
    assert status == 200 and flagged[:2] == ["truncated", "format_invalid"], (headers, body[:300])
    status, headers, body = daemon.request(
        "POST", "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 8, "logit_bias": end_at_once()}
    )
    assert status == 200 and headers.get("x-blazar-sentinel") == "empty", (headers, body)
    after = {c: sentinel_metric(daemon, "tiny:latest", c) for c in before}
    assert after["truncated"] == before["truncated"] + 2 and after["format_invalid"] == before["format_invalid"] + 1
    assert after["empty"] >= before["empty"] + 1, (before, after)
    audit = [json.loads(line) for line in (daemon.root / "audit.jsonl").read_text().splitlines()]
    assert any((line.get("sentinel") or [])[:2] == ["truncated", "format_invalid"] for line in audit), audit[-3:]
    # a good answer says nothing
    status, headers, _ = daemon.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": ASK,
            "tools": openai_tools(WEATHER),
            "tool_choice": "required",
            "max_tokens": 200,
        },
    )
    assert status == 200 and "x-blazar-sentinel" not in headers


def test_enforced_the_sentinel_refuses_with_a_422_on_every_surface(daemon: Daemon) -> None:
    for path, body, shape in (
        # (two random-weight tokens can be bytes of one unfinished character, which is dropped,
        # and the answer is then empty too: "truncated,empty", seed or not; truncated is the point)
        ("/v1/chat/completions", {"model": "strict", "messages": ASK, "max_tokens": 2, "seed": 3}, "openai"),
        ("/v1/messages", {"model": "strict", "messages": ASK, "max_tokens": 2, "seed": 3}, "anthropic"),
        ("/v1/responses", {"model": "strict", "input": "hi", "max_output_tokens": 2, "seed": 3}, "openai"),
        (
            "/api/chat",
            {"model": "strict", "messages": ASK, "stream": False, "options": {"num_predict": 2, "seed": 3}},
            "ollama",
        ),
    ):
        status, headers, data = daemon.request("POST", path, body)
        flagged = headers.get("x-blazar-sentinel", "").split(",")
        assert status == 422 and flagged[0] == "truncated" and set(flagged) <= {"truncated", "empty"}, (
            path,
            status,
            headers,
            data[:300],
        )
        answer = json.loads(data)
        message = answer["error"] if shape == "ollama" else answer["error"]["message"]
        assert "sentinel enforce: [truncated]" in message, (path, answer)
    # streams are never cut: counted, and they finish
    before = sentinel_metric(daemon, "strict:latest", "truncated")
    events = [
        e
        for e, _ in daemon.stream(
            "/v1/chat/completions", {"model": "strict", "messages": ASK, "max_tokens": 2, "stream": True}
        )
    ]
    assert events[-1] == "[DONE]"
    assert counted_after_stream(daemon, "strict:latest", "truncated", before + 1) == before + 1


def test_a_stalled_stream_is_counted_and_finishes(daemon: Daemon) -> None:
    """
    The child SIGSTOPped for a few seconds mid-stream (sentinel_stall_secs
    is 1 here): the stream is flagged stalled, and it still ends well.
    """
    import threading
    import time

    before = sentinel_metric(daemon, "tiny:latest", "stalled")
    child = daemon.engine_for("tiny:latest")
    events: list[str] = []

    def pause() -> None:
        while not events:
            time.sleep(0.01)
        child.suspend()
        time.sleep(2.5)
        child.resume()

    pauser = threading.Thread(target=pause)
    pauser.start()
    for data, _ in daemon.stream(
        "/v1/chat/completions",
        {"model": "tiny", "messages": ASK, "max_tokens": 200, "ignore_eos": True, "stream": True},
    ):
        events.append(data)
    pauser.join()
    assert events[-1] == "[DONE]"
    deadline = time.monotonic() + 5
    while sentinel_metric(daemon, "tiny:latest", "stalled") != before + 1:
        assert time.monotonic() < deadline, "the stall was not counted"
        time.sleep(0.1)


def test_claude_codes_own_tools_can_be_forced(daemon: Daemon) -> None:
    """
    The recorded Claude Code request's whole toolset under tool_choice any:
    the tools a grammar cannot express (a pattern, propertyNames) are left
    out of the grammar, the call is one of the others and validates.
    """
    from pathlib import Path

    recorded = json.loads(
        (Path(__file__).resolve().parents[1] / "fixtures" / "clients" / "claude-code-tool-result.json").read_text()
    )
    tools = recorded["body"]["tools"]
    schemas = {t["name"]: t["input_schema"] for t in tools if "input_schema" in t}
    for seed in (1, 2, 3):
        status, _, data = daemon.request(
            "POST",
            "/v1/messages",
            {
                "model": "big",
                "max_tokens": 400,
                "messages": ASK,
                "tools": tools,
                "tool_choice": {"type": "any"},
                "seed": seed,
            },
        )
        assert status == 200, data[:500]
        uses = [b for b in json.loads(data)["content"] if b["type"] == "tool_use"]
        assert uses, data[:500]
        for block in uses:
            jsonschema.validate(block["input"], schemas[block["name"]])


# -- the model's own calls (auto tool choice), judged -------------------------------


def toward_calls() -> dict[str, int]:
    """A logit_bias that makes the random model write <tool_call> often (the
    engine's parser then fails on what follows: its 500, without Blazar)."""
    from blazar.models.testmodel import vocabulary

    return {str(vocabulary()[0].index("<tool_call>")): 6}


def audit_codes(daemon: Daemon) -> set[str]:
    lines = [json.loads(line) for line in (daemon.root / "audit.jsonl").read_text().splitlines()]
    return {code for line in lines for code in line.get("sentinel") or []}


def test_a_call_the_engine_cannot_parse_is_an_answer_not_a_500(daemon: Daemon) -> None:
    """
    Auto tool choice, the model's call garbled: llama-server answers 500
    ("does not match the expected ... format") or cuts its stream with that
    error. Through Blazar it is the model's text with tool_args_invalid:
    a 200 on every surface, streams that end well; a 422 under enforce.
    """
    before = sentinel_metric(daemon, "tiny:latest", "tool_args_invalid")
    ask = {"messages": ASK, "tools": openai_tools(WEATHER), "max_tokens": 60, "logit_bias": toward_calls()}
    for seed in (1, 2, 3):
        status, headers, body = daemon.request("POST", "/v1/chat/completions", {"model": "tiny", "seed": seed, **ask})
        assert status == 200, (status, body[:300])
        assert "tool_args_invalid" in headers.get("x-blazar-sentinel", "").split(","), headers
        assert "<tool_call>" in (json.loads(body)["choices"][0]["message"]["content"] or ""), body[:300]
        events = [
            e for e, _ in daemon.stream("/v1/chat/completions", {"model": "tiny", "seed": seed, "stream": True, **ask})
        ]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length"), events[-2]
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key="none", max_retries=0)
    tool: ToolParam = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
    }
    # greedy (temperature 0): the same garbled call every run, as the seeded ones above
    message = client.messages.create(
        model="tiny",
        max_tokens=60,
        messages=ASK,
        tools=[tool],
        extra_body={"logit_bias": toward_calls(), "temperature": 0},
    )
    assert message.stop_reason in ("end_turn", "max_tokens"), message
    with client.messages.stream(
        model="tiny",
        max_tokens=60,
        messages=ASK,
        tools=[tool],
        extra_body={"logit_bias": toward_calls(), "temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens"), final
    # counted when each response is finished, which a streaming client may see a moment before
    deadline = time.monotonic() + 5
    while sentinel_metric(daemon, "tiny:latest", "tool_args_invalid") < before + 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sentinel_metric(daemon, "tiny:latest", "tool_args_invalid") >= before + 8
    status, _, body = daemon.request("POST", "/v1/chat/completions", {"model": "strict", "seed": 1, **ask})
    assert status == 422 and b"[tool_args_invalid]" in body, (status, body[:300])
    assert "tool_args_invalid" in audit_codes(daemon)
    log = daemon.log()  # the engine did refuse them: Blazar made them answers
    assert "asking once more with tool_choice none" in log and "the stream ends with its text" in log


def grammar_for(text: str) -> str:
    return "root ::= " + json.dumps(text)


def test_a_call_left_in_the_text_is_judged_by_name_and_schema(daemon: Daemon) -> None:
    """
    Call syntax the engine does not lift into tool_calls (tool_choice none,
    the text held to a call by the request's own llama.cpp grammar): a call
    of a tool that was not offered is tool_name_unknown, one whose
    arguments break the tool's schema is tool_args_schema; streamed and not.
    """
    cases = {
        "tool_name_unknown": '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        "tool_args_schema": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": "kelvin"}}'
        "\n</tool_call>",
    }
    for code, text in cases.items():
        before = sentinel_metric(daemon, "tiny:latest", code)
        ask = {
            "model": "tiny",
            "messages": ASK,
            "tools": openai_tools(WEATHER),
            "tool_choice": "none",
            "grammar": grammar_for(text),
            "max_tokens": 100,
        }
        status, headers, body = daemon.request("POST", "/v1/chat/completions", ask)
        assert status == 200 and headers.get("x-blazar-sentinel") == code, (headers, body[:300])
        assert json.loads(body)["choices"][0]["message"]["content"] == text  # the answer's bytes are the model's
        events = [e for e, _ in daemon.stream("/v1/chat/completions", {**ask, "stream": True})]
        assert events[-1] == "[DONE]"
        assert counted_after_stream(daemon, "tiny:latest", code, before + 2) == before + 2
        status, _, body = daemon.request("POST", "/v1/chat/completions", {**ask, "model": "strict"})
        assert status == 422 and f"[{code}]".encode() in body, (status, body[:300])
        assert code in audit_codes(daemon)


def test_reasoning_and_no_answer_is_reasoning_only(daemon: Daemon) -> None:
    """
    A thinking model (its template opens <think>) cut before it closes the
    thought: all reasoning_content, no content.
    """
    before = sentinel_metric(daemon, "thinker:latest", "reasoning_only")
    status, headers, body = daemon.request(
        "POST", "/v1/chat/completions", {"model": "thinker", "messages": ASK, "max_tokens": 12}
    )
    message = json.loads(body)["choices"][0]["message"]
    assert status == 200 and message.get("reasoning_content") and not message.get("content"), body[:300]
    assert headers.get("x-blazar-sentinel") == "truncated,reasoning_only", headers
    events = [
        e
        for e, _ in daemon.stream(
            "/v1/chat/completions", {"model": "thinker", "messages": ASK, "max_tokens": 12, "stream": True}
        )
    ]
    assert events[-1] == "[DONE]"
    assert counted_after_stream(daemon, "thinker:latest", "reasoning_only", before + 2) == before + 2
    assert "reasoning_only" in audit_codes(daemon)


def test_a_cut_stream_keeps_its_usage_and_text_that_quotes_the_error_is_left_alone(daemon: Daemon) -> None:
    """
    The end Blazar gives a stream the engine cut carries the tokens the
    child's tokenizer counts (usage chunk, finish_reason length at
    max_tokens); a stream whose text merely quotes the engine's error
    sentence is relayed as it is, with one [DONE].
    """
    for seed in (2, 3):
        events = [
            e
            for e, _ in daemon.stream(
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": ASK,
                    "tools": openai_tools(WEATHER),
                    "max_tokens": 10,
                    "seed": seed,
                    "logit_bias": toward_calls(),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        ]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0, usage
        finish = json.loads(events[-3])["choices"][0]["finish_reason"]
        assert finish == ("length" if usage["completion_tokens"] >= 10 else "stop"), (finish, usage)
    text = "Error: The model produced output that does not match the expected format. It means X. The end."
    for stop in (None, ["The model produced output that does not match the expected formaQ"]):
        ask = {"model": "tiny", "messages": ASK, "grammar": grammar_for(text), "max_tokens": 100, "stream": True}
        if stop:
            ask["stop"] = stop  # the engine holds text back: the sentence comes in one delta
        events = [e for e, _ in daemon.stream("/v1/chat/completions", ask)]
        content = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or ""
            for e in events[:-1]
            if json.loads(e).get("choices")
        )
        assert content == text and events.count("[DONE]") == 1, events
