"""
Table tests of the Ollama translators, on streams recorded from the pinned
llama-server (compact JSON, as it writes it).
"""

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.sse import SSEEvents
from blazar.web.translate import ollama as tr


def sse(*chunks: dict) -> bytes:
    return (
        b"".join(
            b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for c in chunks
        )
        + b"data: [DONE]\n\n"
    )


def delta(**d: object) -> dict:
    return {
        "choices": [{"finish_reason": None, "index": 0, "delta": d}],
        "created": 1,
        "id": "chatcmpl-x",
        "model": "m:latest",
        "object": "chat.completion.chunk",
    }


def finish(reason: str) -> dict:
    return {
        "choices": [{"finish_reason": reason, "index": 0, "delta": {}}],
        "created": 1,
        "id": "chatcmpl-x",
        "model": "m:latest",
        "object": "chat.completion.chunk",
    }


USAGE = {
    "choices": [],
    "created": 1,
    "id": "chatcmpl-x",
    "model": "m:latest",
    "object": "chat.completion.chunk",
    "usage": {"completion_tokens": 4, "prompt_tokens": 21, "total_tokens": 25},
    "timings": {"prompt_n": 21, "prompt_ms": 1.5, "predicted_n": 4, "predicted_ms": 2.25},
}

TEXT_STREAM = sse(
    delta(role="assistant", content=None),
    delta(content="caf"),
    delta(content="é €"),
    delta(content="😀"),
    finish("length"),
    USAGE,
)

