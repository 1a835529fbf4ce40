"""
JSON answers without the engine's chat parser (L{blazar.gateway.jsonanswer},
issue 35 item 3): the pure translation, and the pipeline's route through the
real surfaces (StubTreq) with a llama-server stand-in whose chat parser
refuses every JSON answer, as the pinned engine's does on text that is not
UTF-8.
"""

from __future__ import annotations

import json
from typing import Any

from klein import Klein
from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway import jsonanswer
from blazar.models.testmodel import THINKING_CHAT_TEMPLATE, make_test_model
from blazar.testing import FakeSupervisor
from tests.web.gateway import MemoryGateway

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
ASK = [{"role": "user", "content": "Where?"}]
UNPARSED = "The model produced output that does not match the expected peg-native format"
PROBS: list[dict[str, Any]] = [
    {
        "id": 1,
        "token": '{"city":',
        "bytes": [123],
        "logprob": -0.5,
        "top_logprobs": [
            {"id": 1, "token": '{"city":', "bytes": [123], "logprob": -0.5},
            {"id": 2, "token": "x", "bytes": [120], "logprob": -2.0},
        ],
    }
]


class PureTests(SynchronousTestCase):
    def test_json_format(self) -> None:
        self.assertEqual(jsonanswer.json_format({"response_format": FORMAT}), CITY)
        self.assertEqual(jsonanswer.json_format({"response_format": {"type": "json_object"}}), {"type": "object"})
        self.assertIsNone(jsonanswer.json_format({"response_format": {"type": "text"}}))
        self.assertIsNone(jsonanswer.json_format({}))

    def test_the_completion_request_keeps_the_clients_settings(self) -> None:
        chat = {
            "model": "m",
            "messages": ASK,
            "response_format": FORMAT,
            "max_tokens": 30,
            "seed": 4,
            "temperature": 0.2,
            "dry_multiplier": 0.8,
            "stop": ["\n\n"],
            "logprobs": True,
            "top_logprobs": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body = jsonanswer.completion_request(chat, "PROMPT", CITY, stream=True)
        self.assertEqual(
            body,
            {
                "prompt": "PROMPT",
                "json_schema": CITY,
                "stream": True,
                "cache_prompt": True,
                "n_predict": 30,
                "seed": 4,
                "temperature": 0.2,
                "dry_multiplier": 0.8,
                "stop": ["\n\n"],
                "n_probs": 3,
            },
        )
        self.assertEqual(jsonanswer.completion_request({"messages": ASK}, "P", CITY, False)["n_predict"], -1)

    def test_a_stream_becomes_chat_chunks(self) -> None:
        stream = jsonanswer.ChatFromCompletion(
            "m", {"stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}
        )
        first = stream.feed({"content": '{"city":', "stop": False, "completion_probabilities": PROBS})
        self.assertEqual(
            [c["choices"][0]["delta"] for c in first], [{"role": "assistant", "content": ""}, {"content": '{"city":'}]
        )
        self.assertEqual(first[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"], PROBS[0]["top_logprobs"][:1])
        last = stream.feed(
            {
                "content": '"Oslo"}',
                "stop": True,
                "stop_type": "eos",
                "tokens_predicted": 5,
                "tokens_evaluated": 9,
                "timings": {"predicted_n": 5},
            }
        )
        self.assertEqual(
            [c["choices"][0]["finish_reason"] if c["choices"] else "usage" for c in last], [None, "stop", "usage"]
        )
        self.assertEqual(last[-1]["usage"]["completion_tokens"], 5)
        self.assertEqual(last[1]["timings"], {"predicted_n": 5})
        self.assertTrue(stream.finished)
        self.assertEqual(stream.feed({"content": "late", "stop": True}), [])
        # without logprobs asked, no logprobs anywhere in a chunk (the fresh-clone trial saw a stray one)
        plain = jsonanswer.ChatFromCompletion("m", {}).feed({"content": "{}", "stop": True})
        self.assertTrue(all("logprobs" not in c and "logprobs" not in c["choices"][0] for c in plain))

    def test_several_answers(self) -> None:
        self.assertEqual(jsonanswer.completion_request({"n": 2}, "P", CITY, False)["n_cmpl"], 2)
        done = [
            {"index": 1, "content": '{"city":"B"}', "stop_type": "limit", "tokens_predicted": 4, "tokens_evaluated": 9},
            {"index": 0, "content": '{"city":"A"}', "stop_type": "eos", "tokens_predicted": 3, "tokens_evaluated": 9},
        ]
        answer = json.loads(jsonanswer.chat_completion("m", done, {"n": 2}))
        self.assertEqual(
            [(c["index"], c["message"]["content"], c["finish_reason"]) for c in answer["choices"]],
            [(0, '{"city":"A"}', "stop"), (1, '{"city":"B"}', "length")],
        )
        self.assertEqual((answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]), (9, 7))
        stream = jsonanswer.ChatFromCompletion("m", {"n": 2, "stream_options": {"include_usage": True}})
        chunks = [
            c
            for e in (
                {"index": 1, "content": "{"},
                {"index": 0, "content": "["},
                {"index": 1, "content": "}", "stop": True, "tokens_predicted": 2, "tokens_evaluated": 5},
                {"index": 0, "content": "]", "stop": True, "tokens_predicted": 2, "tokens_evaluated": 5},
            )
            for c in stream.feed(e)
        ]
        self.assertTrue(stream.finished)
        by_index: dict[int, str] = {}
        for c in chunks[:-1]:
            choice = c["choices"][0]
            by_index[choice["index"]] = by_index.get(choice["index"], "") + (choice["delta"].get("content") or "")
        self.assertEqual(by_index, {0: "[]", 1: "{}"})
        self.assertEqual(
            [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]],
            ["stop", "stop"],
        )
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 4)

    def test_a_limit_is_length(self) -> None:
        answer = json.loads(
            jsonanswer.chat_completion("m", {"content": '{"ci', "stop_type": "limit", "tokens_predicted": 3}, {})
        )
        self.assertEqual(
            (answer["choices"][0]["finish_reason"], answer["choices"][0]["message"]["content"]), ("length", '{"ci')
        )
        self.assertIsNone(answer["choices"][0]["logprobs"])


def refusing_engine() -> Any:
    """
    llama-server with a chat parser that refuses every JSON answer: 500
    not streamed; streamed, two pieces of text then its in-stream error.
    C{/apply-template} and C{/completion} work.
    """
    app: Any = Klein()  # and the requests it records
    app.requests = []

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/v1/chat/completions", body))
        if not body.get("stream"):
            request.setResponseCode(500)
            return json.dumps({"error": {"code": 500, "message": UNPARSED, "type": "server_error"}}).encode()
        request.setHeader(b"content-type", b"text/event-stream")
        out = b""
        for text in ('{"ci', 'ty":'):
            out += (
                b"data: "
                + json.dumps(
                    {
                        "choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}],
                        "created": 1,
                        "id": "chatcmpl-x",
                        "model": "m:latest",
                        "object": "chat.completion.chunk",
                    }
                ).encode()
                + b"\n\n"
            )
        return out + b"data: " + json.dumps({"error": {"code": 500, "message": UNPARSED}}).encode() + b"\n\n"

    @app.route("/apply-template", methods=["POST"])
    def apply_template(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/apply-template", body))
        return json.dumps({"prompt": "RENDERED"}).encode()

    @app.route("/completion", methods=["POST"])
    def completion(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/completion", body))
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            events = [
                {"content": '{"city":', "stop": False, "completion_probabilities": PROBS},
                {"content": '"Oslo"}', "stop": False},
                {
                    "content": "",
                    "stop": True,
                    "stop_type": "eos",
                    "tokens_predicted": 4,
                    "tokens_evaluated": 7,
                    "timings": {"prompt_n": 7, "predicted_n": 4},
                },
            ]
            return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return json.dumps(
            {
                "content": '{"city":"Oslo"}',
                "stop": True,
                "stop_type": "eos",
                "tokens_predicted": 4,
                "tokens_evaluated": 7,
            }
        ).encode()

    return app


class RouteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.app = refusing_engine()
        self.gateway = MemoryGateway(self, FakeSupervisor(["m:latest", "t:latest"]), self.app, models=("m", "t"))
        # t's template reasons: its JSON stays on the chat path
        make_test_model(self.gateway.root / "t.gguf", seed=1, chat_template=THINKING_CHAT_TEMPLATE)

    def paths(self) -> list[str]:
        return [path for path, _ in self.app.requests]

    def test_a_json_answer_is_decoded_without_the_chat_parser_on_every_surface(self) -> None:
        asks = {
            "/v1/chat/completions": {"model": "m", "messages": ASK, "response_format": FORMAT, "max_tokens": 20},
            "/api/chat": {"model": "m", "messages": ASK, "format": CITY, "stream": False},
            "/v1/messages": {
                "model": "m",
                "messages": ASK,
                "max_tokens": 20,
                "output_config": {"format": {"type": "json_schema", "schema": CITY}},
            },
            "/v1/responses": {
                "model": "m",
                "input": "Where?",
                "max_output_tokens": 20,
                "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY}},
            },
        }
        for path, body in asks.items():
            del self.app.requests[:]
            status, _, data = self.gateway.post(path, body)
            self.assertEqual(status, 200, (path, data))
            self.assertIn(b"Oslo", data, path)
            self.assertEqual(self.paths(), ["/apply-template", "/completion"], path)
            self.assertEqual(self.app.requests[1][1]["json_schema"], CITY)
        del self.app.requests[:]
        status, _, data = self.gateway.post(
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": ASK,
                "response_format": FORMAT,
                "stream": True,
                "logprobs": True,
                "stream_options": {"include_usage": True},
            },
        )
        self.assertEqual(status, 200, data)
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertEqual(
            "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), '{"city":"Oslo"}'
        )
        self.assertEqual([c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1], "stop")
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 4)
        self.assertEqual(chunks[1]["choices"][0]["logprobs"]["content"][0]["token"], '{"city":')
        self.assertEqual(self.paths(), ["/apply-template", "/completion"])

    def test_a_reasoning_models_refused_json_is_asked_once_more_without_the_parser(self) -> None:
        status, _, data = self.gateway.post(
            "/v1/chat/completions", {"model": "t", "messages": ASK, "response_format": FORMAT, "max_tokens": 20}
        )
        self.assertEqual(status, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["message"]["content"], '{"city":"Oslo"}')
        self.assertEqual(self.paths(), ["/v1/chat/completions", "/apply-template", "/completion"])

    def test_a_reasoning_models_cut_json_stream_ends_with_an_error_not_a_stop(self) -> None:
        status, _, data = self.gateway.post(
            "/v1/chat/completions",
            {"model": "t", "messages": ASK, "response_format": FORMAT, "max_tokens": 20, "stream": True},
        )
        self.assertEqual(status, 200, data)
        events = [
            json.loads(line[6:])
            for line in data.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        self.assertIn("error", events[-1])
        self.assertIn("incomplete", events[-1]["error"]["message"])
        self.assertFalse([e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")])


class CacheHiderTests(SynchronousTestCase):
    def test_whole_events_hidden_and_an_unfinished_one_kept(self) -> None:
        from blazar.gateway.reply import _CacheHider

        out: list[bytes] = []
        hider = _CacheHider(out.append)
        stream = (
            b'data: {"a":1}\n\ndata: {"timings":{"prompt_n":2,"cache_n":5}}\n\n'
            b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":5}}}\n\ndata: [DONE]'
        )
        for i in range(0, len(stream), 7):
            hider.feed(stream[i : i + 7])
        hider.flush()
        text = b"".join(out)
        self.assertIn(b'"prompt_n":7,"cache_n":0', text)
        self.assertIn(b'"cached_tokens":0', text)
        self.assertTrue(text.startswith(b'data: {"a":1}\n\n') and text.endswith(b"data: [DONE]"), text)
