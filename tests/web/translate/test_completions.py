"""
Table tests of the legacy Completions translator, on answers recorded from
the pinned llama-server (the random-weight test model, prompt "Hello",
seed 1; compact JSON as it writes it, timings cut short).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from blazar.web.sse import SSERewriter
from blazar.web.translate import completions as tr

# POST /v1/completions {"prompt":"Hello","max_tokens":3,"stream":true,"n_probs":2,"seed":1}
STREAM = (
    b'data: {"choices":[{"text":"e","index":0,"logprobs":{"content":[{"id":104,"token":"e","bytes":[101],'
    b'"logprob":-2.4368138313293457,"top_logprobs":[{"id":209,"token":"","bytes":[206],"logprob":-0.5601391792297363},'
    b'{"id":102,"token":"c","bytes":[99],"logprob":-1.7664790153503418}]}]},"finish_reason":null}],'
    b'"created":1796156757,"model":"tiny","system_fingerprint":"b0-unknown","object":"text_completion",'
    b'"id":"chatcmpl-mcw3"}\n\n'
    b'data: {"choices":[{"text":",","index":0,"logprobs":{"content":[{"id":279,"token":",","bytes":[44],'
    b'"logprob":-3.856166362762451,"top_logprobs":[{"id":149,"token":"\xef\xbf\xbd","bytes":[146],"logprob":-1.289197564125061},'
    b'{"id":113,"token":"n","bytes":[110],"logprob":-1.5445361137390137}]}]},"finish_reason":null}],'
    b'"created":1796156757,"model":"tiny","system_fingerprint":"b0-unknown","object":"text_completion",'
    b'"id":"chatcmpl-mcw3"}\n\n'
    b'data: {"choices":[{"text":"?","index":0,"logprobs":{"content":[{"id":66,"token":"?","bytes":[63],'
    b'"logprob":-0.37516891956329346,"top_logprobs":[{"id":66,"token":"?","bytes":[63],"logprob":-0.37516891956329346},'
    b'{"id":150,"token":"\xef\xbf\xbd","bytes":[147],"logprob":-2.0032074451446533}]}]},"finish_reason":null}],'
    b'"created":1796156757,"model":"tiny","system_fingerprint":"b0-unknown","object":"text_completion",'
    b'"id":"chatcmpl-mcw3"}\n\n'
    b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1796156757,'
    b'"model":"tiny","system_fingerprint":"b0-unknown","object":"text_completion","usage":{"completion_tokens":3,'
    b'"prompt_tokens":5,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":4}},"id":"chatcmpl-mcw3",'
    b'"timings":{"prompt_n":5,"predicted_n":3}}\n\n'
    b"data: [DONE]\n\n"
)

# POST /v1/completions {"prompt":["Hi","Yo"],"max_tokens":2,"stream":true,"seed":1}: two
# choices, each with its own usage, after a "data: null"
TWO_PROMPTS = (
    b"data: null\n\n"
    b'data: {"choices":[{"text":"\\u000f","index":0,"logprobs":null,"finish_reason":null}],"created":1,'
    b'"model":"tiny","object":"text_completion","id":"c"}\n\n'
    b'data: {"choices":[{"text":"\xef\xbf\xbd","index":1,"logprobs":null,"finish_reason":null}],"created":1,'
    b'"model":"tiny","object":"text_completion","id":"c"}\n\n'
    b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1,'
    b'"model":"tiny","object":"text_completion","usage":{"completion_tokens":2,"prompt_tokens":2,"total_tokens":4,'
    b'"prompt_tokens_details":{"cached_tokens":1}},"id":"c","timings":{"prompt_n":1,"predicted_n":2}}\n\n'
    b'data: {"choices":[{"text":"","index":1,"logprobs":null,"finish_reason":"length"}],"created":1,'
    b'"model":"tiny","object":"text_completion","usage":{"completion_tokens":2,"prompt_tokens":2,"total_tokens":4,'
    b'"prompt_tokens_details":{"cached_tokens":1}},"id":"c","timings":{"prompt_n":1,"predicted_n":2}}\n\n'
    b"data: [DONE]\n\n"
)

# the same request as STREAM, not streamed
REPLY: dict[str, Any] = {
    "choices": [
        {
            "text": "e,?",
            "index": 0,
            "finish_reason": "length",
            "logprobs": {
                "content": [
                    {
                        "id": 104,
                        "token": "e",
                        "bytes": [101],
                        "logprob": -2.43,
                        "top_logprobs": [
                            {"id": 209, "token": "", "bytes": [206], "logprob": -0.56},
                            {"id": 102, "token": "c", "bytes": [99], "logprob": -1.77},
                        ],
                    },
                    {
                        "id": 279,
                        "token": ",",
                        "bytes": [44],
                        "logprob": -3.86,
                        "top_logprobs": [
                            {"id": 149, "token": "\ufffd", "bytes": [146], "logprob": -1.29},
                            {"id": 113, "token": "n", "bytes": [110], "logprob": -1.54},
                        ],
                    },
                    {
                        "id": 66,
                        "token": "?",
                        "bytes": [63],
                        "logprob": -0.37,
                        "top_logprobs": [
                            {"id": 66, "token": "?", "bytes": [63], "logprob": -0.37},
                            {"id": 150, "token": "\ufffd", "bytes": [147], "logprob": -2.0},
                        ],
                    },
                ]
            },
        }
    ],
    "created": 1,
    "model": "tiny",
    "object": "text_completion",
    "id": "c",
    "usage": {"completion_tokens": 3, "prompt_tokens": 5, "total_tokens": 8},
}

# POST /tokenize {"content":"Hello","add_special":false,"with_pieces":true}
HELLO_PIECES = [
    {"id": 75, "piece": "H"},
    {"id": 104, "piece": "e"},
    {"id": 111, "piece": "l"},
    {"id": 111, "piece": "l"},
    {"id": 114, "piece": "o"},
]


def run(stream: bytes, plan: tr.CompletionPlan, prompts: list[tr.PromptText], split: int | None = None) -> list:
    out: list[bytes] = []
    rewriter = SSERewriter(
        out.append,
        tr.CompletionStream(plan, prompts).event,
        None if plan.rewrites else (lambda b: b'"usage":{' in b or b"[DONE]" in b or b"data: null" in b),
    )
    if split is None:
        rewriter.feed(stream)
    else:
        rewriter.feed(stream[:split])
        rewriter.feed(stream[split:])
    rewriter.finish()
    events = b"".join(out).split(b"\n\n")
    assert events[-1] == b""
    return [e[len(b"data: ") :] if e == b"data: [DONE]" else json.loads(e[len(b"data: ") :]) for e in events[:-1]]


class PlanTests(SynchronousTestCase):
    def test_logprobs_become_n_probs_and_echo_is_kept_from_the_engine(self) -> None:
        plan = tr.plan_completion({"prompt": "x", "logprobs": 3, "echo": True, "stream": True})
        self.assertEqual(plan.engine_body, {"prompt": "x", "stream": True, "n_probs": 3})
        self.assertEqual((plan.logprobs, plan.echo, plan.rewrites), (3, True, True))

    def test_zero_asks_the_engine_for_one(self) -> None:
        self.assertEqual(tr.plan_completion({"prompt": "x", "logprobs": 0}).engine_body["n_probs"], 1)

    def test_a_plain_request_is_left_alone(self) -> None:
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
        plan = tr.plan_completion(body)
        self.assertIs(plan.engine_body, body)
        self.assertEqual((plan.rewrites, plan.include_usage, plan.needs_pieces), (False, True, False))

    def test_malformed(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"logprobs": True}, "logprobs"),
            ({"logprobs": -1}, "logprobs"),
            ({"logprobs": "2"}, "logprobs"),
            ({"echo": 1}, "echo"),
        ]
        for body, param in cases:
            with self.assertRaises(tr.CompletionRequestError) as e:
                tr.plan_completion({"prompt": "x", **body})
            self.assertEqual(e.exception.param, param)

    def test_pieces_are_needed_for_echoed_logprobs_and_token_prompts(self) -> None:
        def needs(**body: object) -> bool:
            return tr.plan_completion({"prompt": "x", **body}).needs_pieces

        self.assertFalse(needs(echo=True))
        self.assertFalse(needs(logprobs=1))
        self.assertTrue(needs(echo=True, logprobs=1))
        self.assertTrue(needs(prompt=[1, 2], echo=True))
        self.assertFalse(needs(prompt=[1, 2]))

    def test_prompts_split_as_the_engine_splits_them(self) -> None:
        self.assertEqual(tr.prompts_of("a"), ["a"])
        self.assertEqual(tr.prompts_of([1, 2]), [[1, 2]])
        self.assertEqual(tr.prompts_of(["a", [1, 2]]), ["a", [1, 2]])


class PromptTextTests(SynchronousTestCase):
    def test_pieces(self) -> None:
        prompt = tr.prompt_text("Hello", HELLO_PIECES)
        self.assertEqual(prompt, tr.PromptText("Hello", ("H", "e", "l", "l", "o"), (0, 1, 2, 3, 4)))

    def test_split_utf8_pieces_are_named_by_their_bytes(self) -> None:
        # /tokenize {"content":"café 😀"}: é and 😀 come as byte tokens
        pieces = [
            {"piece": "caf"},
            {"piece": [195]},
            {"piece": [169]},
            {"piece": " "},
            {"piece": [240]},
            {"piece": [159]},
            {"piece": [152]},
            {"piece": [128]},
        ]
        prompt = tr.prompt_text("café 😀", pieces)
        self.assertEqual(
            prompt.tokens,
            ("caf", "bytes:\\xc3", "bytes:\\xa9", " ", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80"),
        )
        self.assertEqual(prompt.offsets, (0, 3, 3, 4, 5, 5, 5, 5))

    def test_token_prompt_text_is_read_back(self) -> None:
        self.assertEqual(tr.prompt_text([75, 104], HELLO_PIECES[:2]).text, "He")
        self.assertEqual(tr.prompt_text([75, 104]), tr.PromptText(""))


class LegacyLogprobsTests(SynchronousTestCase):
    def test_shape(self) -> None:
        entries = REPLY["choices"][0]["logprobs"]["content"]
        out, end = tr.legacy_logprobs(entries, 2, 5)
        self.assertEqual(out["tokens"], ["e", ",", "?"])
        self.assertEqual(out["token_logprobs"], [-2.43, -3.86, -0.37])
        self.assertEqual(out["text_offset"], [5, 6, 7])
        self.assertEqual(end, 8)
        # the engine writes "" or U+FFFD for a lone byte: named by its bytes;
        # the sampled token is always there (N + 1 entries at most)
        self.assertEqual(
            out["top_logprobs"],
            [
                {"bytes:\\xce": -0.56, "c": -1.77, "e": -2.43},
                {"bytes:\\x92": -1.29, "n": -1.54, ",": -3.86},
                {"?": -0.37, "bytes:\\x93": -2.0},
            ],
        )

    def test_top_is_cut_to_n(self) -> None:
        entries = REPLY["choices"][0]["logprobs"]["content"]
        out, _ = tr.legacy_logprobs(entries, 0, 0)
        self.assertEqual(out["top_logprobs"], [{"e": -2.43}, {",": -3.86}, {"?": -0.37}])


class ReplyTests(SynchronousTestCase):
    def test_logprobs(self) -> None:
        plan = tr.plan_completion({"prompt": "Hello", "logprobs": 1})
        out = tr.completion_reply(REPLY, plan, [tr.prompt_text("Hello")])
        (choice,) = out["choices"]
        self.assertEqual(choice["text"], "e,?")
        self.assertEqual(set(choice["logprobs"]), {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
        self.assertEqual(choice["logprobs"]["text_offset"], [5, 6, 7])  # from the prompt's start
        self.assertEqual(out["usage"], REPLY["usage"])

    def test_echo_with_logprobs(self) -> None:
        plan = tr.plan_completion({"prompt": "Hello", "logprobs": 1, "echo": True})
        (choice,) = tr.completion_reply(REPLY, plan, [tr.prompt_text("Hello", HELLO_PIECES)])["choices"]
        self.assertEqual(choice["text"], "Helloe,?")
        lp = choice["logprobs"]
        self.assertEqual(lp["tokens"], ["H", "e", "l", "l", "o", "e", ",", "?"])
        self.assertEqual(lp["token_logprobs"][:5], [None] * 5)
        self.assertEqual(lp["top_logprobs"][:5], [None] * 5)
        self.assertEqual(lp["text_offset"], list(range(8)))
        for token, offset in zip(lp["tokens"], lp["text_offset"]):
            self.assertEqual(choice["text"][offset : offset + len(token)], token)

    def test_echo_without_logprobs(self) -> None:
        plan = tr.plan_completion({"prompt": "Hello", "echo": True})
        reply = {**REPLY, "choices": [{**REPLY["choices"][0], "logprobs": None}]}
        (choice,) = tr.completion_reply(reply, plan, [tr.prompt_text("Hello")])["choices"]
        self.assertEqual((choice["text"], choice["logprobs"]), ("Helloe,?", None))

    def test_choices_answer_their_prompt(self) -> None:
        plan = tr.plan_completion({"prompt": ["A", "B"], "echo": True, "n": 2})
        reply = {"choices": [{"text": str(i), "index": i, "logprobs": None} for i in range(4)]}
        out = tr.completion_reply(reply, plan, [tr.prompt_text("A"), tr.prompt_text("B")])
        self.assertEqual([c["text"] for c in out["choices"]], ["A0", "A1", "B2", "B3"])


class StreamTests(SynchronousTestCase):
    def test_usage_chunk_has_no_choices(self) -> None:
        chunks = run(
            STREAM,
            tr.plan_completion({"prompt": "Hello", "stream_options": {"include_usage": True}}),
            [tr.prompt_text("Hello")],
        )
        *body, usage, done = chunks
        self.assertEqual(done, b"[DONE]")
        self.assertEqual(usage["choices"], [])
        self.assertEqual(usage["usage"]["total_tokens"], 8)
        self.assertEqual((usage["id"], usage["object"], usage["model"]), ("chatcmpl-mcw3", "text_completion", "tiny"))
        self.assertEqual(body[-1]["choices"][0]["finish_reason"], "length")
        self.assertTrue(all("usage" not in c for c in body))
        self.assertEqual(body[-1]["timings"], {"prompt_n": 5, "predicted_n": 3})  # still there for metrics

    def test_no_usage_unless_asked(self) -> None:
        chunks = run(STREAM, tr.plan_completion({"prompt": "Hello"}), [tr.prompt_text("Hello")])
        self.assertEqual(chunks[-1], b"[DONE]")
        self.assertTrue(all("usage" not in c for c in chunks[:-1]))
        self.assertEqual(len(chunks), 5)

    def test_other_events_pass_as_they_came(self) -> None:
        out: list[bytes] = []
        plan = tr.plan_completion({"prompt": "Hello"})
        rewriter = SSERewriter(
            out.append, tr.CompletionStream(plan, []).event, lambda b: b'"usage":{' in b or b"[DONE]" in b
        )
        rewriter.feed(STREAM)
        first = STREAM.split(b"\n\n")[0]
        self.assertTrue(b"".join(out).startswith(first + b"\n\n"))

    def test_two_prompts_one_summed_usage(self) -> None:
        plan = tr.plan_completion({"prompt": ["Hi", "Yo"], "stream_options": {"include_usage": True}})
        chunks = run(TWO_PROMPTS, plan, [tr.prompt_text("Hi"), tr.prompt_text("Yo")])
        self.assertNotIn(None, chunks)  # the engine's "data: null" is gone
        usage = chunks[-2]
        self.assertEqual(usage["choices"], [])
        self.assertEqual(
            usage["usage"],
            {
                "completion_tokens": 4,
                "prompt_tokens": 4,
                "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        )

    def test_legacy_logprobs_and_echo(self) -> None:
        plan = tr.plan_completion(
            {"prompt": "Hello", "logprobs": 2, "echo": True, "stream_options": {"include_usage": True}}
        )
        chunks = run(STREAM, plan, [tr.prompt_text("Hello", HELLO_PIECES)])
        echo, *body, usage, done = chunks
        self.assertEqual(echo["choices"][0]["text"], "Hello")
        self.assertEqual(echo["choices"][0]["logprobs"]["tokens"], list("Hello"))
        self.assertEqual(echo["id"], "chatcmpl-mcw3")
        texts = [c["choices"][0]["text"] for c in body]
        self.assertEqual(texts, ["e", ",", "?", ""])
        offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in body[:3]]
        self.assertEqual(offsets, [[5], [6], [7]])
        self.assertEqual(
            body[0]["choices"][0]["logprobs"]["top_logprobs"],
            [{"bytes:\\xce": -0.5601391792297363, "c": -1.7664790153503418, "e": -2.4368138313293457}],
        )
        self.assertIsNone(body[-1]["choices"][0]["logprobs"])
        self.assertEqual(usage["choices"], [])

    @given(st.integers(min_value=0, max_value=len(STREAM)))
    def test_split_anywhere(self, at: int) -> None:
        plan = tr.plan_completion({"prompt": "Hello", "logprobs": 1, "stream_options": {"include_usage": True}})
        whole = run(STREAM, plan, [tr.prompt_text("Hello")])
        self.assertEqual(run(STREAM, plan, [tr.prompt_text("Hello")], split=at), whole)