TOOL_STREAM = sse(
    delta(role="assistant", content=None),
    delta(
        tool_calls=[
            {"index": 0, "id": "abc", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}
        ]
    ),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '\n\n"ci'}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": 'ty":"Pa'}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": 'ris"}'}}]),
    delta(
        tool_calls=[{"index": 1, "id": "def", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    ),
    finish("tool_calls"),
    USAGE,
)


def run(stream: bytes, splits: list[int], kind: str = "chat") -> list[bytes]:
    """
    Feed C{stream} cut at C{splits} through the SSE parser and translator;
    return the NDJSON lines.
    """
    clock = iter(float(i) for i in range(1000))
    translator = tr.OllamaStream(kind, "m", tr.Timing(started=0.0, loaded=0.5), lambda: next(clock))
    out: list[bytes] = []

    def on_event(data: bytes) -> None:
        if data != b"[DONE]":
            out.append(tr.ndjson(translator.feed(json.loads(data))))

    events = SSEEvents(on_event)
    cuts = [0, *sorted(splits), len(stream)]
    for a, b in zip(cuts, cuts[1:]):
        events.feed(stream[a:b])
    out.append(tr.ndjson([translator.finish()]))
    return [line for chunk in out for line in chunk.splitlines()]


class StreamTests(SynchronousTestCase):
    def test_text_stream_lines_and_final(self) -> None:
        lines = [json.loads(line) for line in run(TEXT_STREAM, [])]
        self.assertEqual([line["done"] for line in lines], [False, False, False, True])
        self.assertEqual("".join(line["message"]["content"] for line in lines), "café €😀")
        final = lines[-1]
        self.assertEqual(final["done_reason"], "length")
        for key in (
            "total_duration",
            "load_duration",
            "prompt_eval_count",
            "prompt_eval_duration",
            "eval_count",
            "eval_duration",
        ):
            self.assertIsInstance(final[key], int, key)
        self.assertEqual((final["prompt_eval_count"], final["eval_count"]), (21, 4))
        self.assertEqual(final["prompt_eval_duration"], 1_500_000)
        self.assertEqual(final["eval_duration"], 2_250_000)
        self.assertEqual(final["load_duration"], 500_000_000)
        self.assertEqual(final["model"], "m")
        self.assertRegex(final["created_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")

    def test_multibyte_characters_split_at_every_byte(self) -> None:
        expected = run(TEXT_STREAM, [])
        for cut in range(1, len(TEXT_STREAM)):
            lines = run(TEXT_STREAM, [cut])
            self.assertEqual(
                [json.loads(x)["message"]["content"] for x in lines],
                [json.loads(x)["message"]["content"] for x in expected],
                cut,
            )
            for line in lines:
                line.decode("utf-8")  # never broken UTF-8

    def test_tool_call_fragments_become_object_arguments(self) -> None:
        for cut in (0, 150, 301, 452):
            lines = [json.loads(line) for line in run(TOOL_STREAM, [cut] if cut else [])]
            calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
            self.assertEqual(
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
                [("get_weather", {"city": "Paris"}), ("get_time", {})],
            )
            self.assertEqual(sum(1 for line in lines if line["done"]), 1)
            self.assertTrue(lines[-1]["done"])
            self.assertEqual(lines[-1]["done_reason"], "stop")

    @given(st.lists(st.integers(min_value=1, max_value=len(TOOL_STREAM) - 1), max_size=6))
    def test_any_chunking_gives_the_same_lines(self, splits: list[int]) -> None:
        def strip(lines: list[bytes]) -> list[dict]:
            return [{k: v for k, v in json.loads(x).items() if k != "created_at"} for x in lines]

        self.assertEqual(strip(run(TOOL_STREAM, splits)), strip(run(TOOL_STREAM, [])))

    def test_generate_lines_carry_response(self) -> None:
        lines = [json.loads(line) for line in run(TEXT_STREAM, [], kind="generate")]
        self.assertEqual("".join(line["response"] for line in lines), "café €😀")
        self.assertNotIn("message", lines[0])


class RequestTests(SynchronousTestCase):
    def test_chat_request(self) -> None:
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "look", "images": ["iVBORw0KGgoAAAANSUhEUg=="]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
                },
                {"role": "tool", "content": "42", "tool_name": "f"},
            ],
            "options": {
                "temperature": 0.1,
                "num_predict": 7,
                "seed": 3,
                "stop": ["\n"],
                "repeat_penalty": 1.2,
                "num_ctx": 8192,
                "top_k": 5,
            },
            "format": "json",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "think": True,
        }
        out = tr.chat_to_openai(body, stream=True)
        self.assertEqual(out["max_tokens"], 7)
        self.assertEqual((out["temperature"], out["seed"], out["stop"], out["top_k"]), (0.1, 3, ["\n"], 5))
        self.assertEqual(out["repeat_penalty"], 1.2)
        self.assertNotIn("num_ctx", out)
        self.assertEqual(out["response_format"], {"type": "json_object"})
        self.assertEqual(out["stream_options"], {"include_usage": True})
        self.assertEqual(out["chat_template_kwargs"], {"enable_thinking": True})
        user = out["messages"][1]
        self.assertEqual(user["content"][0], {"type": "text", "text": "look"})
        self.assertEqual(user["content"][1]["image_url"]["url"][:22], "data:image/png;base64,")
        call = out["messages"][2]["tool_calls"][0]
        self.assertEqual(call["function"], {"name": "f", "arguments": '{"x": 1}'})
        self.assertEqual(out["messages"][3]["tool_call_id"], call["id"])

    def test_schema_format(self) -> None:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        out = tr.chat_to_openai({"messages": [], "format": schema}, stream=False)
        self.assertEqual(out["response_format"]["json_schema"]["schema"], schema)
        self.assertNotIn("stream_options", out)

    def test_generate_paths(self) -> None:
        path, out = tr.generate_to_openai({"prompt": "p", "system": "s"}, stream=False)
        self.assertEqual(path, "/v1/chat/completions")
        self.assertEqual(out["messages"], [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}])
        path, out = tr.generate_to_openai({"prompt": "p", "raw": True, "context": [1, 2]}, stream=True)
        self.assertEqual((path, out["prompt"]), ("/v1/completions", "p"))
        path, out = tr.generate_to_openai(
            {"prompt": "def f(", "suffix": "return x", "options": {"num_predict": 9}}, stream=False
        )
        self.assertEqual(
            (path, out["input_prefix"], out["input_suffix"], out["n_predict"]), ("/infill", "def f(", "return x", 9)
        )

    def test_bad_requests(self) -> None:
        bodies: list[dict[str, Any]] = [
            {"messages": "hi"},
            {"messages": [{"content": "x"}]},
            {"messages": [], "options": 3},
            {"messages": [], "format": 5},
            {"messages": [{"role": "user", "content": 1}]},
            {"messages": [{"role": "user", "content": "x", "images": [3]}]},
        ]
        for body in bodies:
            with self.assertRaises(tr.TranslationError, msg=body):
                tr.chat_to_openai(body, stream=False)
        with self.assertRaises(tr.TranslationError):
            tr.generate_to_openai({"prompt": 5}, stream=False)

    def test_keep_alive(self) -> None:
        self.assertEqual(tr.parse_keep_alive("5m"), 300)
        self.assertEqual(tr.parse_keep_alive("1h30m"), 5400)
        self.assertEqual(tr.parse_keep_alive("250ms"), 0.25)
        self.assertEqual(tr.parse_keep_alive(0), 0)
        self.assertEqual(tr.parse_keep_alive("-1"), -1)
        self.assertEqual(tr.parse_keep_alive("-1m"), -60)
        self.assertIsNone(tr.parse_keep_alive(None))
        for bad in ["soon", "5x", True, [1]]:
            with self.assertRaises(tr.TranslationError):
                tr.parse_keep_alive(bad)

    def test_arguments_always_an_object(self) -> None:
        self.assertEqual(tr.parse_arguments('{"a": 1}'), {"a": 1})
        self.assertEqual(tr.parse_arguments(""), {})
        self.assertEqual(tr.parse_arguments("[1]"), {"__arguments": [1]})
        self.assertEqual(tr.parse_arguments("{bad"), {"__arguments": "{bad"})


