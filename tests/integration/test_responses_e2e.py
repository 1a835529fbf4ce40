"""
The Responses API end to end: the official openai SDK against a real daemon
and llama-server child, and raw SSE checks.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from typing import Any, Iterator, cast

import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam, ResponseInputParam

from blazar.models.testmodel import GeneratedModel
from blazar.testing import forced_tool_call_request
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789abc"
RECIPE = forced_tool_call_request("tiny")
FUNCTION = RECIPE["tools"][0]["function"]
TOOL = cast(
    FunctionToolParam,
    {  # without "strict", which the SDK's type requires and the API does not
        "type": "function",
        "name": FUNCTION["name"],
        "description": FUNCTION["description"],
        "parameters": FUNCTION["parameters"],
    },
)
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("responses"),
        daemon_config(engine, models)
        + (f'[[keys]]\nname = "alice"\nsecret = "{ALICE}"\n[[keys]]\nname = "bob"\nsecret = "{BOB}"\n'),
    )
    d.start()
    try:
        yield d
    finally:
        d.close()


def client(d: Daemon, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=key, max_retries=0, timeout=60)


def test_create_with_a_string_and_with_items(daemon: Daemon) -> None:
    c = client(daemon)
    r = c.responses.create(model="tiny", input="hi", max_output_tokens=8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete") and isinstance(r.output_text, str)
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    r2 = c.responses.create(
        model="tiny",
        instructions="You are terse.",
        max_output_tokens=8,
        input=cast(
            ResponseInputParam,
            [  # an assistant turn as clients send it back, looser than the SDK's type
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                {"role": "user", "content": "again"},
            ],
        ),
    )
    assert r2.usage is not None and r2.usage.input_tokens > r.usage.input_tokens
    count = cast(
        dict[str, Any], c.post("/responses/input_tokens", cast_to=object, body={"model": "tiny", "input": "hi"})
    )
    assert count["input_tokens"] == r.usage.input_tokens


def ends_early(seed: int, push: int) -> dict[str, Any]:
    """
    extra_body that makes the random model end its turn by itself after
    a few tokens (the SDK's get_final_response needs response.completed).
    """
    from blazar.models.testmodel import vocabulary

    end = vocabulary()[0].index("<|im_end|>")
    return {"logit_bias": {str(end): push}, "seed": seed}


def test_stream_matches_the_final_response(daemon: Daemon) -> None:
    c = client(daemon)
    for seed in range(1, 9):
        for push in (6, 9, 12):
            deltas = []
            with c.responses.stream(
                model="tiny", input="hi", max_output_tokens=64, extra_body=ends_early(seed, push)
            ) as stream:
                for event in stream:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                    last = event.type
            if last == "response.completed" and deltas:
                final = stream.get_final_response()
                plain = c.responses.create(
                    model="tiny", input="hi", max_output_tokens=64, extra_body=ends_early(seed, push)
                )
                assert final.output_text == "".join(deltas)
                assert set(final.model_dump()) == set(plain.model_dump())
                assert [o.type for o in final.output] == [o.type for o in plain.output] == ["message"]
                assert final.usage is not None and final.usage.output_tokens > 0
                return
    raise AssertionError("the model never ended a turn by itself with text")


def test_forced_function_call_then_its_output(daemon: Daemon) -> None:
    c = client(daemon)
    for seed in range(1, 6):
        r = c.responses.create(
            model="tiny",
            input="What is the weather in Paris?",
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            extra_body={"logit_bias": RECIPE["logit_bias"], "seed": seed},
        )
        calls = [o for o in r.output if o.type == "function_call"]
        if calls:
            break
    assert calls, [o.model_dump() for o in r.output]
    call = calls[0]
    assert json.loads(call.arguments)["city"] in {"Paris", "Oslo"}
    follow = c.responses.create(
        model="tiny",
        max_output_tokens=8,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[TOOL],
    )
    assert follow.status in ("completed", "incomplete")


def test_json_schema_output_validates(daemon: Daemon) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    c = client(daemon)
    # about half the seeds end inside the JSON on the random model (../shared/ENGINE.md): try several
    for seed in range(1, 9):
        try:
            r = c.responses.create(
                model="tiny",
                input="city?",
                max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
                extra_body={"seed": seed},
            )
        except openai.APIStatusError:
            continue
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), schema)
            return
    raise AssertionError("no seed in 1-8 gave schema-valid JSON")


def test_small_max_output_tokens_is_incomplete(daemon: Daemon) -> None:
    r = client(daemon).responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={"logit_bias": {}})
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_store_retrieve_delete_and_keys(daemon: Daemon) -> None:
    c = client(daemon)
    first = c.responses.create(model="tiny", input="remember the word blue", max_output_tokens=8)
    fresh = c.responses.create(model="tiny", input="which word?", max_output_tokens=8, store=False)
    follow = c.responses.create(model="tiny", input="which word?", max_output_tokens=8, previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and fresh.usage is not None
    assert follow.usage.input_tokens > fresh.usage.input_tokens
    assert c.responses.retrieve(first.id).id == first.id
    items = c.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].id
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(fresh.id)  # store: false: never written
    with pytest.raises(openai.NotFoundError):
        client(daemon, BOB).responses.retrieve(first.id)  # another key's: as if absent
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    # the chain survives a restart
    daemon.stop()
    daemon.start()
    again = client(daemon).responses.create(
        model="tiny", input="which word?", max_output_tokens=8, previous_response_id=follow.id
    )
    assert again.usage is not None and follow.usage is not None
    assert again.usage.input_tokens > follow.usage.input_tokens
    client(daemon).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(daemon).responses.retrieve(first.id)


def raw_stream(d: Daemon, body: dict[str, Any], kill: bool = False) -> tuple[list[tuple[str, dict[str, Any]]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    conn.request(
        "POST",
        "/v1/responses",
        json.dumps({**body, "stream": True}),
        {"content-type": "application/json", "authorization": f"Bearer {ALICE}"},
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
    events: list[tuple[str, dict[str, Any]]] = []
    kind = None
    killed_at = 0.0
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind or "", json.loads(line[6:])))
            if kill and not killed_at and len(events) >= 5:
                d.engine_for("tiny:latest").send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    conn.close()
    return events, (time.monotonic() - killed_at) if killed_at else 0.0


def check_events(events: list[tuple[str, dict[str, Any]]]) -> None:
    assert all(kind == payload["type"] for kind, payload in events), events[:3]
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert [k for k, _ in events][:2] == ["response.created", "response.in_progress"]
    assert sum(1 for k, _ in events if k in TERMINAL) == 1 and events[-1][0] in TERMINAL


def test_raw_sse_text_and_function_call(daemon: Daemon) -> None:
    events, _ = raw_stream(daemon, {"model": "tiny", "input": "hi", "max_output_tokens": 8})
    check_events(events)
    kinds = [k for k, _ in events]
    assert (
        kinds.index("response.output_item.added")
        < kinds.index("response.content_part.added")
        < kinds.index("response.output_text.delta")
        < kinds.index("response.output_text.done")
        < kinds.index("response.content_part.done")
        < kinds.index("response.output_item.done")
    )
    for seed in range(1, 6):
        events, _ = raw_stream(
            daemon,
            {
                "model": "tiny",
                "input": "What is the weather in Paris?",
                "tools": [TOOL],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "max_output_tokens": 200,
                "logit_bias": RECIPE["logit_bias"],
                "seed": seed,
            },
        )
        check_events(events)
        done = [p for k, p in events if k == "response.function_call_arguments.done"]
        if done:
            assert json.loads(done[0]["arguments"])["city"] in {"Paris", "Oslo"}
            return
    raise AssertionError("no forced call in seeds 1-5")


def test_child_killed_mid_stream_is_response_failed(daemon: Daemon) -> None:
    client(daemon).responses.create(model="tiny", input="hi", max_output_tokens=2)  # loaded
    events, after_kill = raw_stream(
        daemon, {"model": "tiny", "input": "hi", "max_output_tokens": 1900, "logit_bias": {}, "seed": 3}, kill=True
    )
    check_events(events)
    assert events[-1][0] == "response.failed", events[-2:]
    assert "killed by signal 9" in events[-1][1]["response"]["error"]["message"], events[-1]
    assert after_kill < 5
    assert client(daemon).responses.create(model="tiny", input="hi", max_output_tokens=2).status


def post_raw(d: Daemon, body: bytes) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/responses", body, {"content-type": "application/json", "authorization": f"Bearer {ALICE}"}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_hostile_input_gets_400s_or_valid_json_never_500(daemon: Daemon) -> None:
    status, body = post_raw(daemon, b'{"model":"tiny","input":"x","user":"\\ud800","max_output_tokens":2}')
    assert status == 200 and body["user"] == "\ud800"  # escaped, valid JSON
    cases = [
        (b'{"model":"tiny","input":[{"type":"message","role":["user"],"content":"x"}]}', "input[0]"),
        (b'{"model":"tiny","input":"x","metadata":{"a":NaN}}', None),
        (b'{"model":"tiny","input":"x","metadata":' + b"[" * 900 + b"]" * 900 + b"}", "metadata"),
        (b'{"model":"tiny","input":"x","store":"no"}', "store"),
        (b'{"model":"tiny","input":"x","tool_choice":"required"}', "tool_choice"),
    ]
    for raw, param in cases:
        status, body = post_raw(daemon, raw)
        assert status == 400, (raw[:80], body)
        assert set(body) == {"error"} and body["error"]["param"] == param, body
    assert "Unhandled Error" not in daemon.log() and "internal error" not in daemon.log()