class ReplyTests(SynchronousTestCase):
    def test_chat_reply(self) -> None:
        reply = {
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "id": "x", "function": {"name": "f", "arguments": '{"a":2}'}}
                        ],
                    },
                }
            ],
            "usage": {"completion_tokens": 3, "prompt_tokens": 5, "total_tokens": 8},
            "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0},
        }
        out = tr.chat_reply(reply, "m", tr.Timing(0.0, 0.25), 1.0)
        self.assertEqual(out["message"]["tool_calls"][0]["function"]["arguments"], {"a": 2})
        self.assertEqual((out["done"], out["done_reason"]), (True, "stop"))
        self.assertEqual((out["total_duration"], out["load_duration"]), (1_000_000_000, 250_000_000))
        self.assertEqual((out["prompt_eval_count"], out["eval_count"]), (5, 3))

    def test_durations_from_child_timings(self) -> None:
        reply = {
            "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
            "usage": {"completion_tokens": 3, "prompt_tokens": 5},
            "timings": {"prompt_ms": 1.5, "predicted_ms": 2.0},
        }
        out = tr.chat_reply(reply, "m", tr.Timing(0.0, 0.25), 1.0)
        self.assertEqual((out["prompt_eval_duration"], out["eval_duration"]), (1_500_000, 2_000_000))

    def test_durations_measured_without_child_timings(self) -> None:
        reply = {
            "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
            "usage": {"completion_tokens": 3, "prompt_tokens": 5},
        }
        out = tr.chat_reply(reply, "m", tr.Timing(0.0, 0.25), 1.0)
        self.assertEqual((out["prompt_eval_duration"], out["eval_duration"]), (0, 750_000_000))
        timed = tr.Timing(0.0, 0.25, first_token=0.5)
        out = tr.chat_reply(reply, "m", timed, 1.0)
        self.assertEqual((out["prompt_eval_duration"], out["eval_duration"]), (250_000_000, 500_000_000))

    def test_embed_reply_keeps_input_order(self) -> None:
        reply = {
            "data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
            "usage": {"prompt_tokens": 4},
        }
        out = tr.embed_reply(reply, "e", tr.Timing(0.0, 0.0), 1.0)
        self.assertEqual(out["embeddings"], [[1.0], [2.0]])
        self.assertEqual(out["prompt_eval_count"], 4)


class CreatedAtTests(SynchronousTestCase):
    @given(st.lists(st.floats(min_value=0, max_value=4e9, allow_nan=False), min_size=1, max_size=20))
    def test_as_strftime_writes_it(self, moments: list[float]) -> None:
        """
        L{tr.created_at} (which formats each second once) writes what
        formatting every moment afresh writes, in any order of moments.
        """
        import time

        for now in moments + sorted(moments):
            seconds, frac = divmod(int(now * 1e9), 1_000_000_000)
            fresh = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{frac:09d}Z"
            self.assertEqual(tr.created_at(now), fresh)
